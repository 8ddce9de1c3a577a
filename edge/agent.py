"""The edge agent's uplink: one mutual-TLS MQTT 5 session to the hub's broker, kept up forever.

On connect the agent subscribes to its own ``desired`` and ``cmd`` topics, publishes a retained
``online`` state and then a heartbeat every ``heartbeat_interval_s``. If it vanishes, the broker
publishes its retained ``offline`` last will; a clean stop publishes ``offline`` (reason shutdown) itself.
Every topic comes from :mod:`interfaces.topics` (DESIGN §4.4).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import ssl
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiomqtt
import psutil
from aiomqtt.exceptions import MqttConnectError
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from pydantic import BaseModel, ValidationError

from device.files import write_atomic
from edge.identity import IdentityStore
from device.resources import ResourceSampler
from interfaces.messages import (
    CommandBody,
    CommandError,
    CommandResultBody,
    ConnectionState,
    EventBody,
    Health,
    HeartbeatBody,
    ReportedBody,
    StateBody,
    envelope,
)
from interfaces.resources import Resources
from interfaces.topics import (
    NODE_CMD,
    NODE_CMD_REPLY,
    NODE_DESIRED,
    NODE_EVENTS,
    NODE_HEARTBEAT,
    NODE_REPORTED,
    NODE_STATE,
    Topic,
)

log = logging.getLogger("aisynergy.edge")

try:
    AGENT_VERSION = version("aisynergy")
except PackageNotFoundError:  # pragma: no cover - running from a bare checkout
    AGENT_VERSION = "0+unknown"

MQTTS_DEFAULT_PORT = 8883
MIN_HEARTBEAT_S = 0.1


def parse_mqtt_url(url: str) -> tuple[str, int]:
    """``mqtts://host[:port]`` -> (host, port); the uplink is always TLS."""
    parts = urlsplit(url)
    if parts.scheme not in ("mqtts", "ssl") or not parts.hostname:
        raise ValueError(f"{url!r} is not an mqtts://host[:port] URL")
    return parts.hostname, parts.port or MQTTS_DEFAULT_PORT


def tls_context(identity: IdentityStore) -> ssl.SSLContext:
    """Trust only the hub CA, verify the broker's host name, present the node certificate."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(identity.ca_path))
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(str(identity.cert_path), str(identity.key_path))
    return context


def _is_tls_failure(exc: BaseException, reason: str) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLError):
            return True
        seen = seen.__cause__ or seen.__context__
    return any(word in reason for word in ("SSL", "certificate", "alert"))


class _LastError(logging.Filter):
    """Remembers paho's last error line: a TLS alert during connect (revoked or unknown certificate) is
    only logged by paho, while aiomqtt just reports a timeout waiting for CONNACK."""

    def __init__(self) -> None:
        super().__init__()
        self.message: str | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            self.message = record.getMessage()
        return True


@dataclass(frozen=True)
class AgentConfig:
    node_id: str
    mqtt_url: str
    data_dir: Path
    heartbeat_interval_s: float = 10.0
    reconnect_cap_s: float = 1.5**10
    keepalive_s: int = 30
    connect_timeout_s: float = 10.0


class EdgeAgent:
    """Keeps the node's MQTT session up until :meth:`stop`; see the module docstring."""

    def __init__(self, config: AgentConfig, sampler: ResourceSampler | None = None) -> None:
        self.config = config
        self.node_id = config.node_id
        self.host, self.port = parse_mqtt_url(config.mqtt_url)
        if config.heartbeat_interval_s < MIN_HEARTBEAT_S:
            raise ValueError(f"heartbeat interval {config.heartbeat_interval_s} s is below {MIN_HEARTBEAT_S} s")
        self.identity = IdentityStore(config.data_dir)
        self._tls = tls_context(self.identity)
        self.desired_path = Path(config.data_dir) / "desired.json"
        self.rejected = 0
        self._sampler = sampler or ResourceSampler(Path(config.data_dir))
        self._last_resources: Resources | None = None
        self._stop = asyncio.Event()
        self._mqtt_log = logging.getLogger(f"aisynergy.edge.mqtt.{self.node_id}")
        self._transport_error = _LastError()
        self._seq = 0
        self._started = time.monotonic()

    def stop(self) -> None:
        """Ask :meth:`run` to publish ``offline``, disconnect and return."""
        self._stop.set()

    async def run(self) -> None:
        """Connect, serve, and reconnect with jittered back-off until stopped."""
        self._mqtt_log.addFilter(self._transport_error)
        try:
            await self._run()
        finally:
            self._mqtt_log.removeFilter(self._transport_error)

    async def _run(self) -> None:
        attempt = 0
        while not self._stop.is_set():
            attempt += 1
            self._transport_error.message = None
            log.info("connecting to mqtts://%s:%s as %s (attempt %s)", self.host, self.port, self.node_id, attempt)
            try:
                async with contextlib.AsyncExitStack() as stack:
                    client = await self._connect(stack)
                    if client is None:
                        log.info("stopped while connecting")
                        return
                    log.info("connected to %s:%s", self.host, self.port)
                    attempt = 0
                    await self._session(client)
                    await self._publish(client, NODE_STATE, self._state(ConnectionState.OFFLINE, "shutdown"))
                    log.info("published offline (shutdown); disconnecting")
                    return
            except aiomqtt.MqttError as exc:
                delay = random.uniform(0, min(self.config.reconnect_cap_s, 1.5 ** min(10, attempt)))
                self._log_failure(exc, delay)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), delay)

    # ---- connection ---------------------------------------------------------------------------------
    async def _connect(self, stack: contextlib.AsyncExitStack) -> aiomqtt.Client | None:
        """Enter a fresh client's context on ``stack``; ``None`` when stopped before the broker answered."""
        connecting = asyncio.create_task(stack.enter_async_context(self._client()))
        stopping = asyncio.create_task(self._stop.wait())
        await asyncio.wait((connecting, stopping), return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if not connecting.done():
            connecting.cancel()
            return None
        return connecting.result()

    def _client(self) -> aiomqtt.Client:
        will = envelope(self.node_id, self._state(ConnectionState.OFFLINE, "will"))
        return aiomqtt.Client(
            self.host,
            self.port,
            identifier=self.node_id,
            protocol=aiomqtt.ProtocolVersion.V5,
            tls_context=self._tls,
            will=aiomqtt.Will(
                NODE_STATE.topic(node_id=self.node_id), will.model_dump_json(), NODE_STATE.qos, NODE_STATE.retain
            ),
            keepalive=self.config.keepalive_s,
            timeout=self.config.connect_timeout_s,
            logger=self._mqtt_log,
        )

    def _log_failure(self, exc: aiomqtt.MqttError, delay: float) -> None:
        where = f"{self.host}:{self.port}"
        reason = str(exc) or type(exc).__name__
        if self._transport_error.message:  # the real cause, where aiomqtt only saw a timeout
            reason = f"{self._transport_error.message} ({reason})"
        if isinstance(exc, MqttConnectError):
            log.error("broker %s refused %s: %s; retrying in %.1f s", where, self.node_id, reason, delay)
        elif _is_tls_failure(exc, reason):
            log.error("TLS with %s failed: %s; retrying in %.1f s", where, reason, delay)
        else:
            log.warning("connection to %s failed or lost: %s; retrying in %.1f s", where, reason, delay)

    async def _session(self, client: aiomqtt.Client) -> None:
        """Serve one connection; return when stopped, raise :class:`aiomqtt.MqttError` when it breaks."""
        for topic in (NODE_DESIRED, NODE_CMD):
            codes = await client.subscribe(topic.topic(node_id=self.node_id), qos=topic.qos)
            if any(getattr(code, "is_failure", False) for code in codes):
                log.error("broker refused the subscription to %s: %s", topic.topic(node_id=self.node_id), codes)
        await self._publish(client, NODE_STATE, self._state(ConnectionState.ONLINE))
        try:
            async with asyncio.TaskGroup() as group:
                loops = [group.create_task(self._heartbeats(client)), group.create_task(self._messages(client))]
                await self._stop.wait()
                for task in loops:
                    task.cancel()
        except ExceptionGroup as errors:  # one loop failed: the connection broke
            raise errors.exceptions[0] from None

    # ---- publishing ---------------------------------------------------------------------------------
    def _state(self, state: ConnectionState, reason: str | None = None) -> StateBody:
        return StateBody(state=state, agent_version=AGENT_VERSION, reason=reason)

    async def _publish(
        self,
        client: aiomqtt.Client,
        topic: Topic[Any],
        body: BaseModel,
        *,
        to: str | None = None,
        reply_to: str | None = None,
        properties: Properties | None = None,
    ) -> None:
        """Publish ``body`` in an envelope with the topic's QoS and retain flag (``to``: a response topic)."""
        message = envelope(self.node_id, body, reply_to=reply_to)  # type: ignore[type-var]
        if not isinstance(message, topic.payload):
            raise TypeError(f"{type(body).__name__} does not travel on {topic.pattern}")
        await client.publish(
            to or topic.topic(node_id=self.node_id),
            message.model_dump_json().encode(),
            qos=topic.qos,
            retain=topic.retain,
            properties=properties,
        )

    async def _heartbeats(self, client: aiomqtt.Client) -> None:
        while True:
            body = await self._heartbeat()
            if body is not None:
                await self._publish(client, NODE_HEARTBEAT, body)
                log.debug("heartbeat %s sent", body.seq)
            await asyncio.sleep(self.config.heartbeat_interval_s)

    async def _heartbeat(self) -> HeartbeatBody | None:
        health, detail = Health.OK, None
        try:
            self._last_resources = await asyncio.to_thread(self._sampler.read)
        except (OSError, psutil.Error) as exc:
            log.warning("cannot read resources: %s", exc)
            health, detail = Health.DEGRADED, f"resource readings failed: {exc}"[:512]
        if self._last_resources is None:
            return None
        body = HeartbeatBody(
            seq=self._seq,
            health=health,
            health_detail=detail,
            agent_version=AGENT_VERSION,
            uptime_s=time.monotonic() - self._started,
            resources=self._last_resources,
        )
        self._seq += 1
        return body

    # ---- incoming -----------------------------------------------------------------------------------
    async def _messages(self, client: aiomqtt.Client) -> None:
        desired, cmd = NODE_DESIRED.topic(node_id=self.node_id), NODE_CMD.topic(node_id=self.node_id)
        async for message in client.messages:
            if message.topic.value == desired:
                await self._on_desired(client, message)
            elif message.topic.value == cmd:
                await self._on_command(client, message)
            else:
                log.debug("ignoring a message on %s", message.topic.value)

    async def _on_desired(self, client: aiomqtt.Client, message: aiomqtt.Message) -> None:
        if not message.payload:
            log.info("the desired document was cleared")
            return
        try:
            request = NODE_DESIRED.payload.model_validate_json(message.payload)
        except ValidationError as exc:
            await self._reject(client, message, exc)
            return
        try:
            write_atomic(self.desired_path, request.model_dump_json().encode(), mode=0o600)
        except OSError as exc:
            log.error("cannot store desired version %s: %s", request.body.version, exc)
            error = EventBody(
                type="desired_not_stored", severity="error", message=str(exc), data={"version": request.body.version}
            )
            await self._publish(client, NODE_EVENTS, error)
            return
        log.info("desired version %s stored", request.body.version)
        await self._publish(client, NODE_REPORTED, ReportedBody(version=request.body.version), reply_to=request.id)

    async def _on_command(self, client: aiomqtt.Client, message: aiomqtt.Message) -> None:
        props = message.properties
        response_topic = getattr(props, "ResponseTopic", None)
        reply_props = Properties(PacketTypes.PUBLISH)
        correlation = getattr(props, "CorrelationData", None)
        if correlation is not None:
            reply_props.CorrelationData = correlation
        request_id = None
        try:
            request = NODE_CMD.payload.model_validate_json(message.payload)
        except ValidationError as exc:
            self.rejected += 1
            log.warning("rejected a malformed command: %s", exc.error_count())
            log.debug("malformed command payload: %r", message.payload)
            result = CommandResultBody(ok=False, error_code=CommandError.VALIDATION_FAILED.value, error=str(exc)[:2048])
        else:
            request_id = request.id
            result = self._execute(request.body)
            log.info("command %s (%s) answered ok=%s", request.body.name, request_id, result.ok)
        await self._publish(
            client, NODE_CMD_REPLY, result, to=response_topic, reply_to=request_id, properties=reply_props
        )

    def _execute(self, command: CommandBody) -> CommandResultBody:
        if command.name == "ping":
            return CommandResultBody(ok=True, result={"pong": True, "ts": datetime.now(UTC).isoformat()})
        return CommandResultBody(ok=False, error_code=CommandError.UNKNOWN_COMMAND.value, error=f"unknown command {command.name!r}")

    async def _reject(self, client: aiomqtt.Client, message: aiomqtt.Message, exc: ValidationError) -> None:
        """Drop a malformed message, count it and say so on ``events`` (DESIGN §6)."""
        self.rejected += 1
        log.warning("rejected a malformed message on %s: %s errors", message.topic.value, exc.error_count())
        log.debug("malformed payload: %r", message.payload)
        event = EventBody(
            type="message_rejected",
            severity="error",
            message=str(exc)[:8192],
            data={"topic": message.topic.value, "rejected_total": self.rejected},
        )
        await self._publish(client, NODE_EVENTS, event)
