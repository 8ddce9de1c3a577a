"""The ``training`` worker program (``TrainingSpec`` + the order's ``AlgorithmRun``): a user's algorithm trained on
this site's own datasets, in a limited process of its own (:func:`device.algorithm.runtime.run_worker`).

Checks first (each failing one REJECTS the order): this target is a training site, it keeps every dataset the
spec names, and the package is the hub's: its signed manifest and SHA-256 are verified before it is used (a tampered
or unsigned package is REJECTED with the reason), and the manifest inside it is the one the hub admitted.

Then, RUNNING, in ``<site root>/<task id>/`` (kept across restarts of the agent, one worker of a task at a time):
the package is unpacked into ``package/`` and the algorithm runs in ``work/`` (its only writable place) with the
limits of the order; every step's metrics become the worker's metrics (``step``, ``steps``, ``num_examples`` and
what ``fit`` reported), its stdout and stderr become log lines, each checkpoint a log line. A run started where
``work/checkpoint`` holds one resumes from it (the agent was killed mid-training: the steps since the last
checkpoint are taken again, no others). A failure of the algorithm FAILS the worker with its reason (raised,
contract, memory, timeout, forbidden_write, died) and the last lines of its traceback. While the task is paused the
algorithm's processes are stopped where they are (no CPU, their memory kept) and go on when it resumes; the
heartbeats say paused meanwhile.

At the end the ONNX export (when the algorithm has one) and the parameters are uploaded through the chunked upload
API with the order's publish grant (resumable: a restart continues the upload) and one ``TrainedModel`` event names
them with the evaluation; the task's directory is then removed.
"""

from __future__ import annotations

import fcntl
import re
import shutil
import threading
from pathlib import Path
from typing import Any

from device.tasks.worker import Failed, Rejected, Worker
from interfaces.algorithms import AlgorithmManifest
from interfaces.tasks import PARAMETERS_SUFFIX, TASK_TRAINED_EVENT, TrainedModel, TrainingSpec, TrainingTaskOrder

PACKAGE_DIR, WORK_DIR, LOCK_FILE = "package", "work", ".lock"
MAX_DETAIL = 2000


def run(worker: Worker) -> None:
    from device.algorithm.runner import Job
    from device.algorithm.runtime import AlgorithmFailed, Limits, run_worker
    from device.upload import UploadError

    spec = worker.spec(TrainingSpec)
    order = worker.order_as(TrainingTaskOrder)
    algorithm = order.run
    if algorithm is None:
        raise Rejected("a training order must carry its run (the package, the limits, the publish grant)")
    site = worker.site
    if site is None:
        raise Rejected("this target is no training site (an edge node, or a device enrolled through one)")
    try:
        datasets = {name: str(site.dataset(local)) for name, local in spec.datasets.items()}
    except KeyError as exc:
        raise Rejected(str(exc.args[0])) from None
    package_zip = worker.fetch_inputs(algorithm.package)  # REJECTED when the signature or the content does not verify
    initial = worker.fetch_inputs(algorithm.initial) if algorithm.initial is not None else None
    home = Path(site.root) / order.task_id
    home.mkdir(parents=True, exist_ok=True)
    with _one_at_a_time(home / LOCK_FILE, worker) as held:
        if not held:
            return  # stopped while another worker of the task ran here
        package = home / PACKAGE_DIR
        manifest = unpack_admitted(package_zip, package, algorithm.manifest)
        work = home / WORK_DIR
        resuming = (work / "checkpoint" / "state.json").exists()
        progress = _Progress(spec.steps)
        worker.metrics_source(progress.sample)
        worker.running()
        worker.log(f"training {manifest.name} {manifest.version} on {', '.join(f'{k}={v}' for k, v in spec.datasets.items()) or 'no dataset'}: "
                   f"{spec.steps} steps, a checkpoint every {spec.checkpoint_every}, {algorithm.cpu_cores:g} cores, "
                   f"{algorithm.memory_bytes >> 20} MiB" + (", resuming from the last checkpoint" if resuming else ""))  # fmt: skip
        job = Job(package_dir=str(package), datasets=datasets, config=dict(spec.config), steps=spec.steps, checkpoint_every=spec.checkpoint_every,
                  initial_parameters=str(initial) if initial is not None else None, private_dir=str(site.private) if site.private else None)  # fmt: skip
        limits = Limits(cpu_cores=algorithm.cpu_cores, memory_bytes=algorithm.memory_bytes, timeout_s=algorithm.timeout_s, accelerators=tuple(algorithm.accelerators))
        stop = threading.Event()
        watcher = threading.Thread(target=_watch, args=(worker, stop), daemon=True)
        watcher.start()
        try:
            result = run_worker(order.worker_id, work, job, limits, stop=stop, on_log=lambda stream, line: worker.log(line, "warning" if stream == "stderr" else "info"),
                                on_frame=lambda frame: _frame(worker, progress, frame), paused=worker.pause_requested)  # fmt: skip
        except AlgorithmFailed as exc:
            if exc.reason == "stopped":
                return
            raise Failed(_detail(exc)) from None
        finally:
            stop.set()
        worker.log(f"trained {result.steps} steps (resumed from {result.resumed_from}): loss {result.loss:.4g} on {result.num_examples} examples, "
                   + ", ".join(f"{k} {v:.4g}" for k, v in sorted(result.metrics.items())) + f"; limited by {result.limited_by}")  # fmt: skip
        grant = algorithm.publish
        name = grant.names[0]
        try:
            onnx = site.publish(result.onnx, name, grant.version, "onnx", grant.token, home / "upload-onnx.json") if result.onnx is not None else None
            parameters = site.publish(result.parameters, name + PARAMETERS_SUFFIX, grant.version, "safetensors", grant.token, home / "upload-parameters.json")
        except UploadError as exc:
            raise Failed(f"publishing the trained model failed: {exc}") from None
        worker.event(TASK_TRAINED_EVENT, TrainedModel(
            task_id=order.task_id, worker_id=order.worker_id, parameters=parameters, onnx=onnx, steps=result.steps, resumed_from=result.resumed_from,
            num_examples=result.num_examples, loss=result.loss if result.loss == result.loss else 0.0, metrics=dict(list(result.metrics.items())[:64]),
        ))  # fmt: skip
        worker.items_done = result.steps
        worker.log(f"published {name} {grant.version}" + (f" (ONNX {onnx})" if onnx else "") + f" and its parameters ({parameters})")
    shutil.rmtree(home, ignore_errors=True)


def unpack_admitted(archive: Path, package: Path, admitted: AlgorithmManifest) -> AlgorithmManifest:
    """Unpack the package ``archive`` into ``package`` (replacing what is there); :class:`Rejected` when it does not
    unpack or its manifest is not the one the hub ``admitted``."""
    from device.algorithm.loader import AlgorithmError, read_manifest
    from device.algorithm.package import unpack

    if package.exists():
        shutil.rmtree(package)
    try:
        unpack(archive, package)
        manifest = read_manifest(package)
    except (AlgorithmError, ValueError, OSError) as exc:
        raise Rejected(f"the algorithm package does not unpack: {exc}") from None
    if manifest != admitted:
        raise Rejected(f"the package's manifest is not the one the hub admitted ({manifest.name} {manifest.version})")
    return manifest


def _detail(exc: Any) -> str:
    head = f"{exc.reason}: {exc.message}"
    tail = exc.tail[-(MAX_DETAIL - len(head) - 1) :] if exc.tail and len(head) < MAX_DETAIL - 1 else ""
    return f"{head}\n{tail}" if tail else head[:MAX_DETAIL]


def _watch(worker: Worker, stop: threading.Event) -> None:
    while not stop.is_set():
        if worker.stopping:
            stop.set()
            return
        stop.wait(0.2)


class _one_at_a_time:
    """An exclusive lock on the task's directory (another worker of the task on this site waits for it)."""

    def __init__(self, path: Path, worker: Worker) -> None:
        self.path, self.worker = path, worker
        self._fd: Any = None

    def __enter__(self) -> bool:
        self._fd = self.path.open("a")
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if not self.worker.wait(0.5):
                    return False

    def __exit__(self, *exc: object) -> None:
        self._fd.close()


def _frame(worker: Worker, progress: _Progress, frame: dict[str, Any]) -> None:
    kind = frame.get("type")
    if kind == "started":
        progress.update(step=int(frame.get("resumed_from", 0)))
        if frame.get("resumed_from"):
            worker.log(f"resumed from the checkpoint of step {frame['resumed_from']}")
        worker.log(f"the algorithm's writes are confined to its directory by the {str(frame.get('confinement', 'audit hook'))[:40]}")
    elif kind == "step":
        step = int(frame.get("step", 0))
        metrics = frame.get("metrics") if isinstance(frame.get("metrics"), dict) else {}
        progress.update(step=step, num_examples=float(frame.get("num_examples", 0)), metrics=metrics)
        worker.items_done = step
    elif kind == "checkpoint":
        worker.log(f"checkpoint at step {frame.get('step')}")


class _Progress:
    """The latest step's numbers (written by the frame reader, read by the host's ticker)."""

    def __init__(self, steps: int) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, float] = {"step": 0.0, "steps": float(steps)}

    def update(self, step: int, num_examples: float | None = None, metrics: dict[str, Any] | None = None) -> None:
        with self._lock:
            self._values["step"] = float(step)
            if num_examples is not None:
                self._values["num_examples"] = num_examples
            for key, value in (metrics or {}).items():
                if isinstance(key, str) and isinstance(value, int | float) and not isinstance(value, bool) and len(self._values) < 64:
                    self._values[_metric_name(key)] = float(value)

    def sample(self) -> dict[str, float]:
        with self._lock:
            return {k: v for k, v in self._values.items() if v == v}


def _metric_name(key: str) -> str:
    name = re.sub(r"[^a-z0-9_]", "_", key.lower())[:64]
    return name if name[:1].isalpha() else f"m_{name}"[:64]


