"""The ``inference`` worker program (``InferenceSpec``): serve a loaded model and report how it is used.

The model must be loaded here (name, and version if given), else the order is REJECTED. Requests keep
arriving the usual way (the ``infer`` command, the application calling ``ModelHost.infer``); the worker
listens to :meth:`~device.ota.models.ModelHost.add_listener` and reports every ``report_interval_s``:
``requests`` and ``errors`` (since the worker started), ``requests_per_s`` and, when there were requests,
``latency_p50_ms`` and ``latency_p99_ms`` (since the previous sample). After ``duration_s`` of running
(paused time excluded) it SUCCEEDS; withdrawn, it stops.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque

from device.tasks.programs import require_model
from device.tasks.worker import Worker
from interfaces.tasks import InferenceSpec

MAX_LATENCIES = 100_000  # per sample; beyond, the oldest are dropped


def run(worker: Worker) -> None:
    spec = worker.spec(InferenceSpec)
    model = require_model(worker.models, spec.model)
    stats = _Requests(model.name)
    worker.models.add_listener(stats.observe)
    try:
        until = f"for {spec.duration_s:g} s" if spec.duration_s is not None else "until stopped"
        worker.log(f"serving {model.name} {model.version} {until}")
        worker.metrics_source(stats.sample, spec.report_interval_s)
        worker.running()
        left = spec.duration_s
        while worker.checkpoint() and (left is None or left > 0):
            started = time.monotonic()
            worker.wait(left)
            if left is not None:
                left -= time.monotonic() - started
        if not worker.stopping:
            worker.log(f"served {stats.requests} requests ({stats.errors} failed)")
    finally:
        worker.models.remove_listener(stats.observe)


class _Requests:
    """Requests to one model, as the model host reports them (from any thread)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.requests = self.errors = 0
        self._lock = threading.Lock()
        self._latencies: deque[float] = deque(maxlen=MAX_LATENCIES)
        self._since, self._since_requests = time.monotonic(), 0

    def observe(self, model: str, seconds: float, rows: int, ok: bool) -> None:
        if model != self.model:
            return
        with self._lock:
            self.requests += 1
            self.errors += not ok
            self._latencies.append(seconds)

    def sample(self) -> dict[str, float]:
        with self._lock:
            now = time.monotonic()
            latencies, self._latencies = sorted(self._latencies), deque(maxlen=MAX_LATENCIES)
            values = {
                "requests": self.requests, "errors": self.errors,
                "requests_per_s": (self.requests - self._since_requests) / max(now - self._since, 1e-9),
            }  # fmt: skip
            self._since, self._since_requests = now, self.requests
        if latencies:
            values["latency_p50_ms"] = 1000 * percentile(latencies, 0.50)
            values["latency_p99_ms"] = 1000 * percentile(latencies, 0.99)
        return values


def percentile(ordered: list[float], q: float) -> float:
    """Nearest-rank percentile of a sorted, non-empty list."""
    return ordered[min(len(ordered), max(1, math.ceil(q * len(ordered)))) - 1]
