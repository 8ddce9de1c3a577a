"""One mutual-TLS MQTT 5 session, kept up forever with jittered back-off, that routes what it receives.

The edge has one link to the hub's broker (upstream) and one to its devices' broker (downstream); when
both are the same broker it has ONE link serving both roles, because the broker takes the certificate's
CN as the client id and a second connection with the same certificate would take the first one over.

A link is the asyncio face of the agents' session core (:mod:`device.session`; the device's
:class:`~device.agent.Device` is the synchronous one): its :class:`~device.session.SessionPlan` says who
connects, whether the broker keeps the session, the node's will, ``online`` and ``offline`` states and the
reconnect timing; the link runs it on aiomqtt.

Services plug into a link: :meth:`Link.route` a topic to a handler, :meth:`Link.during_session` a loop
that runs while connected, :meth:`Link.before_disconnect` what to say on a clean stop. Handlers run one
at a time in arrival order, so per-sender order is kept; a handler must not wait long.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiomqtt
from aiomqtt.exceptions import MqttConnectError
from paho.mqtt.properties import Properties

from device.connection import PahoLog, log_retry, parse_mqtt_url
from device.session import SessionPlan
from interfaces.topics import Topic

# Small request/response packets must not wait for the peer's delayed ACK (~40 ms per hop on Linux).
# QoS 1 publishes awaiting their PUBACK at once (paho's default: 20): the outbox's window and a rollout's burst of
# desired documents then cost a round trip or two, not one per 20 messages
MAX_INFLIGHT = 1000
DRAIN_BATCH = 256  # queued messages handled between two passes of the event loop
PENDING_CALLS_WARNING = 10_000  # aiomqtt warns above this many publishes awaiting their PUBACK
# How long a subscription or a QoS 1 publish may wait for the broker's answer once connected. Not the connect
# timeout: a broker that has just come back, busy with a fleet's handshakes and this session's queued messages,
# can take longer than that to answer, and giving the session up then makes it send everything again (a livelock
# under load). A dead connection is found by the keepalive, and ends the session's loops at once.
OPERATION_TIMEOUT_S = 120.0
NO_DELAY = ((socket.IPPROTO_TCP, socket.TCP_NODELAY, 1),)
log = logging.getLogger("aisynergy.edge")

Handler = Callable[[aiomqtt.Client, aiomqtt.Message, dict[str, str]], Awaitable[None]]
SessionTask = Callable[[aiomqtt.Client], Awaitable[None]]


class NotConnected(aiomqtt.MqttError):
    """The link has no session right now."""


@dataclass(frozen=True)
class _Route:
    topic: Topic[Any]
    fixed: dict[str, str]
    handler: Handler


class Link:
    """Keeps one MQTT session to ``url`` up until the stop event is set; see the module docstring."""

    def __init__(self, name: str, url: str, tls: ssl.SSLContext, plan: SessionPlan) -> None:
        self.name = name
        self.host, self.port = parse_mqtt_url(url)
        self.plan = plan
        self.client_id = plan.client_id
        self.client: aiomqtt.Client | None = None
        self.connected = asyncio.Event()
        self._publishers: set[asyncio.Task[Any]] = set()  # waiting in publish() for a PUBACK
        self._cut_off: set[asyncio.Task[Any]] = set()  # ... whose wait the end of the session cancelled
        self._tls = tls
        self._routes: list[_Route] = []
        self._tasks: list[SessionTask] = []
        self._farewells: list[SessionTask] = []
        self._mqtt_log = logging.getLogger(f"aisynergy.edge.mqtt.{name}")
        # paho's last error line: a TLS alert during connect (revoked or unknown certificate) is only logged by
        # paho, while aiomqtt just reports a timeout waiting for CONNACK
        self._transport_error = PahoLog()

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    # ---- what services plug in ----------------------------------------------------------------------
    def route(self, topic: Topic[Any], handler: Handler, **fixed: str) -> None:
        """Subscribe to ``topic.filter(**fixed)`` on every connect and hand its messages to ``handler``
        (with the client they came on and the ids in their topic)."""
        topic.filter(**fixed)  # validates the fixed ids now rather than at connect time
        self._routes.append(_Route(topic, fixed, handler))

    def during_session(self, task: SessionTask) -> None:
        """Run ``task(client)`` after each connect until the session ends (it may also return early)."""
        self._tasks.append(task)

    def before_disconnect(self, task: SessionTask) -> None:
        """Run ``task(client)`` on a clean stop, before disconnecting."""
        self._farewells.append(task)

    async def publish(
        self, topic: str, payload: bytes, *, qos: int, retain: bool = False, properties: Properties | None = None
    ) -> None:
        """Publish on the current session (QoS 1: return after the PUBACK); :class:`NotConnected` if none."""
        client = self.client
        if client is None:
            raise NotConnected(f"the {self.name} link is down")
        if qos == 0:  # nothing to wait for
            await client.publish(topic, payload, qos=qos, retain=retain, properties=properties)
            return
        # awaited inline (paho has the message at once); the PUBACK of a session that ends never comes, so the
        # session's end cancels the wait and it answers NotConnected (see _session)
        me = asyncio.current_task()
        assert me is not None
        self._publishers.add(me)
        try:
            await client.publish(topic, payload, qos=qos, retain=retain, properties=properties)
        except asyncio.CancelledError:
            if me not in self._cut_off:
                raise  # the caller's own cancellation
            self._cut_off.discard(me)
            me.uncancel()
            raise NotConnected(f"the {self.name} link went down before the broker acknowledged {topic}") from None
        finally:
            self._publishers.discard(me)

    def publish_nowait(self, topic: str, payload: bytes, *, qos: int = 0, retain: bool = False) -> bool:
        """Hand a message to the current session without waiting for it to leave or for its PUBACK (a message
        handler's relay of a heartbeat: awaiting each one cost the link's message loop a pass of the event loop,
        2.4 ms a message, and a fleet's heartbeats held every other message up; the devices' acknowledgements,
        which a newer one replaces). paho sends it, and resends a QoS 1 one on this session until the broker has
        it. ``False`` when not connected."""
        client = self.client
        if client is None:
            return False
        info = client._client.publish(topic, payload, qos=qos, retain=retain)  # noqa: SLF001  # paho: queues, never blocks
        return info.rc == 0

    # ---- the connection -----------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Connect, serve, and reconnect with jittered back-off until ``stop`` is set."""
        self._mqtt_log.addFilter(self._transport_error)
        try:
            await self._run(stop)
        finally:
            self._mqtt_log.removeFilter(self._transport_error)

    async def _run(self, stop: asyncio.Event) -> None:
        backoff = self.plan.backoff()
        while not stop.is_set():
            self._transport_error.take()
            log.info(
                "%s: connecting to mqtts://%s:%s as %s (attempt %s)",
                self.name,
                self.host,
                self.port,
                self.client_id,
                backoff.attempts + 1,
            )
            try:
                async with contextlib.AsyncExitStack() as stack:
                    client = await self._connect(stack, stop)
                    if client is None:
                        log.info("%s: stopped while connecting", self.name)
                        return
                    log.info("%s: connected to %s:%s", self.name, self.host, self.port)
                    backoff.connected()
                    await self._session(client, stop)
                    for farewell in self._farewells:
                        await farewell(client)
                    if (presence := self.plan.presence) is not None:
                        await client.publish(presence.state_topic, presence.farewell(), qos=presence.qos, retain=presence.retain)
                        log.info("%s: published offline (shutdown)", self.name)
                    log.info("%s: disconnecting", self.name)
                    return
            except aiomqtt.MqttError as exc:
                delay = backoff.failed()
                self._log_failure(exc, delay)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), delay)

    async def _connect(self, stack: contextlib.AsyncExitStack, stop: asyncio.Event) -> aiomqtt.Client | None:
        """Enter a fresh client's context on ``stack``; ``None`` when stopped before the broker answered."""
        connecting = asyncio.create_task(stack.enter_async_context(self._client()))
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait((connecting, stopping), return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if not connecting.done():
            connecting.cancel()
            return None
        client = connecting.result()
        client.timeout = OPERATION_TIMEOUT_S  # connected: from now on, see OPERATION_TIMEOUT_S
        return client

    def _client(self) -> aiomqtt.Client:
        plan, presence = self.plan, self.plan.presence
        will = None
        if presence is not None:  # made for each session: a fresh envelope
            will = aiomqtt.Will(presence.state_topic, presence.will(), presence.qos, presence.retain)
        client = aiomqtt.Client(
            self.host,
            self.port,
            identifier=self.client_id,
            protocol=aiomqtt.ProtocolVersion.V5,
            tls_context=self._tls,
            will=will,
            keepalive=plan.keepalive_s,
            timeout=plan.connect_timeout_s,
            clean_start=plan.clean_start,
            properties=plan.connect_properties(),
            logger=self._mqtt_log,
            socket_options=NO_DELAY,
            max_inflight_messages=MAX_INFLIGHT,
        )
        # the outbox sends a window of QoS 1 messages at once by design: no warning per message in flight
        client.pending_calls_threshold = PENDING_CALLS_WARNING
        # paho's own limit for the TCP connect and the TLS handshake (5 s): the plan's, as the device has it
        client._client.connect_timeout = plan.connect_timeout_s  # noqa: SLF001
        return client

    def _log_failure(self, exc: aiomqtt.MqttError, delay: float) -> None:
        log_retry(
            log,
            f"{self.host}:{self.port}",
            str(exc) or type(exc).__name__,
            delay,
            detail=self._transport_error.take(),  # the real cause, where aiomqtt only saw a timeout
            exc=exc,
            refused=self.client_id if isinstance(exc, MqttConnectError) else None,
            prefix=f"{self.name}: ",
        )

    async def _session(self, client: aiomqtt.Client, stop: asyncio.Event) -> None:
        """Serve one connection; return when stopped, raise :class:`aiomqtt.MqttError` when it breaks."""
        if self._routes:  # one SUBSCRIBE for every route: one round trip, not one per topic
            wanted = [(route.topic.filter(**route.fixed), route.topic.qos) for route in self._routes]
            codes = await client.subscribe(wanted)
            for (topic, _qos), code in zip(wanted, codes, strict=False):
                if getattr(code, "is_failure", False):
                    log.error("%s: broker refused the subscription to %s: %s", self.name, topic, code)
        if (presence := self.plan.presence) is not None:  # subscribed: peers may send now
            await client.publish(presence.state_topic, presence.online(), qos=presence.qos, retain=presence.retain)
        self.client = client
        self.connected.set()
        try:
            async with asyncio.TaskGroup() as group:
                loops = [group.create_task(self._dispatch(client))]
                loops += [group.create_task(task(client)) for task in self._tasks]
                await stop.wait()
                # cancel until they are gone: on Python 3.11 asyncio.wait_for (in aiomqtt's publish) swallows
                # a cancellation that races with the publish completing, and the loop would go on for ever
                while running := [loop for loop in loops if not loop.done()]:
                    for loop in running:
                        loop.cancel()
                    await asyncio.wait(running, timeout=0.1)
        except ExceptionGroup as errors:  # one loop failed: the connection broke
            raise errors.exceptions[0] from None
        finally:
            self.client = None
            self.connected.clear()
            for waiting in self._publishers:  # their PUBACK will not come: they answer NotConnected
                if not waiting.done():
                    self._cut_off.add(waiting)
                    waiting.cancel()

    async def _dispatch(self, client: aiomqtt.Client) -> None:
        # aiomqtt's iterator costs a task and two passes of the event loop per message; behind a burst (a fleet
        # back after an outage, a rollout's reports) that made each message wait for thousands of passes. The
        # messages already queued are taken at once, with a pass of the loop every DRAIN_BATCH for the rest.
        queue: asyncio.Queue[aiomqtt.Message] = client._queue  # noqa: SLF001
        async for first in client.messages:
            await self._handle(client, first)
            taken = 0
            while not queue.empty():
                await self._handle(client, queue.get_nowait())
                taken += 1
                if taken % DRAIN_BATCH == 0:
                    await asyncio.sleep(0)  # the outbox's pump, the acknowledgements and the commits run too

    async def _handle(self, client: aiomqtt.Client, message: aiomqtt.Message) -> None:
        topic = message.topic.value
        for route in self._routes:
            ids = route.topic.parse(topic)
            if ids is not None and route.fixed.items() <= ids.items():
                break
        else:
            log.debug("%s: ignoring a message on %s", self.name, topic)
            return
        try:
            await route.handler(client, message, ids)
        except aiomqtt.MqttError:
            raise
        except Exception:  # a bug in one handler must not take the session down
            log.exception("%s: handling a message on %s failed", self.name, topic)
