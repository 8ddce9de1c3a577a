"""Where to cut a model between device and edge, from measurements (DESIGN §5, split inference).

The cost of one request cut at tensor ``t`` is

    head_ms(t) on the device + [RTT + (activation_bytes(t) + reply_bytes) * 8 / bandwidth] + tail_ms(t) on the edge

where the device's share counts encoding the frame and decoding the answer as well as running the head (on a
slow board, int8 quantisation of a large activation is not free), and the answer's bytes cross the link too,

with two special cuts: ``DEVICE_ONLY`` (the whole model on the device, nothing crosses the link) and
``EDGE_ONLY`` (the raw input crosses, the whole model runs on the edge). The :class:`Planner` picks the
cheapest cut for the link as measured and re-plans only when the link estimate moves by more than
``replan_ratio`` (so a noisy link does not make it flap); :class:`LinkEstimator` turns observed
transfers and round trips into that estimate (exponentially weighted).

Per-cut latencies come from profiling the parts on the device and on the edge (``cloud.ml.partition``
profiles them with ONNX Runtime; a device re-measures its own heads), activation sizes from the
tensor shapes times the bytes per element (int8 frames are a quarter of fp32).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

DEVICE_ONLY = "<device>"
EDGE_ONLY = "<edge>"


@dataclass(frozen=True)
class CutCost:
    """What one cut costs, measured: ``head_ms`` on the device, ``tail_ms`` on the edge, the bytes that cross."""

    cut: str
    head_ms: float
    tail_ms: float
    activation_bytes: int
    reply_bytes: int = 0
    """the answer's bytes coming back (the outputs): they cross the same link"""

    def estimate_ms(self, link: Link) -> float:
        if self.cut == DEVICE_ONLY:
            return self.head_ms
        return self.head_ms + link.transfer_ms(self.activation_bytes + self.reply_bytes) + self.tail_ms


@dataclass(frozen=True)
class Link:
    bandwidth_bps: float
    rtt_ms: float

    def transfer_ms(self, nbytes: int) -> float:
        """One request's time on the link: a round trip plus the bytes at the bandwidth."""
        return self.rtt_ms + nbytes * 8 / max(self.bandwidth_bps, 1.0) * 1000

    def differs(self, other: Link, ratio: float) -> bool:
        def off(a: float, b: float) -> bool:
            return abs(a - b) > ratio * max(abs(b), 1e-9)

        return off(self.bandwidth_bps, other.bandwidth_bps) or off(self.rtt_ms, other.rtt_ms)


@dataclass(frozen=True)
class Plan:
    cut: str
    estimate_ms: float
    link: Link
    ranking: tuple[tuple[str, float], ...] = field(default=())
    """every cut with its estimate, cheapest first"""


def choose(costs: list[CutCost], link: Link) -> Plan:
    """The cheapest cut for ``link`` (ties: the earlier cut in ``costs``, so less runs on the device)."""
    if not costs:
        raise ValueError("no cut to choose from")
    ranked = sorted(((c.cut, c.estimate_ms(link), i) for i, c in enumerate(costs)), key=lambda r: (r[1], r[2]))
    best = ranked[0]
    return Plan(best[0], best[1], link, tuple((cut, ms) for cut, ms, _ in ranked))


class Planner:
    """The current cut; ``update(link)`` re-plans when the link moved by more than ``replan_ratio``."""

    def __init__(self, costs: list[CutCost], link: Link, replan_ratio: float = 0.25) -> None:
        self._lock = threading.Lock()
        self.costs = list(costs)
        self.replan_ratio = replan_ratio
        self.plan = choose(self.costs, link)
        self.replans = 0

    def update(self, link: Link) -> Plan:
        with self._lock:
            if link.differs(self.plan.link, self.replan_ratio):
                new = choose(self.costs, link)
                if new.cut != self.plan.cut:
                    self.replans += 1
                self.plan = new
            return self.plan

    def set_costs(self, costs: list[CutCost]) -> Plan:
        """New measurements of the parts (a device re-profiled its heads): plan again for the same link."""
        with self._lock:
            self.costs = list(costs)
            self.plan = choose(self.costs, self.plan.link)
            return self.plan


class LinkEstimator:
    """Bandwidth and RTT from what the link did: ``observe(nbytes, seconds)`` per transfer, ``observe_rtt``
    per empty round trip; each an exponentially weighted mean (``alpha`` = weight of the newest)."""

    def __init__(self, initial: Link, alpha: float = 0.3) -> None:
        self._lock = threading.Lock()
        self._bandwidth, self._rtt, self._alpha = initial.bandwidth_bps, initial.rtt_ms, alpha

    def observe_rtt(self, ms: float) -> None:
        with self._lock:
            self._rtt += self._alpha * (ms - self._rtt)

    def observe(self, nbytes: int, seconds: float) -> None:
        """A transfer of ``nbytes`` that took ``seconds`` end to end (its round trip included)."""
        with self._lock:
            wire_s = seconds - self._rtt / 1000
            if nbytes <= 0 or wire_s <= 0:
                return
            self._bandwidth += self._alpha * (nbytes * 8 / wire_s - self._bandwidth)

    @property
    def link(self) -> Link:
        with self._lock:
            return Link(self._bandwidth, self._rtt)


def probe_link(call: Callable[[bytes], object], estimator: LinkEstimator, pings: int = 5, transfers: int = 3,
               min_wire_ms: float = 4.0, max_bytes: int = 4 << 20) -> Link:  # fmt: skip
    """Measure a link through ``call(frame)`` (a request that sends ``frame`` and waits for the answer):
    ``pings`` empty round trips for the RTT, then ``transfers`` transfers of growing size (8 KiB, x4 each
    time, at most ``max_bytes``) until their median spends ``min_wire_ms`` on the wire beyond the median
    round trip; those transfers give the bandwidth. Medians, so one stall does not end the probing early.
    Returns the estimator's link."""

    def timed(frame: bytes) -> float:
        started = time.perf_counter()
        call(frame)
        return time.perf_counter() - started

    rtts = [timed(b"") for _ in range(pings)]
    for seconds in rtts:
        estimator.observe_rtt(seconds * 1000)
    rtt_s = statistics.median(rtts)
    size = 8 * 1024
    while True:
        times = [timed(bytes(size)) for _ in range(transfers)]
        if (statistics.median(times) - rtt_s) * 1000 >= min_wire_ms or size >= max_bytes:
            break
        size = min(size * 4, max_bytes)
    for seconds in times:
        estimator.observe(size, seconds)
    return estimator.link
