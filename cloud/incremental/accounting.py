"""Privacy accounting of DP-SGD with dp_accounting's RDP accountant (Mironov 2017; Mironov, Talwar, Zhang 2019).

A run of DP-SGD is ``steps`` compositions of the Poisson-sampled Gaussian mechanism
(``PoissonSampledDpEvent(q, GaussianDpEvent(σ))``, add-or-remove-one neighbours). Its Rényi divergence
at each order α is ``steps`` times that of one step, and runs compose by adding their RDP curves, so:

* :func:`step_rdp` asks ``RdpAccountant`` once per (q, σ) for one step's curve (cached);
* the curve of any set of runs is a sum of ``steps × step_rdp(q, σ)`` (:func:`curve`), exactly what
  composing ``SelfComposedDpEvent``s in one accountant yields;
* :func:`epsilon` converts a curve to ε at δ with the accountant's own conversion
  (``rdp_privacy_accountant.compute_epsilon``, the same the accountant's ``get_epsilon`` uses);
* :func:`max_steps` finds, by bisection over this monotone ε, the most steps a run may take so that every
  limit holds (a device budget over all its runs, a task's own ε).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import dp_accounting

# dp_accounting (and scipy under it) load at the first computation, not with the hub


@lru_cache(maxsize=1)
def orders() -> np.ndarray:
    """The RDP orders: the accountant's defaults."""
    from dp_accounting.rdp import rdp_privacy_accountant

    return np.array(rdp_privacy_accountant.DEFAULT_RDP_ORDERS, dtype=np.float64)


@dataclass(frozen=True)
class Run:
    """``steps`` DP-SGD steps at sample rate q with noise multiplier σ."""

    sample_rate: float
    noise_multiplier: float
    steps: int


@dataclass(frozen=True)
class Limit:
    """Spending ``base`` (an RDP curve) plus the new run must stay within ``epsilon`` at ``delta``."""

    base: np.ndarray
    epsilon: float
    delta: float


def event(sample_rate: float, noise_multiplier: float, steps: int) -> dp_accounting.DpEvent:
    """The dp_accounting event of a DP-SGD run (what a reference computation composes)."""
    import dp_accounting

    return dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(sample_rate, dp_accounting.GaussianDpEvent(noise_multiplier)), steps)


@lru_cache(maxsize=1024)
def _step_rdp(sample_rate: float, noise_multiplier: float) -> tuple[float, ...]:
    import dp_accounting
    from dp_accounting.rdp import rdp_privacy_accountant

    accountant = rdp_privacy_accountant.RdpAccountant(orders())
    accountant.compose(dp_accounting.PoissonSampledDpEvent(sample_rate, dp_accounting.GaussianDpEvent(noise_multiplier)))
    return tuple(float(v) for v in accountant.rdp)


def step_rdp(sample_rate: float, noise_multiplier: float) -> np.ndarray:
    """The RDP curve (at :func:`orders`) of one step."""
    return np.array(_step_rdp(float(sample_rate), float(noise_multiplier)))


def zero() -> np.ndarray:
    return np.zeros_like(orders())


def curve(runs: Iterable[Run]) -> np.ndarray:
    """The RDP curve of all ``runs`` composed (a run of 0 steps adds nothing)."""
    total = zero()
    for run in runs:
        if run.steps > 0:
            total = total + run.steps * step_rdp(run.sample_rate, run.noise_multiplier)
    return total


def epsilon(rdp: np.ndarray, delta: float) -> float:
    """ε at ``delta`` of an RDP curve."""
    if not np.any(rdp):
        return 0.0
    from dp_accounting.rdp import rdp_privacy_accountant

    return float(rdp_privacy_accountant.compute_epsilon(orders(), rdp, delta)[0])


def run_epsilon(run: Run, delta: float) -> float:
    return epsilon(curve([run]), delta)


def max_steps(sample_rate: float, noise_multiplier: float, limits: Sequence[Limit], most: int) -> int:
    """The largest k in [0, most] such that ``epsilon(limit.base + k · step) <= limit.epsilon`` for every limit."""
    step = step_rdp(sample_rate, noise_multiplier)

    def fits(k: int) -> bool:  # an order whose RDP is infinite stays so; 0 steps add nothing (0 * inf is nan)
        return all(epsilon(limit.base + k * step if k else limit.base, limit.delta) <= limit.epsilon for limit in limits)

    if most <= 0 or not fits(0):
        return 0
    if fits(most):
        return most
    lo, hi = 0, most  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo
