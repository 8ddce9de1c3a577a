"""The whole-model ``federated_training`` participant (``FederatedTrainingSpec`` with ``algorithm``): a user's
algorithm trained round after round on this site's own datasets, in a limited process of its own
(:func:`device.algorithm.runtime.run_worker`, as a ``training`` worker runs it).

Checks first (each failing one REJECTS the order): this target is a training site (an edge node, or a device
enrolled through one) and keeps every dataset the spec names. RUNNING, it follows the rounds its order names; for
each round attempt it has not taken yet and whose deadline has not passed it

1. fetches the round's global parameters and the package of its algorithm (signed artefacts, verified like any
   download; a package whose manifest is not the one the hub admitted is REJECTED), unpacking the package once;
2. runs the algorithm in ``<site root>/<task>/r<round>.a<attempt>/`` from those parameters for ``local_fits``
   calls of its ``fit`` with the configuration its order names (its variant's, else the task's); its stdout and
   stderr become log lines, its metrics the worker's;
3. encodes the trained parameters as the task's ``compression`` says (``interfaces.compression``: fp16, or int8 /
   topk deltas from the global parameters with this site's error feedback added, kept in its directory between
   rounds; with ``dp``, the delta from the global parameters first clipped to ``clip_norm``, DP-FedAvg; with ``secure_aggregation``: times its ``weight / total_examples``, fixed point, masked with every
   other participant's pair seed, ``device.tasks.secure``), uploads them through the chunked upload API with the round's grant (resumable: a restart of the agent
   continues the upload) and sends one ``fl.update`` naming the stored artefact, the examples ``fit`` reported and
   its metrics.

An order's ``evaluation`` (the cross-site evaluation at the end, or the check of a round's global model with
``evaluate_every``, told apart by its ``round``) is run once each: the models scored on this site's datasets by the
algorithm's ``evaluate``, the scores sent as one ``fl.evaluation``.

A participant that missed a round (stopped, slow, offline) starts the next one from the new global parameters: a
reset, never a stale continuation; training still under way when the order names another round attempt is stopped
(unless ``late_updates: stale`` or ``sync: async`` would still count it). A failure of the algorithm FAILS the worker with its reason;
an upload the hub refuses is logged and the round goes on without this participant. The task's directory is removed when the
worker stops. Metrics: ``rounds``, ``round``, ``fit_s``, ``upload_s``, ``examples`` and what ``fit`` reported.
"""

from __future__ import annotations

import shutil
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from device.tasks.secure import PairMasks
from device.tasks.training import PACKAGE_DIR, _detail, _metric_name, _one_at_a_time, _watch, unpack_admitted
from device.tasks.worker import Failed, Rejected, Worker
from interfaces.tasks import (
    FL_EVALUATION_EVENT, FL_UPDATE_EVENT, TASK_TRAINED_EVENT, AlgorithmRun, FederatedTrainingOrder, FederatedTrainingSpec, FlEvaluation, FlEvaluationOrder,
    FlExportOrder, FlOrder, FlScore, FlUpdate, TrainedModel,
)  # fmt: skip

IDLE_WAIT_S = 5.0
LOCK_FILE = ".lock"
FEEDBACK_FILE = "feedback.safetensors"
"""int8 and topk: the error feedback kept between rounds in the task's directory (never uploaded)"""


def run(worker: Worker) -> None:
    _Site(worker).run()


def aggregate(worker: Worker) -> None:
    _EdgeAggregator(worker).run()


def _seconds_left(fl: FlOrder) -> float:
    return (fl.deadline_at - datetime.now(UTC)).total_seconds()


class _Site:
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.spec = worker.spec(FederatedTrainingSpec)
        site = worker.site
        if site is None:
            raise Rejected("this target is no training site (an edge node, or a device enrolled through one)")
        self.site = site
        try:
            self.datasets = {name: str(site.dataset(local)) for name, local in self.spec.datasets.items()}
        except KeyError as exc:
            raise Rejected(str(exc.args[0])) from None
        self.home = Path(site.root) / worker.task_id
        self.done: set[tuple[int, int]] = set()
        self.package_sha: str | None = None
        self._lock = threading.Lock()
        self.metrics: dict[str, float] = {"rounds": 0.0}
        self.masks = PairMasks(worker)  # secure aggregation
        self.scored: set[int | None] = set()  # the evaluations done here: the rounds checked (evaluate_every), None for the one at the end
        self.exported = False  # the ONNX export of the published model (then_deploy) is done here

    def _sample(self) -> dict[str, float]:
        with self._lock:
            return dict(self.metrics)

    def run(self) -> None:
        w = self.worker
        self.home.mkdir(parents=True, exist_ok=True)
        try:
            with _one_at_a_time(self.home / LOCK_FILE, w) as held:
                if not held:
                    return
                w.metrics_source(self._sample)
                w.running()
                w.log(f"taking part in {self.spec.rounds} whole-model rounds on {', '.join(f'{k}={v}' for k, v in self.spec.datasets.items()) or 'no dataset'} "
                      f"({self.spec.strategy}, {self.spec.local_fits} fit calls a round)")  # fmt: skip
                if self.spec.secure_aggregation:
                    self.masks.send_key()
                while w.checkpoint():
                    order = w.order_as(FederatedTrainingOrder)
                    if order.export is not None and not self.exported:
                        self._export(order.export)
                        continue
                    if order.evaluation is not None and order.evaluation.round not in self.scored:
                        self._evaluate(order.evaluation)
                        continue
                    fl = order.fl
                    self.masks.reveal_if_asked(fl)
                    if fl is None or (fl.round, fl.attempt) in self.done:
                        w.wait(IDLE_WAIT_S)
                        continue
                    if fl.run is None or fl.participant is None:
                        raise Rejected("a whole-model round's order carries the algorithm, the update grant and this participant's id")
                    if fl.secure and not self.masks.masks_with(fl, fl.participant):  # the others did not mask with this run's key
                        self.done.add((fl.round, fl.attempt))
                        continue
                    if _seconds_left(fl) <= 0:
                        self.done.add((fl.round, fl.attempt))
                        w.log(f"round {fl.round} (attempt {fl.attempt}) is past its deadline; waiting for the next one", "warning")
                        continue
                    if not self._round(fl):
                        return
        finally:
            shutil.rmtree(self.home, ignore_errors=True)

    def _package(self, fl: FlOrder) -> Path:
        assert fl.run is not None
        return self._package_of(fl.run)

    def _package_of(self, run: AlgorithmRun) -> Path:
        package = self.home / PACKAGE_DIR
        sha = run.package.signed_manifest.manifest.sha256
        if sha == self.package_sha and package.exists():
            return package
        archive = self.worker.fetch_inputs(run.package)  # REJECTED when the signature or the content does not verify
        unpack_admitted(archive, package, run.manifest)
        self.package_sha = sha
        return package

    def _job(self, package: Path, config: dict[str, Any], **kw: Any) -> Any:
        """The runner's job: this site's datasets and private directory, ``package`` run with ``config``, and ``kw``."""
        from device.algorithm.runner import Job

        return Job(package_dir=str(package), datasets=self.datasets, config=config, private_dir=str(self.site.private) if self.site.private else None, **kw)

    def _run(self, suffix: str, work: Path, job: Any, run: AlgorithmRun, on_frame: Any = None, stoppable: bool = True, round_of: FlOrder | None = None) -> Any:
        """Run ``job`` in a limited process of the algorithm's limits, its output as the worker's log; ``stoppable``:
        stopped with the worker (and paused with it), and (``round_of``) once the hub moved past that round attempt."""
        from device.algorithm.runtime import Limits, run_worker

        w = self.worker
        limits = Limits(cpu_cores=run.cpu_cores, memory_bytes=run.memory_bytes, timeout_s=run.timeout_s, accelerators=tuple(run.accelerators))
        on_log = lambda stream, line: w.log(line, "warning" if stream == "stderr" else "info")  # noqa: E731
        if not stoppable:
            return run_worker(f"{w.worker_id}-{suffix}", work, job, limits, on_log=on_log)
        stop = threading.Event()
        threading.Thread(target=_watch, args=(w, stop), daemon=True).start()
        if round_of is not None:
            threading.Thread(target=self._watch_round, args=(round_of, stop), daemon=True).start()
        try:
            return run_worker(f"{w.worker_id}-{suffix}", work, job, limits, stop=stop, on_frame=on_frame or (lambda frame: None), on_log=on_log, paused=w.pause_requested)
        finally:
            stop.set()

    def _encode(self, fl: FlOrder, parameters: Path, weights: Path, attempt_dir: Path) -> tuple[Path, Path | None]:
        """The file to upload for the trained ``parameters`` (``interfaces.compression``; secure aggregation: masked,
        ``device.tasks.secure``), and the new error feedback's file (None for none, fp16 and masked; it replaces the
        kept one once the update is uploaded)."""
        from safetensors.numpy import load_file, save_file

        from interfaces import compression

        if fl.secure:
            if fl.participant is None or fl.weight is None or fl.total_examples is None:
                raise Failed("secure aggregation: the order names no weight and total of examples for this participant")
            out = attempt_dir / "update.safetensors"
            save_file(self.masks.mask(fl, fl.participant, load_file(str(parameters)), fl.weight / fl.total_examples), str(out))
            return out, None
        kind = self.spec.compression
        if kind == "none":
            return parameters, None
        kept = self.home / FEEDBACK_FILE
        residual = load_file(str(kept)) if kept.exists() else None
        encoded, feedback = compression.encode(kind, load_file(str(parameters)), load_file(str(weights)), residual, self.spec.topk_fraction)
        out = attempt_dir / "update.safetensors"
        save_file(encoded, str(out), metadata={compression.METADATA_KEY: kind})
        if kind in ("fp16",):
            return out, None
        staged = attempt_dir / FEEDBACK_FILE
        save_file(feedback, str(staged))
        return out, staged

    def _export(self, export: FlExportOrder) -> None:
        """The published parameters as ONNX by this site's algorithm (when it has ``export``), uploaded with the
        order's grant and reported (``task.trained``, ``onnx`` None when the algorithm does not export)."""
        from device.algorithm.runtime import AlgorithmFailed
        from device.upload import UploadError

        w, run = self.worker, export.run
        self.exported = True
        package = self._package_of(run)
        directory = self.home / "export"
        shutil.rmtree(directory, ignore_errors=True)
        parameters = w.fetch_inputs(export.parameters)
        config = dict(export.config) if export.config is not None else dict(self.spec.config)
        job = self._job(package, config, steps=1, export=True, export_from=str(parameters))
        try:
            finished = self._run("export", directory / "work", job, run, stoppable=False)
        except AlgorithmFailed as exc:
            raise Failed(f"exporting the published model failed: {_detail(exc)}") from None
        onnx = None
        if finished.onnx is not None:
            grant = run.publish
            try:
                onnx = self.site.publish(finished.onnx, grant.names[0], grant.version, "onnx", grant.token, directory / "upload.json")
            except UploadError as exc:
                w.log(f"the ONNX export could not be uploaded ({exc})", "warning")
                return
        w.log(f"the published model exported as ONNX: {onnx}" if onnx else f"{run.manifest.name} {run.manifest.version} has no export: no ONNX model")
        report = TrainedModel(task_id=w.task_id, worker_id=w.worker_id, parameters=export.parameters.artifact_id, onnx=onnx, steps=self.spec.rounds,
                              resumed_from=0, num_examples=0, loss=0.0)  # fmt: skip
        try:
            w.event(TASK_TRAINED_EVENT, report)
        except Exception as exc:  # noqa: BLE001 - not connected: the hub goes on without it at the deadline
            w.log(f"could not report the ONNX export: {exc}", "warning")

    def _evaluate(self, evaluation: FlEvaluationOrder) -> None:
        """The cross-site evaluation: every model of the order scored on this site's datasets by its algorithm's
        ``evaluate`` (one run of the algorithm, nothing trained), the scores sent to the hub."""
        from device.algorithm.runtime import AlgorithmFailed

        w, run = self.worker, evaluation.run
        self.scored.add(evaluation.round)
        what = "the cross-site evaluation" if evaluation.round is None else f"the check of round {evaluation.round}'s global model"
        if (evaluation.deadline_at - datetime.now(UTC)).total_seconds() <= 0:
            w.log(f"{what} is past its deadline", "warning")
            return
        package = self._package_of(run)
        directory = self.home / ("evaluation" if evaluation.round is None else f"check-r{evaluation.round}")
        shutil.rmtree(directory, ignore_errors=True)
        models = {label: str(w.fetch_inputs(ref)) for label, ref in evaluation.models.items()}
        config = dict(evaluation.config) if evaluation.config is not None else dict(self.spec.config)
        job = self._job(package, config, steps=1, export=False, evaluate=models)
        scores: dict[str, FlScore] = {}

        def on_frame(frame: dict[str, Any]) -> None:
            if frame.get("type") == "evaluated" and frame.get("label") in models:
                loss = frame.get("loss")
                metrics = {_metric_name(k): float(v) for k, v in dict(frame.get("metrics") or {}).items()
                           if isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool) and v == v}  # fmt: skip
                scores[str(frame["label"])] = FlScore(loss=float(loss) if isinstance(loss, int | float) and loss == loss else None,
                                                      num_examples=max(0, int(frame.get("num_examples") or 0)), metrics=dict(list(metrics.items())[:64]))  # fmt: skip

        try:
            self._run("evaluation", directory / "work", job, run, on_frame=on_frame)
        except AlgorithmFailed as exc:
            if exc.reason == "stopped":
                return
            raise Failed(f"{what} failed: {_detail(exc)}") from None
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        if not scores:
            raise Failed(f"{what} scored no model")
        shown = ", ".join(f"{label} {s.metrics.get('accuracy', s.loss)}" for label, s in sorted(scores.items()))
        w.log(f"{what}: scored {len(scores)} model{'s' if len(scores) > 1 else ''} on this site's data ({shown})")
        try:
            w.event(FL_EVALUATION_EVENT, FlEvaluation(task_id=w.task_id, worker_id=w.worker_id, scores=scores, round=evaluation.round))
        except Exception as exc:  # noqa: BLE001 - not connected: the hub closes the evaluation without this site at its deadline
            w.log(f"could not send the scores of {what}: {exc}", "warning")

    def _clipped(self, parameters: Path, weights: Path, attempt_dir: Path) -> Path:
        """DP-FedAvg: the trained parameters with their delta from the global ones clipped to the task's clip norm
        (``interfaces.dpfedavg.clip``), so that what leaves the site is bounded; the hub adds the noise."""
        from safetensors.numpy import load_file, save_file

        from interfaces.dpfedavg import clip

        assert self.spec.dp is not None
        clipped, _ = clip(load_file(str(parameters)), load_file(str(weights)), self.spec.dp.clip_norm)  # its norm is not logged: the hub reads the logs
        out = attempt_dir / "clipped.safetensors"
        save_file(clipped, str(out))
        return out

    def _watch_round(self, fl: FlOrder, stop: threading.Event) -> None:
        """Stop the training of ``fl``'s round attempt once the order names another one (the hub closed it without this
        site, or ran it again) and its update could no longer count: a reset, never a stale continuation."""
        if self.spec.sync == "async":
            return  # every update counts there, at its staleness's weight: train to the end
        keeps = self.spec.late_updates == "stale"
        while not stop.is_set():
            now = self.worker.order_as(FederatedTrainingOrder).fl
            if now is not None and (now.round, now.attempt) != (fl.round, fl.attempt) and not (keeps and now.round - fl.round <= self.spec.max_staleness and now.round > fl.round):
                stop.set()
                return
            stop.wait(0.5)

    def _round(self, fl: FlOrder) -> bool:
        """Train one round attempt and send the update; False: stop now."""
        from device.algorithm.runtime import AlgorithmFailed
        from device.upload import UploadError

        w, run = self.worker, fl.run
        assert run is not None and fl.participant is not None
        package = self._package(fl)
        weights = w.fetch_inputs(fl.weights)
        attempt_dir = self.home / f"r{fl.round}.a{fl.attempt}"
        for old in self.home.glob("r*.a*"):
            if old != attempt_dir:
                shutil.rmtree(old, ignore_errors=True)
        config = dict(fl.config) if fl.config is not None else dict(self.spec.config)
        fit_config: dict[str, float | int] = {"server_round": fl.round, "local_fits": self.spec.local_fits}
        if self.spec.strategy == "fedprox":  # the proximal term is the participant's: its algorithm gets mu
            from interfaces.aggregation import strategy_from_spec

            fit_config["proximal_mu"] = float(strategy_from_spec(self.spec.strategy, **self.spec.strategy_params).params()["mu"])
        job = self._job(package, config, steps=self.spec.local_fits, checkpoint_every=self.spec.local_fits, initial_parameters=str(weights), export=False,
                        fit_config=fit_config)  # fmt: skip
        fitted: dict[str, Any] = {"num_examples": 0, "metrics": {}}

        def on_frame(frame: dict[str, Any]) -> None:
            if frame.get("type") == "step":
                fitted["num_examples"] = int(frame.get("num_examples") or 0)
                fitted["metrics"] = frame.get("metrics") if isinstance(frame.get("metrics"), dict) else {}

        started = time.perf_counter()
        try:
            self._run(f"r{fl.round}a{fl.attempt}", attempt_dir / "work", job, run, on_frame=on_frame, round_of=fl)
        except AlgorithmFailed as exc:
            if exc.reason != "stopped":
                raise Failed(_detail(exc)) from None
            if w.stopping:
                return False
            self.done.add((fl.round, fl.attempt))
            w.log(f"round {fl.round} (attempt {fl.attempt}): the hub moved on before this site finished; its training is reset to the new round", "warning")
            return True
        fit_s = time.perf_counter() - started
        self.done.add((fl.round, fl.attempt))
        parameters = attempt_dir / "work" / "output" / "parameters.safetensors"
        grant = run.publish
        uploaded = time.perf_counter()
        try:
            if self.spec.dp is not None:
                parameters = self._clipped(parameters, weights, attempt_dir)
            encoded, feedback = self._encode(fl, parameters, weights, attempt_dir)
            if fl.via_edge:  # hierarchical: to the aggregator on this device's edge, which uploads its devices' weighted mean
                artifact_id = self.site.hand_to_edge(encoded, grant.token)
            else:
                artifact_id = self.site.publish(encoded, grant.names[0], grant.version, "safetensors", grant.token, attempt_dir / "upload.json")
        except UploadError as exc:
            w.log(f"round {fl.round}: the update could not be uploaded ({exc}); the next round starts from the new global model", "warning")
            return True
        except ValueError as exc:
            raise Failed(f"round {fl.round}: the trained parameters do not encode as {self.spec.compression}: {exc}") from None
        if feedback is not None:
            feedback.replace(self.home / FEEDBACK_FILE)  # what compression left out, added to the next round's delta
        upload_s = time.perf_counter() - uploaded
        metrics = {_metric_name(k): float(v) for k, v in dict(fitted["metrics"]).items()
                   if isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool) and v == v}  # fmt: skip
        update = FlUpdate(task_id=w.task_id, worker_id=w.worker_id, round=fl.round, attempt=fl.attempt, contributors=[fl.participant],
                          num_examples=max(1, int(fitted["num_examples"])), parameters=artifact_id, metrics=dict(list(metrics.items())[:64]), masked=fl.secure)  # fmt: skip
        shown = ", ".join(f"{k} {v:.4g}" for k, v in sorted(metrics.items()))
        w.log(f"round {fl.round}: {run.manifest.name} {run.manifest.version}, {self.spec.local_fits} fit calls on {update.num_examples} examples in {fit_s:.1f} s"
              + (f" ({shown})" if shown else "") + (f"; update handed to the edge in {upload_s:.1f} s" if fl.via_edge else f"; update {artifact_id} uploaded in {upload_s:.1f} s"))  # fmt: skip
        with self._lock:
            self.metrics = {"rounds": self.metrics["rounds"] + 1, "round": float(fl.round), "fit_s": fit_s, "upload_s": upload_s,
                            "examples": float(update.num_examples), **metrics}  # fmt: skip
        w.items_done = int(self.metrics["rounds"])
        # this round's sample (its fit time) goes before the update: the hub may end the task on the last update,
        # and a withdrawn worker sends no sample after it
        w.report_now()
        try:
            if fl.via_edge:
                if w.fl is None:
                    raise RuntimeError("this device has no fl channel to its edge")
                w.fl.send(update)
            else:
                w.event(FL_UPDATE_EVENT, update)
        except Exception as exc:  # noqa: BLE001 - not connected: this round goes on without us; the next one resets us
            w.log(f"round {fl.round}: could not send the update: {exc}", "warning")
        return True


# --- hierarchical rounds: the aggregator on a device's edge --------------------------------------------

EDGE_MARGIN = 0.2
"""The aggregator uploads what it has this share of the round's timeout (at most 2 s) before the deadline."""
INTAKE_SLACK_BYTES = 1 << 20
"""A device's file may exceed the global parameters' file by this much (another header), and by a tenth."""


class _EdgeAggregator:
    """The ``aggregator`` worker on an edge node of a hierarchical whole-model task (``topology: hierarchical``).

    It opens an inbox in the edge's :class:`edge.fl.UpdateIntake` (each device file at most the global parameters'
    size, plus slack) and takes its devices' ``fl`` updates (:class:`edge.fl.FlRouter`), each naming the file the
    device handed over. When every participant under this node answered, or ``EDGE_MARGIN`` before the deadline
    with at least one, it reads the files one tensor at a time (each checked against the round's global parameters:
    names, dtypes, shapes, finite values), writes their sample-weighted mean (``interfaces.aggregation.FedAvg``,
    streaming) and uploads it with the grant of its order (the update ``fl-update.<task>.<node>`` of the round
    attempt); its ``fl.update`` names those devices as contributors and their examples in all. The hub fuses it
    with the others at that weight, which for a decomposable strategy is what it would have fused from the devices
    themselves. A device's update that comes after the upload is dropped (the node's update of the round attempt
    is stored once). Metrics: ``rounds``, ``updates``, ``refused``, ``bytes_in``, ``bytes_up``."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.spec = worker.spec(FederatedTrainingSpec)
        router, site = worker.fl, worker.site
        if router is None or not hasattr(router, "serve") or not hasattr(router, "intake"):
            raise Rejected("this target aggregates no federated updates (it is not an edge node)")
        if site is None:
            raise Rejected("this edge node has no directory for its devices' updates")
        self.router, self.intake, self.site = router, router.intake, site
        self.home = Path(site.root) / f"{worker.task_id}-aggregator"
        self._lock = threading.Lock()
        self.inbox: dict[tuple[int, int], dict[str, FlUpdate]] = {}
        self.counts = {"rounds": 0.0, "updates": 0.0, "refused": 0.0, "bytes_in": 0.0, "bytes_up": 0.0}
        self.weights: dict[str, Path] = {}  # global parameters' artefact -> the local file

    def offer(self, update: FlUpdate) -> None:
        """A device's update from the router (on the event loop: only kept)."""
        with self._lock:
            self.inbox.setdefault((update.round, update.attempt), {}).setdefault(update.contributors[0], update)
            self.counts["updates"] += 1
        self.worker.wake()

    def _sample(self) -> dict[str, float]:
        with self._lock:
            return dict(self.counts)

    def _weights(self, fl: FlOrder) -> Path:
        path = self.weights.get(fl.weights.artifact_id)
        if path is None:
            self.weights = {fl.weights.artifact_id: (path := self.worker.fetch_inputs(fl.weights))}
        return path

    def run(self) -> None:
        w = self.worker
        self.home.mkdir(parents=True, exist_ok=True)
        self.router.serve(w.task_id, self.offer)
        try:
            w.metrics_source(self._sample)
            w.running()
            w.log(f"aggregating this node's devices' whole-model updates ({self.spec.strategy}, weighted by their examples)")
            sent: set[tuple[int, int]] = set()
            window: dict[tuple[int, int], float] = {}  # seconds left when this node first saw each round attempt
            while w.checkpoint():
                fl = w.order_as(FederatedTrainingOrder).fl
                wait: float | None = IDLE_WAIT_S
                if fl is not None and fl.run is not None:
                    key = (fl.round, fl.attempt)
                    weights = self._weights(fl)
                    self.intake.open(w.task_id, self.home / "inbox", weights.stat().st_size * 11 // 10 + INTAKE_SLACK_BYTES)
                    self.intake.forget_before(w.task_id, *key)
                    with self._lock:
                        for old in [k for k in self.inbox if k < key]:
                            del self.inbox[old]
                        got = {d: u for d, u in self.inbox.get(key, {}).items() if d in fl.participants}
                    left = _seconds_left(fl)
                    length = min(self.spec.round_timeout_s, max(0.0, window.setdefault(key, left)))
                    send_at = left - min(2.0, EDGE_MARGIN * length)
                    if key not in sent:
                        if got and (set(got) >= set(fl.participants) or send_at <= 0):
                            sent.add(key)
                            self._send(fl, weights, list(got.values()))
                        elif left > 0:
                            wait = max(0.05, send_at) if send_at > 0 else min(IDLE_WAIT_S, left)
                    for old in [k for k in window if k < key]:
                        del window[old]
                w.wait(wait)
        finally:
            self.router.unserve(w.task_id, self.offer)
            self.intake.close(w.task_id)
            shutil.rmtree(self.home, ignore_errors=True)

    def _send(self, fl: FlOrder, weights: Path, updates: list[FlUpdate]) -> None:
        """The weighted mean of the devices' files, uploaded with the order's grant and reported to the hub."""
        from contextlib import ExitStack

        from device.upload import UploadError
        from interfaces import compression
        from interfaces.aggregation import FedAvg, StreamUpdate, weighted_metrics
        from interfaces.tensorfile import TensorFile, TensorFileError, TensorWriter

        w, run = self.worker, fl.run
        assert run is not None
        out = self.home / f"r{fl.round}.a{fl.attempt}.safetensors"
        started = time.perf_counter()
        with ExitStack() as stack:
            base = stack.enter_context(TensorFile(weights))
            infos = base.infos()
            streams = []
            for update in updates:
                device = update.contributors[0]
                got = self.intake.take(w.task_id, device, fl.round, fl.attempt, update.parameters or "")
                why = "its file did not reach this edge" if got is None else None
                if got is not None:
                    try:
                        tensors = stack.enter_context(TensorFile(got.path))
                        why = compression.misfit("none", tensors, infos)
                    except TensorFileError as exc:
                        why = f"not a safetensors file: {exc}"
                if why is not None:
                    w.log(f"round {fl.round}: left out {device}'s update: {why}", "warning")
                    with self._lock:
                        self.counts["refused"] += 1
                    continue
                assert got is not None
                streams.append(StreamUpdate(tensors, update.num_examples, dict(update.metrics), device))
                with self._lock:
                    self.counts["bytes_in"] += got.size
            if not streams:
                return
            try:
                with TensorWriter(out, infos) as writer:
                    FedAvg().aggregate_stream(base, streams, writer.write)
            except ValueError as exc:  # a value the checks above could not see (a non-finite tensor read)
                w.log(f"round {fl.round}: the devices' updates do not combine: {exc}", "warning")
                return
        contributors = sorted(str(s.participant) for s in streams)
        try:
            artifact_id = self.site.publish(out, run.publish.names[0], run.publish.version, "safetensors", run.publish.token, self.home / "upload.json")
        except UploadError as exc:
            w.log(f"round {fl.round}: the combined update could not be uploaded ({exc})", "warning")
            return
        finally:
            size = out.stat().st_size if out.exists() else 0
            out.unlink(missing_ok=True)
        combined = FlUpdate(task_id=w.task_id, worker_id=w.worker_id, round=fl.round, attempt=fl.attempt, contributors=contributors,
                            num_examples=sum(s.num_examples for s in streams), parameters=artifact_id, metrics=dict(list(weighted_metrics(streams).items())[:64]))  # fmt: skip
        with self._lock:
            self.counts["rounds"] += 1
            self.counts["bytes_up"] += size
        w.log(f"round {fl.round}: {len(contributors)} of {len(fl.participants)} devices combined ({combined.num_examples} examples) and uploaded as "
              f"{artifact_id} in {time.perf_counter() - started:.1f} s")  # fmt: skip
        try:
            w.event(FL_UPDATE_EVENT, combined)
        except Exception as exc:  # noqa: BLE001 - not connected: the round closes without this node's devices
            w.log(f"round {fl.round}: could not send the combined update: {exc}", "warning")
