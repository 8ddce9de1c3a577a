"""Compressed whole-model updates (``FederatedTrainingSpec.compression``): what a participant uploads and how the hub
reads it back, one tensor at a time.

A participant trained the round's global model x into w. With ``none`` it uploads w itself (any floating dtype).
The others carry, per tensor of the model, what the hub adds to x to get the participant's model back:

* ``fp16``: w in float16 (half the bytes of float32; no error feedback: the rounding is unbiased enough).
* ``int8``: the delta ``d = w − x + e`` (e: the participant's error feedback, below) quantised per tensor with one
  scale ``s = max|d| / 127`` (1 when d is all zero): ``q = round(d / s)`` in int8 under the tensor's name, s as a
  float32 scalar under ``<name>#scale``. The hub reads ``x + q s``.
* ``topk``: the ``k = max(1, ⌈fraction · size⌉)`` coordinates of d of the largest magnitude: their flat indices
  (int64, ascending) under ``<name>#indices`` and their values (float32) under ``<name>#values``. The hub reads x with
  those coordinates moved by the values.

Error feedback (Seide et al. 2014; Karimireddy et al. 2019, "EF-SGD"): what compression dropped this round,
``e' = d − decode(encode(d))``, is kept by the participant and added to its next delta, so nothing is lost, only
late. :func:`encode` returns it; the participant keeps it in its own directory between rounds (it never leaves
the site). The encoded file's metadata names the scheme (``aisynergy.compression``).

:func:`layout` is what an encoded update of a model must hold (names, dtypes, shapes) for the hub's checks;
:class:`Decoded` is a :class:`~interfaces.aggregation.TensorSource` that reads one tensor of the participant's
model at a time from its encoded update and the global model. numpy only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np

from interfaces.tensorfile import TensorInfo

Compression = Literal["none", "fp16", "int8", "topk"]
COMPRESSIONS: tuple[str, ...] = ("none", "fp16", "int8", "topk")
METADATA_KEY = "aisynergy.compression"
SCALE, INDICES, VALUES = "#scale", "#indices", "#values"
FLOATS = frozenset({"float16", "float32", "float64"})


def kept(size: int, fraction: float) -> int:
    """How many coordinates ``topk`` keeps of a tensor of ``size`` values."""
    return min(size, max(1, math.ceil(fraction * size))) if size else 0


def layout(kind: str, infos: Mapping[str, TensorInfo], fraction: float = 0.1) -> dict[str, TensorInfo] | None:
    """The tensors an encoded update of a model laid out as ``infos`` holds (None for ``none``: the model's names and
    shapes in any floating dtype)."""
    if kind == "none":
        return None
    out: dict[str, TensorInfo] = {}
    for name, info in infos.items():
        if kind == "fp16":
            out[name] = TensorInfo("float16", info.shape)
        elif kind == "int8":
            out[name] = TensorInfo("int8", info.shape)
            out[name + SCALE] = TensorInfo("float32", ())
        elif kind == "topk":
            k = kept(int(np.prod(info.shape, dtype=np.int64)), fraction)
            out[name + INDICES] = TensorInfo("int64", (k,))
            out[name + VALUES] = TensorInfo("float32", (k,))
        else:
            raise ValueError(f"unknown compression {kind!r}; known: {', '.join(COMPRESSIONS)}")
    return out


def encode(kind: str, local: Mapping[str, np.ndarray], global_: Mapping[str, np.ndarray], residual: Mapping[str, np.ndarray] | None = None,
           fraction: float = 0.1) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:  # fmt: skip
    """``(tensors to upload, the new error feedback)`` for the participant's model ``local`` trained from ``global_``
    (``residual``: the error feedback kept from the last round; empty for ``none`` and ``fp16``)."""
    if set(local) != set(global_):
        raise ValueError(f"the trained model's tensors {sorted(local)[:5]} are not the global model's {sorted(global_)[:5]}")
    if kind == "none":
        return {name: np.ascontiguousarray(array) for name, array in local.items()}, {}
    if kind == "fp16":
        return {name: np.asarray(array, np.float16) for name, array in local.items()}, {}
    out: dict[str, np.ndarray] = {}
    feedback: dict[str, np.ndarray] = {}
    for name, w in local.items():
        x = np.asarray(global_[name], np.float64)
        if np.shape(w) != x.shape:
            raise ValueError(f"tensor {name!r}: trained shape {np.shape(w)}, global shape {x.shape}")
        delta = np.asarray(w, np.float64) - x
        if residual is not None and name in residual and np.shape(residual[name]) == delta.shape:
            delta = delta + np.asarray(residual[name], np.float64)
        if kind == "int8":
            peak = float(np.abs(delta).max()) if delta.size else 0.0
            scale = peak / 127.0 if peak > 0 else 1.0
            q = np.clip(np.rint(delta / scale), -127, 127).astype(np.int8)
            out[name], out[name + SCALE] = q, np.asarray(scale, np.float32)
            sent = q.astype(np.float64) * float(np.float32(scale))
        elif kind == "topk":
            flat = delta.ravel()
            k = kept(flat.size, fraction)
            indices = np.sort(np.argpartition(np.abs(flat), flat.size - k)[flat.size - k :]) if k else np.zeros(0, np.int64)
            values = flat[indices].astype(np.float32)
            out[name + INDICES], out[name + VALUES] = indices.astype(np.int64), values
            sent = np.zeros_like(flat)
            sent[indices] = values
            sent = sent.reshape(delta.shape)
        else:
            raise ValueError(f"unknown compression {kind!r}; known: {', '.join(COMPRESSIONS)}")
        feedback[name] = (delta - sent).astype(np.float32)
    return out, feedback


def misfit(kind: str, tensors: Any, infos: Mapping[str, TensorInfo], fraction: float = 0.1) -> str | None:
    """Why the encoded update ``tensors`` (a :class:`~interfaces.tensorfile.TensorFile`) is not an update of the model
    laid out as ``infos``; None when it is (names, dtypes, shapes, finite values, indices in range)."""
    have = tensors.infos()
    want = layout(kind, infos, fraction)
    expected = set(infos) if want is None else set(want)
    if set(have) != expected:
        return f"its tensors differ from a {kind} update of the model: missing {sorted(expected - set(have))[:5]}, unexpected {sorted(set(have) - expected)[:5]}"
    for name, got in have.items():
        need = infos[name] if want is None else want[name]
        if got.shape != need.shape or (got.dtype not in FLOATS if want is None else got.dtype != need.dtype):
            return f"tensor {name!r} is {got.dtype} {list(got.shape)}; a {kind} update holds {need.dtype if want else 'a float'} {list(need.shape)}"
        array = tensors.read(name)
        if name.endswith(INDICES):
            size = int(np.prod(infos[name[: -len(INDICES)]].shape, dtype=np.int64))
            if array.size and (array.min() < 0 or array.max() >= size or np.any(np.diff(array) <= 0)):
                return f"tensor {name!r} holds indices out of [0, {size}) or not strictly ascending"
        elif np.issubdtype(array.dtype, np.floating) and not np.isfinite(array).all():
            return f"tensor {name!r} holds NaN or infinite values"
    return None


class Decoded:
    """The participant's model, one tensor at a time, from its encoded ``update`` and the ``global_`` model it was
    trained from (both :class:`~interfaces.aggregation.TensorSource`); tensors in float64 but for ``none`` and ``fp16``."""

    def __init__(self, kind: str, update: Any, global_: Any) -> None:
        if kind not in COMPRESSIONS:
            raise ValueError(f"unknown compression {kind!r}; known: {', '.join(COMPRESSIONS)}")
        self.kind, self.update, self.global_ = kind, update, global_

    @property
    def names(self) -> Sequence[str]:
        return list(self.global_.names)

    def info(self, name: str) -> TensorInfo:
        info: TensorInfo = self.global_.info(name)
        if self.kind in ("none", "fp16"):
            return self.update.info(name)  # type: ignore[no-any-return]
        return TensorInfo("float64", info.shape)

    def read(self, name: str) -> np.ndarray:
        if self.kind in ("none", "fp16"):
            return self.update.read(name)  # type: ignore[no-any-return]
        x = np.asarray(self.global_.read(name), np.float64)
        if self.kind == "int8":
            return x + self.update.read(name).astype(np.float64) * float(self.update.read(name + SCALE))  # type: ignore[no-any-return]
        flat = x.reshape(-1)
        flat[self.update.read(name + INDICES)] += self.update.read(name + VALUES).astype(np.float64)
        return flat.reshape(x.shape)
