"""The quality simulation (``aisynergy simulate quality``): a small model and many participants; what model quality
federated training reaches. Deterministic for a seed (the same numbers on the same machine and numpy/BLAS).


* **Data**: scikit-learn's shipped digits (1,797 8×8 images, nothing downloaded), pixel / 16, split 75/25
  stratified with ``random_state=0`` — the split :func:`cloud.ml.train.load_digits_split` makes (that module imports
  torch at its top, so the few lines are repeated here). Needs scikit-learn (the ``train`` extra): without it
  :class:`~cloud.simulation.common.MissingExtra` says so.
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
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from cloud.simulation.common import TRAIN_EXTRA, MissingExtra, SimulationError, build_strategy, machine
from cloud.simulation.mlp import as_float32, evaluate, init_mlp, param_count, sgd_step
from interfaces.aggregation import ClientUpdate

DIGITS_SEED = 0
DIGITS_TEST_SIZE = 0.25
DIGITS_CLASSES = 10


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
