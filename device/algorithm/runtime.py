"""The site runtime of users' algorithms (issue 18): each worker in a limited process of its own, never in the agent.

:func:`run_worker` starts ``python -I -m device.algorithm.runner`` (:mod:`device.algorithm.runner`) in the worker's
own directory, hands it its :class:`~device.algorithm.runner.Job` on stdin and reads its frames on a pipe of its
own (its number in ``AISYNERGY_FRAMES_FD``); the algorithm's stdout and stderr come back line by line as log lines. The child gets

* an environment of its own: ``PATH``, ``LANG``, ``HOME`` (its directory), ``TMPDIR`` (inside it), thread counts
  that follow its CPU share, and ``CUDA_VISIBLE_DEVICES`` = the accelerators reserved for it (none: the empty
  string, so it sees no card). Nothing of the agent's environment, no credentials, no broker or hub address;
* its own session and process group, killed with it (and with the agent: ``PR_SET_PDEATHSIG``);
* limits: a CPU quota (``cpu.cfs_quota_us``) and a memory limit (``memory.limit_in_bytes``, swap included where the
  kernel accounts it) in a cgroup of its own under ``/sys/fs/cgroup/{cpu,memory}/aisynergy/`` where the site lets
  the agent create one (cgroup v1, as root); otherwise ``RLIMIT_AS`` for memory and ``nice`` 10 for CPU
  (:func:`limit_support` says which). Always ``RLIMIT_CORE`` 0 and ``RLIMIT_NOFILE`` 1024;
* a wall-clock timeout, after which the whole group is killed (time spent paused does not count: while its task is
  paused the group is stopped with ``SIGSTOP`` and continued with ``SIGCONT``);
* writes only inside its directory (the runner's audit hook; see its module).

The outcome is a :class:`Finished` (the result frame) or an :class:`AlgorithmFailed` whose ``reason`` says what
happened: ``raised`` (with the last lines of its traceback), ``contract`` (it broke the client API), ``memory`` (the
limit killed it, or it ran out under ``RLIMIT_AS``), ``timeout``, ``forbidden_write``, ``died`` (a signal or an exit
without a result), ``stopped`` (the agent stopped it).
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from device.algorithm.runner import FRAMES_ENV, OUTPUT_DIR, Job

log = logging.getLogger("aisynergy.device.algorithm")

CGROUP_ROOT = Path("/sys/fs/cgroup")
CGROUP_PARENT = "aisynergy"
CPU_PERIOD_US = 100_000
NICE = 10
TAIL_LINES = 20
MAX_LINE = 4000

Reason = Literal["raised", "contract", "memory", "timeout", "forbidden_write", "died", "stopped"]


@dataclass(frozen=True)
class Limits:
    """What one worker may use: ``cpu_cores`` (a quota, in cores), ``memory_bytes``, ``timeout_s`` (None: none) and
    ``accelerators`` (indices of the reserved cards)."""

    cpu_cores: float | None = None
    memory_bytes: int | None = None
    timeout_s: float | None = None
    accelerators: tuple[int, ...] = ()


@dataclass(frozen=True)
class Finished:
    """The result frame of a run: what ``evaluate`` said and where the outputs are."""

    steps: int
    resumed_from: int
    loss: float
    num_examples: int
    metrics: dict[str, float]
    parameters: Path
    onnx: Path | None
    limited_by: str
    """how the limits were applied: ``cgroup`` or ``rlimit``"""


class AlgorithmFailed(Exception):
    def __init__(self, reason: Reason, message: str, tail: str = "") -> None:
        self.reason, self.message, self.tail = reason, message, tail
        super().__init__(f"{message}\n{tail}".rstrip() if tail else message)


@dataclass
class _Cgroup:
    cpu: Path | None = None
    memory: Path | None = None

    @property
    def procs(self) -> list[Path]:
        """The ``cgroup.procs`` files the worker joins."""
        return [group / "cgroup.procs" for group in (self.cpu, self.memory) if group is not None]

    def oom_killed(self) -> bool:
        if self.memory is None:
            return False
        try:
            control = (self.memory / "memory.oom_control").read_text()
            if any(line.split()[0] == "oom_kill" and int(line.split()[1]) > 0 for line in control.splitlines() if line.strip()):
                return True
            return int((self.memory / "memory.failcnt").read_text()) > 0 and int((self.memory / "memory.max_usage_in_bytes").read_text()) >= int(
                (self.memory / "memory.limit_in_bytes").read_text()) * 0.95  # fmt: skip
        except (OSError, ValueError, IndexError):
            return False

    def remove(self) -> None:
        for path in (self.cpu, self.memory):
            if path is None:
                continue
            for _ in range(50):  # the last process leaves the group a moment after it is reaped
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)


def limit_support(root: Path = CGROUP_ROOT) -> str:
    """``cgroup`` when this process may create cgroup v1 groups for cpu and memory under ``root``, else ``rlimit``."""
    for controller in ("cpu", "memory"):
        base = root / controller
        if not (base / "cgroup.procs").exists() or not os.access(base, os.W_OK):
            return "rlimit"
    return "cgroup"


def _make_cgroup(name: str, limits: Limits, root: Path) -> _Cgroup:
    group = _Cgroup()
    try:
        if limits.cpu_cores is not None:
            cpu = root / "cpu" / CGROUP_PARENT / name
            cpu.mkdir(parents=True, exist_ok=True)
            group.cpu = cpu
            (cpu / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
            (cpu / "cpu.cfs_quota_us").write_text(str(max(1000, int(limits.cpu_cores * CPU_PERIOD_US))))
        if limits.memory_bytes is not None:
            memory = root / "memory" / CGROUP_PARENT / name
            memory.mkdir(parents=True, exist_ok=True)
            group.memory = memory
            (memory / "memory.limit_in_bytes").write_text(str(limits.memory_bytes))
            swap = memory / "memory.memsw.limit_in_bytes"
            if swap.exists():
                try:
                    swap.write_text(str(limits.memory_bytes))
                except OSError:
                    pass
    except OSError:
        group.remove()
        raise
    return group


def _environment(work: Path, limits: Limits) -> dict[str, str]:
    threads = str(max(1, math.ceil(limits.cpu_cores))) if limits.cpu_cores is not None else str(os.cpu_count() or 1)
    tmp = work / "tmp"
    tmp.mkdir(exist_ok=True)
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(work), "TMPDIR": str(tmp),
        "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "OPENBLAS_NUM_THREADS": threads,
        "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in limits.accelerators), "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
    }  # fmt: skip


def _prctl() -> Any:
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()
_PR_SET_PDEATHSIG = 1


def _preexec(limits: Limits, group: _Cgroup | None) -> Callable[[], None]:
    """What the child does between fork and exec. It imports nothing and takes no lock another thread of the agent
    could hold at the fork (everything it calls is resolved here, in the parent)."""
    procs = [str(p) for p in group.procs] if group is not None else []
    address_space = limits.memory_bytes if (group is None or group.memory is None) and limits.memory_bytes is not None else None
    nice = (group is None or group.cpu is None) and limits.cpu_cores is not None

    def setup() -> None:
        os.setsid()
        if _PRCTL is not None:
            _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)  # the worker dies with its agent
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
        for path in procs:
            fd = os.open(path, os.O_WRONLY)
            try:
                os.write(fd, str(os.getpid()).encode())
            finally:
                os.close(fd)
        if address_space is not None:
            resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
        if nice:
            os.nice(NICE)

    return setup


def _pump(stream: Any, sink: Callable[[str], None], tail: deque[str]) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "replace").rstrip("\n")[:MAX_LINE]
        tail.append(line)
        try:
            sink(line)
        except Exception:  # a sink's failure must not stop the draining of the pipe
            log.exception("a log line of the algorithm was lost")
    stream.close()


def _absolute(job: Job) -> Job:
    """``job`` with every path in it absolute, as the agent's working directory resolves it."""

    def absolute(path: str) -> str:
        return str(Path(path).resolve())

    def optional(path: str | None) -> str | None:
        return None if path is None else absolute(path)

    return job.model_copy(update={
        "package_dir": absolute(job.package_dir), "datasets": {k: absolute(v) for k, v in job.datasets.items()},
        "initial_parameters": optional(job.initial_parameters), "evaluate": {k: absolute(v) for k, v in job.evaluate.items()},
        "export_from": optional(job.export_from), "private_dir": optional(job.private_dir),
    })  # fmt: skip


def run_worker(
    name: str, work: Path, job: Job, limits: Limits, *, on_log: Callable[[str, str], None] = lambda stream, line: None,
    on_frame: Callable[[dict[str, Any]], None] = lambda frame: None, stop: threading.Event | None = None, cgroup_root: Path = CGROUP_ROOT,
    python: str = sys.executable, paused: Callable[[], bool] | None = None,
) -> Finished:  # fmt: skip
    """Run one worker (``name``: unique on this site, e.g. its worker id) in ``work`` and wait for it; see the module
    docstring. ``on_log(stream, line)`` gets each line of its stdout and stderr, ``on_frame`` each frame (started,
    step, checkpoint, evaluated) as it comes; ``stop`` set: the worker is killed and the run raises ``stopped``; while
    ``paused()`` says so the worker's processes are stopped (``SIGSTOP`` to its process group: it holds its memory,
    takes no CPU, and goes on where it was at ``SIGCONT``), and paused time does not count towards its timeout."""
    work = Path(work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    job = _absolute(job)  # the child starts in ``work``: a path relative to the agent's directory would miss there
    group: _Cgroup | None = None
    how = limit_support(cgroup_root)
    if how == "cgroup" and (limits.cpu_cores is not None or limits.memory_bytes is not None):
        try:
            group = _make_cgroup(name, limits, cgroup_root)
        except OSError as exc:
            log.warning("cannot create the cgroups of worker %s (%s); limiting it with rlimits", name, exc)
            how = "rlimit"
    read_frames, write_frames = os.pipe()
    tails: dict[str, deque[str]] = {"stdout": deque(maxlen=TAIL_LINES), "stderr": deque(maxlen=TAIL_LINES)}
    frames: list[dict[str, Any]] = []
    try:
        try:
            env = {**_environment(work, limits), FRAMES_ENV: str(write_frames)}
            child = subprocess.Popen(
                [python, "-I", "-m", "device.algorithm.runner"], cwd=work, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, pass_fds=(write_frames,), preexec_fn=_preexec(limits, group), close_fds=True,  # noqa: PLW1509 - see _preexec
            )  # fmt: skip
        except BaseException:
            os.close(read_frames)
            raise
        finally:
            os.close(write_frames)
        started = time.monotonic()
        pumps = [threading.Thread(target=_pump, args=(getattr(child, s), lambda line, s=s: on_log(s, line), tails[s]), daemon=True) for s in tails]
        for pump in pumps:
            pump.start()

        def read_frames_loop() -> None:
            with os.fdopen(read_frames, "rb") as stream:
                for raw in stream:
                    try:
                        frame = json.loads(raw)
                    except ValueError:
                        continue
                    if isinstance(frame, dict):
                        frames.append(frame)
                        if frame.get("type") in ("started", "step", "checkpoint", "evaluated"):
                            try:
                                on_frame(frame)
                            except Exception:
                                log.exception("a frame of worker %s was lost", name)

        reader = threading.Thread(target=read_frames_loop, daemon=True)
        reader.start()
        assert child.stdin is not None
        try:
            child.stdin.write(job.model_dump_json().encode())
            child.stdin.close()
        except BrokenPipeError:
            pass
        why: Reason | None = None
        held_since: float | None = None
        while child.poll() is None:
            if stop is not None and stop.is_set():
                why = "stopped"
            elif held_since is None and limits.timeout_s is not None and time.monotonic() - started > limits.timeout_s:
                why = "timeout"
            if why is not None:
                _kill(child)
                break
            hold = paused is not None and paused()
            if hold and held_since is None:
                held_since = time.monotonic()
                _signal(child, signal.SIGSTOP)
            elif not hold and held_since is not None:
                started += time.monotonic() - held_since  # paused time is not running time
                held_since = None
                _signal(child, signal.SIGCONT)
            time.sleep(0.05)
        child.wait()
        reader.join(5)
        for pump in pumps:
            pump.join(5)
        return _outcome(child.returncode, why, frames, tails, group, limits, work, how)
    finally:
        if group is not None:
            group.remove()


def _kill(child: subprocess.Popen[bytes]) -> None:
    _signal(child, signal.SIGKILL)


def _signal(child: subprocess.Popen[bytes], signum: signal.Signals) -> None:
    """``signum`` to the worker's process group (it is the leader of its own session)."""
    try:
        os.killpg(child.pid, signum)
    except ProcessLookupError:
        pass


def _outcome(
    code: int, why: Reason | None, frames: list[dict[str, Any]], tails: dict[str, deque[str]], group: _Cgroup | None, limits: Limits, work: Path, how: str,
) -> Finished:  # fmt: skip
    tail = "\n".join(tails["stderr"])
    if why == "stopped":
        raise AlgorithmFailed("stopped", "the worker was stopped")
    if why == "timeout":
        raise AlgorithmFailed("timeout", f"the algorithm ran past its timeout of {limits.timeout_s:g} s and was killed", tail)
    result = next((f for f in frames if f.get("type") == "result"), None)
    if code == 0 and result is not None:
        out = work / OUTPUT_DIR
        return Finished(
            steps=int(result["steps"]), resumed_from=int(result["resumed_from"]), loss=float(result["loss"]), num_examples=int(result["num_examples"]),
            metrics={str(k): float(v) for k, v in result["metrics"].items()}, parameters=out / str(result["parameters"]),
            onnx=(out / str(result["onnx"])) if result.get("onnx") else None, limited_by=how,
        )  # fmt: skip
    error = next((f for f in frames if f.get("type") == "error"), None)
    memory = limits.memory_bytes
    if group is not None and group.oom_killed() or (error is not None and error.get("kind") == "memory"):
        raise AlgorithmFailed("memory", f"the algorithm exceeded its memory limit of {memory // (1 << 20) if memory else '?'} MiB and was killed", tail)
    if error is not None:
        kind = str(error.get("kind", "raised"))
        reason: Reason = kind if kind in ("contract", "forbidden_write", "raised") else "raised"  # type: ignore[assignment]
        raise AlgorithmFailed(reason, str(error.get("message", "the algorithm failed")), str(error.get("traceback", "")) or tail)
    if code < 0:
        raise AlgorithmFailed("died", f"the algorithm's process was killed by signal {signal.Signals(-code).name}", tail)
    raise AlgorithmFailed("died", f"the algorithm's process exited with status {code} before its result", tail)
