"""The hub's MQTT bridge: one connection to the broker with the hub's own certificate.

Consumes node and relayed device channels through shared subscriptions (so N replicas split the
load), validates every payload into the envelope models and hands them to :class:`StatusIngest` (one it
drops, malformed, oversized or from the wrong sender, is counted and answered with a ``message_rejected``
event recorded on the node it came from, DESIGN §6);
publishes retained desired documents (and keeps them published: a change made while the broker was
away goes out on reconnect); sends commands with an MQTT 5 response topic and correlation data and
waits for the answer. The hub serves REST whether or not the broker is reachable: this loop connects,
and reconnects with jittered back-off, in the background.

Acknowledged only once stored: a QoS 1 report that goes to :class:`StatusIngest` is acknowledged
(``PUBACK``) after the ingest transaction that holds it commits, not on receipt, so a hub killed
between the two loses nothing: the broker keeps the message in the hub's persistent session and
redelivers it (events are kept once by their id). Anything else is acknowledged on receipt.

It stays one module: the connection loop, its incoming queue, the routing of what arrives, the acknowledgements
after commit and the command round trips share one client and its connection generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import ssl
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiomqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from pydantic import BaseModel, ValidationError

from cloud.desired import DesiredPublisher
from cloud.ingest import DEVICE, NODE, StatusIngest
from interfaces.messages import (
    HUB_SRC,
    MAX_MESSAGE_BYTES,
    CommandBody,
    CommandResultBody,
    ConnectionState,
    Envelope,
    EventBody,
    HeartbeatBody,
    ReportedBody,
    HubStateBody,
    StateBody,
    envelope,
    rejection_event,
)
from interfaces.reconnect import RECONNECT_CAP_S, reconnect_delay
from interfaces.topics import (
    HUB_STATE,
    NODE_CMD_REPLY,
    NODE_EVENTS,
    NODE_HEARTBEAT,
    NODE_REPORTED,
    NODE_STATE,
    RELAY_CMD_REPLY,
    RELAY_EVENTS,
    RELAY_HEARTBEAT,
    RELAY_REPORTED,
    RELAY_STATE,
    Topic,
)

log = logging.getLogger("aisynergy.hub.mqtt")
REPLY_GRACE_S = 1.0
REJECTIONS_PER_MINUTE = 20
"""``message_rejected`` events recorded per node a minute at most (a node sending garbage cannot fill the database)."""
RECEIVE_MAXIMUM = 65535  # the MQTT 5 maximum
Ack = tuple[int, int, int]  # (connection generation, packet id, QoS)


def _hub_state(state: ConnectionState, reason: str | None = None, signing_key_id: str | None = None) -> str:
    return envelope(HUB_SRC, HubStateBody(state=state, reason=reason, signing_key_id=signing_key_id)).model_dump_json()


@dataclass
class _NodeRejections:
    window_start: float
    recorded: int = 0  # events recorded in this window
    suppressed: int = 0  # drops not recorded since the last event
    total: int = 0


class _Rejections:
    """Per node: how many of its messages were dropped, and a one-minute window that limits the events recorded."""

    def __init__(self, per_minute: int) -> None:
        self.per_minute = per_minute
        self._nodes: dict[str, _NodeRejections] = {}

    def admit(self, node_id: str, now: float) -> tuple[int, int | None]:
        """Count one dropped message: (the node's total, how many went unrecorded before this one), or (total, None)
        when this one is over the limit and must not be recorded."""
        entry = self._nodes.setdefault(node_id, _NodeRejections(window_start=now))
        entry.total += 1
        if now - entry.window_start >= 60.0:
            entry.window_start, entry.recorded = now, 0
        if entry.recorded >= self.per_minute:
            entry.suppressed += 1
            return entry.total, None
        entry.recorded += 1
        suppressed, entry.suppressed = entry.suppressed, 0
        return entry.total, suppressed


class BrokerUnavailable(RuntimeError):
    pass


class CommandTimeout(TimeoutError):
    pass


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


MAX_INFLIGHT = 1000  # QoS 1 publishes awaiting their PUBACK (paho's default: 20); the broker allows any number
MESSAGE_COST_BYTES = 1024  # what a queued message costs beside its payload (its objects, topic, properties)
INCOMING_QUEUE_BYTES = 192 * 1024 * 1024
"""The bound of the messages received and not yet dispatched, each counted as its payload plus
:data:`MESSAGE_COST_BYTES`: the broker's whole window of unacknowledged QoS 1 messages (:data:`RECEIVE_MAXIMUM`) fits
when they are up to 2 KiB (reports are a few hundred bytes); of the largest (256 KiB), about 760."""


class IncomingOverflow(aiomqtt.MqttError):
    """QoS 1 messages were left unacknowledged when the incoming queue was full: the broker delivers them again on
    the next connection of the persistent session."""


class IncomingQueue(asyncio.Queue):  # type: ignore[type-arg]
    """aiomqtt's incoming queue, bounded by :data:`INCOMING_QUEUE_BYTES`. Full, it drops what arrives: a QoS 0
    message (a heartbeat: the next one follows) for good, a QoS 1 message unacknowledged, so the broker keeps it
    and sends it again when the bridge connects again (:class:`IncomingOverflow`, once the queue has drained)."""

    def __init__(self, maxsize: int = 0, max_bytes: int = INCOMING_QUEUE_BYTES) -> None:
        super().__init__(maxsize)
        self.max_bytes = max_bytes
        self.bytes = 0
        self.dropped = 0  # QoS 0, gone
        self.left_unacknowledged = 0  # QoS 1, the broker's to send again

    @staticmethod
    def cost(message: aiomqtt.Message) -> int:
        payload = message.payload
        return MESSAGE_COST_BYTES + (len(payload) if isinstance(payload, bytes | bytearray) else 0)

    def put_nowait(self, item: aiomqtt.Message) -> None:
        if self.bytes >= self.max_bytes or self.full():
            if item.qos > 0:
                self.left_unacknowledged += 1
            else:
                self.dropped += 1
            return
        super().put_nowait(item)

    def _put(self, item: aiomqtt.Message) -> None:
        self.bytes += self.cost(item)
        super()._put(item)  # type: ignore[misc]

    def _get(self) -> aiomqtt.Message:
        item: aiomqtt.Message = super()._get()  # type: ignore[misc]
        self.bytes -= self.cost(item)
        return item
DRAIN_BATCH = 256  # queued messages dispatched between two passes of the event loop
SIGNING_KEY_CHECK_S = 1.0  # how often the connection looks for a rotated signing key (a stat)
OPERATION_TIMEOUT_S = 120.0  # a SUBSCRIBE's or a QoS 1 publish's answer, once connected (aiomqtt's default: 10 s)


class MqttBridge:
    def __init__(self, broker_url: str, pki_dir: Path, identity: str, ingest: StatusIngest,
                 desired: DesiredPublisher | None = None, max_backoff_s: float = RECONNECT_CAP_S,
                 session_expiry_s: int = 86_400) -> None:  # fmt: skip
        self.host, self.port, self.tls = parse_broker_url(broker_url)
        self.pki_dir = pki_dir
        self.identity = identity
        self.ingest = ingest
        self.desired = desired
        self.signing_key_id: Callable[[], str] | None = None
        """The hub's current signing key id, announced in its retained state; set by the app."""
        self.max_backoff_s = max_backoff_s
        self.session_expiry_s = session_expiry_s
        self.connected = asyncio.Event()
        self.counters: dict[str, int] = defaultdict(int)
        self._client: aiomqtt.Client | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._replies: dict[bytes, asyncio.Future[CommandResultBody]] = {}
        self._desired_wakeup = asyncio.Event()
        # topic -> (payload model, handler(ids, envelope), ingested); the ingested reports are shared across hub
        # replicas and acknowledged after the ingest commits them
        self._routes: list[tuple[Topic, type[BaseModel], Callable[[dict[str, str], Any], None], bool]] = [
            (NODE_STATE, Envelope[StateBody], lambda ids, m: ingest.offer(ids["node_id"], m.body), True),
            (NODE_HEARTBEAT, Envelope[HeartbeatBody], lambda ids, m: ingest.offer(ids["node_id"], m.body), True),
            (NODE_REPORTED, Envelope[ReportedBody], lambda ids, m: ingest.offer(ids["node_id"], m.body), True),
            (NODE_EVENTS, Envelope[EventBody], lambda ids, m: ingest.offer_node_event(ids["node_id"], m), True),
            (RELAY_STATE, Envelope[StateBody], lambda ids, m: ingest.offer(ids["device_id"], m.body, kind=DEVICE, via=ids["node_id"]), True),
            (RELAY_HEARTBEAT, Envelope[HeartbeatBody], lambda ids, m: ingest.offer(ids["device_id"], m.body, kind=DEVICE, via=ids["node_id"]), True),
            (RELAY_REPORTED, Envelope[ReportedBody], lambda ids, m: ingest.offer(ids["device_id"], m.body, kind=DEVICE, via=ids["node_id"]), True),
            (RELAY_EVENTS, Envelope[EventBody], lambda ids, m: ingest.offer_event(ids["node_id"], ids["device_id"], m), True),
            (NODE_CMD_REPLY, Envelope[CommandResultBody], self._on_reply, False),
            (RELAY_CMD_REPLY, Envelope[CommandResultBody], self._on_reply, False),
        ]
        self._correlation: bytes | None = None
        self._rejections = _Rejections(REJECTIONS_PER_MINUTE)
        self._generation = 0  # one per connection: an acknowledgement is only sent on the connection it came on
        ingest.on_persisted = self._acknowledge_from_thread

    async def run(self) -> None:
        """Connect and consume forever; returns only when cancelled."""
        self._loop = asyncio.get_running_loop()
        attempt = 0
        while True:
            try:
                ctx = tls_context(self.pki_dir, self.identity) if self.tls else None
                # A persistent session: while the hub is away the broker keeps its (shared) subscriptions
                # and queues what edges deliver, so a store-and-forward flush never lands in the void.
                connect_props = Properties(PacketTypes.CONNECT)
                connect_props.SessionExpiryInterval = self.session_expiry_s
                # reports wait for their ingest commit before their PUBACK: let the broker keep many in flight
                connect_props.ReceiveMaximum = RECEIVE_MAXIMUM
                will = aiomqtt.Will(HUB_STATE.topic(), _hub_state(ConnectionState.OFFLINE, "will"), qos=HUB_STATE.qos, retain=True)
                client = aiomqtt.Client(
                    self.host, self.port, identifier=self.identity, protocol=aiomqtt.ProtocolVersion.V5,
                    tls_context=ctx, keepalive=30, clean_start=False, properties=connect_props, will=will,
                    queue_type=IncomingQueue, socket_options=((socket.IPPROTO_TCP, socket.TCP_NODELAY, 1),),
                    max_inflight_messages=MAX_INFLIGHT,
                )  # fmt: skip
                # aiomqtt has no option for it; its paho client does (acknowledge after the ingest commit)
                client._client.manual_ack_set(True)  # noqa: SLF001
                async with client:
                    # connected: a broker busy after an outage may take long to answer; giving the session up then
                    # would make it send everything again (a dead connection is found by the keepalive)
                    client.timeout = OPERATION_TIMEOUT_S
                    self._generation += 1
                    self._client = client
                    # what the broker kept for the persistent session arrives right after CONNACK, ahead of any
                    # SUBACK: consume it now, or the subscription waits behind all of it (seconds after an outage)
                    consumer = asyncio.create_task(self._consume(client))
                    publisher = announcer = None
                    try:
                        # one SUBSCRIBE for every route: one round trip to the broker, not one per topic
                        await client.subscribe([(topic.shared_filter() if shared else topic.filter(), topic.qos)
                                                for topic, _model, _handler, shared in self._routes])  # fmt: skip
                        # subscribed: edges may now deliver what they stored (Sparkplug's primary-host STATE)
                        announced = self._signing_key_id()
                        await client.publish(HUB_STATE.topic(), _hub_state(ConnectionState.ONLINE, signing_key_id=announced), qos=HUB_STATE.qos, retain=True)
                        log.info("connected to broker %s:%d as %s", self.host, self.port, self.identity)
                        self.connected.set()
                        self.counters["connects"] += 1
                        attempt = 0
                        publisher = asyncio.create_task(self._publish_desired(client)) if self.desired else None
                        announcer = asyncio.create_task(self._announce_signing_key(client, announced))
                        await consumer
                    except asyncio.CancelledError:
                        # a clean stop: say so before leaving, as the will would for a crash
                        with contextlib.suppress(Exception):
                            await asyncio.wait_for(asyncio.shield(client.publish(
                                HUB_STATE.topic(), _hub_state(ConnectionState.OFFLINE, "shutdown"), qos=HUB_STATE.qos, retain=True)), 2)  # fmt: skip
                        raise
                    finally:
                        consumer.cancel()
                        if publisher is not None:
                            publisher.cancel()
                        if announcer is not None:
                            announcer.cancel()
            except asyncio.CancelledError:
                raise
            except IncomingOverflow as exc:
                self.counters["incoming_overflows"] += 1
                log.warning("%s; connecting again, for the broker to send them again", exc)
            except (aiomqtt.MqttError, OSError, ssl.SSLError) as exc:
                self.counters["connection_errors"] += 1
                log.warning("broker %s:%d unavailable: %s", self.host, self.port, exc)
            except Exception:  # anything else ends this connection, never the bridge: the hub must keep trying
                self.counters["connection_errors"] += 1
                self.counters["unexpected_errors"] += 1
                log.exception("broker %s:%d: unexpected error on the connection; connecting again", self.host, self.port)
            finally:
                self._client = None
                self.connected.clear()
            attempt += 1
            await asyncio.sleep(reconnect_delay(attempt, self.max_backoff_s))

    def _signing_key_id(self) -> str | None:
        try:
            return self.signing_key_id() if self.signing_key_id is not None else None
        except Exception:  # noqa: BLE001 - the announcement is a hint: the hub's state still goes out
            log.exception("cannot read the signing key's id")
            return None

    async def _announce_signing_key(self, client: aiomqtt.Client, announced: str | None) -> None:
        """After ``aisynergy hub rotate signing-key``, say so in the retained hub state within a second: edges
        learn the hand-over before a device shows them a token the new key signed."""
        while True:
            await asyncio.sleep(SIGNING_KEY_CHECK_S)
            now = await asyncio.to_thread(self._signing_key_id)
            if now != announced:
                await client.publish(HUB_STATE.topic(), _hub_state(ConnectionState.ONLINE, signing_key_id=now), qos=HUB_STATE.qos, retain=True)
                log.info("announced the signing key %s", now)
                announced = now

    async def _consume(self, client: aiomqtt.Client) -> None:
        generation = self._generation
        # aiomqtt's iterator costs a task and two passes of the event loop per message: what is queued already is
        # taken at once (a pass of the loop every DRAIN_BATCH), or a burst waits thousands of passes
        queue: IncomingQueue = client._queue  # noqa: SLF001
        counted = 0
        async for first in client.messages:
            message, taken = first, 0
            while True:
                ack = (generation, message.mid, message.qos) if message.qos > 0 else None
                self.dispatch(str(message.topic), message.payload, message.properties, ack)  # type: ignore[arg-type]
                if queue.empty():
                    if queue.dropped != counted:
                        log.warning("incoming queue full (%d bytes): %d QoS 0 messages dropped", queue.max_bytes, queue.dropped - counted)
                        self.counters["incoming_dropped"] += queue.dropped - counted
                        counted = queue.dropped
                    if queue.left_unacknowledged:
                        self.counters["incoming_left_unacknowledged"] += queue.left_unacknowledged
                        raise IncomingOverflow(f"incoming queue full ({queue.max_bytes} bytes): {queue.left_unacknowledged} "
                                               "QoS 1 messages left unacknowledged")  # fmt: skip
                    break
                message = queue.get_nowait()
                taken += 1
                if taken % DRAIN_BATCH == 0:
                    await asyncio.sleep(0)

    async def _publish_desired(self, client: aiomqtt.Client) -> None:
        """Publish every desired document the broker does not hold yet; wake on changes, or every 5 s."""
        assert self.desired is not None
        while True:
            try:
                batch = await asyncio.to_thread(self.desired.pending)
                # all in flight at once (paho hands them to the socket in order; a rollout's 1,000 documents
                # then cost one round trip, not 1,000); a batch is marked only once the broker holds all of it
                results = await asyncio.gather(
                    *(client.publish(item.topic, item.payload, qos=1, retain=True) for item in batch), return_exceptions=True
                )
                failure = next((r for r in results if isinstance(r, BaseException)), None)
                self.counters["desired_published"] += sum(1 for r in results if not isinstance(r, BaseException))
                if failure is not None:
                    raise failure
                if batch:
                    await asyncio.to_thread(self.desired.mark_published, batch)
                    continue
            except aiomqtt.MqttError:
                return  # the connection is gone; the next one publishes what is left
            except Exception:  # noqa: BLE001 - a bad tick (database busy) must not stop publishing
                log.exception("publishing desired documents failed; retrying")
            self._desired_wakeup.clear()
            try:
                await asyncio.wait_for(self._desired_wakeup.wait(), timeout=5)
            except TimeoutError:
                pass

    def poke_desired(self) -> None:
        """A desired document changed: publish it now (thread-safe)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._desired_wakeup.set)

    def dispatch(self, topic: str, payload: bytes, properties: Properties | None = None, ack: Ack | None = None) -> None:
        """Validate one message and route it; anything malformed is dropped and counted.

        ``ack`` (QoS 1 messages from the broker) is sent at once, or, for a report the ingest stores,
        after the transaction that stores it commits.
        """
        persisted = self._route(topic, payload, properties)
        if ack is None:
            return
        if persisted:
            self.ingest.hold_ack(ack)
        else:
            self._acknowledge([ack])

    def _route(self, topic: str, payload: bytes, properties: Properties | None) -> bool:
        """True when the message went to the ingest (its acknowledgement waits for the commit)."""
        self.counters["messages_received"] += 1
        if not isinstance(payload, bytes | bytearray):
            self.counters["dropped_invalid"] += 1
            return False
        for pattern, model, handler, ingested in self._routes:
            ids = pattern.parse(topic)
            if ids is None:
                continue
            if not payload:  # a cleared retained message
                return False
            if len(payload) > MAX_MESSAGE_BYTES:
                self.counters["dropped_invalid"] += 1
                self._reject(ids, topic, f"{len(payload)} bytes exceed the {MAX_MESSAGE_BYTES} byte limit")
                return False
            try:
                message = model.model_validate_json(payload)
            except ValidationError as exc:
                self.counters["dropped_invalid"] += 1
                self._reject(ids, topic, exc)
                return False
            # on relayed topics the sender is the device, or its edge answering for it (unknown device, timeout)
            senders = {ids["node_id"], ids.get("device_id", ids["node_id"])}
            if message.src not in senders:  # type: ignore[attr-defined]
                self.counters["dropped_src_mismatch"] += 1
                self._reject(ids, topic, f"src {message.src!r} is not a sender of this topic (expected one of {sorted(senders)})")  # type: ignore[attr-defined]
                return False
            self._correlation = getattr(properties, "CorrelationData", None)
            handler(ids, message)
            return ingested
        self.counters["dropped_unknown_topic"] += 1
        return False

    def _reject(self, ids: dict[str, str], topic: str, reason: ValidationError | str) -> None:
        """A message from a node was dropped: record a ``message_rejected`` event on that node (DESIGN §6), at most
        :data:`REJECTIONS_PER_MINUTE` a minute per node; those over the limit are counted in the next one."""
        node_id = ids["node_id"]
        total, suppressed = self._rejections.admit(node_id, time.monotonic())
        why = f"{reason.error_count()} validation errors" if isinstance(reason, ValidationError) else reason
        if suppressed is None:  # a flood: counted, not logged or recorded one by one
            self.counters["rejections_suppressed"] += 1
            log.debug("dropped a message on %s: %s", topic, why)
            return
        log.warning("dropped a message on %s: %s", topic, why)
        data: dict[str, Any] = {"device_id": ids["device_id"]} if "device_id" in ids else {}
        if suppressed:
            data["suppressed"] = suppressed
        self.ingest.offer_node_event(node_id, envelope(HUB_SRC, rejection_event(topic, reason, total, **data)))
        self.counters["rejections_recorded"] += 1

    def _acknowledge_from_thread(self, acks: list[Ack]) -> None:
        """The ingest committed these messages (called from its worker thread)."""
        loop = self._loop
        if loop is not None and acks:
            loop.call_soon_threadsafe(self._acknowledge, acks)

    def _acknowledge(self, acks: list[Ack]) -> None:
        client = self._client
        for generation, mid, qos in acks:
            if client is None or generation != self._generation:
                # the connection it came on is gone: the broker redelivers it, and that copy is acknowledged
                self.counters["acks_dropped_reconnected"] += 1
                continue
            client._client.ack(mid, qos)  # noqa: SLF001
            self.counters["acks_sent"] += 1

    def _on_reply(self, _ids: dict[str, str], message: Envelope[CommandResultBody]) -> None:
        future = self._replies.get(self._correlation or b"")
        if future is None or future.done():
            self.counters["replies_unmatched"] += 1  # for another replica, or too late
            return
        future.set_result(message.body)

    async def request(self, topic: str, reply_topic: str, body: CommandBody) -> CommandResultBody:
        """Send a command and wait for its answer: ``timeout_s``, plus a grace period so that an edge that
        reports its device's timeout (at ``timeout_s``) is heard rather than raced."""
        client = self._client
        if client is None:
            raise BrokerUnavailable("the hub is not connected to the broker")
        correlation = uuid.uuid4().bytes
        future: asyncio.Future[CommandResultBody] = asyncio.get_running_loop().create_future()
        self._replies[correlation] = future
        props = Properties(PacketTypes.PUBLISH)
        props.ResponseTopic = reply_topic
        props.CorrelationData = correlation
        props.MessageExpiryInterval = max(1, math.ceil(body.timeout_s))  # an agent away longer never runs it late
        try:
            await client.publish(topic, envelope(HUB_SRC, body).model_dump_json(), qos=1, properties=props)
            self.counters["commands_sent"] += 1
            return await asyncio.wait_for(future, body.timeout_s + REPLY_GRACE_S)
        except TimeoutError as exc:
            self.counters["commands_timed_out"] += 1
            raise CommandTimeout(f"no answer within {body.timeout_s:g} s") from exc
        finally:
            self._replies.pop(correlation, None)

    def call(self, coro: Any, timeout: float) -> Any:
        """Run a bridge coroutine from a worker thread (the REST routes) and wait for its result."""
        loop = self._loop
        if loop is None or not self.connected.is_set():
            coro.close()
            raise BrokerUnavailable("the hub is not connected to the broker")
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    def forget_node(self, node_id: str) -> None:
        """Clear the retained state of a deleted node (thread-safe; no-op while disconnected)."""
        client, loop = self._client, self._loop
        if client is None or loop is None:
            return
        topic = NODE_STATE.topic(node_id=node_id)
        asyncio.run_coroutine_threadsafe(client.publish(topic, b"", qos=NODE_STATE.qos, retain=True), loop)


__all__ = ["NODE", "DEVICE", "MqttBridge", "BrokerUnavailable", "CommandTimeout"]
