"""Diagnostics only (``heartbeat_load.py --instrument-hub``): run the unmodified hub CLI, timing two
background jobs from the outside.

Wraps ``StatusIngest.flush`` (the batched heartbeat write) and the liveness tick, and appends one JSON
line per call to ``$AISYNERGY_BENCH_TIMINGS``: ``{"t": wall, "job": ..., "ms": duration, "rows": n}``.
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


StatusIngest.flush = flush  # type: ignore[method-assign]
app_module._liveness_tick = liveness_tick  # type: ignore[assignment]

if __name__ == "__main__":
    main()
