"""DP-SGD for an algorithm's ``fit`` (per-example privacy inside a site; the hub's DP-FedAvg protects whole sites).

Abadi et al. 2016: each step samples every example with probability ``q = batch_size / n`` (Poisson sampling),
clips each sampled example's gradient to L2 norm ``clip_norm``, sums them, adds Gaussian noise of standard
deviation ``noise_multiplier * clip_norm`` and divides by the expected batch ``q * n``. ε at ``delta`` after
``steps`` such steps is accounted with dp_accounting's RDP accountant (the one the hub charges budgets with).

An algorithm turns it on from its configuration (:func:`DpSgd.from_config`: ``dp_noise_multiplier`` > 0, with
``dp_clip_norm`` and ``dp_delta``), draws its batches with :meth:`DpSgd.batches`, privatises each batch's
per-example gradients with :meth:`DpSgd.privatise` and reports ``epsilon`` (:meth:`DpSgd.epsilon`, over
:func:`fit_calls` calls) in its metrics. Sampling and noise come from fresh operating-system entropy, never from
the configuration's seed: whoever knows a seed could subtract the noise.

The count is an upper bound: a site that missed a round trained fewer steps than :func:`fit_calls` assumes.
"""

from __future__ import annotations

import contextlib
import logging
import math
import secrets
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

CONFIG_KEYS = ("dp_noise_multiplier", "dp_clip_norm", "dp_delta")
"""The configuration keys of DP-SGD (an algorithm's ``config_schema`` declares them)."""


@dataclass(frozen=True)
class DpSgd:
    noise_multiplier: float
    clip_norm: float
    delta: float

    def __post_init__(self) -> None:
        if not (self.noise_multiplier > 0 and math.isfinite(self.noise_multiplier)):
            raise ValueError(f"dp_noise_multiplier must be a finite number > 0, got {self.noise_multiplier}")
        if not (self.clip_norm > 0 and math.isfinite(self.clip_norm)):
            raise ValueError(f"dp_clip_norm must be a finite number > 0, got {self.clip_norm}")
        if not 0 < self.delta < 1:
            raise ValueError(f"dp_delta must be in (0, 1), got {self.delta}")

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> DpSgd | None:
        """DP-SGD as the configuration asks, or ``None`` (``dp_noise_multiplier`` absent or 0)."""
        sigma = float(config.get("dp_noise_multiplier", 0.0))
        if sigma == 0:
            return None
        return cls(sigma, float(config.get("dp_clip_norm", 1.0)), float(config.get("dp_delta", 1e-5)))

    @staticmethod
    def sample_rate(examples: int, batch_size: int) -> float:
        return min(1.0, batch_size / examples)

    @staticmethod
    def steps_per_epoch(examples: int, batch_size: int) -> int:
        return math.ceil(examples / batch_size)

    def batches(self, examples: int, batch_size: int, epochs: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
        """The indices of each step's Poisson-sampled batch (it may be empty: the step then adds noise only)."""
        q = self.sample_rate(examples, batch_size)
        for _ in range(epochs * self.steps_per_epoch(examples, batch_size)):
            yield np.flatnonzero(rng.random(examples) < q)

    def privatise(self, per_example: Mapping[str, np.ndarray], expected_batch: float, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """The noised mean gradient from per-example gradients (``name -> [B, *shape]``, B ≥ 0): each example's
        gradient clipped to ``clip_norm`` over all parameters together, summed, noised, divided by ``expected_batch``."""
        arrays = {name: np.asarray(g, np.float64) for name, g in per_example.items()}
        count = next(iter(arrays.values())).shape[0] if arrays else 0
        norms = np.sqrt(sum((g.reshape(count, -1) ** 2).sum(axis=1) for g in arrays.values())) if count else np.zeros(0)
        scale = np.minimum(1.0, self.clip_norm / np.maximum(norms, 1e-12))
        out = {}
        for name, g in arrays.items():
            summed = np.tensordot(scale, g, axes=(0, 0)) if count else np.zeros(g.shape[1:])
            noise = rng.normal(0.0, self.noise_multiplier * self.clip_norm, summed.shape)
            out[name] = ((summed + noise) / expected_batch).astype(np.float32)
        return out

    def epsilon(self, examples: int, batch_size: int, steps: int) -> float:
        """ε at ``delta`` after ``steps`` steps on ``examples`` examples."""
        return epsilon(self.sample_rate(examples, batch_size), self.noise_multiplier, steps, self.delta)


def secret_rng() -> np.random.Generator:
    """A generator seeded from the operating system's entropy (for sampling and noise)."""
    return np.random.default_rng(secrets.randbits(128))


def fit_calls(config: Mapping[str, Any]) -> int:
    """How many fit calls this one is, at most, counting the earlier rounds' of a federated task (``server_round``,
    ``local_fits``) and this run's (``round``)."""
    call = int(config.get("round", 1))
    server_round = int(config.get("server_round", 0))
    return call + max(0, server_round - 1) * int(config.get("local_fits", 1))


def epsilon(sample_rate: float, noise_multiplier: float, steps: int, delta: float) -> float:
    """ε at ``delta`` of ``steps`` Poisson-sampled Gaussian steps (RDP, dp_accounting)."""
    if steps <= 0:
        return 0.0
    try:
        import dp_accounting
        from dp_accounting.rdp import rdp_privacy_accountant
    except ImportError as exc:  # pragma: no cover - the train extra installs it
        raise RuntimeError("DP-SGD accounting needs dp-accounting (pip install 'aisynergy[train]')") from exc
    accountant = rdp_privacy_accountant.RdpAccountant()
    step = dp_accounting.PoissonSampledDpEvent(sample_rate, dp_accounting.GaussianDpEvent(noise_multiplier))
    with _quiet("absl"):  # orders whose series does not converge are left out (a looser, still valid bound), and said so
        accountant.compose(dp_accounting.SelfComposedDpEvent(step, steps))
        return float(accountant.get_epsilon(delta))


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
