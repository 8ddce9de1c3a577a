"""The ``split_inference`` tail (the edge node, one per task): serves the tails the hub cut, and the whole model for
edge-only requests, to the task's heads (see :mod:`device.tasks.split`)."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from device.split.planner import EDGE_ONLY
from device.tasks.serve import percentile
from device.tasks.split.order import MAX_LATENCIES, open_part, split_order
from device.tasks.worker import Rejected, Worker
from interfaces.infer import InferReply, InferRequest
from interfaces.tasks import SplitInferenceSpec

if TYPE_CHECKING:
    from device.runtime import Runtime


def serve_tails(worker: Worker) -> None:
    spec = worker.spec(SplitInferenceSpec)
    split = split_order(worker)
    router = worker.infer
    if router is None or not hasattr(router, "serve"):
        raise Rejected("this target serves no split-inference tails (it is not an edge node)")
    tails: dict[str, Runtime] = {}
    for part in split.parts:
        if part.tail is None:
            raise Rejected(f"the order's part at {part.cut} has no tail")
        tails[part.cut] = open_part(worker, part.tail, f"tail at {part.cut}")
    if split.whole is not None:
        tails[EDGE_ONLY] = open_part(worker, split.whole, "whole model")
    stats = _TailStats()

    def answer(request: InferRequest, payload: bytes) -> tuple[InferReply, bytes]:
        if request.kind == "probe":
            stats.count(probe=True)
            return InferReply(status="ok"), b""
        from safetensors.numpy import save

        from device.tensors import decode_activation

        runner = tails.get(request.cut)
        if runner is None:
            stats.count(error=True)
            return InferReply(status="error", error=f"this edge has no tail at {request.cut!r} for task {worker.task_id}"), b""
        started = time.perf_counter()
        try:
            x = decode_activation(payload)
            outputs = runner.run({runner.inputs[0].name: x})
        except Exception as exc:  # noqa: BLE001 - a bad frame or a shape the tail refuses: the device falls back
            stats.count(error=True)
            return InferReply(status="error", error=f"{type(exc).__name__}: {exc}"[:500]), b""
        seconds = time.perf_counter() - started
        stats.count(seconds=seconds)
        return InferReply(status="ok", tail_ms=seconds * 1000), save({k: _contiguous(v) for k, v in outputs.items()})

    router.serve(worker.task_id, answer)
    try:
        worker.metrics_source(stats.sample, spec.report_interval_s)
        worker.running()
        worker.log(f"serving {len(tails)} tails of {spec.model.name} ({', '.join(tails)})")
        while worker.checkpoint():
            worker.wait()
    finally:
        router.unserve(worker.task_id, answer)


def _contiguous(array: Any) -> Any:
    import numpy as np

    return np.ascontiguousarray(array)


class _TailStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = self.errors = self.probes = 0
        self._seconds: deque[float] = deque(maxlen=MAX_LATENCIES)

    def count(self, seconds: float | None = None, error: bool = False, probe: bool = False) -> None:
        with self._lock:
            self.probes += probe
            self.requests += not probe
            self.errors += error
            if seconds is not None:
                self._seconds.append(seconds)

    def sample(self) -> dict[str, float]:
        with self._lock:
            values = {"requests": self.requests, "errors": self.errors, "probes": self.probes}
            seconds, self._seconds = sorted(self._seconds), deque(maxlen=MAX_LATENCIES)
        if seconds:
            values["tail_ms_p50"] = 1000 * percentile(seconds, 0.5)
        return values
