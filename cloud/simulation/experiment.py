"""The federated experiment (``aisynergy experiment fl``): seed 000's CIFAR-10 demo, redone on digits.

The seed's demo (``seeds/000``): five parties each hold part of the data, which never leaves them; the federated
model is 4 points more accurate than each party's model trained on its own data alone and 1 point less accurate than
a model trained on all the data pooled; communication is under 20 % of the training time. This module measures the
same comparison on scikit-learn's digits, in one process with numpy only, deterministic for a seed (the accuracies
exactly, on the same machine and numpy/BLAS; the times are measurements).

Data and model
==============

* **Data**: :func:`cloud.simulation.quality.load_digits` (1,797 8×8 images shipped with scikit-learn, pixel / 16,
  split 75/25 stratified): the 1,347 training images are dealt out to ``parties`` (default 5) by
  :func:`cloud.simulation.quality.dirichlet_split` (label mix q_k ~ Dir(α·1₁₀), default α = 0.5; parties of equal
  size ±1); the 450 test images are the shared held-out set every arm is scored on.
* **Model**: the simulation's MLP (:func:`cloud.simulation.mlp.init_mlp`): ``64 → hidden (ReLU) → 10``, softmax
  cross-entropy, He-initialised from the seed (``hidden`` 0: softmax regression). Every arm starts from the same
  initial weights. Trained with the simulation's plain mini-batch SGD loop
  (:func:`cloud.simulation.quality.local_train`: ``epochs`` passes of shuffled mini-batches of ``batch``, ``lr``;
  FedProx's proximal term when that strategy is chosen).

The arms (each with the same total number of epochs E = ``rounds × local_epochs`` over its data)
================================================================================================

1. **local-only**: each party trains alone on its own images for E epochs. Reported: each party's test accuracy,
   and their mean (the seed's "each party alone").
2. **federated**: ``rounds`` rounds; in each, every party starts from the global model, trains ``local_epochs``
   epochs on its images, and the strategy (default FedAvg, weights: image counts; any of
   :mod:`interfaces.aggregation`'s) combines the five models into the next global one.
3. **centralised**: the five parties' images pooled (all 1,347) and trained for E epochs.
4. **federated + DP** (only with ``dp_epsilon``): the federated arm, each party running DP-SGD instead of SGD
   (Abadi et al. 2016): Poisson sampling at rate q_k = ``dp_batch`` / n_k, each example's gradient (all layers
   together) clipped to L2 norm ``clip_norm`` C, the clipped sum plus N(0, σ_k² C² I) divided by the expected batch
   q_k n_k, step ``dp_lr``; ``round(local_epochs / q_k)`` steps a round, T_k = ``rounds`` × that over the task.
   σ_k is the smallest noise multiplier (bisection, to 0.1 %) whose ε after T_k steps of the Poisson-sampled
   Gaussian mechanism, by dp-accounting's RDP accountant (:mod:`cloud.incremental.accounting`), is at most
   ``dp_epsilon`` at ``dp_delta``: each party's own data get (ε, δ)-DP, add-or-remove-one example, over the whole
   task; what leaves a party (its model after each round) is a post-processing of the noised steps. Reported per
   party: q, T, σ and the ε actually spent. Per-example clipping costs nothing extra: an example's gradient of a
   dense layer is aᵢ ⊗ δᵢ, whose norm is ‖aᵢ‖·‖δᵢ‖, and the clipped sum is ``Aᵀ (s ⊙ Δ)``, one product.
   The DP-SGD steps and the calibration of σ are :mod:`cloud.simulation.dp_sgd`.

All accuracies are the **final** model's (after the last epoch or round), never the best one seen on the test set.

Communication (the federated arms)
==================================

A round on a computed clock, as :func:`cloud.simulation.efficiency.run_efficiency` keeps it: each party's local
training is timed (real); its model is serialised with ``safetensors.numpy.save`` (real, timed) and uploaded over its
own simulated link (:class:`cloud.simulation.efficiency.Link`: ``latency + bytes · 8 / bandwidth``, computed, never
slept; default links: :func:`cloud.simulation.efficiency.default_links`, 1,000 → 100 Mbit/s and 5 → 20 ms); the
server deserialises each update as it arrives (real), aggregates (real) the deserialised models, serialises the global
model (real) and every party downloads (simulated) and deserialises it (real). The parties train one after another
in this process, but on the clock they overlap: party k's round starts when it holds the previous global model. The
task's time T is when the last party holds the final model; a party's **communication share** is its simulated
upload + download time / T, and the headline is the largest share (the slowest link), as the seed reports for its
slowest participant.

It stays one module: the four arms share the configuration, the parties' data and the clock defined above.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from cloud.simulation import efficiency, mlp, quality
from cloud.simulation.common import SimulationError, build_strategy, machine
from cloud.simulation.dp_sgd import DpPlan, calibrate_sigma, dp_local_train, epsilon_spent
from interfaces.aggregation import ClientUpdate, Strategy

# the seed's claims for its CIFAR-10 demo (seeds/000), and the DP target of this experiment
SEED_GAIN_OVER_LOCAL_POINTS = 4.0
SEED_GAP_TO_CENTRAL_POINTS = 1.0
SEED_COMMUNICATION_PCT = 20.0
DP_GAP_TO_CENTRAL_POINTS = 3.0


# --------------------------------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class ExperimentConfig:
    parties: int = 5
    alpha: float = 0.5
    rounds: int = 200
    local_epochs: int = 1
    batch: int = 10
    lr: float = 0.1
    hidden: int = 64
    strategy: str = "fedavg"
    strategy_params: dict[str, float] = field(default_factory=dict)
    dp_epsilon: float | None = None
    dp_delta: float = 1e-5
    clip_norm: float = 0.5
    dp_batch: int = 256
    dp_lr: float = 2.0
    bandwidth_mbps: tuple[float, ...] | None = None
    latency_ms: tuple[float, ...] | None = None
    seed: int = 0

    @property
    def total_epochs(self) -> int:
        return self.rounds * self.local_epochs

    def check(self) -> list[efficiency.Link]:
        """Refuse what cannot run (:class:`SimulationError`); the parties' links."""
        if self.parties < 1:
            raise SimulationError(f"parties must be >= 1, got {self.parties}")
        if not (self.alpha > 0 and math.isfinite(self.alpha)):
            raise SimulationError(f"alpha must be a finite number > 0, got {self.alpha}")
        if self.rounds < 1 or self.local_epochs < 1 or self.batch < 1 or self.hidden < 0:
            raise SimulationError("rounds, local_epochs and batch must be >= 1, hidden >= 0")
        for name in ("lr", "dp_lr", "clip_norm"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise SimulationError(f"{name} must be a finite number > 0, got {value}")
        if self.dp_epsilon is not None:
            if not (self.dp_epsilon > 0 and math.isfinite(self.dp_epsilon)):
                raise SimulationError(f"dp_epsilon must be a finite number > 0, got {self.dp_epsilon}")
            if not 0 < self.dp_delta < 1:
                raise SimulationError(f"dp_delta must be in (0, 1), got {self.dp_delta}")
            if self.dp_batch < 1:
                raise SimulationError(f"dp_batch must be >= 1, got {self.dp_batch}")
        bw_default, lat_default = efficiency.default_links(self.parties)
        bandwidth = efficiency.per_participant("--bandwidth-mbps", self.bandwidth_mbps, self.parties, bw_default)
        latency = efficiency.per_participant("--latency-ms", self.latency_ms, self.parties, lat_default, low_open=False)
        return [efficiency.Link(b, lat) for b, lat in zip(bandwidth, latency, strict=True)]


# --------------------------------------------------------------------------------------------------- DP-SGD


def dp_plan(party: int, examples: int, cfg: ExperimentConfig) -> DpPlan:
    assert cfg.dp_epsilon is not None
    q = min(1.0, cfg.dp_batch / examples)
    per_round = max(1, round(cfg.local_epochs / q))
    steps = per_round * cfg.rounds
    sigma = calibrate_sigma(q, steps, cfg.dp_epsilon, cfg.dp_delta)
    return DpPlan(party, examples, q, per_round, steps, sigma, epsilon_spent(q, sigma, steps, cfg.dp_delta),
                  cfg.dp_delta)


# --------------------------------------------------------------------------------------------------- results


@dataclass
class PartyClock:
    """A party's totals over a federated arm, in seconds; shares of the arm's time T in %."""

    name: str
    bandwidth_mbps: float
    latency_ms: float
    compute_s: float = 0.0
    serialise_s: float = 0.0
    deserialise_s: float = 0.0
    upload_s: float = 0.0
    download_s: float = 0.0
    communication_pct: float = 0.0
    compute_pct: float = 0.0
    serialisation_pct: float = 0.0


@dataclass(frozen=True)
class FederatedArm:
    accuracy: float
    loss: float
    curve: list[float]
    """Test accuracy of the global model after each round (round 0: the initial model)."""
    total_s: float
    """T: the computed clock at which the last party holds the final model."""
    parties: list[PartyClock]
    server: dict[str, float]
    update_bytes: int
    communication_pct_max: float
    wall_s: float
    dp: list[DpPlan] | None = None


@dataclass(frozen=True)
class ExperimentResult:
    config: dict[str, Any]
    model: dict[str, Any]
    data: dict[str, Any]
    local: dict[str, Any]
    federated: FederatedArm
    centralised: dict[str, Any]
    federated_dp: FederatedArm | None
    comparison: dict[str, Any]
    wall_s: float

    def to_json(self) -> dict[str, Any]:
        return {"kind": "experiment-fl", **asdict(self), "machine": machine()}


# --------------------------------------------------------------------------------------------------- the arms


def _train_cfg(cfg: ExperimentConfig, epochs: int) -> quality.QualityConfig:
    """The settings the simulation's training loop reads (epochs, batch, learning rate)."""
    return quality.QualityConfig(local_epochs=epochs, batch=cfg.batch, lr=cfg.lr, hidden=cfg.hidden)


def _rng(cfg: ExperimentConfig, *path: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([cfg.seed, *path]))


ARM_LOCAL, ARM_FEDERATED, ARM_CENTRAL, ARM_DP = 1, 2, 3, 4


def _federated(cfg: ExperimentConfig, data: quality.Digits, parts: Sequence[np.ndarray], init: dict[str, np.ndarray],
               strategy: Strategy, links: Sequence[efficiency.Link],
               train: Callable[[int, int, dict[str, np.ndarray]], tuple[dict[str, np.ndarray], float]],
               dp: list[DpPlan] | None = None) -> FederatedArm:
    from safetensors.numpy import load as st_load
    from safetensors.numpy import save as st_save

    began = time.perf_counter()
    global_w = {name: array.copy() for name, array in init.items()}
    clocks = [PartyClock(f"party{k + 1}", lk.bandwidth_mbps, lk.latency_ms) for k, lk in enumerate(links)]
    server = {"deserialise_s": 0.0, "aggregate_s": 0.0, "serialise_s": 0.0}
    start = [0.0] * len(parts)  # when each party holds the current global model (computed clock)
    curve = [mlp.evaluate(global_w, data.x_test, data.y_test)[0]]
    update_bytes = 0
    for r in range(1, cfg.rounds + 1):
        arrivals: list[tuple[float, float]] = []
        updates: list[ClientUpdate] = []
        for k, (clock, link) in enumerate(zip(clocks, links, strict=True)):
            t0 = time.perf_counter()
            local, loss = train(r, k, global_w)
            compute = time.perf_counter() - t0
            t0 = time.perf_counter()
            blob = st_save(local)
            serialise = time.perf_counter() - t0
            update_bytes = len(blob)
            upload = link.transfer_s(len(blob))
            t0 = time.perf_counter()
            received = st_load(blob)
            server_deserialise = time.perf_counter() - t0
            updates.append(ClientUpdate(weights=received, num_examples=len(parts[k]), metrics={"loss": loss},
                                        participant=clock.name))
            arrivals.append((start[k] + compute + serialise + upload, server_deserialise))
            clock.compute_s += compute
            clock.serialise_s += serialise
            clock.upload_s += upload
        t_server = 0.0
        for arrival, deserialise in sorted(arrivals):
            t_server = max(t_server, arrival) + deserialise
            server["deserialise_s"] += deserialise
        t0 = time.perf_counter()
        global_w = mlp.as_float32(strategy.aggregate(global_w, updates))
        aggregate = time.perf_counter() - t0
        t0 = time.perf_counter()
        global_blob = st_save(global_w)
        serialise = time.perf_counter() - t0
        server["aggregate_s"] += aggregate
        server["serialise_s"] += serialise
        t_server += aggregate + serialise
        for k, (clock, link) in enumerate(zip(clocks, links, strict=True)):
            download = link.transfer_s(len(global_blob))
            t0 = time.perf_counter()
            st_load(global_blob)
            deserialise = time.perf_counter() - t0
            start[k] = t_server + download + deserialise
            clock.download_s += download
            clock.deserialise_s += deserialise
        curve.append(mlp.evaluate(global_w, data.x_test, data.y_test)[0])
    total = max(start)
    for clock in clocks:
        clock.communication_pct = 100.0 * (clock.upload_s + clock.download_s) / total
        clock.compute_pct = 100.0 * clock.compute_s / total
        clock.serialisation_pct = 100.0 * (clock.serialise_s + clock.deserialise_s) / total
    accuracy, loss = mlp.evaluate(global_w, data.x_test, data.y_test)
    return FederatedArm(accuracy=accuracy, loss=loss, curve=curve, total_s=total, parties=clocks, server=server,
                        update_bytes=update_bytes, communication_pct_max=max(c.communication_pct for c in clocks),
                        wall_s=time.perf_counter() - began, dp=dp)


def run_experiment(cfg: ExperimentConfig, data: quality.Digits | None = None,
                   on_arm: Callable[[str, Any], None] | None = None) -> ExperimentResult:
    """Train the digits MLP local-only, federated, centralised (and federated with DP-SGD); see the module."""
    began = time.perf_counter()
    links = cfg.check()
    strategy = build_strategy(cfg.strategy, cfg.strategy_params)
    mu = float(getattr(strategy, "mu", 0.0))
    data = data if data is not None else quality.load_digits()
    if cfg.parties > len(data.y_train):
        raise SimulationError(f"{cfg.parties} parties but only {len(data.y_train)} training images")
    parts = quality.dirichlet_split(data.y_train, cfg.parties, cfg.alpha, _rng(cfg, 0, 0), classes=quality.DIGITS_CLASSES)
    sizes = [data.x_train.shape[1], *([cfg.hidden] if cfg.hidden else []), quality.DIGITS_CLASSES]
    init = mlp.init_mlp(sizes, _rng(cfg, 0, 1))
    xs = [data.x_train[p] for p in parts]
    ys = [data.y_train[p] for p in parts]

    def notify(arm: str, value: Any) -> None:
        if on_arm is not None:
            on_arm(arm, value)

    # (1) local-only
    t0 = time.perf_counter()
    local_cfg = _train_cfg(cfg, cfg.total_epochs)
    local_acc = []
    for k in range(cfg.parties):
        w, _ = quality.local_train(init, xs[k], ys[k], local_cfg, 0.0, _rng(cfg, ARM_LOCAL, k))
        local_acc.append(mlp.evaluate(w, data.x_test, data.y_test)[0])
    local = {"accuracies": local_acc, "mean": float(np.mean(local_acc)), "min": min(local_acc),
             "max": max(local_acc), "epochs": cfg.total_epochs, "wall_s": time.perf_counter() - t0}
    notify("local", local)

    # (2) federated
    round_cfg = _train_cfg(cfg, cfg.local_epochs)

    def sgd_train(r: int, k: int, global_w: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], float]:
        return quality.local_train(global_w, xs[k], ys[k], round_cfg, mu, _rng(cfg, ARM_FEDERATED, r, k))

    federated = _federated(cfg, data, parts, init, strategy, links, sgd_train)
    notify("federated", federated)

    # (3) centralised
    t0 = time.perf_counter()
    pooled = np.concatenate(list(parts))
    w, _ = quality.local_train(init, data.x_train[pooled], data.y_train[pooled], local_cfg, 0.0, _rng(cfg, ARM_CENTRAL))
    c_acc, c_loss = mlp.evaluate(w, data.x_test, data.y_test)
    centralised = {"accuracy": c_acc, "loss": c_loss, "examples": len(pooled), "epochs": cfg.total_epochs,
                   "wall_s": time.perf_counter() - t0}
    notify("centralised", centralised)

    # (4) federated + DP-SGD
    federated_dp = None
    if cfg.dp_epsilon is not None:
        plans = [dp_plan(k, len(parts[k]), cfg) for k in range(cfg.parties)]

        def dp_train(r: int, k: int, global_w: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], float]:
            return dp_local_train(global_w, xs[k], ys[k], plans[k], cfg.clip_norm, cfg.dp_lr,
                                  _rng(cfg, ARM_DP, r, k))

        dp_strategy = build_strategy(cfg.strategy, cfg.strategy_params)  # its own state (FedAdam's moments)
        federated_dp = _federated(cfg, data, parts, init, dp_strategy, links, dp_train, dp=plans)
        notify("federated_dp", federated_dp)

    comparison = compare(local["mean"], federated, c_acc, federated_dp)
    part_sizes = [len(p) for p in parts]
    return ExperimentResult(
        config={**asdict(cfg), "bandwidth_mbps": [lk.bandwidth_mbps for lk in links],
                "latency_ms": [lk.latency_ms for lk in links], "total_epochs": cfg.total_epochs},
        model={"sizes": sizes, "parameters": mlp.param_count(sizes),
               "kind": "MLP" if cfg.hidden else "softmax regression", "strategy": repr(strategy)},
        data={"train": len(data.y_train), "test": len(data.y_test), "party_sizes": part_sizes,
              "label_skew": quality.label_skew(data.y_train, parts),
              "label_counts": [np.bincount(y, minlength=quality.DIGITS_CLASSES).tolist() for y in ys]},
        local=local, federated=federated, centralised=centralised, federated_dp=federated_dp,
        comparison=comparison, wall_s=time.perf_counter() - began,
    )


def compare(local_mean: float, federated: FederatedArm, central: float,
            federated_dp: FederatedArm | None) -> dict[str, Any]:
    """The seed's comparison in percentage points, and which of its claims (and the DP target) hold."""
    gain = 100.0 * (federated.accuracy - local_mean)
    gap = 100.0 * (central - federated.accuracy)
    out: dict[str, Any] = {
        "federated_minus_local_points": gain,
        "centralised_minus_federated_points": gap,
        "communication_pct_max": federated.communication_pct_max,
        "met": {
            f"federated >= local-only + {SEED_GAIN_OVER_LOCAL_POINTS:g} points": gain >= SEED_GAIN_OVER_LOCAL_POINTS,
            f"federated within {SEED_GAP_TO_CENTRAL_POINTS:g} point of centralised": gap <= SEED_GAP_TO_CENTRAL_POINTS,
            f"communication < {SEED_COMMUNICATION_PCT:g} % of the time":
                federated.communication_pct_max < SEED_COMMUNICATION_PCT,
        },
    }
    if federated_dp is not None:
        dp_gap = 100.0 * (central - federated_dp.accuracy)
        out["centralised_minus_federated_dp_points"] = dp_gap
        out["federated_dp_minus_local_points"] = 100.0 * (federated_dp.accuracy - local_mean)
        out["met"][f"federated+DP within {DP_GAP_TO_CENTRAL_POINTS:g} points of centralised"] = (
            dp_gap <= DP_GAP_TO_CENTRAL_POINTS)
    return out


SUMMARY_FIELDS = {
    "local_only_mean": lambda r: r.local["mean"],
    "federated": lambda r: r.federated.accuracy,
    "centralised": lambda r: r.centralised["accuracy"],
    "federated_dp": lambda r: r.federated_dp.accuracy if r.federated_dp is not None else None,
    "federated_minus_local_points": lambda r: r.comparison["federated_minus_local_points"],
    "centralised_minus_federated_points": lambda r: r.comparison["centralised_minus_federated_points"],
    "centralised_minus_federated_dp_points": lambda r: r.comparison.get("centralised_minus_federated_dp_points"),
    "communication_pct_max": lambda r: r.comparison["communication_pct_max"],
}


def summarise(results: Sequence[ExperimentResult]) -> dict[str, Any]:
    """Mean, standard deviation (n − 1), min and max of each headline figure over runs (seeds), and for each target
    how many runs met it."""
    out: dict[str, Any] = {"runs": len(results), "seeds": [r.config["seed"] for r in results]}
    for name, get in SUMMARY_FIELDS.items():
        values = [get(r) for r in results]
        if any(v is None for v in values):
            continue
        arr = np.array(values, dtype=np.float64)
        out[name] = {"mean": float(arr.mean()), "sd": float(arr.std(ddof=1)) if len(arr) > 1 else 0.0,
                     "min": float(arr.min()), "max": float(arr.max())}
    out["met"] = {target: sum(bool(r.comparison["met"][target]) for r in results)
                  for target in results[0].comparison["met"]}
    return out
