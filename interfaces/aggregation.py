"""Federated aggregation strategies (DESIGN §5): how the hub and the edges turn participants' models into the next one.

A round starts from the global model x (tensor name -> array, :data:`Weights`). Participant k trains locally on
its n_k > 0 examples and sends back its model w_k (a :class:`ClientUpdate`; the model itself, not the delta). With
N = Σ_k n_k, every operation below is elementwise per tensor and coordinate, computed in float64 and returned in the
dtype of x:

* **FedAvg** (McMahan et al. 2017): ``x' = Σ_k (n_k / N) w_k``.
* **FedProx** (Li et al. 2020): the server side is FedAvg. The participants minimise ``F_k(w) + (μ/2) ‖w − x‖²``
  instead of their loss ``F_k(w)``, i.e. they add :func:`proximal_gradient` ``= μ (w − x)`` to every local gradient.
* **FedAdam** (Reddi et al. 2021, "Adaptive Federated Optimization", Algorithm 2): with the pseudo-gradient
  ``Δ = FedAvg(updates) − x``::

      m  ← β1 m + (1 − β1) Δ
      v  ← β2 v + (1 − β2) Δ²
      x' = x + η m / (√v + τ)

  m and v start at zero (as in Flower; the paper allows any v₋₁ ≥ τ², whose weight decays as β2^t) and there is no
  bias correction, as in the paper and Flower's original FedAdam (some later implementations scale η by Adam's
  √(1 − β2^t) / (1 − β1^t)). m and v persist across rounds: they are the strategy's state (:meth:`Strategy.state`).
* **Median** (Yin et al. 2018): ``x'[c] = median_k w_k[c]``, unweighted (n_k is ignored).
* **TrimmedMean(β)** (Yin et al. 2018): per coordinate, sort the n values, drop the t = ⌊β n⌋ largest and the t
  smallest, and average the n − 2t left; unweighted. With 0 ≤ β < 1/2 something always remains; what can fail is
  trimming: with β > 0 and fewer than :attr:`TrimmedMean.min_updates` updates t would be 0, a plain mean in disguise
  with none of the robustness asked for, so :meth:`Strategy.aggregate` refuses it.

Hierarchy (device → edge → cloud). :func:`combine` turns the updates an edge collected into one update, their
sample-weighted mean with ``num_examples = Σ n_k``. Because FedAvg is a weighted mean, it is decomposable::

    FedAvg().aggregate(x, [combine(edge1_updates), combine(edge2_updates)])
        == FedAvg().aggregate(x, edge1_updates + edge2_updates)        # up to float rounding

and so are FedProx and FedAdam, whose only use of the updates is that mean (:attr:`Strategy.decomposable`). Median
and trimmed mean are not: the median of the edges' means is not the median of the devices' models. An edge serving a
round with them forwards its raw updates; a cloud that applies them over edge aggregates computes a different (coarser)
estimator, robust to a bad edge rather than to a bad device.

Validation (``ValueError``, naming the update by its position and :attr:`ClientUpdate.participant` and the tensor):
at least one update; every update carries exactly the tensor names of x with the same shapes; the global model is
floating-point; every value is finite.

State: :meth:`Strategy.state` returns ``(meta, arrays)``, ``meta`` a JSON-serialisable dict (the strategy's name,
parameters and round count) and ``arrays`` a :data:`Weights` (FedAdam's moments, keyed ``m/<tensor>`` and
``v/<tensor>``; empty for the stateless strategies) that the caller stores the way it stores models.
:func:`strategy_from_state` (or :meth:`Strategy.restore` on a strategy built with the same parameters) rebuilds it, so a
hub restarted mid-task resumes FedAdam where it stopped. numpy only; no I/O.

The strategies stay in one module with their checks: each is a few lines over the shared validation and weighted
mean, and the definitions above are the one text the hub, the edges and the simulation cite.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

Weights = dict[str, np.ndarray]
"""A model: tensor name -> array (float32 or float64)."""

STATE_VERSION = 1


@dataclass(frozen=True)
class ClientUpdate:
    """What one participant (a device, or an edge's :func:`combine`) sends back at the end of a round."""

    weights: Weights
    """The participant's model after local training (not the delta)."""
    num_examples: int
    """How many examples it trained on (> 0): its weight in FedAvg."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Training metrics (loss, accuracy, ...), averaged by :func:`combine` and :func:`weighted_metrics`."""
    participant: str | None = None
    """Who sent it (device or edge id); only used in error messages."""

    def __post_init__(self) -> None:
        if isinstance(self.num_examples, bool) or not isinstance(self.num_examples, (int, np.integer)):
            raise ValueError(f"{self._label()}: num_examples must be an int, got {type(self.num_examples).__name__}")
        if self.num_examples <= 0:
            raise ValueError(f"{self._label()}: num_examples must be > 0, got {self.num_examples}")
        if not isinstance(self.weights, Mapping):
            raise ValueError(f"{self._label()}: weights must be a dict of tensor name -> array")

    def _label(self) -> str:
        return f"update from {self.participant!r}" if self.participant is not None else "update"


# --------------------------------------------------------------------------------------------------- validation


def _describe(index: int, update: ClientUpdate) -> str:
    who = f" ({update.participant!r})" if update.participant is not None else ""
    return f"update #{index}{who}"


def _check_global(global_weights: Weights) -> None:
    if not isinstance(global_weights, Mapping) or not global_weights:
        raise ValueError("the global model must be a non-empty dict of tensor name -> array")
    for name, array in global_weights.items():
        array = np.asarray(array)
        if not np.issubdtype(array.dtype, np.floating):
            raise ValueError(f"global tensor {name!r} has dtype {array.dtype}; only floating-point models aggregate")
        if not np.isfinite(array).all():
            raise ValueError(f"global tensor {name!r} has NaN or infinite values")


def _check_updates(reference: Mapping[str, np.ndarray], updates: Sequence[ClientUpdate], against: str) -> None:
    """Every update has exactly ``reference``'s tensor names and shapes, real numeric dtypes and finite values."""
    if not updates:
        raise ValueError("no updates to aggregate: at least one is needed")
    names = set(reference)
    for index, update in enumerate(updates):
        if not isinstance(update, ClientUpdate):
            raise ValueError(f"update #{index} is a {type(update).__name__}, not a ClientUpdate")
        label = _describe(index, update)
        got = set(update.weights)
        if got != names:
            missing, extra = sorted(names - got), sorted(got - names)
            raise ValueError(f"{label} does not match {against}: missing tensors {missing}, unexpected tensors {extra}")
        for name, expected in reference.items():
            array = np.asarray(update.weights[name])
            if array.shape != np.shape(expected):
                raise ValueError(
                    f"{label}: tensor {name!r} has shape {array.shape}, {against} has {np.shape(expected)}"
                )
            if not (np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)):
                raise ValueError(f"{label}: tensor {name!r} has non-numeric dtype {array.dtype}")
            if not np.isfinite(array).all():
                raise ValueError(f"{label}: tensor {name!r} has NaN or infinite values")


def _weighted_mean(updates: Sequence[ClientUpdate], names: Sequence[str]) -> dict[str, np.ndarray]:
    """``Σ_k n_k w_k / Σ_k n_k`` per tensor, in float64."""
    total = float(sum(int(u.num_examples) for u in updates))
    out: dict[str, np.ndarray] = {}
    for name in names:
        acc = np.zeros(np.shape(updates[0].weights[name]), dtype=np.float64)
        for update in updates:
            acc += float(update.num_examples) * np.asarray(update.weights[name], dtype=np.float64)
        out[name] = acc / total
    return out


def _stack(updates: Sequence[ClientUpdate], name: str) -> np.ndarray:
    return np.stack([np.asarray(u.weights[name], dtype=np.float64) for u in updates])


def weighted_metrics(updates: Sequence[ClientUpdate]) -> dict[str, float]:
    """The sample-weighted mean of each metric that every update reports (a metric some lack is left out)."""
    if not updates:
        return {}
    keys = set(updates[0].metrics).intersection(*(u.metrics for u in updates[1:]))
    total = float(sum(int(u.num_examples) for u in updates))
    return {key: sum(u.num_examples * float(u.metrics[key]) for u in updates) / total for key in sorted(keys)}


def combine(updates: Sequence[ClientUpdate], participant: str | None = None) -> ClientUpdate:
    """One update standing for ``updates``: their sample-weighted mean, ``num_examples`` their sum.

    What an edge sends up for a decomposable strategy (FedAvg, FedProx, FedAdam): the cloud's FedAvg over edges'
    combined updates equals its FedAvg over all the devices' updates (see the module docstring). Accumulated in
    float64; each tensor is returned in the dtype the updates share (``np.result_type`` of theirs). Metrics: the
    weighted mean of those every update reports. Not for Median/TrimmedMean (not decomposable).
    """
    updates = list(updates)
    if not updates:
        raise ValueError("no updates to combine: at least one is needed")
    _check_updates(updates[0].weights, updates, against="update #0")
    names = list(updates[0].weights)
    mean = _weighted_mean(updates, names)
    weights = {
        name: mean[name].astype(np.result_type(*(np.asarray(u.weights[name]).dtype for u in updates)), copy=False)
        for name in names
    }
    return ClientUpdate(
        weights=weights,
        num_examples=sum(int(u.num_examples) for u in updates),
        metrics=weighted_metrics(updates),
        participant=participant,
    )


def proximal_gradient(local: Weights, global_: Weights, mu: float) -> Weights:
    """FedProx's proximal term's gradient ``μ (w − x)``, per tensor, in ``local``'s dtypes.

    The gradient of ``(μ/2) ‖w − x‖²`` with respect to the local model w, where x is the global model the round
    started from. FedProx's client-side training adds it to the loss gradient of every local step (before any
    clipping or noise), which pulls w towards x and bounds the drift of heterogeneous participants.
    """
    mu = _number("mu", mu, low=0.0)
    if set(local) != set(global_):
        raise ValueError(
            f"local and global models differ: missing {sorted(set(global_) - set(local))}, "
            f"unexpected {sorted(set(local) - set(global_))}"
        )
    out: Weights = {}
    for name, w in local.items():
        w = np.asarray(w)
        x = np.asarray(global_[name])
        if w.shape != x.shape:
            raise ValueError(f"tensor {name!r}: local shape {w.shape}, global shape {x.shape}")
        dtype = w.dtype if np.issubdtype(w.dtype, np.floating) else np.float64
        out[name] = (mu * (w.astype(np.float64) - x.astype(np.float64))).astype(dtype)
    return out


def _number(name: str, value: Any, *, low: float, high: float = math.inf, low_open: bool = False,
            high_open: bool = False) -> float:
    """``value`` as a float in the interval given (ValueError otherwise)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    number = float(value)
    below = number <= low if low_open else number < low
    above = number >= high if high_open else number > high
    if not math.isfinite(number) or below or above:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise ValueError(f"{name} must be a finite number in {interval}, got {number!r}")
    return number


# --------------------------------------------------------------------------------------------------- strategies


class Strategy(ABC):
    """Turns the global model and the round's updates into the next global model."""

    name: ClassVar[str]
    """The name :func:`strategy_from_spec` knows it by."""
    decomposable: ClassVar[bool]
    """True when aggregating edges' :func:`combine` equals aggregating all their devices' updates."""

    def __init__(self) -> None:
        self.rounds = 0
        """Rounds aggregated so far (kept in the state)."""

    @property
    def min_updates(self) -> int:
        """The fewest updates a round needs."""
        return 1

    def params(self) -> dict[str, float]:
        """The constructor's parameters, as :func:`strategy_from_spec` takes them."""
        return {}

    def aggregate(self, global_weights: Weights, updates: Sequence[ClientUpdate]) -> Weights:
        """The new global model (a fresh dict, every tensor in the dtype of ``global_weights``' tensor)."""
        updates = list(updates)
        _check_global(global_weights)
        _check_updates(global_weights, updates, against="the global model")
        if len(updates) < self.min_updates:
            raise ValueError(
                f"{self.name} needs at least {self.min_updates} updates per round, got {len(updates)}"
                f"{self._too_few_reason()}"
            )
        merged = self._aggregate({name: np.asarray(array) for name, array in global_weights.items()}, updates)
        self.rounds += 1
        return {name: merged[name].astype(np.asarray(global_weights[name]).dtype) for name in global_weights}

    def _too_few_reason(self) -> str:
        return ""

    @abstractmethod
    def _aggregate(self, global_weights: Weights, updates: list[ClientUpdate]) -> dict[str, np.ndarray]:
        """The new model in float64 (inputs already validated)."""

    def state(self) -> tuple[dict[str, Any], Weights]:
        """``(meta, arrays)``: JSON-serialisable metadata and the arrays of the strategy's state (see the module)."""
        meta = {"version": STATE_VERSION, "strategy": self.name, "params": self.params(), "rounds": self.rounds}
        return meta, self._arrays()

    def _arrays(self) -> Weights:
        return {}

    def restore(self, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> None:
        """Load a :meth:`state` taken from a strategy of the same name and parameters."""
        if meta.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported strategy state version {meta.get('version')!r}")
        if meta.get("strategy") != self.name:
            raise ValueError(f"the state is of strategy {meta.get('strategy')!r}, not {self.name!r}")
        if dict(meta.get("params") or {}) != self.params():
            raise ValueError(f"the state's parameters {meta.get('params')!r} differ from this {self!r}")
        rounds = meta.get("rounds")
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
            raise ValueError(f"the state's rounds must be an int >= 0, got {rounds!r}")
        self._restore_arrays(dict(arrays))
        self.rounds = rounds

    def _restore_arrays(self, arrays: Weights) -> None:
        if arrays:
            raise ValueError(f"{self.name} keeps no arrays, the state has {sorted(arrays)}")

    def __repr__(self) -> str:
        params = ", ".join(f"{key}={value!r}" for key, value in self.params().items())
        return f"{type(self).__name__}({params})"


class FedAvg(Strategy):
    """``x' = Σ_k (n_k / N) w_k``."""

    name = "fedavg"
    decomposable = True

    def _aggregate(self, global_weights: Weights, updates: list[ClientUpdate]) -> dict[str, np.ndarray]:
        return _weighted_mean(updates, list(global_weights))


class FedProx(FedAvg):
    """FedAvg on the server; ``mu`` is for the participants' :func:`proximal_gradient` (the hub sends it to them)."""

    name = "fedprox"
    decomposable = True

    def __init__(self, mu: float = 0.01) -> None:
        super().__init__()
        self.mu = _number("mu", mu, low=0.0)

    def params(self) -> dict[str, float]:
        return {"mu": self.mu}


class FedAdam(Strategy):
    """Adam on the server over the FedAvg pseudo-gradient (see the module docstring); m and v are its state."""

    name = "fedadam"
    decomposable = True

    def __init__(self, eta: float = 1e-2, beta_1: float = 0.9, beta_2: float = 0.99, tau: float = 1e-3) -> None:
        super().__init__()
        self.eta = _number("eta", eta, low=0.0, low_open=True)
        self.beta_1 = _number("beta_1", beta_1, low=0.0, high=1.0, high_open=True)
        self.beta_2 = _number("beta_2", beta_2, low=0.0, high=1.0, high_open=True)
        self.tau = _number("tau", tau, low=0.0, low_open=True)
        self.m: dict[str, np.ndarray] = {}
        self.v: dict[str, np.ndarray] = {}

    def params(self) -> dict[str, float]:
        return {"eta": self.eta, "beta_1": self.beta_1, "beta_2": self.beta_2, "tau": self.tau}

    def _aggregate(self, global_weights: Weights, updates: list[ClientUpdate]) -> dict[str, np.ndarray]:
        names = list(global_weights)
        if self.m:
            self._check_moments(global_weights)
        mean = _weighted_mean(updates, names)
        m: dict[str, np.ndarray] = {}
        v: dict[str, np.ndarray] = {}
        out: dict[str, np.ndarray] = {}
        for name in names:
            x = global_weights[name].astype(np.float64)
            delta = mean[name] - x
            m[name] = self.beta_1 * self.m.get(name, 0.0) + (1.0 - self.beta_1) * delta
            v[name] = self.beta_2 * self.v.get(name, 0.0) + (1.0 - self.beta_2) * np.square(delta)
            out[name] = x + self.eta * m[name] / (np.sqrt(v[name]) + self.tau)
        self.m, self.v = m, v  # only once every tensor succeeded
        return out

    def _check_moments(self, global_weights: Weights) -> None:
        if set(self.m) != set(global_weights):
            raise ValueError(
                f"FedAdam's moments are for tensors {sorted(self.m)}, the global model has {sorted(global_weights)}"
            )
        for name, array in global_weights.items():
            if self.m[name].shape != array.shape:
                raise ValueError(
                    f"FedAdam's moments for {name!r} have shape {self.m[name].shape}, the global tensor {array.shape}"
                )

    def _arrays(self) -> Weights:
        arrays = {f"m/{name}": array.copy() for name, array in self.m.items()}
        arrays.update({f"v/{name}": array.copy() for name, array in self.v.items()})
        return arrays

    def _restore_arrays(self, arrays: Weights) -> None:
        m: dict[str, np.ndarray] = {}
        v: dict[str, np.ndarray] = {}
        for key, array in arrays.items():
            kind, _, name = key.partition("/")
            if kind not in ("m", "v") or not name:
                raise ValueError(f"unexpected FedAdam state array {key!r} (expected m/<tensor> or v/<tensor>)")
            array = np.asarray(array, dtype=np.float64)
            if not np.isfinite(array).all():
                raise ValueError(f"FedAdam state array {key!r} has NaN or infinite values")
            (m if kind == "m" else v)[name] = array.copy()
        if set(m) != set(v):
            raise ValueError(f"FedAdam state: m has tensors {sorted(m)}, v has {sorted(v)}")
        for name, first in m.items():
            if first.shape != v[name].shape:
                raise ValueError(f"FedAdam state: m/{name} has shape {first.shape}, v/{name} {v[name].shape}")
            if (v[name] < 0).any():
                raise ValueError(f"FedAdam state: v/{name} has negative values")
        self.m, self.v = m, v


class Median(Strategy):
    """Coordinate-wise median, unweighted."""

    name = "median"
    decomposable = False

    def _aggregate(self, global_weights: Weights, updates: list[ClientUpdate]) -> dict[str, np.ndarray]:
        return {name: np.median(_stack(updates, name), axis=0) for name in global_weights}


class TrimmedMean(Strategy):
    """Coordinate-wise mean after dropping the ⌊β n⌋ largest and ⌊β n⌋ smallest values, unweighted."""

    name = "trimmed_mean"
    decomposable = False

    def __init__(self, beta: float = 0.1) -> None:
        super().__init__()
        self.beta = _number("beta", beta, low=0.0, high=0.5, high_open=True)

    def params(self) -> dict[str, float]:
        return {"beta": self.beta}

    def trimmed(self, n: int) -> int:
        """How many values are dropped at each end when ``n`` updates arrive: ⌊β n⌋."""
        return math.floor(self.beta * n)

    @property
    def min_updates(self) -> int:
        """The fewest updates for which ⌊β n⌋ ≥ 1 (1 when β = 0: a plain unweighted mean was asked for)."""
        if self.beta == 0.0:
            return 1
        n = max(1, math.floor(1.0 / self.beta) - 1)
        while self.trimmed(n) < 1:
            n += 1
        return n

    def _too_few_reason(self) -> str:
        return f": with beta={self.beta:g}, fewer trim nothing (floor(beta * n) = 0) and would be a plain mean"

    def _aggregate(self, global_weights: Weights, updates: list[ClientUpdate]) -> dict[str, np.ndarray]:
        n = len(updates)
        t = self.trimmed(n)
        if n - 2 * t < 1:  # unreachable with beta < 1/2; kept as the invariant the mean relies on
            raise ValueError(f"trimmed_mean with beta={self.beta:g} over {n} updates would leave no value")
        out: dict[str, np.ndarray] = {}
        for name in global_weights:
            ordered = np.sort(_stack(updates, name), axis=0)
            out[name] = ordered[t : n - t].mean(axis=0)
        return out


STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (FedAvg, FedProx, FedAdam, Median, TrimmedMean)
}


def strategy_from_spec(name: str, **params: Any) -> Strategy:
    """A strategy by name (``fedavg | fedprox | fedadam | median | trimmed_mean``) with its parameters."""
    cls = STRATEGIES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"unknown aggregation strategy {name!r}; known: {', '.join(STRATEGIES)}")
    try:
        return cls(**params)
    except TypeError as exc:  # an unknown or missing keyword
        raise ValueError(f"bad parameters for strategy {name!r}: {exc}") from None


def strategy_from_state(meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> Strategy:
    """The strategy a :meth:`Strategy.state` was taken from, with that state restored."""
    if not isinstance(meta, Mapping):
        raise ValueError("strategy state metadata must be a dict")
    params = meta.get("params") or {}
    if not isinstance(params, Mapping):
        raise ValueError(f"strategy state params must be a dict, got {params!r}")
    strategy = strategy_from_spec(meta.get("strategy"), **params)  # type: ignore[arg-type]
    strategy.restore(meta, arrays)
    return strategy
