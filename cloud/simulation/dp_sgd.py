"""DP-SGD for the experiment's federated + DP arm (:mod:`cloud.simulation.experiment`, arm 4): each example's
gradient of the MLP clipped, Gaussian noise added, the noise multiplier calibrated by dp-accounting's RDP accountant.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from cloud.incremental import accounting
from cloud.simulation import mlp
from cloud.simulation.common import SimulationError

SIGMA_TOLERANCE = 1e-3


class _DropUnconverged(logging.Filter):
    """The accountant logs (through absl) every RDP order below 2 whose series does not converge for a large q; it
    leaves that order out of the ε (which stays an upper bound: ε is a minimum over the orders). Not news here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "failed to converge" not in record.getMessage()


@contextmanager
def _quiet_accountant() -> Iterator[None]:
    logger, drop = logging.getLogger("absl"), _DropUnconverged()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def epsilon_spent(sample_rate: float, noise_multiplier: float, steps: int, delta: float) -> float:
    """ε at ``delta`` of ``steps`` Poisson-sampled Gaussian steps (dp-accounting's RDP accountant, through
    :func:`cloud.incremental.accounting.run_epsilon`)."""
    with _quiet_accountant():
        return accounting.run_epsilon(accounting.Run(sample_rate, noise_multiplier, steps), delta)


def calibrate_sigma(sample_rate: float, steps: int, epsilon: float, delta: float) -> float:
    """The smallest noise multiplier σ (to :data:`SIGMA_TOLERANCE` relative) with
    ``epsilon_spent(q, σ, steps, δ) <= epsilon``; bisection over σ, ε being decreasing in σ."""
    if steps < 1:
        raise SimulationError(f"steps must be >= 1, got {steps}")

    def fits(sigma: float) -> bool:
        return epsilon_spent(sample_rate, sigma, steps, delta) <= epsilon

    lo, hi = 0.0, 1.0
    while not fits(hi):
        lo, hi = hi, hi * 2
        if hi > 1e6:
            raise SimulationError(f"no noise multiplier reaches epsilon {epsilon:g} in {steps} steps at q {sample_rate:g}")
    while hi - lo > SIGMA_TOLERANCE * hi:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def clipped_gradient_sum(weights: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray,
                         clip_norm: float) -> tuple[dict[str, np.ndarray], float]:
    """Σᵢ clip(∇ℓᵢ) over the examples of (x, y), each example's gradient (every layer's weight and bias together)
    scaled to L2 norm at most ``clip_norm``; also the batch's summed loss.

    An example's gradient of a dense layer is ``aᵢ ⊗ δᵢ`` (input activation, output error) and ``δᵢ`` for its bias,
    of squared norm ``(‖aᵢ‖² + 1) ‖δᵢ‖²``; the clipped sum is ``Aᵀ (s ⊙ Δ)`` with sᵢ = min(1, C / ‖∇ℓᵢ‖)."""
    names = mlp.layer_names(len(weights) // 2)
    if len(y) == 0:
        return {name: np.zeros_like(array) for name, array in weights.items()}, 0.0
    acts = mlp.forward(weights, x)
    loss, probs = mlp.softmax_xent(acts[-1], y)
    probs[np.arange(len(y)), y] -= 1.0
    delta = probs.astype(np.float32)
    deltas: list[np.ndarray] = [np.empty(0, np.float32)] * len(names)
    norm_sq = np.zeros(len(y), dtype=np.float64)
    for index in range(len(names) - 1, -1, -1):
        deltas[index] = delta
        a = acts[index]
        norm_sq += (np.einsum("ij,ij->i", a, a, dtype=np.float64) + 1.0) * np.einsum("ij,ij->i", delta, delta,
                                                                                     dtype=np.float64)
        if index > 0:
            delta = (delta @ weights[names[index][0]].T) * (acts[index] > 0)
    norms = np.sqrt(norm_sq)
    scale = np.minimum(1.0, clip_norm / np.maximum(norms, 1e-12)).astype(np.float32)[:, None]
    grads: dict[str, np.ndarray] = {}
    for index, (w_name, b_name) in enumerate(names):
        scaled = deltas[index] * scale
        grads[w_name] = acts[index].T @ scaled
        grads[b_name] = scaled.sum(axis=0)
    return grads, loss * len(y)


@dataclass(frozen=True)
class DpPlan:
    """One party's DP-SGD over the task: sample rate, steps per round and in all, noise multiplier, ε spent."""

    party: int
    examples: int
    sample_rate: float
    steps_per_round: int
    steps: int
    noise_multiplier: float
    epsilon: float
    delta: float


def dp_local_train(global_w: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray, plan: DpPlan, clip_norm: float,
                   lr: float, rng: np.random.Generator) -> tuple[dict[str, np.ndarray], float]:
    """``plan.steps_per_round`` DP-SGD steps from ``global_w`` on (x, y); the model and the mean loss of the sampled
    examples (a training metric, not covered by the guarantee)."""
    w = {name: array.copy() for name, array in global_w.items()}
    expected = plan.sample_rate * len(y)
    std = plan.noise_multiplier * clip_norm
    step = np.float32(lr / expected)
    loss_sum, seen = 0.0, 0
    for _ in range(plan.steps_per_round):
        idx = np.flatnonzero(rng.random(len(y)) < plan.sample_rate)
        grads, batch_loss = clipped_gradient_sum(w, x[idx], y[idx], clip_norm)
        loss_sum += batch_loss
        seen += len(idx)
        for name, grad in grads.items():
            grad += rng.standard_normal(grad.shape, dtype=np.float32) * np.float32(std)
            grad *= step
            w[name] -= grad
    return w, loss_sum / max(seen, 1)
