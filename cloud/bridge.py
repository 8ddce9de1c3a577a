"""The hub's MQTT bridge: one connection to the broker with the hub's own certificate.

Consumes node ``state`` and ``heartbeat`` through shared subscriptions (so N replicas split the load),
validates every payload into the envelope models, and hands them to :class:`StatusIngest`. The hub
serves REST whether or not the broker is reachable: this loop connects, and reconnects with jittered
back-off, in the background.
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
from collections import defaultdict
from pathlib import Path
from urllib.parse import urlsplit

import aiomqtt
from pydantic import ValidationError

from cloud.ingest import StatusIngest
from interfaces.messages import MAX_MESSAGE_BYTES, Envelope, HeartbeatBody, StateBody
from interfaces.topics import NODE_HEARTBEAT, NODE_STATE

log = logging.getLogger("aisynergy.hub.mqtt")

_STATE = Envelope[StateBody]
_HEARTBEAT = Envelope[HeartbeatBody]


def parse_broker_url(url: str) -> tuple[str, int, bool]:
    parts = urlsplit(url)
    if parts.scheme not in ("mqtt", "mqtts"):
        raise ValueError(f"broker URL must be mqtt:// or mqtts://, not {url!r}")
    tls = parts.scheme == "mqtts"
    return parts.hostname or "127.0.0.1", parts.port or (8883 if tls else 1883), tls


def tls_context(pki_dir: Path, identity: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(pki_dir / "ca.crt"))
    ctx.load_cert_chain(str(pki_dir / f"{identity}.crt"), str(pki_dir / f"{identity}.key"))
    return ctx


class MqttBridge:
    def __init__(self, broker_url: str, pki_dir: Path, identity: str, ingest: StatusIngest, max_backoff_s: float = 30.0) -> None:
        self.host, self.port, self.tls = parse_broker_url(broker_url)
        self.pki_dir = pki_dir
        self.identity = identity
        self.ingest = ingest
        self.max_backoff_s = max_backoff_s
        self.connected = asyncio.Event()
        self.counters: dict[str, int] = defaultdict(int)
        self._client: aiomqtt.Client | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def run(self) -> None:
        """Connect and consume forever; returns only when cancelled."""
        self._loop = asyncio.get_running_loop()
        attempt = 0
        while True:
            try:
                ctx = tls_context(self.pki_dir, self.identity) if self.tls else None
                async with aiomqtt.Client(
                    self.host, self.port, identifier=self.identity, protocol=aiomqtt.ProtocolVersion.V5,
                    tls_context=ctx, keepalive=30, clean_start=True, max_queued_incoming_messages=200_000,
                ) as client:  # fmt: skip
                    self._client = client
                    await client.subscribe(NODE_STATE.shared_filter(), qos=NODE_STATE.qos)
                    await client.subscribe(NODE_HEARTBEAT.shared_filter(), qos=NODE_HEARTBEAT.qos)
                    log.info("connected to broker %s:%d as %s", self.host, self.port, self.identity)
                    self.connected.set()
                    self.counters["connects"] += 1
                    attempt = 0
                    async for message in client.messages:
                        self.dispatch(str(message.topic), message.payload)  # type: ignore[arg-type]
            except asyncio.CancelledError:
                raise
            except (aiomqtt.MqttError, OSError, ssl.SSLError) as exc:
                self.counters["connection_errors"] += 1
                log.warning("broker %s:%d unavailable: %s", self.host, self.port, exc)
            finally:
                self._client = None
                self.connected.clear()
            attempt += 1
            await asyncio.sleep(random.uniform(0, min(self.max_backoff_s, 1.5 ** min(10, attempt))))

    def dispatch(self, topic: str, payload: bytes) -> None:
        """Validate one message and queue it; anything malformed is dropped and counted."""
        self.counters["messages_received"] += 1
        if not isinstance(payload, bytes | bytearray) or len(payload) > MAX_MESSAGE_BYTES:
            self.counters["dropped_invalid"] += 1
            return
        for pattern, model in ((NODE_HEARTBEAT, _HEARTBEAT), (NODE_STATE, _STATE)):
            ids = pattern.parse(topic)
            if ids is None:
                continue
            if not payload:  # a cleared retained message
                return
            try:
                envelope = model.model_validate_json(payload)
            except ValidationError as exc:
                self.counters["dropped_invalid"] += 1
                log.debug("dropping invalid message on %s: %s", topic, exc)
                return
            if envelope.src != ids["node_id"]:
                self.counters["dropped_src_mismatch"] += 1
                return
            self.ingest.offer(ids["node_id"], envelope.body)
            return
        self.counters["dropped_unknown_topic"] += 1

    def forget_node(self, node_id: str) -> None:
        """Clear the retained state of a deleted node (thread-safe; no-op while disconnected)."""
        client, loop = self._client, self._loop
        if client is None or loop is None:
            return
        topic = NODE_STATE.topic(node_id=node_id)
        asyncio.run_coroutine_threadsafe(client.publish(topic, b"", qos=NODE_STATE.qos, retain=True), loop)
