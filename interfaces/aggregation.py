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

Streaming. A whole model (tens of millions of parameters) need not be in memory, let alone once per participant and
in float64: :meth:`Strategy.aggregate_stream` takes the global model and each :class:`StreamUpdate` as a
:class:`TensorSource` (a :class:`~interfaces.tensorfile.TensorFile`, or a :class:`DictSource` over a dict) and
computes the same result, bit for bit, one tensor name at a time: it reads that tensor of x and of each update,
computes, hands the new tensor to ``out(name, array)`` and drops them. Names, shapes and dtypes are checked up front
from the headers, values as each tensor is read. Both paths share each strategy's per-tensor step
(``Strategy._tensor``). FedAvg, FedProx and FedAdam read the updates' tensors one at a time into a single float64
accumulator, so what the hub holds does not grow with the number of participants; FedAdam adds its moments of that
tensor, read from ``state_in`` and written to ``state_out`` (keys ``m/<tensor>``, ``v/<tensor>``). Median and
trimmed mean need all n values of a coordinate at once: they stack the n updates of one tensor (n float64 copies of
it), which is inherent to them.

State: :meth:`Strategy.state` returns ``(meta, arrays)``, ``meta`` a JSON-serialisable dict (the strategy's name,
parameters and round count) and ``arrays`` a :data:`Weights` (FedAdam's moments, keyed ``m/<tensor>`` and
``v/<tensor>``; empty for the stateless strategies) that the caller stores the way it stores models.
:func:`strategy_from_state` (or :meth:`Strategy.restore` on a strategy built with the same parameters) rebuilds it, so a
hub restarted mid-task resumes FedAdam where it stopped. The streaming path keeps the arrays outside the strategy: it
stores :meth:`Strategy.state_meta`, rebuilds with :func:`strategy_from_meta`, and passes FedAdam's moments as
``state_in`` / ``state_out`` (laid out by :meth:`Strategy.state_infos`). numpy only; no I/O.

The strategies stay in one module with their checks: each is a few lines over the shared validation and weighted
mean, and the definitions above are the one text the hub, the edges and the simulation cite.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np

from interfaces.tensorfile import TensorFileError, TensorInfo

Weights = dict[str, np.ndarray]
"""A model: tensor name -> array (float32 or float64)."""

STATE_VERSION = 1

_CHUNK = 1 << 18
"""Coordinates per step of the elementwise loops: their temporaries stay a few MiB whatever the tensor's size."""

Loader = Callable[[int], np.ndarray]
"""``load(k)``: update k's array of the tensor being aggregated, read (and checked) when asked for."""


@runtime_checkable
class TensorSource(Protocol):
    """A model read one tensor at a time: a :class:`~interfaces.tensorfile.TensorFile`, a :class:`DictSource`.

    ``read`` may return an array the source keeps (aggregation never writes into what it reads).
    """

    @property
    def names(self) -> Sequence[str]: ...

    def info(self, name: str) -> TensorInfo: ...

    def read(self, name: str) -> np.ndarray: ...


class DictSource:
    """A :data:`Weights` seen as a :class:`TensorSource` (its arrays are handed out as they are, not copied)."""

    def __init__(self, weights: Mapping[str, np.ndarray]) -> None:
        self.weights = dict(weights)

    @property
    def names(self) -> list[str]:
        return list(self.weights)

    def info(self, name: str) -> TensorInfo:
        return TensorInfo.of(self.weights[name])

    def infos(self) -> dict[str, TensorInfo]:
        return {name: TensorInfo.of(array) for name, array in self.weights.items()}

    def read(self, name: str) -> np.ndarray:
        return np.asarray(self.weights[name])


def _label(participant: str | None) -> str:
    return f"update from {participant!r}" if participant is not None else "update"


def _check_num_examples(label: str, num_examples: Any) -> None:
    if isinstance(num_examples, bool) or not isinstance(num_examples, (int, np.integer)):
        raise ValueError(f"{label}: num_examples must be an int, got {type(num_examples).__name__}")
    if num_examples <= 0:
        raise ValueError(f"{label}: num_examples must be > 0, got {num_examples}")


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
        _check_num_examples(self._label(), self.num_examples)
        if not isinstance(self.weights, Mapping):
            raise ValueError(f"{self._label()}: weights must be a dict of tensor name -> array")

    def _label(self) -> str:
        return _label(self.participant)


@dataclass(frozen=True)
class StreamUpdate:
    """A :class:`ClientUpdate` whose model is read one tensor at a time (:meth:`Strategy.aggregate_stream`)."""

    tensors: TensorSource
    """The participant's model after local training (not the delta)."""
    num_examples: int
    """How many examples it trained on (> 0): its weight in FedAvg."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Training metrics, as :attr:`ClientUpdate.metrics`."""
    participant: str | None = None
    """Who sent it (device or edge id); only used in error messages."""

    def __post_init__(self) -> None:
        _check_num_examples(_label(self.participant), self.num_examples)
        if not isinstance(self.tensors, TensorSource):
            raise ValueError(f"{_label(self.participant)}: tensors must be a TensorSource (names, info, read)")


# --------------------------------------------------------------------------------------------------- validation


def _describe(index: int, update: ClientUpdate | StreamUpdate) -> str:
    who = f" ({update.participant!r})" if update.participant is not None else ""
    return f"update #{index}{who}"


def _chunks(size: int) -> Iterator[slice]:
    for start in range(0, size, _CHUNK):
        yield slice(start, start + _CHUNK)


def _all_finite(array: np.ndarray) -> bool:
    """No NaN or infinity in ``array``, checked a chunk at a time (no tensor-sized mask)."""
    if not np.issubdtype(array.dtype, np.inexact):
        return True
    flat = array.reshape(-1)
    return all(bool(np.isfinite(flat[part]).all()) for part in _chunks(flat.size))


def _numeric(dtype: Any) -> bool:
    return bool(np.issubdtype(dtype, np.floating) or np.issubdtype(dtype, np.integer))


def _check_global(global_weights: Weights) -> None:
    if not isinstance(global_weights, Mapping) or not global_weights:
        raise ValueError("the global model must be a non-empty dict of tensor name -> array")
    for name, array in global_weights.items():
        array = np.asarray(array)
        if not np.issubdtype(array.dtype, np.floating):
            raise ValueError(f"global tensor {name!r} has dtype {array.dtype}; only floating-point models aggregate")
        if not _all_finite(array):
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
            if not _numeric(array.dtype):
                raise ValueError(f"{label}: tensor {name!r} has non-numeric dtype {array.dtype}")
            if not _all_finite(array):
                raise ValueError(f"{label}: tensor {name!r} has NaN or infinite values")


def _info(source: TensorSource, name: str, label: str) -> TensorInfo:
    try:
        return source.info(name)
    except TensorFileError as exc:
        raise ValueError(f"{label}: tensor {name!r}: {exc}") from None


def _check_stream(global_weights: TensorSource, updates: Sequence[StreamUpdate]) -> dict[str, tuple[int, ...]]:
    """:func:`_check_global` and :func:`_check_updates` from the headers alone; the global model's shapes."""
    if not isinstance(global_weights, TensorSource) or not list(global_weights.names):
        raise ValueError("the global model must be a TensorSource with at least one tensor")
    shapes: dict[str, tuple[int, ...]] = {}
    for name in global_weights.names:
        info = _info(global_weights, name, "the global model")
        if not np.issubdtype(np.dtype(info.dtype), np.floating):
            raise ValueError(f"global tensor {name!r} has dtype {info.dtype}; only floating-point models aggregate")
        shapes[name] = info.shape
    if not updates:
        raise ValueError("no updates to aggregate: at least one is needed")
    for index, update in enumerate(updates):
        if not isinstance(update, StreamUpdate):
            raise ValueError(f"update #{index} is a {type(update).__name__}, not a StreamUpdate")
        label = _describe(index, update)
        got = set(update.tensors.names)
        if got != set(shapes):
            missing, extra = sorted(set(shapes) - got), sorted(got - set(shapes))
            raise ValueError(
                f"{label} does not match the global model: missing tensors {missing}, unexpected tensors {extra}"
            )
        for name, shape in shapes.items():
            info = _info(update.tensors, name, label)
            if info.shape != shape:
                raise ValueError(f"{label}: tensor {name!r} has shape {info.shape}, the global model has {shape}")
            if not _numeric(np.dtype(info.dtype)):
                raise ValueError(f"{label}: tensor {name!r} has non-numeric dtype {info.dtype}")
    return shapes


def _read_checked(source: TensorSource, name: str, shape: tuple[int, ...], what: str, *, floating: bool) -> np.ndarray:
    """Tensor ``name`` of ``source``, checked against its header's shape, for its dtype and for finite values."""
    array = np.asarray(source.read(name))
    if array.shape != shape:
        raise ValueError(f"{what} was read with shape {array.shape}, its header says {shape}")
    if not (np.issubdtype(array.dtype, np.floating) if floating else _numeric(array.dtype)):
        raise ValueError(f"{what} was read with dtype {array.dtype}")
    if not _all_finite(array):
        raise ValueError(f"{what} has NaN or infinite values")
    return array


def _stream_loader(updates: Sequence[StreamUpdate], name: str, shape: tuple[int, ...]) -> Loader:
    def load(index: int) -> np.ndarray:
        update = updates[index]
        return _read_checked(update.tensors, name, shape, f"{_describe(index, update)}: tensor {name!r}",
                             floating=False)

    return load


def _dict_loader(updates: Sequence[ClientUpdate], name: str) -> Loader:
    return lambda index: np.asarray(updates[index].weights[name])


# ------------------------------------------------------------------------------------------------ per-tensor math


def _weighted_mean_of(load: Loader, counts: Sequence[int], shape: tuple[int, ...]) -> np.ndarray:
    """``Σ_k n_k w_k / Σ_k n_k`` of one tensor in float64: one accumulator, the w_k loaded one at a time."""
    acc = np.zeros(shape, dtype=np.float64)
    flat = acc.reshape(-1)
    for index, count in enumerate(counts):
        weight = float(count)
        source = load(index).reshape(-1)
        for part in _chunks(flat.size):
            flat[part] += weight * source[part].astype(np.float64)
        del source  # the next update's tensor is loaded once this one is dropped
    flat /= float(sum(int(c) for c in counts))
    return acc


def _stacked(load: Loader, n: int, shape: tuple[int, ...]) -> np.ndarray:
    """The n updates' values of one tensor, stacked along a new first axis, in float64."""
    stack = np.empty((n, *shape), dtype=np.float64)
    for index in range(n):
        stack[index] = load(index)
    return stack


def _weighted_mean(updates: Sequence[ClientUpdate], names: Sequence[str]) -> dict[str, np.ndarray]:
    """``Σ_k n_k w_k / Σ_k n_k`` per tensor, in float64."""
    counts = [int(u.num_examples) for u in updates]
    return {
        name: _weighted_mean_of(_dict_loader(updates, name), counts, np.shape(updates[0].weights[name]))
        for name in names
    }


def weighted_metrics(updates: Sequence[ClientUpdate | StreamUpdate]) -> dict[str, float]:
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
    state_kinds: ClassVar[tuple[str, ...]] = ()
    """The per-tensor arrays of the strategy's state, keyed ``<kind>/<tensor>`` (FedAdam: ``m`` and ``v``)."""

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
        self._check_count(len(updates))
        held = self._held_state()
        if held:
            self._check_state_layout({key: np.shape(a) for key, a in held.items()},
                                     {name: np.shape(a) for name, a in global_weights.items()})
        counts = [int(u.num_examples) for u in updates]
        merged: Weights = {}
        kept: dict[str, dict[str, np.ndarray]] = {}
        for name, array in global_weights.items():
            x = np.asarray(array)
            state = {kind: held[f"{kind}/{name}"] for kind in self.state_kinds} if held else {}
            tensor, kept[name] = self._tensor(x, _dict_loader(updates, name), counts, state)
            merged[name] = tensor.astype(x.dtype, copy=False)
        self._keep_state(kept)  # only once every tensor succeeded
        self.rounds += 1
        return merged

    def aggregate_stream(
        self,
        global_weights: TensorSource,
        updates: Sequence[StreamUpdate],
        out: Callable[[str, np.ndarray], None],
        state_in: TensorSource | None = None,
        state_out: Callable[[str, np.ndarray], None] | None = None,
    ) -> None:
        """:meth:`aggregate`, one tensor at a time: ``out(name, tensor)`` for each of the global model's names in order.

        Each tensor comes out in the dtype of the global tensor, bit-identical to :meth:`aggregate`'s. The arguments
        are checked from their headers before anything is read; values as each tensor is read, so an error (a
        ``ValueError`` naming the update, its participant and the tensor) can come after ``out`` took some tensors:
        what it took is then to be discarded (a :class:`~interfaces.tensorfile.TensorWriter` left by the exception
        deletes its file). :attr:`rounds` counts the round only once every tensor succeeded.

        The state of a stateful strategy (FedAdam's moments) is read per tensor from ``state_in`` (``None``, or a
        source without tensors, on the first round) and the new state written per tensor with
        ``state_out(key, array)``, keys ``<kind>/<tensor>`` in the order of :meth:`state_infos`; the strategy then
        keeps none itself. Without ``state_in`` it reads the state it holds (:meth:`restore`, :meth:`aggregate`);
        without ``state_out`` it keeps the new one, as :meth:`aggregate` does. Stateless strategies ignore both.
        """
        updates = list(updates)
        shapes = _check_stream(global_weights, updates)
        self._check_count(len(updates))
        state_source = self._stream_state(state_in, shapes)
        counts = [int(u.num_examples) for u in updates]
        kept: dict[str, dict[str, np.ndarray]] = {}
        for name, shape in shapes.items():
            x = _read_checked(global_weights, name, shape, f"global tensor {name!r}", floating=True)
            state = {} if state_source is None else {
                kind: self._state_array(f"{kind}/{name}", state_source.read(f"{kind}/{name}"))
                for kind in self.state_kinds
            }
            tensor, new = self._tensor(x, _stream_loader(updates, name, shape), counts, state)
            del state
            out(name, tensor.astype(x.dtype, copy=False))
            del tensor, x
            if state_out is None:
                kept[name] = new
            else:
                for kind, array in new.items():
                    state_out(f"{kind}/{name}", array)
            del new
        self._keep_state(kept if state_out is None else {})
        self.rounds += 1

    def _check_count(self, n: int) -> None:
        if n < self.min_updates:
            raise ValueError(
                f"{self.name} needs at least {self.min_updates} updates per round, got {n}{self._too_few_reason()}"
            )

    def _too_few_reason(self) -> str:
        return ""

    @abstractmethod
    def _tensor(self, x: np.ndarray, load: Loader, counts: Sequence[int],
                state: Mapping[str, np.ndarray]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """One tensor of the new model in float64, and its new state (kind -> array; empty when stateless).

        ``x`` is the global tensor, ``load(k)`` update k's (already checked; loaded when asked, and not to be kept
        longer than needed), ``counts[k]`` its number of examples, ``state`` the strategy's state of this tensor
        (kind -> float64 array; empty on the first round). Neither ``x`` nor what ``load`` returns is written to.
        """

    # ---------------------------------------------------------------------------------------------------- state

    def state(self) -> tuple[dict[str, Any], Weights]:
        """``(meta, arrays)``: JSON-serialisable metadata and the arrays of the strategy's state (see the module)."""
        return self.state_meta(), self._arrays()

    def state_meta(self) -> dict[str, Any]:
        """The ``meta`` part of :meth:`state`: name, parameters and round count (:func:`strategy_from_meta`)."""
        return {"version": STATE_VERSION, "strategy": self.name, "params": self.params(), "rounds": self.rounds}

    def state_infos(self, infos: Mapping[str, TensorInfo]) -> dict[str, TensorInfo]:
        """The layout of the state that :meth:`aggregate_stream` hands ``state_out`` for a model laid out as ``infos``.

        In the order it hands them over (float64; empty for the stateless strategies): a
        :class:`~interfaces.tensorfile.TensorWriter` given this layout takes ``state_out`` as it comes.
        """
        return {f"{kind}/{name}": TensorInfo("float64", info.shape) for name, info in infos.items()
                for kind in self.state_kinds}

    def _arrays(self) -> Weights:
        return {key: array.copy() for key, array in self._held_state().items()}

    def _held_state(self) -> Weights:
        """The state arrays the strategy holds, keyed ``<kind>/<tensor>`` (not copies)."""
        return {}

    def _keep_state(self, state: dict[str, dict[str, np.ndarray]]) -> None:
        """Hold ``state`` (tensor -> kind -> array; empty: hold none) as the strategy's state."""

    def _state_array(self, key: str, array: np.ndarray) -> np.ndarray:
        """State array ``key`` in float64, checked."""
        array = np.asarray(array, dtype=np.float64)
        if not _all_finite(array):
            raise ValueError(f"{self._state_label()} array {key!r} has NaN or infinite values")
        return array

    def _state_label(self) -> str:
        return f"{self.name} state"

    def _check_state_layout(self, layout: Mapping[str, tuple[int, ...]], shapes: Mapping[str, tuple[int, ...]]) -> None:
        """The state's arrays (key -> shape) are exactly ``<kind>/<tensor>`` for the global model's tensors."""
        expected = {f"{kind}/{name}": shape for name, shape in shapes.items() for kind in self.state_kinds}
        if set(layout) != set(expected):
            tensors = sorted({key.partition("/")[2] for key in layout})
            raise ValueError(
                f"{self._state_label()} is for tensors {tensors}, the global model has {sorted(shapes)}: missing "
                f"arrays {sorted(set(expected) - set(layout))}, unexpected arrays {sorted(set(layout) - set(expected))}"
            )
        for key, shape in layout.items():
            if tuple(shape) != expected[key]:
                raise ValueError(f"{self._state_label()} {key!r} has shape {tuple(shape)}, the global tensor {expected[key]}")

    def _stream_state(self, state_in: TensorSource | None, shapes: Mapping[str, tuple[int, ...]]) -> TensorSource | None:
        """Where :meth:`aggregate_stream` reads the state from (``None``: stateless, or the first round), checked."""
        if not self.state_kinds:
            return None
        source = state_in if state_in is not None else DictSource(self._held_state())
        if not isinstance(source, TensorSource):
            raise ValueError(f"state_in must be a TensorSource, got {type(source).__name__}")
        if not list(source.names):
            return None
        layout = {}
        for key in source.names:
            info = _info(source, key, self._state_label())
            if not np.issubdtype(np.dtype(info.dtype), np.floating):
                raise ValueError(f"{self._state_label()} array {key!r} has dtype {info.dtype}, not floating-point")
            layout[key] = info.shape
        self._check_state_layout(layout, shapes)
        return source

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

    def _tensor(self, x: np.ndarray, load: Loader, counts: Sequence[int],
                state: Mapping[str, np.ndarray]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        return _weighted_mean_of(load, counts, x.shape), {}


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
    state_kinds = ("m", "v")

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

    def _tensor(self, x: np.ndarray, load: Loader, counts: Sequence[int],
                state: Mapping[str, np.ndarray]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        out = _weighted_mean_of(load, counts, x.shape)  # the mean, overwritten chunk by chunk with x'
        m, v = np.empty_like(out), np.empty_like(out)
        flat_x, flat_out, flat_m, flat_v = (a.reshape(-1) for a in (x, out, m, v))
        old_m = state["m"].reshape(-1) if state else None
        old_v = state["v"].reshape(-1) if state else None
        for part in _chunks(flat_out.size):
            xs = flat_x[part].astype(np.float64)
            delta = flat_out[part] - xs
            flat_m[part] = self.beta_1 * (0.0 if old_m is None else old_m[part]) + (1.0 - self.beta_1) * delta
            flat_v[part] = (self.beta_2 * (0.0 if old_v is None else old_v[part])
                            + (1.0 - self.beta_2) * np.square(delta))
            flat_out[part] = xs + self.eta * flat_m[part] / (np.sqrt(flat_v[part]) + self.tau)
        return out, {"m": m, "v": v}

    def _state_label(self) -> str:
        return "FedAdam's moments"

    def _held_state(self) -> Weights:
        arrays = {f"m/{name}": array for name, array in self.m.items()}
        arrays.update({f"v/{name}": array for name, array in self.v.items()})
        return arrays

    def _keep_state(self, state: dict[str, dict[str, np.ndarray]]) -> None:
        self.m = {name: kinds["m"] for name, kinds in state.items()}
        self.v = {name: kinds["v"] for name, kinds in state.items()}

    def _state_array(self, key: str, array: np.ndarray) -> np.ndarray:
        array = np.asarray(array, dtype=np.float64)
        if not _all_finite(array):
            raise ValueError(f"FedAdam state array {key!r} has NaN or infinite values")
        if key.startswith("v/") and (array < 0).any():
            raise ValueError(f"FedAdam state: {key} has negative values")
        return array

    def _restore_arrays(self, arrays: Weights) -> None:
        m: dict[str, np.ndarray] = {}
        v: dict[str, np.ndarray] = {}
        for key, array in arrays.items():
            kind, _, name = key.partition("/")
            if kind not in ("m", "v") or not name:
                raise ValueError(f"unexpected FedAdam state array {key!r} (expected m/<tensor> or v/<tensor>)")
            (m if kind == "m" else v)[name] = self._state_array(key, array).copy()
        if set(m) != set(v):
            raise ValueError(f"FedAdam state: m has tensors {sorted(m)}, v has {sorted(v)}")
        for name, first in m.items():
            if first.shape != v[name].shape:
                raise ValueError(f"FedAdam state: m/{name} has shape {first.shape}, v/{name} {v[name].shape}")
        self.m, self.v = m, v


class Median(Strategy):
    """Coordinate-wise median, unweighted (it stacks the n updates of one tensor at a time)."""

    name = "median"
    decomposable = False

    def _tensor(self, x: np.ndarray, load: Loader, counts: Sequence[int],
                state: Mapping[str, np.ndarray]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        return np.median(_stacked(load, len(counts), x.shape), axis=0, overwrite_input=True), {}


class TrimmedMean(Strategy):
    """Coordinate-wise mean after dropping the ⌊β n⌋ largest and ⌊β n⌋ smallest values, unweighted (stacks, as Median)."""

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

    def _tensor(self, x: np.ndarray, load: Loader, counts: Sequence[int],
                state: Mapping[str, np.ndarray]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        n = len(counts)
        t = self.trimmed(n)
        if n - 2 * t < 1:  # unreachable with beta < 1/2; kept as the invariant the mean relies on
            raise ValueError(f"trimmed_mean with beta={self.beta:g} over {n} updates would leave no value")
        ordered = _stacked(load, n, x.shape)
        ordered.sort(axis=0)
        return ordered[t : n - t].mean(axis=0), {}


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


def strategy_from_meta(meta: Mapping[str, Any]) -> Strategy:
    """The strategy a :meth:`Strategy.state_meta` was taken from, holding no arrays.

    For :meth:`Strategy.aggregate_stream`, which takes FedAdam's moments from ``state_in`` instead.
    """
    return strategy_from_state(meta, {})
