"""Federated-training simulation (DESIGN §5, ``seeds/002``): the two kinds AISynergy's simulation offers.

* :func:`run_quality` — a small model and many participants: what model quality federated training reaches.
* :func:`run_efficiency` — a large model and few participants: where each participant's time goes.

Both run in one process, with numpy only (no torch), and are deterministic for a seed (``quality`` exactly: the
same numbers on the same machine and numpy/BLAS; ``efficiency``'s times are measurements and vary, its weights and
byte counts do not). The aggregation is :mod:`interfaces.aggregation`'s, the same code the hub runs.

The model (both kinds)
======================

A multi-layer perceptron ``input → hidden layers (ReLU) → classes`` with softmax cross-entropy, forward and
backward written out in numpy, plain mini-batch SGD. Its weights are a dict ``fc{i}.weight`` (``[in, out]``) and
``fc{i}.bias`` (``[out]``), float32, He-initialised from the seed. One SGD step on a batch (x, y) of size B:
forward, ``dlogits = (softmax − onehot(y)) / B``, then layer by layer from the last: the weight and bias gradients,
the gradient flowing down (``dlogits @ Wᵀ``, masked by the ReLU), and the update ``W −= lr · grad`` done in place
before the next layer's gradient is formed, so a step never holds more than one layer's gradient (the efficiency
simulation keeps one buffer of the largest layer's size for it, allocated once). Under FedProx a participant adds
:func:`interfaces.aggregation.proximal_gradient` ``μ (w − x)`` (x: the round's global model) to every gradient.

Quality (``aisynergy simulate quality``)
========================================

* **Data**: scikit-learn's shipped digits (1,797 8×8 images, nothing downloaded), pixel / 16, split 75/25
  stratified with ``random_state=0`` — the split :func:`cloud.ml.train.load_digits_split` makes (that module imports
  torch at its top, so the few lines are repeated here). Needs scikit-learn (the ``train`` extra): without it
  :class:`MissingExtra` says so.
* **Participants** (``participants``, default 100): the 1,347 training images are dealt out non-IID with a
  Dirichlet over labels (Hsu et al. 2019, "Measuring the effects of non-identical data distribution"): participant
  i draws its label mix q_i ~ Dir(α·1₁₀) and gets ⌊N/P⌋ or ⌈N/P⌉ images (so every participant has at least
  one), each of a label drawn from q_i among the labels that still have images left (participants are served in a
  random order, so no fixed participant always gets what the others left). Small α: each participant sees one or
  two labels; large α: close to the overall mix. :func:`label_skew` (the mean share of a participant's most common
  label) measures it.
* **A round**: the server samples ``max(1, round(fraction · P))`` participants without replacement; with
  ``dropout`` d, ``round(d · m)`` of the m sampled fail (at most m − 1: the round closes with the k of n that
  answered, DESIGN §4.3); each of the others starts from the global model and runs ``local_epochs`` passes over its
  own images in shuffled mini-batches of ``batch``; the strategy aggregates their models (weights: their image
  counts). Round 0 is the initial model, untrained.
* **Reported per round**: accuracy and mean cross-entropy of the global model on the 450 held-out test images, the
  participants sampled, failed and used, the used participants' mean local training loss (sample-weighted). Then
  the best accuracy and its round.

Efficiency (``aisynergy simulate efficiency``)
==============================================

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
import os
import platform
import re
import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from interfaces.aggregation import STRATEGIES, ClientUpdate, FedAvg, Strategy, proximal_gradient, strategy_from_spec

TRAIN_EXTRA = "train"
DIGITS_SEED = 0
DIGITS_TEST_SIZE = 0.25
DIGITS_CLASSES = 10
EFFICIENCY_INPUT = 1024
EFFICIENCY_CLASSES = 10
SIZE_TOLERANCE = 0.01
STRATEGY_NAMES = tuple(STRATEGIES)


class SimulationError(ValueError):
    """A configuration the simulation cannot run (the CLI turns it into a usage error)."""


class MissingExtra(RuntimeError):
    """A dependency of an optional extra is not installed."""


# --------------------------------------------------------------------------------------------------- the MLP


def layer_names(n_layers: int) -> list[tuple[str, str]]:
    return [(f"fc{i}.weight", f"fc{i}.bias") for i in range(1, n_layers + 1)]


def param_count(sizes: Sequence[int]) -> int:
    """Parameters of the MLP with layer sizes ``[input, hidden..., classes]`` (weights and biases)."""
    return sum(a * b + b for a, b in itertools.pairwise(sizes))


def init_mlp(sizes: Sequence[int], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """He-normal weights (std √(2 / fan_in); √(1 / fan_in) for the output layer), zero biases, float32."""
    weights: dict[str, np.ndarray] = {}
    names = layer_names(len(sizes) - 1)
    for index, ((w_name, b_name), fan_in, fan_out) in enumerate(zip(names, sizes[:-1], sizes[1:], strict=True)):
        w = rng.standard_normal((fan_in, fan_out), dtype=np.float32)
        w *= np.float32(math.sqrt((1.0 if index == len(names) - 1 else 2.0) / fan_in))
        weights[w_name] = w
        weights[b_name] = np.zeros(fan_out, dtype=np.float32)
    return weights


def _n_layers(weights: dict[str, np.ndarray]) -> int:
    return len(weights) // 2


def forward(weights: dict[str, np.ndarray], x: np.ndarray) -> list[np.ndarray]:
    """``[x, a1, ..., logits]``: the input, each hidden layer's ReLU output, the logits."""
    acts = [x]
    names = layer_names(_n_layers(weights))
    for index, (w_name, b_name) in enumerate(names):
        z = acts[-1] @ weights[w_name]
        z += weights[b_name]
        if index < len(names) - 1:
            np.maximum(z, 0, out=z)
        acts.append(z)
    return acts


def softmax_xent(logits: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean cross-entropy and the softmax probabilities (float64 for the loss's sake)."""
    shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    log_norm = np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    log_p = shifted - log_norm
    loss = float(-log_p[np.arange(len(y)), y].mean())
    return loss, np.exp(log_p)


def sgd_step(weights: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray, lr: float,
             anchor: dict[str, np.ndarray] | None = None, mu: float = 0.0,
             scratch: np.ndarray | None = None) -> float:
    """One SGD step on (x, y), updating ``weights`` in place; returns the batch's loss before the step.

    With ``anchor`` (the round's global model) and ``mu`` > 0, FedProx's proximal gradient is added to each
    gradient. ``scratch``, a float32 buffer of at least the largest weight matrix's size, holds each weight gradient
    in turn (no allocation per layer and step; the efficiency simulation passes one)."""
    acts = forward(weights, x)
    loss, probs = softmax_xent(acts[-1], y)
    probs[np.arange(len(y)), y] -= 1.0
    delta = (probs / len(y)).astype(np.float32)
    lr32 = np.float32(lr)
    names = layer_names(_n_layers(weights))
    for index in range(len(names) - 1, -1, -1):
        w_name, b_name = names[index]
        w, b = weights[w_name], weights[b_name]
        if scratch is not None:
            grad_w = np.matmul(acts[index].T, delta, out=scratch[: w.size].reshape(w.shape))
        else:
            grad_w = acts[index].T @ delta
        grad_b = delta.sum(axis=0)
        below = delta @ w.T if index > 0 else None
        if anchor is not None and mu > 0:
            prox = proximal_gradient({w_name: w, b_name: b}, {w_name: anchor[w_name], b_name: anchor[b_name]}, mu)
            grad_w += prox[w_name]
            grad_b += prox[b_name]
        grad_w *= lr32
        w -= grad_w
        del grad_w
        b -= lr32 * grad_b
        if below is not None:
            below *= acts[index] > 0
            delta = below
    return loss


def evaluate(weights: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """``(accuracy, mean cross-entropy)`` of the model on (x, y)."""
    logits = forward(weights, x)[-1]
    loss, _ = softmax_xent(logits, y)
    return float((logits.argmax(axis=1) == y).mean()), loss


def as_float32(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {name: np.ascontiguousarray(array, dtype=np.float32) for name, array in weights.items()}


def build_strategy(name: str, params: dict[str, Any] | None) -> Strategy:
    try:
        return strategy_from_spec(name, **(params or {}))
    except ValueError as exc:
        raise SimulationError(str(exc)) from None


# --------------------------------------------------------------------------------------------------- quality


@dataclass(frozen=True)
class Digits:
    x_train: np.ndarray  # float32 [N, 64], pixel / 16
    y_train: np.ndarray  # int64 [N]
    x_test: np.ndarray
    y_test: np.ndarray


def load_digits(seed: int = DIGITS_SEED, test_size: float = DIGITS_TEST_SIZE) -> Digits:
    """scikit-learn's digits, pixel / 16, split stratified with ``seed`` (as
    :func:`cloud.ml.train.load_digits_split` does)."""
    try:
        from sklearn.datasets import load_digits as sk_load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as exc:
        raise MissingExtra(
            f"the quality simulation needs scikit-learn's digits data set ({exc.name} is not installed): "
            f"pip install 'aisynergy[{TRAIN_EXTRA}]'"
        ) from exc
    digits = sk_load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=test_size, random_state=seed, stratify=y)
    return Digits(x_train, y_train, x_test, y_test)


def dirichlet_split(labels: np.ndarray, participants: int, alpha: float, rng: np.random.Generator,
                    classes: int | None = None) -> list[np.ndarray]:
    """Deal ``labels``' indices out to ``participants``, non-IID by a Dirichlet(α) over labels (see the module).

    Every index goes to exactly one participant; participant sizes differ by at most one, so each has at least one
    example when ``participants`` ≤ ``len(labels)``."""
    labels = np.asarray(labels)
    n = len(labels)
    if participants < 1:
        raise SimulationError(f"participants must be >= 1, got {participants}")
    if participants > n:
        raise SimulationError(f"{participants} participants but only {n} examples: each needs at least one")
    if not (alpha > 0 and math.isfinite(alpha)):
        raise SimulationError(f"alpha must be a finite number > 0, got {alpha}")
    classes = int(classes if classes is not None else labels.max() + 1)
    pools = [list(rng.permutation(np.flatnonzero(labels == k))) for k in range(classes)]
    left = np.array([len(p) for p in pools], dtype=np.int64)
    sizes = [n // participants + (1 if i < n % participants else 0) for i in range(participants)]
    parts: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * participants
    for i in rng.permutation(participants):
        mix = rng.dirichlet(np.full(classes, alpha))
        taken = []
        for _ in range(sizes[i]):
            p = mix * (left > 0)
            if not p.sum() > 0:  # its labels are used up (or the mix underflowed): any label that is left
                p = (left > 0).astype(np.float64)
            k = int(rng.choice(classes, p=p / p.sum()))
            taken.append(pools[k].pop())
            left[k] -= 1
        parts[i] = np.sort(np.array(taken, dtype=np.int64))
    return parts


def label_skew(labels: np.ndarray, parts: Sequence[np.ndarray]) -> float:
    """The mean over participants of the share of their examples that carry their most common label (1 = one label
    each; about the largest class share for an IID split of many examples)."""
    shares = [np.bincount(labels[p]).max() / len(p) for p in parts if len(p)]
    return float(np.mean(shares))


@dataclass(frozen=True)
class QualityConfig:
    participants: int = 100
    alpha: float = 0.5
    rounds: int = 50
    fraction: float = 0.1
    local_epochs: int = 2
    batch: int = 10
    lr: float = 0.1
    hidden: int = 32
    strategy: str = "fedavg"
    strategy_params: dict[str, float] = field(default_factory=dict)
    dropout: float = 0.0
    seed: int = 0

    def check(self) -> None:
        if self.participants < 1:
            raise SimulationError(f"participants must be >= 1, got {self.participants}")
        if not (self.alpha > 0 and math.isfinite(self.alpha)):
            raise SimulationError(f"alpha must be a finite number > 0, got {self.alpha}")
        if self.rounds < 0:
            raise SimulationError(f"rounds must be >= 0, got {self.rounds}")
        if not 0 < self.fraction <= 1:
            raise SimulationError(f"fraction must be in (0, 1], got {self.fraction}")
        if self.local_epochs < 1 or self.batch < 1 or self.hidden < 0:
            raise SimulationError("local_epochs and batch must be >= 1, hidden >= 0")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise SimulationError(f"lr must be a finite number > 0, got {self.lr}")
        if not 0 <= self.dropout < 1:
            raise SimulationError(f"dropout must be in [0, 1), got {self.dropout}")


@dataclass(frozen=True)
class QualityRound:
    round: int
    accuracy: float
    loss: float
    sampled: int
    failed: int
    used: int
    train_loss: float | None
    seconds: float


@dataclass(frozen=True)
class QualityResult:
    config: dict[str, Any]
    model: dict[str, Any]
    data: dict[str, Any]
    rounds: list[QualityRound]
    best_accuracy: float
    best_round: int
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return {"kind": "quality", **asdict(self), "machine": machine()}


def local_train(global_w: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray, cfg: QualityConfig, mu: float,
                 rng: np.random.Generator) -> tuple[dict[str, np.ndarray], float]:
    w = {name: array.copy() for name, array in global_w.items()}
    losses, counts = [], []
    for _ in range(cfg.local_epochs):
        order = rng.permutation(len(y))
        for start in range(0, len(y), cfg.batch):
            idx = order[start:start + cfg.batch]
            losses.append(sgd_step(w, x[idx], y[idx], cfg.lr, anchor=global_w if mu > 0 else None, mu=mu))
            counts.append(len(idx))
    return w, float(np.average(losses, weights=counts))


def run_quality(cfg: QualityConfig, data: Digits | None = None,
                on_round: Callable[[QualityRound], None] | None = None) -> QualityResult:
    """Simulate federated training of the digits MLP (see the module docstring)."""
    cfg.check()
    strategy = build_strategy(cfg.strategy, cfg.strategy_params)
    mu = float(getattr(strategy, "mu", 0.0))
    data = data if data is not None else load_digits()
    seeds = np.random.SeedSequence(cfg.seed).spawn(3)
    split_rng, init_rng, sample_rng = (np.random.default_rng(s) for s in seeds)
    parts = dirichlet_split(data.y_train, cfg.participants, cfg.alpha, split_rng, classes=DIGITS_CLASSES)
    sizes = [data.x_train.shape[1], *([cfg.hidden] if cfg.hidden else []), DIGITS_CLASSES]
    global_w = init_mlp(sizes, init_rng)
    per_round = max(1, round(cfg.fraction * cfg.participants))
    began = time.perf_counter()
    rounds: list[QualityRound] = []

    def record(r: int, sampled: int, failed: int, used: int, train_loss: float | None, t0: float) -> None:
        accuracy, loss = evaluate(global_w, data.x_test, data.y_test)
        entry = QualityRound(r, accuracy, loss, sampled, failed, used, train_loss, time.perf_counter() - t0)
        rounds.append(entry)
        if on_round is not None:
            on_round(entry)

    record(0, 0, 0, 0, None, began)
    for r in range(1, cfg.rounds + 1):
        t0 = time.perf_counter()
        sampled = np.sort(sample_rng.choice(cfg.participants, per_round, replace=False))
        n_failed = min(round(cfg.dropout * per_round), per_round - 1)
        failed = set(sample_rng.choice(sampled, n_failed, replace=False).tolist()) if n_failed else set()
        updates = []
        for pid in (int(p) for p in sampled if int(p) not in failed):
            idx = parts[pid]
            local_rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, 1, r, pid]))
            w, train_loss = local_train(global_w, data.x_train[idx], data.y_train[idx], cfg, mu, local_rng)
            updates.append(ClientUpdate(weights=w, num_examples=len(idx), metrics={"loss": train_loss},
                                        participant=f"p{pid}"))
        global_w = as_float32(strategy.aggregate(global_w, updates))
        weighted_loss = float(np.average([u.metrics["loss"] for u in updates],
                                         weights=[u.num_examples for u in updates]))
        record(r, len(sampled), len(failed), len(updates), weighted_loss, t0)
    best = max(rounds, key=lambda e: (e.accuracy, -e.round))
    part_sizes = [len(p) for p in parts]
    return QualityResult(
        config=asdict(cfg),
        model={"sizes": sizes, "parameters": param_count(sizes), "strategy": repr(strategy)},
        data={"train": len(data.y_train), "test": len(data.y_test), "participant_sizes_min": min(part_sizes),
              "participant_sizes_max": max(part_sizes), "label_skew": label_skew(data.y_train, parts),
              "sampled_per_round": per_round},
        rounds=rounds, best_accuracy=best.accuracy, best_round=best.round, seconds=time.perf_counter() - began,
    )


# --------------------------------------------------------------------------------------------------- efficiency

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


def machine() -> dict[str, Any]:
    """What the measured times ran on."""
    return {"platform": platform.platform(), "python": platform.python_version(), "numpy": np.__version__,
            "cpus": os.cpu_count(), "processor": _cpu_name()}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
