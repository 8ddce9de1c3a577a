"""How every agent of the protocol waits before it connects again (hub, edge and device alike).

Full-jitter exponential back-off with a low cap: the broker coming back is what matters, not how long it was
away, so an agent is connected again within :data:`RECONNECT_CAP_S` (plus one handshake) of its broker being
back, while the jitter spreads a fleet of 1,000 devices over that window instead of the same millisecond.
"""

from __future__ import annotations

import random

RECONNECT_BASE_S = 0.25
RECONNECT_CAP_S = 3.0


def reconnect_delay(attempt: int, cap_s: float = RECONNECT_CAP_S) -> float:
    """Seconds to wait before the next connection attempt, after ``attempt`` failed ones (0 or 1: the first wait)."""
    return random.uniform(0, min(cap_s, RECONNECT_BASE_S * 2 ** min(max(attempt, 1), 16)))
