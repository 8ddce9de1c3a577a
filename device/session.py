"""The session core: what one agent's MQTT session is and does, at either tier.

DESIGN §3 says an edge node is to the hub what a device is to its edge, and so both agents keep their session to
their broker the same way, decided here once:

* :class:`SessionPlan`: who connects (the client id, the certificate's CN), its keepalive and connect timeout,
  and whether the broker keeps the session while the agent is away (a session expiry, ``clean_start`` off) or
  forgets it (expiry 0);
* :class:`Presence`: the agent's retained ``state`` topic: the last will the broker publishes when the agent
  vanishes (``offline``, reason ``will``, in an envelope made fresh for every session), ``online`` once the
  session is subscribed, and ``offline`` (reason ``shutdown``) said by the agent itself on a clean stop;
* :class:`Backoff`: how long to wait after each failed attempt (:mod:`interfaces.reconnect`: full jitter with a
  low cap, so an agent is back within seconds of its broker and a fleet does not come back in one millisecond),
  counted from the last successful connect.

Two faces run this core, because the two tiers embed differently, and both drive the same MQTT 5 client
underneath (paho-mqtt; aiomqtt is its asyncio wrapper):

* the **synchronous face** is :class:`device.agent.Device`: paho's own network thread and callbacks. A device
  agent is embedded in plain synchronous application code on a small board (``with Device(...) as d:
  d.emit(...)``); it runs no event loop of its own, which keeps it small (no asyncio, no aiomqtt) and does not
  force one on the application.
* the **asyncio face** is :class:`edge.link.Link`: aiomqtt in the edge's event loop, where one process serves two
  links, an HTTP enrolment proxy and artefact cache, the relay and its outbox concurrently.

The faces own only the mechanics of their loop (threads and callbacks, or tasks and ``await``); everything a
broker or a peer can observe of a session (its client id, will, persistence, retained state, reconnect timing)
comes from here, so it cannot drift between the tiers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from device.connection import encode
from device.heartbeat import state_body
from interfaces.messages import ConnectionState
from interfaces.reconnect import RECONNECT_CAP_S, reconnect_delay
from interfaces.topics import Topic

MAX_SESSION_EXPIRY_S = 0xFFFF_FFFF  # MQTT 5: a four-byte integer (and this value: never expires)


@dataclass(frozen=True)
class Presence:
    """One agent's retained ``state``: what the broker says when it vanishes, and what it says itself."""

    topic: Topic[Any]  # NODE_STATE or DEVICE_STATE
    agent_id: str
    ids: dict[str, str] = field(default_factory=dict)  # the topic's ids, e.g. {"node_id": ...}

    @property
    def state_topic(self) -> str:
        return self.topic.topic(**self.ids)

    @property
    def qos(self) -> int:
        return self.topic.qos

    @property
    def retain(self) -> bool:
        return self.topic.retain

    def will(self) -> bytes:
        """The last will of the next session (a fresh envelope: its own id and time)."""
        return self._state(ConnectionState.OFFLINE, "will")

    def online(self) -> bytes:
        """Published once the session is subscribed: peers may send to the agent now."""
        return self._state(ConnectionState.ONLINE)

    def farewell(self) -> bytes:
        """Published by the agent on a clean stop, before it disconnects (the will is for crashes)."""
        return self._state(ConnectionState.OFFLINE, "shutdown")

    def _state(self, state: ConnectionState, reason: str | None = None) -> bytes:
        return encode(self.topic, self.agent_id, state_body(state, reason))


@dataclass(frozen=True)
class SessionPlan:
    """How one agent connects to its broker; see the module docstring."""

    client_id: str
    keepalive_s: int = 30
    connect_timeout_s: float = 10.0
    reconnect_cap_s: float = RECONNECT_CAP_S
    session_expiry_s: int = 0  # > 0: the broker keeps the subscriptions and queues QoS 1 this long while away
    presence: Presence | None = None  # None: a session that says nothing about the agent (a second link)

    def __post_init__(self) -> None:
        if not self.client_id:
            raise ValueError("a session needs a client id")
        if not 1 <= self.keepalive_s <= 65_535:
            raise ValueError(f"keepalive {self.keepalive_s} s is outside 1..65535")
        if self.connect_timeout_s <= 0 or self.reconnect_cap_s <= 0:
            raise ValueError("the connect timeout and the reconnect cap must be positive")
        if not 0 <= self.session_expiry_s <= MAX_SESSION_EXPIRY_S:
            raise ValueError(f"session expiry {self.session_expiry_s} s is outside 0..{MAX_SESSION_EXPIRY_S}")

    @property
    def clean_start(self) -> bool:
        """A persistent session must not be discarded on reconnect; a transient one starts clean."""
        return self.session_expiry_s == 0

    def connect_properties(self) -> Properties | None:
        """The CONNECT properties (MQTT 5): the session expiry, when the session is to outlive the connection."""
        if self.session_expiry_s == 0:
            return None
        properties = Properties(PacketTypes.CONNECT)
        properties.SessionExpiryInterval = self.session_expiry_s
        return properties

    def backoff(self) -> Backoff:
        return Backoff(self.reconnect_cap_s)


class Backoff:
    """Failed attempts since the last successful connect, and the wait before the next one."""

    def __init__(self, cap_s: float = RECONNECT_CAP_S) -> None:
        self.cap_s = cap_s
        self.attempts = 0

    def failed(self) -> float:
        """Count a failed attempt (or a lost session); the seconds to wait before the next one."""
        self.attempts += 1
        return reconnect_delay(self.attempts, self.cap_s)

    def connected(self) -> None:
        self.attempts = 0


__all__ = ["MAX_SESSION_EXPIRY_S", "Backoff", "Presence", "SessionPlan"]
