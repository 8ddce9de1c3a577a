"""The ``split_inference`` head (each device): calibrates, plans the cut and routes the model's requests through it,
falling back to the whole model here when the edge does not answer (see :mod:`device.tasks.split`)."""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from device.split.planner import DEVICE_ONLY, EDGE_ONLY, CutCost, Link, LinkEstimator, Plan, Planner, choose, probe_link
from device.tasks.programs import require_model
from device.tasks.serve import percentile
from device.tasks.split.order import MAX_LATENCIES, open_part, split_order
from device.tasks.worker import Failed, Rejected, Worker
from interfaces.infer import InferRequest
from interfaces.tasks import SplitInferenceSpec, WorkerAction

if TYPE_CHECKING:
    import numpy as np

    from device.ota.models import LoadedModel
    from device.runtime import Runtime

CALIBRATION_RUNS = 5  # timed runs of each part here (after one warm-up); their median counts
EDGE_RUNS = 3  # requests per cut to the edge at calibration; the median of the edge's compute times counts
MAX_PROBE_BYTES = 1 << 20
INITIAL_LINK = Link(10e6, 5.0)  # before anything is measured (never planned with: calibration comes first)


@dataclass
class _Part:
    cut: str
    head: Runtime | None  # None: edge-only (the raw input crosses)
    index: int


class Head:
    """One head worker: its parts, its plan and its route; see the module docstring."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.spec = worker.spec(SplitInferenceSpec)
        self.split = split_order(worker)
        self.channel = worker.infer
        if self.channel is None or not hasattr(self.channel, "call"):
            raise Rejected("this target cannot send split-inference requests (it has no infer channel)")
        self.model = require_model(worker.models, self.spec.model)
        if self.model.sha256 != self.split.base_sha256:
            raise Rejected(f"the loaded {self.model.name} {self.model.version} ({self.model.sha256[:12]}) is not the model the hub cut ({self.split.base_sha256[:12]})")
        inputs = self.model.inputs
        if len(inputs) != 1 or inputs[0].name != self.split.input or inputs[0].dtype != "float32":
            raise Rejected(f"split inference feeds one float32 input {self.split.input!r}; {self.model.name} takes {[(t.name, t.dtype) for t in inputs]}")
        self.parts: dict[str, _Part] = {EDGE_ONLY: _Part(EDGE_ONLY, None, 0)}
        for i, part in enumerate(self.split.parts, start=1):
            if part.head is None:
                raise Rejected(f"the order's part at {part.cut} has no head")
            self.parts[part.cut] = _Part(part.cut, open_part(worker, part.head, f"head at {part.cut}"), i)
        pinned = self.spec.cut
        if pinned is not None and pinned != DEVICE_ONLY and pinned not in self.parts:
            raise Rejected(f"the pinned cut {pinned!r} is not one of the order's parts ({', '.join(p.cut for p in self.split.parts)})")
        self.pinned = pinned
        self.stats = _HeadStats()
        self.estimator = LinkEstimator(INITIAL_LINK)
        self.planner: Planner | None = None
        self.plan_cut = DEVICE_ONLY  # until calibrated
        self.down_until = 0.0  # the edge failed: requests stay here until then
        self.last_crossed = 0.0  # monotonic time of the last request that crossed the link
        self._failed_model: str | None = None

    # ---- the worker's thread ------------------------------------------------------------------------
    def run(self) -> None:
        w, spec, models = self.worker, self.spec, self.worker.models
        if not self._take_route():
            return
        try:
            w.metrics_source(self._sample, spec.report_interval_s)
            w.running()
            options = "pinned to " + self.spec.cut if self.pinned else f"{len(self.parts) + 1} options"
            w.log(f"serving {self.model.name} {self.model.version} split with the edge ({options}; activations {'int8' if spec.quantize else 'float32'})")
            left = spec.duration_s
            next_look = 0.0
            while left is None or left > 0:
                if w.order.action is WorkerAction.PAUSE:
                    models.clear_route(self.model.name, self.route)
                if not w.checkpoint() or not self._take_route():
                    return
                if self._failed_model is not None:
                    raise Failed(self._failed_model)
                now = time.monotonic()
                if now >= next_look:
                    self._look(now)
                    next_look = time.monotonic() + self._look_interval()
                started = time.monotonic()
                wait = max(0.05, next_look - started)
                w.wait(wait if left is None else min(wait, left))
                if left is not None:
                    left -= time.monotonic() - started
            w.log(f"served {self.stats.requests} requests: {self.stats.split} split, {self.stats.edge} on the edge, "
                  f"{self.stats.device} on the device, {self.stats.fallbacks} fallbacks")  # fmt: skip
        finally:
            models.clear_route(self.model.name, self.route)

    def _take_route(self) -> bool:
        """Route the model's requests through this worker; a head being replaced (withdrawn, stopping) lets go of
        the route when it sees its stop, within about one ``timeout_ms``: wait that long for it, then REJECT."""
        deadline = time.monotonic() + max(2.0, 2 * self.spec.timeout_ms / 1000)
        while True:
            try:
                self.worker.models.set_route(self.model.name, self.route)
                return True
            except ValueError as exc:
                if time.monotonic() >= deadline:
                    raise Rejected(str(exc)) from None
                if not self.worker.wait(0.05):
                    return False

    def _look_interval(self) -> float:
        return min(self.spec.retry_after_s, self.spec.probe_interval_s) if self.planner is None else min(self.spec.probe_interval_s, 1.0)

    def _look(self, now: float) -> None:
        """Calibrate when there is no plan yet or the edge failed; probe the link when nothing crossed lately."""
        if self.pinned == DEVICE_ONLY:
            if self.planner is None:
                self._calibrate()
        elif self.planner is None or (self.down_until and now >= self.down_until):
            self._calibrate()
        elif self.pinned is None and now - self.last_crossed >= self.spec.probe_interval_s:
            try:
                link = probe_link(self._probe, self.estimator, max_bytes=MAX_PROBE_BYTES)
            except Exception as exc:  # noqa: BLE001 - SplitUnavailable and the runtime's own errors
                self._edge_failed(f"the link probe failed: {exc}")
                return
            self.last_crossed = time.monotonic()
            self._replanned(self.planner.update(link))

    def _calibrate(self) -> None:
        from device.tensors import encode_activation

        w, spec = self.worker, self.spec
        x = _sample_input(self.model)
        device_ms = _timed(lambda: self.model.runner.run({self.split.input: x}))
        costs = [CutCost(DEVICE_ONLY, device_ms, 0.0, 0)]
        try:
            for part in self.parts.values():
                if self.worker.stopping:
                    return
                if self.pinned not in (None, part.cut):
                    continue
                activation = x if part.head is None else self._head(part, x)
                # the device's share: the head, encoding the frame, and (below) decoding the answer
                head_ms = _timed(lambda p=part: encode_activation(x if p.head is None else self._head(p, x), spec.quantize))
                frame, meta = encode_activation(activation, spec.quantize)
                request = InferRequest(task_id=w.task_id, cut=part.cut, encoding=meta["encoding"], shape=meta["shape"])
                answers = [self.channel.call(request, frame, spec.timeout_ms / 1000) for _ in range(EDGE_RUNS)]
                payload = answers[-1][1]
                head_ms += _timed(lambda b=payload: _outputs(b, self.model))
                costs.append(CutCost(part.cut, head_ms, statistics.median(a[0].tail_ms for a in answers), len(frame), len(payload)))
            link = self.estimator.link if self.pinned == DEVICE_ONLY else probe_link(self._probe, self.estimator, max_bytes=MAX_PROBE_BYTES)
        except Exception as exc:  # noqa: BLE001 - the edge is not there (yet), or the runtime refused
            self._edge_failed(f"calibration failed: {exc}")
            return
        self.last_crossed = time.monotonic()
        self.down_until = 0.0
        first = self.planner is None
        self.planner = Planner(costs, link)
        plan = self._pinned_plan(costs, link) if self.pinned else self.planner.plan
        ranking = ", ".join(f"{cut} {ms:.2f} ms" for cut, ms in choose(costs, link).ranking)
        w.log(f"{'calibrated' if first else 'edge back; calibrated again'}: link {link.bandwidth_bps / 1e6:.2f} Mbit/s, rtt {link.rtt_ms:.2f} ms; "
              f"estimates {ranking}; cut at {plan.cut}")  # fmt: skip
        self._use(plan)

    def _pinned_plan(self, costs: list[CutCost], link: Link) -> Plan:
        cost = next((c for c in costs if c.cut == self.pinned), costs[0])
        return Plan(cost.cut, cost.estimate_ms(link), link)

    def _probe(self, frame: bytes) -> object:
        return self.channel.call(InferRequest(task_id=self.worker.task_id, kind="probe"), frame, self.spec.timeout_ms / 1000)

    def _head(self, part: _Part, x: np.ndarray) -> np.ndarray:
        assert part.head is not None
        outputs = part.head.run({part.head.inputs[0].name: x})
        return outputs[part.cut] if part.cut in outputs else next(iter(outputs.values()))

    def _use(self, plan: Plan) -> None:
        self.plan_cut = plan.cut
        self.stats.plan(plan, -1 if plan.cut == DEVICE_ONLY else self.parts[plan.cut].index)

    def _replanned(self, plan: Plan) -> None:
        if plan.cut != self.plan_cut and not self.pinned:
            self.stats.replans += 1
            self.worker.log(f"cut moved from {self.plan_cut} to {plan.cut}: link {plan.link.bandwidth_bps / 1e6:.2f} Mbit/s, "
                            f"rtt {plan.link.rtt_ms:.2f} ms (estimate {plan.estimate_ms:.2f} ms)")  # fmt: skip
            self._use(plan)
        else:
            self.stats.plan(plan, self.stats.cut_index)

    def _edge_failed(self, why: str) -> None:
        first = not self.down_until
        self.down_until = time.monotonic() + self.spec.retry_after_s
        if first:
            what = "requests run on the device" + (" (fallbacks)" if self.planner is not None else "")
            self.worker.log(f"the edge did not answer ({why}); {what} for {self.spec.retry_after_s:g} s, then it is tried again", "warning")

    # ---- requests (the caller's thread) -------------------------------------------------------------
    def route(self, model: LoadedModel, feeds: dict[str, Any]) -> tuple[dict[str, Any], str]:
        started = time.perf_counter()
        ok = False
        try:
            outputs, how = self._serve(model, feeds)
            ok = True
            return outputs, how
        finally:
            self.stats.observe(time.perf_counter() - started, ok)

    def _serve(self, model: LoadedModel, feeds: dict[str, Any]) -> tuple[dict[str, Any], str]:
        if model.sha256 != self.split.base_sha256:  # a deployment swapped the model: the parts do not fit it
            self._failed_model = f"{model.name} now runs {model.version} ({model.sha256[:12]}); the parts were cut from {self.split.base_sha256[:12]}"
            self.worker.wake()
            return model.runner.run(feeds), "local"
        cut = self.plan_cut
        if self.planner is None or cut == DEVICE_ONLY:
            self.stats.count("device")
            return model.runner.run(feeds), "device"
        if self.down_until and time.monotonic() < self.down_until:
            self.stats.count("fallbacks")
            return model.runner.run(feeds), "fallback"
        from device.split.channel import SplitUnavailable
        from device.tensors import encode_activation

        part = self.parts[cut]
        x = feeds[self.split.input]
        activation = x if part.head is None else self._head(part, x)
        frame, meta = encode_activation(activation, self.spec.quantize)
        request = InferRequest(task_id=self.worker.task_id, cut=cut, encoding=meta["encoding"], shape=meta["shape"])
        sent = time.perf_counter()
        try:
            reply, payload = self.channel.call(request, frame, self.spec.timeout_ms / 1000)
            outputs = _outputs(payload, model)
        except (SplitUnavailable, ValueError) as exc:
            self._edge_failed(str(exc))
            self.stats.count("fallbacks")
            return model.runner.run(feeds), "fallback"
        seconds = time.perf_counter() - sent
        self.last_crossed = time.monotonic()
        self.down_until = 0.0
        self.estimator.observe(len(frame) + len(payload), max(1e-6, seconds - reply.tail_ms / 1000))
        if self.planner is not None and not self.pinned:
            self._replanned(self.planner.update(self.estimator.link))
        if part.head is None:
            self.stats.count("edge")
            return outputs, "edge"
        self.stats.count("split")
        return outputs, f"split:{cut}"

    def _sample(self) -> dict[str, float]:
        values = self.stats.sample()
        link = self.estimator.link
        values.update(link_mbps=link.bandwidth_bps / 1e6, rtt_ms=link.rtt_ms)
        return values


def _outputs(payload: bytes, model: LoadedModel) -> dict[str, Any]:
    """The edge's answer as the model's outputs; ``ValueError`` when it is not that."""
    from safetensors.numpy import load

    try:
        outputs = load(payload)
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise ValueError(f"the edge's answer is not a safetensors frame: {exc}") from None
    expected = {t.name for t in model.outputs}
    if set(outputs) != expected:
        raise ValueError(f"the edge answered {sorted(outputs)}; the model's outputs are {sorted(expected)}")
    return outputs


def _sample_input(model: LoadedModel) -> np.ndarray:
    import numpy as np

    info = model.inputs[0]
    shape = tuple(d if isinstance(d, int) and d > 0 else 1 for d in info.shape)
    return np.random.default_rng(0).standard_normal(shape).astype(np.float32)


def _timed(fn: Any) -> float:
    fn()
    samples = []
    for _ in range(CALIBRATION_RUNS):
        started = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples)


class _HeadStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = self.errors = self.split = self.edge = self.device = self.fallbacks = self.replans = 0
        self.cut_index = -1
        self.estimate_ms = math.nan
        self._latencies: deque[float] = deque(maxlen=MAX_LATENCIES)

    def count(self, how: str) -> None:
        with self._lock:
            setattr(self, how, getattr(self, how) + 1)

    def observe(self, seconds: float, ok: bool) -> None:
        with self._lock:
            self.requests += 1
            self.errors += not ok
            self._latencies.append(seconds)

    def plan(self, plan: Plan, index: int) -> None:
        with self._lock:
            self.cut_index, self.estimate_ms = index, plan.estimate_ms

    def sample(self) -> dict[str, float]:
        with self._lock:
            values = {
                "requests": self.requests, "errors": self.errors, "split": self.split, "edge": self.edge, "device": self.device,
                "fallbacks": self.fallbacks, "replans": self.replans, "cut_index": self.cut_index,
            }  # fmt: skip
            if not math.isnan(self.estimate_ms):
                values["estimate_ms"] = self.estimate_ms
            latencies, self._latencies = sorted(self._latencies), deque(maxlen=MAX_LATENCIES)
        if latencies:
            values["latency_p50_ms"] = 1000 * percentile(latencies, 0.50)
            values["latency_p99_ms"] = 1000 * percentile(latencies, 0.99)
        return values
