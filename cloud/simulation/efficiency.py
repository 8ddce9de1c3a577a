"""The efficiency simulation (``aisynergy simulate efficiency``): a large model and few participants; where each
participant's time goes. Its times are measurements and vary; its weights and byte counts are deterministic for a seed.


* **The model**: an MLP of ``depth`` hidden layers (default 4) over 1,024 inputs and 10 classes, sized to the
  requested parameter count P: the first ``depth − 1`` hidden layers have the largest width w that keeps the count
  at or under P, the last one the width that brings it closest to P (:func:`size_mlp`; within 1 %, in practice
  within 0.004 % for 10M-100M). The data are synthetic (Gaussian inputs, uniform labels, from the seed): the
  simulation measures time, not learning.
* **A round**, for each participant i (``participants``, default 2), in order:

  1. *compute*: ``local_steps`` real SGD steps at batch ``batch`` on its own copy of the global model; the measured
     wall time × its ``slowdown`` sᵢ (1 = this machine's speed; 1.5 = a participant 1.5× slower);
  2. *serialise*: ``safetensors.numpy.save`` of its model, real, timed;
  3. *upload*: simulated, never slept: ``latency + bytes · 8 / bandwidth`` over its own link (``bandwidth_mbps``
     in Mbit/s = 10⁶ bit/s, ``latency_ms``);
  4. the server *deserialises* it (``safetensors.numpy.load``, real, timed) as it arrives, one update at a time;
  5. once every update has arrived (the round barrier: the fastest waits for the slowest), the server *aggregates*
     (:class:`interfaces.aggregation.FedAvg`, real, timed) and *serialises* the new global model (real, timed);
  6. *download*: simulated, the same formula over the participant's link, the global model's byte count;
  7. the participant *deserialises* it (real, timed) and starts its next round.

  The participants run one after the other on this machine, so a measured time is never inflated by the other
  participant; the clock on which they overlap is computed: participant i's round starts when it has the previous
  global model, its update arrives at ``start + compute + serialise + upload``, the server takes arrivals in order
  (``server = max(server, arrival) + deserialise``), and after the last arrival adds aggregate + serialise; the
  participant has the new model at ``server + download + its deserialise``.

* **Reported, per participant, the seed's columns** (over the whole task; T is the same for every participant):

  - **total time** T: from the start until the last participant holds the final global model;
  - **compute utilisation** = its compute time / T, in %;
  - **communication share** = its simulated transfer time (uploads + downloads, latency included) / T, in %;
  - **serialisation share** = (its serialise + deserialise time) / T, in %;
  - **waiting share** = the rest, T − compute − communication − serialisation, in %: idle at the barrier while
    the slower participant computes or sends, while the server deserialises, aggregates and serialises, and after
    its last round until the task ends. The four add up to 100 %.

  and for the server: its deserialise, aggregate and serialise times (totals and per round).
* **What is measured and what is simulated**: compute, serialisation, deserialisation and aggregation are real
  work timed with ``time.perf_counter`` on this machine (compute scaled by the slowdown); the links are simulated
  (a formula, no transfer, no sleep, no congestion, no TCP dynamics); there is no parallelism between
  participants on this machine, only on the computed clock.
* **Memory**: the model copies held at the peak are the server's global model, one update per participant (its
  safetensors bytes, replaced by the deserialised arrays as soon as the server has read them), and, during FedAvg,
  its float64 accumulator (two float32 copies' worth) and the float32 result; while a participant trains, its
  working copy and then its bytes take the place of its update. That is n + 4 float32 copies for n participants:
  6 × 400 MB = 2.4 GB at 100M with two, plus the gradient buffer (one layer: 126 MB at 100M) and FedAvg's float64
  temporaries of one tensor. ``peak_rss_mb`` in the result is the process's measured peak (2.7-2.9 GB at
  100M on a 2-vCPU test machine).
"""

from __future__ import annotations

import itertools
import math
import re
import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from cloud.simulation.common import SimulationError, machine
from cloud.simulation.mlp import as_float32, init_mlp, param_count, sgd_step
from interfaces.aggregation import ClientUpdate, FedAvg

EFFICIENCY_INPUT = 1024
EFFICIENCY_CLASSES = 10
SIZE_TOLERANCE = 0.01
_COUNT = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kKmMgGbB]?)\s*$")
_SCALE = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "b": 10**9}


def parse_count(text: str | int) -> int:
    """``"10M"`` → 10,000,000 (suffixes k, M, G or B, case-insensitive; decimals allowed: ``"1.5M"``)."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = _COUNT.match(str(text))
        if not match:
            raise SimulationError(f"not a parameter count: {text!r} (e.g. 100000, 100k, 10M, 1.5M)")
        value = round(float(match.group(1)) * _SCALE[match.group(2).lower()])
    if value <= 0:
        raise SimulationError(f"the parameter count must be > 0, got {text!r}")
    return int(value)


def size_mlp(target: int, depth: int = 4, input_dim: int = EFFICIENCY_INPUT,
             classes: int = EFFICIENCY_CLASSES) -> list[int]:
    """Layer sizes ``[input, w, ..., w, w_last, classes]`` (``depth`` hidden layers) with a parameter count within
    1 % of ``target`` (see the module docstring); :class:`SimulationError` when no such MLP exists."""
    if depth < 1:
        raise SimulationError(f"depth must be >= 1, got {depth}")

    def sizes_for(w: int, w_last: int) -> list[int]:
        return [input_dim, *([w] * (depth - 1)), w_last, classes]

    if depth == 1:
        best = [input_dim, max(1, round((target - classes) / (input_dim + 1 + classes))), classes]
    else:
        lo, hi = 1, 1
        while param_count(sizes_for(hi, hi)) <= target:
            hi *= 2
        if param_count(sizes_for(1, 1)) > target:
            hi = 1
        while hi - lo > 1:  # the largest w with count(w, w) <= target
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if param_count(sizes_for(mid, mid)) <= target else (lo, mid)
        w = lo
        fixed = param_count(sizes_for(w, 0)) - classes  # without the last hidden layer's own terms
        w_last = max(1, round((target - fixed - classes) / (w + 1 + classes)))
        best = sizes_for(w, w_last)
    actual = param_count(best)
    if abs(actual - target) > SIZE_TOLERANCE * target:
        raise SimulationError(
            f"no {depth}-hidden-layer MLP over {input_dim} inputs has {target:,} parameters within 1 % "
            f"(closest: {actual:,}); try another --depth or a larger count"
        )
    return best


@dataclass(frozen=True)
class Link:
    bandwidth_mbps: float
    latency_ms: float

    def transfer_s(self, nbytes: int) -> float:
        """Simulated transfer time: ``latency + bytes · 8 / bandwidth`` (computed, never slept)."""
        return self.latency_ms / 1e3 + nbytes * 8 / (self.bandwidth_mbps * 1e6)


def default_links(participants: int) -> tuple[list[float], list[float]]:
    """1,000 and 100 Mbit/s, 5 and 20 ms for two participants; for n, spaced geometrically (bandwidth) and evenly
    (latency) between those ends; one participant gets the fast link."""
    if participants == 1:
        return [1000.0], [5.0]
    return ([float(v) for v in np.geomspace(1000.0, 100.0, participants)],
            [float(v) for v in np.linspace(5.0, 20.0, participants)])


def per_participant(name: str, values: Sequence[float] | None, participants: int, default: Sequence[float],
                    low: float = 0.0, low_open: bool = True) -> list[float]:
    """One value for all, or one per participant."""
    if values is None or len(values) == 0:
        return list(default)
    values = [float(v) for v in values]
    for v in values:
        if not math.isfinite(v) or (v <= low if low_open else v < low):
            raise SimulationError(f"{name} must be {'>' if low_open else '>='} {low:g}, got {v:g}")
    if len(values) == 1:
        return values * participants
    if len(values) != participants:
        raise SimulationError(
            f"{name}: {len(values)} values for {participants} participants (give 1 or {participants})"
        )
    return values


@dataclass(frozen=True)
class EfficiencyConfig:
    params: int = 10_000_000
    participants: int = 2
    rounds: int = 3
    local_steps: int = 5
    batch: int = 32
    depth: int = 4
    lr: float = 0.01
    bandwidth_mbps: tuple[float, ...] | None = None
    latency_ms: tuple[float, ...] | None = None
    slowdown: tuple[float, ...] | None = None
    seed: int = 0

    def check(self) -> tuple[list[Link], list[float]]:
        if self.params <= 0:
            raise SimulationError(f"params must be > 0, got {self.params}")
        if self.participants < 1 or self.rounds < 1 or self.local_steps < 1 or self.batch < 1:
            raise SimulationError("participants, rounds, local_steps and batch must be >= 1")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise SimulationError(f"lr must be a finite number > 0, got {self.lr}")
        bw_default, lat_default = default_links(self.participants)
        bandwidth = per_participant("--bandwidth-mbps", self.bandwidth_mbps, self.participants, bw_default)
        latency = per_participant("--latency-ms", self.latency_ms, self.participants, lat_default, low_open=False)
        slowdown = per_participant("--slowdown", self.slowdown, self.participants, [1.0] * self.participants)
        return [Link(b, lat) for b, lat in zip(bandwidth, latency, strict=True)], slowdown


@dataclass
class ParticipantTimes:
    """One participant's totals over the task, in seconds, and its shares of the total time T, in %."""

    name: str
    bandwidth_mbps: float
    latency_ms: float
    slowdown: float
    compute_measured_s: float = 0.0
    compute_s: float = 0.0
    serialise_s: float = 0.0
    deserialise_s: float = 0.0
    upload_s: float = 0.0
    download_s: float = 0.0
    finished_s: float = 0.0
    total_s: float = 0.0
    waiting_s: float = 0.0
    compute_utilisation_pct: float = 0.0
    communication_pct: float = 0.0
    serialisation_pct: float = 0.0
    waiting_pct: float = 0.0
    last_loss: float = 0.0

    @property
    def communication_s(self) -> float:
        return self.upload_s + self.download_s

    @property
    def serialisation_s(self) -> float:
        return self.serialise_s + self.deserialise_s


@dataclass(frozen=True)
class EfficiencyRound:
    round: int
    duration_s: float
    """How far the round moved the task's clock: from the last participant holding the previous global model to the
    last one holding this round's (the rounds' durations add up to the total time)."""
    server_deserialise_s: float
    aggregate_s: float
    server_serialise_s: float
    participants: list[dict[str, float]]


@dataclass(frozen=True)
class EfficiencyResult:
    config: dict[str, Any]
    model: dict[str, Any]
    total_s: float
    participants: list[ParticipantTimes]
    server: dict[str, float]
    rounds: list[EfficiencyRound]
    update_bytes: int
    wall_s: float
    peak_rss_mb: float

    def to_json(self) -> dict[str, Any]:
        out = {"kind": "efficiency", **asdict(self), "machine": machine()}
        for entry, p in zip(out["participants"], self.participants, strict=True):
            entry["communication_s"] = p.communication_s
            entry["serialisation_s"] = p.serialisation_s
        return out


def _timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    """``fn(*args)`` and its wall time in seconds."""
    t0 = time.perf_counter()
    value = fn(*args)
    return value, time.perf_counter() - t0


def run_efficiency(cfg: EfficiencyConfig, on_round: Callable[[EfficiencyRound], None] | None = None,
                   on_model: Callable[[list[int], int], None] | None = None) -> EfficiencyResult:
    """Simulate federated rounds of an MLP of ``cfg.params`` parameters (see the module docstring)."""
    from safetensors.numpy import load as st_load
    from safetensors.numpy import save as st_save

    links, slowdown = cfg.check()
    strategy = FedAvg()
    sizes = size_mlp(cfg.params, cfg.depth)
    n_params = param_count(sizes)
    if on_model is not None:
        on_model(sizes, n_params)
    began = time.perf_counter()
    seeds = np.random.SeedSequence(cfg.seed).spawn(1 + cfg.participants)
    global_w = init_mlp(sizes, np.random.default_rng(seeds[0]))
    data_rngs = [np.random.default_rng(s) for s in seeds[1:]]
    scratch = np.empty(max(a * b for a, b in itertools.pairwise(sizes)), dtype=np.float32)  # one layer's gradient
    people = [ParticipantTimes(f"client{i + 1}", link.bandwidth_mbps, link.latency_ms, s)
              for i, (link, s) in enumerate(zip(links, slowdown, strict=True))]
    start = [0.0] * cfg.participants  # when each participant holds the current global model (computed clock)
    rounds: list[EfficiencyRound] = []
    server_totals = {"deserialise_s": 0.0, "aggregate_s": 0.0, "serialise_s": 0.0}
    update_bytes = 0
    for r in range(1, cfg.rounds + 1):
        round_start = max(start)
        arrivals: list[tuple[float, float]] = []  # (arrival time, server deserialise time)
        updates: list[ClientUpdate] = []
        detail: list[dict[str, float]] = []
        for i, (person, link) in enumerate(zip(people, links, strict=True)):
            batches = [(data_rngs[i].standard_normal((cfg.batch, sizes[0]), dtype=np.float32),
                        data_rngs[i].integers(0, sizes[-1], cfg.batch)) for _ in range(cfg.local_steps)]
            local = {name: array.copy() for name, array in global_w.items()}
            t0 = time.perf_counter()
            for x, y in batches:
                person.last_loss = sgd_step(local, x, y, cfg.lr, scratch=scratch)
            measured = time.perf_counter() - t0
            compute = measured * person.slowdown
            blob, serialise = _timed(st_save, local)
            del local
            update_bytes = len(blob)
            upload = link.transfer_s(len(blob))
            weights, server_deserialise = _timed(st_load, blob)
            del blob
            updates.append(ClientUpdate(weights=weights, num_examples=cfg.local_steps * cfg.batch,
                                        participant=person.name))
            arrivals.append((start[i] + compute + serialise + upload, server_deserialise))
            person.compute_measured_s += measured
            person.compute_s += compute
            person.serialise_s += serialise
            person.upload_s += upload
            detail.append({"compute_s": compute, "serialise_s": serialise, "upload_s": upload,
                           "arrival_s": arrivals[-1][0]})
        server = 0.0
        server_deser = 0.0
        for arrival, deser in sorted(arrivals):
            server = max(server, arrival) + deser
            server_deser += deser
        aggregated, aggregate = _timed(strategy.aggregate, global_w, updates)
        del updates, weights
        global_w = as_float32(aggregated)
        del aggregated
        global_blob, server_serialise = _timed(st_save, global_w)
        server += aggregate + server_serialise
        for i, (person, link) in enumerate(zip(people, links, strict=True)):
            download = link.transfer_s(len(global_blob))
            _, deserialise = _timed(st_load, global_blob)
            start[i] = server + download + deserialise
            person.download_s += download
            person.deserialise_s += deserialise
            detail[i].update({"download_s": download, "deserialise_s": deserialise, "holds_model_s": start[i]})
        del global_blob
        server_totals["deserialise_s"] += server_deser
        server_totals["aggregate_s"] += aggregate
        server_totals["serialise_s"] += server_serialise
        entry = EfficiencyRound(r, max(start) - round_start, server_deser, aggregate, server_serialise, detail)
        rounds.append(entry)
        if on_round is not None:
            on_round(entry)
    total = max(start)
    for person, finished in zip(people, start, strict=True):
        person.finished_s = finished
        person.total_s = total
        person.waiting_s = total - person.compute_s - person.communication_s - person.serialisation_s
        person.compute_utilisation_pct = 100.0 * person.compute_s / total
        person.communication_pct = 100.0 * person.communication_s / total
        person.serialisation_pct = 100.0 * person.serialisation_s / total
        person.waiting_pct = 100.0 * person.waiting_s / total
    return EfficiencyResult(
        config={**asdict(cfg), "bandwidth_mbps": [lk.bandwidth_mbps for lk in links],
                "latency_ms": [lk.latency_ms for lk in links], "slowdown": slowdown},
        model={"sizes": sizes, "parameters": n_params, "requested": cfg.params,
               "error_pct": 100.0 * (n_params - cfg.params) / cfg.params, "float32_mb": n_params * 4 / 1e6,
               "strategy": repr(strategy)},
        total_s=total, participants=people, server=server_totals, rounds=rounds, update_bytes=update_bytes,
        wall_s=time.perf_counter() - began, peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    )
