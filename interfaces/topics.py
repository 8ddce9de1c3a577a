"""THE MQTT topic table (DESIGN §4.4). Nobody builds a topic string anywhere else.

The same channels exist at both tiers: hub <-> edge under ``synergy/v1/nodes/{node_id}/`` and
edge <-> device under ``synergy/v1/devices/{device_id}/``. Each identity may publish and subscribe only
under its own subtree (broker ACL, :func:`own_subtree`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Generic, TypeVar

from pydantic import BaseModel

from interfaces.infer import InferReply, InferRequest
from interfaces.messages import (
    CommandBody,
    CommandResultBody,
    DesiredBody,
    Envelope,
    EventBody,
    EventsAckBody,
    FlUpdateBody,
    HeartbeatBody,
    ReportedBody,
    HubStateBody,
    StateBody,
)

PREFIX = "synergy/v1"
SHARE_GROUP = "hub"

P = TypeVar("P", bound=BaseModel)


class Direction(StrEnum):
    HUB_TO_EDGE = "hub->edge"
    EDGE_TO_HUB = "edge->hub"
    EDGE_TO_DEVICE = "edge->device"
    DEVICE_TO_EDGE = "device->edge"


class Tier(StrEnum):
    NODE = "nodes"
    DEVICE = "devices"


class Channel(StrEnum):
    STATE = "state"
    HEARTBEAT = "heartbeat"
    DESIRED = "desired"
    REPORTED = "reported"
    CMD = "cmd"
    CMD_REPLY = "cmd/reply"
    EVENTS = "events"
    EVENTS_ACK = "events/ack"
    INFER = "infer"
    INFER_REPLY = "infer/reply"
    FL = "fl"


_PLACEHOLDER = re.compile(r"\{([a-z_]+)\}")
_ID_SEGMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True)
class Topic(Generic[P]):
    pattern: str
    payload: type[P]
    direction: Direction
    qos: int = 1
    retain: bool = False
    description: str = ""
    binary: bool = False
    """the payload is raw bytes (a safetensors frame) described by MQTT 5 user properties; ``payload`` is the
    model of those properties, not of the bytes"""
    _regex: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        regex = "^" + _PLACEHOLDER.sub(lambda m: f"(?P<{m.group(1)}>[^/+#]+)", re.escape(self.pattern).replace(r"\{", "{").replace(r"\}", "}")) + "$"
        object.__setattr__(self, "_regex", re.compile(regex))

    @property
    def placeholders(self) -> list[str]:
        return _PLACEHOLDER.findall(self.pattern)

    def topic(self, **ids: str) -> str:
        """The concrete topic for these ids; each id must be one safe topic level."""
        missing = set(self.placeholders) - set(ids)
        if missing:
            raise ValueError(f"missing ids for {self.pattern}: {sorted(missing)}")
        for name, value in ids.items():
            if not _ID_SEGMENT.match(value):
                raise ValueError(f"{name}={value!r} is not a valid topic level")
        return self.pattern.format(**ids)

    def filter(self, **fixed: str) -> str:
        """The subscription filter: ids given are fixed, the others match anything (``{x}`` -> ``+``)."""
        for name, value in fixed.items():
            if name not in self.placeholders or not _ID_SEGMENT.match(value):
                raise ValueError(f"{name}={value!r} is not a valid id for {self.pattern}")
        return _PLACEHOLDER.sub(lambda m: fixed.get(m.group(1), "+"), self.pattern)

    def shared_filter(self, group: str = SHARE_GROUP, **fixed: str) -> str:
        """A shared subscription so that N hub replicas each get a share of the messages."""
        return f"$share/{group}/{self.filter(**fixed)}"

    def parse(self, topic: str) -> dict[str, str] | None:
        """The ids in a concrete topic, or ``None`` if it is not one of this pattern's."""
        match = self._regex.match(topic)
        return match.groupdict() if match else None


def _pair(channel: Channel, body: type[BaseModel], up: bool, qos: int, retain: bool, what: str) -> tuple[Topic[Any], Topic[Any]]:
    node = Topic(
        f"{PREFIX}/{Tier.NODE}/{{node_id}}/{channel}",
        Envelope[body],  # type: ignore[valid-type]
        Direction.EDGE_TO_HUB if up else Direction.HUB_TO_EDGE,
        qos,
        retain,
        what,
    )
    device = Topic(
        f"{PREFIX}/{Tier.DEVICE}/{{device_id}}/{channel}",
        Envelope[body],  # type: ignore[valid-type]
        Direction.DEVICE_TO_EDGE if up else Direction.EDGE_TO_DEVICE,
        qos,
        retain,
        what,
    )
    return node, device


NODE_STATE, DEVICE_STATE = _pair(Channel.STATE, StateBody, True, 1, True, "retained online/offline; offline is the last will")
NODE_HEARTBEAT, DEVICE_HEARTBEAT = _pair(Channel.HEARTBEAT, HeartbeatBody, True, 0, False, "periodic liveness with resource readings")
NODE_DESIRED, DEVICE_DESIRED = _pair(Channel.DESIRED, DesiredBody, False, 1, True, "retained, versioned desired-state document")
NODE_REPORTED, DEVICE_REPORTED = _pair(Channel.REPORTED, ReportedBody, True, 1, False, "state the agent converged to")
NODE_CMD, DEVICE_CMD = _pair(Channel.CMD, CommandBody, False, 1, False, "requests, with MQTT 5 response topic and correlation data")
NODE_CMD_REPLY, DEVICE_CMD_REPLY = _pair(Channel.CMD_REPLY, CommandResultBody, True, 1, False, "answers to cmd (the response topic)")
NODE_EVENTS, DEVICE_EVENTS = _pair(Channel.EVENTS, EventBody, True, 1, False, "task progress, logs, metrics, errors")

DEVICE_EVENTS_ACK = Topic(
    f"{PREFIX}/{Tier.DEVICE}/{{device_id}}/{Channel.EVENTS_ACK}",
    Envelope[EventsAckBody],
    Direction.EDGE_TO_DEVICE,
    1,
    False,
    "the edge's cumulative acknowledgement of a device's events, after its own commit; the device keeps each event until then",
)

DEVICE_INFER = Topic(
    f"{PREFIX}/{Tier.DEVICE}/{{device_id}}/{Channel.INFER}",
    InferRequest,
    Direction.DEVICE_TO_EDGE,
    0,
    False,
    "split inference: the activation at the cut (safetensors), for the edge's tail; response topic + correlation data",
    binary=True,
)
DEVICE_INFER_REPLY = Topic(
    f"{PREFIX}/{Tier.DEVICE}/{{device_id}}/{Channel.INFER_REPLY}",
    InferReply,
    Direction.EDGE_TO_DEVICE,
    0,
    False,
    "split inference: the tail's outputs (safetensors) or an error, with the request's correlation data",
    binary=True,
)

DEVICE_FL = Topic(
    f"{PREFIX}/{Tier.DEVICE}/{{device_id}}/{Channel.FL}",
    Envelope[FlUpdateBody],
    Direction.DEVICE_TO_EDGE,
    1,
    False,
    "federated training, hierarchical: a device's trained layer for its edge's aggregator (the round's global layer comes by reference, in desired)",
)


def _relay(channel: Channel, body: type[BaseModel], up: bool, qos: int, retain: bool, what: str) -> Topic[Any]:
    """A device's channel relayed by its edge under the edge's own subtree (so the edge's ACL suffices)."""
    return Topic(
        f"{PREFIX}/{Tier.NODE}/{{node_id}}/{Tier.DEVICE}/{{device_id}}/{channel}",
        Envelope[body],  # type: ignore[valid-type]
        Direction.EDGE_TO_HUB if up else Direction.HUB_TO_EDGE,
        qos,
        retain,
        what,
    )


RELAY_STATE = _relay(Channel.STATE, StateBody, True, 1, True, "a device's state, relayed by its edge")
RELAY_HEARTBEAT = _relay(Channel.HEARTBEAT, HeartbeatBody, True, 0, False, "a device's heartbeat, relayed by its edge")
RELAY_DESIRED = _relay(Channel.DESIRED, DesiredBody, False, 1, True, "a device's desired document; the edge republishes it downstream")
RELAY_REPORTED = _relay(Channel.REPORTED, ReportedBody, True, 1, False, "a device's report, relayed by its edge")
RELAY_CMD = _relay(Channel.CMD, CommandBody, False, 1, False, "a command for a device; the edge forwards it and relays the answer")
RELAY_CMD_REPLY = _relay(Channel.CMD_REPLY, CommandResultBody, True, 1, False, "a device's answer to a command, relayed by its edge")
RELAY_EVENTS = _relay(Channel.EVENTS, EventBody, True, 1, False, "a device's events (store-and-forward: in order, exactly once)")

HUB_STATE = Topic(
    f"{PREFIX}/hub/state",
    Envelope[HubStateBody],
    Direction.HUB_TO_EDGE,
    1,
    True,
    "retained online/offline of the hub (offline is its last will); edges deliver stored reports only while it is online",
)

TOPICS: tuple[Topic[Any], ...] = (
    HUB_STATE,
    NODE_STATE, NODE_HEARTBEAT, NODE_DESIRED, NODE_REPORTED, NODE_CMD, NODE_CMD_REPLY, NODE_EVENTS,
    DEVICE_STATE, DEVICE_HEARTBEAT, DEVICE_DESIRED, DEVICE_REPORTED, DEVICE_CMD, DEVICE_CMD_REPLY, DEVICE_EVENTS, DEVICE_EVENTS_ACK,
    DEVICE_INFER, DEVICE_INFER_REPLY, DEVICE_FL,
    RELAY_STATE, RELAY_HEARTBEAT, RELAY_DESIRED, RELAY_REPORTED, RELAY_CMD, RELAY_CMD_REPLY, RELAY_EVENTS,
)  # fmt: skip


def own_subtree(tier: Tier, identity: str) -> str:
    """The only subtree an identity's certificate may publish and subscribe in."""
    return f"{PREFIX}/{tier}/{identity}/#"


def acl_pattern(tier: Tier) -> str:
    """Mosquitto ACL ``pattern`` line body for a tier (``%u`` = certificate CN)."""
    return f"{PREFIX}/{tier}/%u/#"


def topic_table_markdown() -> str:
    """The topic table as committed in ``interfaces/TOPICS.md``."""
    lines = [
        "# MQTT topic table",
        "",
        "Generated from `interfaces/topics.py`; do not edit by hand (`aisynergy contracts write`).",
        "",
        "| pattern | payload | direction | QoS | retain | what |",
        "|---|---|---|---|---|---|",
    ]
    for t in TOPICS:
        if t.binary:
            payload = f"safetensors bytes; user properties `{t.payload.__name__}`"
        else:
            payload = f"`Envelope[{t.payload.model_fields['body'].annotation.__name__}]`"
        lines.append(f"| `{t.pattern}` | {payload} | {t.direction} | {t.qos} | {'yes' if t.retain else 'no'} | {t.description} |")
    lines += [
        "",
        "Access: an identity whose certificate CN is `X` may publish and subscribe only under",
        f"`{PREFIX}/nodes/X/#` (edge nodes) or `{PREFIX}/devices/X/#` (devices). The hub subscribes through",
        f"shared subscriptions (`$share/{SHARE_GROUP}/...`) so that several replicas split the load.",
        "",
    ]
    return "\n".join(lines)
