"""Client-level differential privacy for whole-model rounds: DP-FedAvg (McMahan et al. 2018, "Learning
Differentially Private Recurrent Language Models"), one tensor at a time. numpy only.

A participant trained the round's global model x into w; its update is the delta ``Δ = w − x`` over every tensor
of the model. It is clipped to the L2 norm C (over all tensors together): ``Δ̃ = Δ · min(1, C / ‖Δ‖)``, so one
participant's whole dataset moves the sum of the round's updates by at most C. The aggregate adds Gaussian noise
of standard deviation ``z · C`` to each coordinate of that sum and divides by the number of contributors m::

    x' = x + (Σ_k Δ̃_k + N(0, (z C)² I)) / m

Every contributor counts the same (weighting by example counts would let one site's count change the sensitivity).
Each round is thus the Gaussian mechanism with noise multiplier z on each participant's data; over R rounds each
participant spends what R DP-SGD steps at sample rate 1 and noise multiplier z spend, which the hub accounts (RDP,
dp-accounting) and charges to its privacy budget. The participant clips before it uploads (:func:`clip`: what
leaves the site is already bounded) and the aggregator clips again as it reads (:class:`NoisedMean`), so the bound
holds whatever a participant sent. The noise comes from numpy's PCG64DXSM seeded with 128 bits of the operating
system's entropy: statistically sound, not a cryptographically secure generator.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def _delta(local: np.ndarray, global_: np.ndarray) -> np.ndarray:
    return np.asarray(local, np.float64) - np.asarray(global_, np.float64)


def delta_norm(local: Any, global_: Any) -> float:
    """‖w − x‖₂ over every tensor of ``global_``, read one tensor at a time (both ``TensorSource``)."""
    total = 0.0
    for name in global_.names:
        d = _delta(local.read(name), global_.read(name))
        total += float(np.dot(d.ravel(), d.ravel()))
    return math.sqrt(total)


def clip_factor(norm: float, clip_norm: float) -> float:
    """``min(1, C / norm)`` (1 for a zero update)."""
    if not (math.isfinite(clip_norm) and clip_norm > 0):
        raise ValueError(f"clip_norm must be a positive finite number, got {clip_norm!r}")
    if not math.isfinite(norm):
        raise ValueError("the update's norm is not finite")
    return 1.0 if norm <= clip_norm else clip_norm / norm


def clip(local: Mapping[str, np.ndarray], global_: Mapping[str, np.ndarray], clip_norm: float) -> tuple[dict[str, np.ndarray], float]:
    """The participant's side: its model with the delta from ``global_`` clipped to ``clip_norm`` (each tensor in its own
    dtype), and the delta's norm before clipping."""
    if set(local) != set(global_):
        raise ValueError(f"the trained model's tensors {sorted(local)[:5]} are not the global model's {sorted(global_)[:5]}")
    norm = math.sqrt(sum(float(np.sum(_delta(local[n], global_[n]) ** 2)) for n in global_))
    factor = clip_factor(norm, clip_norm)
    if factor == 1.0:
        return {n: np.ascontiguousarray(a) for n, a in local.items()}, norm
    out = {n: (np.asarray(global_[n], np.float64) + _delta(local[n], global_[n]) * factor).astype(np.asarray(local[n]).dtype) for n in global_}
    return out, norm


class NoisedMean:
    """The aggregator's side, a ``TensorSource`` of the next global model: per tensor, the global ``x`` plus the
    contributors' clipped deltas summed, Gaussian noise of std ``noise_multiplier · clip_norm`` added, divided by
    their number. ``updates``: each contributor's model (a ``TensorSource``); their norms are read (one tensor at a
    time) when it is built, and :attr:`norms` / :attr:`clipped` say what clipping did."""

    def __init__(self, global_: Any, updates: Sequence[Any], clip_norm: float, noise_multiplier: float, rng: np.random.Generator | None = None) -> None:
        if not updates:
            raise ValueError("a noised mean of no update")
        if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
            raise ValueError(f"noise_multiplier must be a finite number >= 0, got {noise_multiplier!r}")
        self.global_, self.updates = global_, list(updates)
        self.clip_norm, self.sigma = float(clip_norm), float(noise_multiplier) * float(clip_norm)
        self.norms = [delta_norm(u, global_) for u in self.updates]
        self.factors = [clip_factor(n, clip_norm) for n in self.norms]
        self.rng = rng if rng is not None else np.random.Generator(np.random.PCG64DXSM(secrets.randbits(128)))

    @property
    def clipped(self) -> int:
        """How many of the updates were longer than the clip norm."""
        return sum(f < 1.0 for f in self.factors)

    @property
    def names(self) -> list[str]:
        return list(self.global_.names)

    def info(self, name: str) -> Any:
        return self.global_.info(name)

    def read(self, name: str) -> np.ndarray:
        x = np.asarray(self.global_.read(name), np.float64)
        total = np.zeros_like(x)
        for update, factor in zip(self.updates, self.factors, strict=True):
            total += _delta(update.read(name), x) * factor
        if self.sigma:
            total += self.rng.normal(0.0, self.sigma, size=x.shape)
        return (x + total / len(self.updates)).astype(self.global_.info(name).dtype)
