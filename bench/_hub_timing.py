"""Diagnostics only (``heartbeat_load.py --instrument-hub``, ``tasks.py --instrument-hub``): run the
unmodified hub CLI, timing background jobs from the outside.

Wraps ``StatusIngest.flush`` (the batched heartbeat write), the liveness tick and the task scheduler's
``TaskController.tick``, and appends one JSON line per call to ``$AISYNERGY_BENCH_TIMINGS``:
``{"t": wall, "job": ..., "ms": duration, "rows": n}`` (for the scheduler ``rows`` is the number of tasks
the tick changed).
The hub's code is not changed; headline figures come from runs without this wrapper.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cloud.api.app as app_module  # noqa: E402
from cloud.cli.root import main  # noqa: E402
from cloud.ingest import StatusIngest  # noqa: E402
from cloud.scheduler import TaskController  # noqa: E402

_out = open(os.environ["AISYNERGY_BENCH_TIMINGS"], "a", buffering=1)  # noqa: SIM115
_lock = threading.Lock()


def _record(job: str, started: float, rows: object) -> None:
    line = json.dumps({"t": time.time(), "job": job, "ms": round((time.perf_counter() - started) * 1000, 2), "rows": rows})
    with _lock:
        _out.write(line + "\n")


_flush = StatusIngest.flush


def flush(self: StatusIngest) -> int:
    backlog = len(self._pending)
    started = time.perf_counter()
    written = _flush(self)
    if backlog:
        _record("flush", started, written)
    return written


_liveness = app_module._liveness_tick


def liveness_tick(*args: object) -> None:
    started = time.perf_counter()
    _liveness(*args)
    _record("liveness", started, None)


_tick = TaskController.tick


def scheduler_tick(self: TaskController, at: object = None) -> int:
    started = time.perf_counter()
    changed = _tick(self, at)  # type: ignore[arg-type]
    _record("scheduler", started, changed)
    return changed


StatusIngest.flush = flush  # type: ignore[method-assign]
TaskController.tick = scheduler_tick  # type: ignore[method-assign]
app_module._liveness_tick = liveness_tick  # type: ignore[assignment]

if __name__ == "__main__":
    main()
