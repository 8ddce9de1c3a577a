"""What the simulations share: their errors, the aggregation strategy by name, the machine the times ran on."""

from __future__ import annotations

import os
import platform
from typing import Any

import numpy as np

from interfaces.aggregation import STRATEGIES, Strategy, strategy_from_spec

TRAIN_EXTRA = "train"
STRATEGY_NAMES = tuple(STRATEGIES)


class SimulationError(ValueError):
    """A configuration the simulation cannot run (the CLI turns it into a usage error)."""


class MissingExtra(RuntimeError):
    """A dependency of an optional extra is not installed."""


def build_strategy(name: str, params: dict[str, Any] | None) -> Strategy:
    try:
        return strategy_from_spec(name, **(params or {}))
    except ValueError as exc:
        raise SimulationError(str(exc)) from None


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
