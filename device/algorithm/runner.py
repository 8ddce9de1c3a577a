"""The child side of the site runtime (``python -I -m device.algorithm.runner``): one worker of a user's algorithm.

:mod:`device.algorithm.runtime` starts it in the worker's own directory with nothing of the agent's (no hub or
broker credentials, no environment beyond what it sets) and writes one :class:`Job` as JSON on its stdin. The
runner then

1. refuses, from an audit hook (PEP 578), every file the algorithm opens for writing, creates, renames or removes
   outside its working directory (``PermissionError`` naming the path; the run FAILS saying so), and has the kernel
   refuse the same to native code, with no TCP and no signal outside its domain (:mod:`device.algorithm.landlock`,
   where the kernel has Landlock; the ``started`` frame says which: ``confinement``);
2. builds the client from the unpacked package (its configuration checked against the manifest's schema);
3. resumes from ``<work>/checkpoint/`` when a checkpoint is there (the step it reached, the parameters, and the
   client's own ``restore``), else starts from the job's initial parameters or the client's ``initial_parameters()``;
4. calls ``fit`` for each remaining step (config ``{"round": step}``), sends each step's metrics, writes a checkpoint
   every ``checkpoint_every`` steps (atomically: a run killed mid-write resumes from the one before);
5. calls ``evaluate``, writes ``<work>/output/parameters.safetensors`` (and ``model.onnx`` when the client has
   ``export``), and sends the result.

A job with ``evaluate`` (label -> parameters file; a whole-model task's cross-site evaluation) only builds the
client and scores each file with ``evaluate``: one ``evaluated`` frame each, then the result. One with
``export_from`` (a federated task's published parameters) only writes ``model.onnx`` from them when the client has
``export``; its result names it (or no ONNX).

Frames go to the agent as JSON lines on a pipe of their own (its descriptor in ``AISYNERGY_FRAMES_FD``) (the algorithm's own stdout and stderr are its log
lines): ``{"type": "started" | "step" | "checkpoint" | "result" | "error", ...}``. Exit status 0 after a result, 3
after an error frame (the algorithm broke the contract or raised), anything else: the process died.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from device.algorithm import landlock

FRAMES_ENV = "AISYNERGY_FRAMES_FD"
"""the environment variable naming the descriptor of the frames pipe"""
CHECKPOINT_DIR = "checkpoint"
OUTPUT_DIR = "output"
PARAMETERS_FILE = "parameters.safetensors"
ONNX_FILE = "model.onnx"
STATE_FILE = "state.json"
CLIENT_STATE_FILE = "client.safetensors"
EXIT_ERROR = 3
TRACEBACK_LINES = 12


class Job(BaseModel):
    """What the agent asks of one worker (written on its stdin)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    package_dir: str = Field(min_length=1, max_length=4096)
    datasets: dict[str, str] = Field(default_factory=dict, max_length=16)
    config: dict[str, Any] = Field(default_factory=dict)
    steps: int = Field(ge=1, le=1_000_000)
    checkpoint_every: int = Field(default=1, ge=1, le=1_000_000)
    initial_parameters: str | None = Field(default=None, max_length=4096)
    export: bool = True
    evaluate: dict[str, str] = Field(default_factory=dict, max_length=1_000, description="score these parameter files (label -> path) instead of training")
    export_from: str | None = Field(default=None, max_length=4096, description="export these parameters (a file) as ONNX instead of training")
    fit_config: dict[str, float | int] = Field(default_factory=dict, max_length=16, description="added to every fit call's config (a federated round: server_round, proximal_mu)")
    private_dir: str | None = Field(default=None, max_length=4096, description="the agent's data directory: unreadable to the algorithm (where the kernel has Landlock) but for its package, its datasets and its own directory")


class _Frames:
    def __init__(self, fd: int) -> None:
        self._out = os.fdopen(fd, "w", buffering=1, encoding="utf-8")

    def send(self, type: str, **fields: Any) -> None:
        self._out.write(json.dumps({"type": type, **fields}) + "\n")
        self._out.flush()


_TWO_PATHS = {"os.rename", "os.link", "shutil.move"}
_WRITE_EVENTS = {"os.mkdir", "os.rename", "os.remove", "os.rmdir", "os.symlink", "os.link", "os.truncate", "os.chmod", "os.chown", "shutil.rmtree", "shutil.move"}


def confine_writes(root: Path, allowed: tuple[Path, ...] = ()) -> None:
    """Refuse writes outside ``root`` (and ``allowed``) for the rest of this process (PEP 578: an audit hook can be
    added, never removed). Opening for reading stays free; the datasets are read-only to the process anyway."""
    bases = tuple(os.path.realpath(p) for p in (root, *allowed))

    def inside(path: Any) -> bool:
        if isinstance(path, int):  # an open file descriptor: it was checked when opened
            return True
        try:
            real = os.path.realpath(os.fsdecode(path))
        except (TypeError, ValueError):
            return True
        return any(real == b or real.startswith(b + os.sep) for b in bases) or real in ("/dev/null",)

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event == "open":
            path, mode, flags = args
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND))
            if writing and path is not None and not inside(path):
                raise PermissionError(f"the algorithm may write only inside its working directory; it tried to write {path}")
        elif event in _WRITE_EVENTS:
            targets = args[:2] if event in _TWO_PATHS else args[:1]  # a rename's or link's destination, too
            outside = [t for t in targets if not inside(t)]
            if outside:
                raise PermissionError(f"the algorithm may write only inside its working directory; it tried {event} on {outside[0]}")

    sys.addaudithook(hook)


def _save_checkpoint(directory: Path, step: int, parameters: Any, client: Any) -> None:
    from device.algorithm.client import save_parameters

    tmp = directory.with_name(directory.name + ".new")
    tmp.mkdir(parents=True, exist_ok=True)
    save_parameters(parameters, tmp / PARAMETERS_FILE)
    if callable(getattr(client, "checkpoint", None)):
        state = client.checkpoint()
        if state:
            save_parameters(state, tmp / CLIENT_STATE_FILE)
    (tmp / STATE_FILE).write_text(json.dumps({"step": step}))
    old = directory.with_name(directory.name + ".old")
    if directory.exists():
        os.replace(directory, old)
    os.replace(tmp, directory)
    if old.exists():
        for child in old.iterdir():
            child.unlink()
        old.rmdir()


def _load_checkpoint(work: Path) -> tuple[int, Any, Any] | None:
    """(step, parameters, the client's own state or None) of the last whole checkpoint, or None."""
    from device.algorithm.client import load_parameters

    for candidate in (work / CHECKPOINT_DIR, work / (CHECKPOINT_DIR + ".old")):
        try:
            step = int(json.loads((candidate / STATE_FILE).read_text())["step"])
            parameters = load_parameters(candidate / PARAMETERS_FILE)
        except (OSError, ValueError, KeyError, TypeError):
            continue
        client_file = candidate / CLIENT_STATE_FILE
        return step, parameters, (load_parameters(client_file) if client_file.exists() else None)
    return None


def run(job: Job, work: Path, frames: _Frames, confinement: str = "audit hook") -> None:
    from device.algorithm.client import (
        AlgorithmError,
        checked_evaluate,
        checked_fit,
        checked_initial_parameters,
        load_parameters,
        save_parameters,
    )  # fmt: skip
    from device.algorithm.loader import load_client

    _, client = load_client(Path(job.package_dir), job.config, {k: Path(v) for k, v in job.datasets.items()})
    if job.export_from is not None:  # a federated task's published model as ONNX, when the client exports
        out = work / OUTPUT_DIR
        out.mkdir(exist_ok=True)
        onnx = None
        if callable(getattr(client, "export", None)):
            data = client.export(load_parameters(Path(job.export_from)))
            if not isinstance(data, bytes | bytearray) or not data:
                raise AlgorithmError(f"export() returned {type(data).__name__}; it returns the ONNX model's bytes")
            (out / ONNX_FILE).write_bytes(bytes(data))
            onnx = ONNX_FILE
        frames.send("result", resumed_from=0, steps=0, loss=0.0, num_examples=0, metrics={}, parameters=PARAMETERS_FILE, onnx=onnx)
        return
    if job.evaluate:  # a cross-site evaluation: each model scored on this site's data, nothing trained or written
        for label, path in job.evaluate.items():
            scored = checked_evaluate(client, load_parameters(Path(path)), {"round": 0})
            frames.send("evaluated", label=label, loss=scored.loss, num_examples=scored.num_examples, metrics=scored.metrics)
        frames.send("result", resumed_from=0, steps=0, loss=0.0, num_examples=0, metrics={}, parameters=PARAMETERS_FILE, onnx=None)
        return
    resumed = _load_checkpoint(work)
    if resumed is not None:
        start, parameters, state = resumed
        if state is not None and callable(getattr(client, "restore", None)):
            client.restore(state)
    else:
        start = 0
        parameters = load_parameters(Path(job.initial_parameters)) if job.initial_parameters else checked_initial_parameters(client)
    frames.send("started", resumed_from=start, steps=job.steps, confinement=confinement)
    for step in range(start + 1, job.steps + 1):
        fitted = checked_fit(client, parameters, {**job.fit_config, "round": step})
        parameters = fitted.parameters
        frames.send("step", step=step, num_examples=fitted.num_examples, metrics=fitted.metrics)
        if step % job.checkpoint_every == 0 or step == job.steps:
            _save_checkpoint(work / CHECKPOINT_DIR, step, parameters, client)
            frames.send("checkpoint", step=step)
    evaluated = checked_evaluate(client, parameters, {"round": job.steps})
    out = work / OUTPUT_DIR
    out.mkdir(exist_ok=True)
    save_parameters(parameters, out / PARAMETERS_FILE)
    onnx = None
    if job.export and callable(getattr(client, "export", None)):
        data = client.export(parameters)
        if not isinstance(data, bytes | bytearray) or not data:
            raise AlgorithmError(f"export() returned {type(data).__name__}; it returns the ONNX model's bytes")
        (out / ONNX_FILE).write_bytes(bytes(data))
        onnx = ONNX_FILE
    frames.send("result", resumed_from=start, steps=job.steps, loss=evaluated.loss, num_examples=evaluated.num_examples,
                metrics=evaluated.metrics, parameters=PARAMETERS_FILE, onnx=onnx)  # fmt: skip


def main() -> int:
    from device.algorithm.client import AlgorithmError

    frames = _Frames(int(os.environ.pop(FRAMES_ENV)))
    work = Path.cwd()
    try:
        job = Job.model_validate_json(sys.stdin.buffer.read())
    except ValueError as exc:
        frames.send("error", kind="contract", message=f"the job is not valid: {exc}")
        return EXIT_ERROR
    sys.path.insert(0, job.package_dir)
    confine_writes(work)
    try:
        readable = [Path(job.package_dir), *map(Path, job.datasets.values()), *map(Path, job.evaluate.values())]
        readable += [Path(p) for p in (job.initial_parameters, job.export_from) if p]
        version = landlock.confine([work], hidden=Path(job.private_dir) if job.private_dir else None, readable=readable)
    except OSError as exc:  # the kernel has Landlock and refused: the algorithm does not run unconfined
        frames.send("error", kind="raised", message=f"the site could not confine the algorithm: {exc}")
        return EXIT_ERROR
    try:
        run(job, work, frames, confinement=f"landlock abi {version}" if version else "audit hook")
    except AlgorithmError as exc:
        frames.send("error", kind="contract", message=str(exc))
        return EXIT_ERROR
    except MemoryError:
        frames.send("error", kind="memory", message="the algorithm ran out of memory (MemoryError) within its memory limit")
        return EXIT_ERROR
    except BaseException as exc:  # noqa: BLE001 - whatever the user's code raised ends the run, said as it is
        lines = traceback.format_exception(exc)
        text = "".join(lines)
        sys.stderr.write(text)
        kind = "forbidden_write" if isinstance(exc, PermissionError) and "only inside its working directory" in str(exc) else "raised"
        tail = "".join(text.splitlines(keepends=True)[-TRACEBACK_LINES:])
        frames.send("error", kind=kind, message=f"{type(exc).__name__}: {exc}", traceback=tail)
        return EXIT_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
