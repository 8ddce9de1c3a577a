"""The sensor application the agent loads from the running slot: reads app/config.json."""

import json
from pathlib import Path

CONFIG = json.loads((Path(__file__).parent / "config.json").read_text())


def calibrate(raw: float) -> float:
    cal = CONFIG["calibration"]
    return raw * cal["scale"] + cal["offset"]


def level(value: float) -> str:
    limits = CONFIG["thresholds"]
    if value >= limits["critical"]:
        return "critical"
    return "warn" if value >= limits["warn"] else "ok"
