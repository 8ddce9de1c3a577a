"""The device SDK: ``from device import Device`` (see :mod:`device.agent`)."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    # Lazy, so that importing a small helper such as device.files does not load paho-mqtt.
    if name in ("Device", "DeviceStats"):
        from device import agent

        return getattr(agent, name)
    raise AttributeError(f"module 'device' has no attribute {name!r}")
