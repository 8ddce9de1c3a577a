"""The wrong-typed heartbeats of the strict-wire tests (a number as a string, a boolean for a number, ``Infinity``),
byte for byte as a misbehaving agent puts them on the wire, at either tier."""

from __future__ import annotations

import json

from interfaces.messages import HeartbeatBody, envelope
from interfaces.resources import CpuReading, DiskReading, MemoryReading, NetworkReading, Resources

GOOD = Resources(
    cpu=CpuReading(cores=4, utilisation=0.25), memory=MemoryReading(total_bytes=8 << 30, available_bytes=4 << 30),
    disk=DiskReading(path="/", total_bytes=100 << 30, free_bytes=50 << 30), network=NetworkReading(bytes_sent=1, bytes_received=2),
)  # fmt: skip
WRONG = [
    (("body", "seq"), '"13"', "body.seq"),
    (("body", "resources", "cpu", "cores"), '"114"', "body.resources.cpu.cores"),
    (("body", "seq"), "true", "body.seq"),
    (("body", "uptime_s"), "Infinity", "body.uptime_s"),
]
"""(where, the bytes put there, the field a refusal names)."""


def good_heartbeat(src: str, seq: int, uptime_s: float) -> bytes:
    return envelope(src, HeartbeatBody(seq=seq, agent_version="good", uptime_s=uptime_s, resources=GOOD)).model_dump_json().encode()


def wrong_heartbeat(src: str, path: tuple[str, ...], raw_value: str) -> bytes:
    """A heartbeat (other readings than :data:`GOOD`) whose value at ``path`` is ``raw_value``, byte for byte."""
    readings = GOOD.model_copy(update={"cpu": CpuReading(cores=114, utilisation=0.99)})
    doc = json.loads(envelope(src, HeartbeatBody(seq=14, agent_version="wrong", uptime_s=99.0, resources=readings)).model_dump_json())
    cursor = doc
    for key in path[:-1]:
        cursor = cursor[key]
    cursor[path[-1]] = "__WRONG__"
    return json.dumps(doc).replace('"__WRONG__"', raw_value).encode()
