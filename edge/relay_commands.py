"""The hub's commands to this edge's devices, relayed (see :mod:`edge.relay`): a command on RELAY_CMD is forwarded
on DEVICE_CMD with our response topic and a fresh correlation id; the device's answer goes to the hub's response
topic with the hub's correlation data; an unknown device, a malformed request or no answer in time: a failed
result, so the hub always gets one."""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import aiomqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from pydantic import ValidationError

from device.rejections import Rejections
from edge.link import Link
from interfaces.messages import CommandError, CommandResultBody, envelope
from interfaces.topics import DEVICE_CMD, DEVICE_CMD_REPLY, RELAY_CMD, RELAY_CMD_REPLY

log = logging.getLogger("aisynergy.edge.relay")


def payload_bytes(payload: object) -> bytes:
    return bytes(payload) if isinstance(payload, (bytes, bytearray)) else str(payload or "").encode()


@dataclass(frozen=True)
class _Command:
    """A hub command on its way to a device, and what its answer needs to find the way back."""

    device_id: str
    request_id: str
    name: str
    payload: bytes
    deadline: float  # event loop time
    response_topic: str
    correlation: bytes | None


@dataclass(frozen=True)
class _Pending:
    command: _Command
    answer: asyncio.Future[bytes]


class CommandRelay:
    """Forwards the hub's commands to the devices and their answers back; ``knows`` tells a device of this edge,
    ``rejections`` counts what is refused as malformed. The owner routes :meth:`on_relay_command` (upstream) and
    :meth:`on_device_reply` (downstream) to it, and cancels ``tasks`` when it closes."""

    def __init__(self, node_id: str, up: Link, down: Link, knows: Callable[[str], bool], rejections: Rejections) -> None:
        self.node_id = node_id
        self.up, self.down = up, down
        self.rejections = rejections
        self.tasks: set[asyncio.Task[None]] = set()
        self._knows = knows
        self._pending: dict[bytes, _Pending] = {}

    async def on_relay_command(self, client: aiomqtt.Client, message: aiomqtt.Message, ids: dict[str, str]) -> None:
        device_id, payload = ids["device_id"], payload_bytes(message.payload)
        response_topic = getattr(message.properties, "ResponseTopic", None) or RELAY_CMD_REPLY.topic(
            node_id=self.node_id, device_id=device_id
        )
        correlation = getattr(message.properties, "CorrelationData", None)
        deadline = asyncio.get_running_loop().time()
        try:
            request = RELAY_CMD.payload.model_validate_json(payload)
        except ValidationError as exc:
            self.rejections.count()
            log.warning("rejected a malformed command for %s: %s errors", device_id, exc.error_count())
            failure = CommandResultBody(
                ok=False, error_code=CommandError.VALIDATION_FAILED.value, error=str(exc)[:2048]
            )
            await self._answer(response_topic, correlation, self._result(failure, None))
            return
        if not self._knows(device_id):
            log.info("command %s (%s) for unknown device %s refused", request.body.name, request.id, device_id)
            failure = CommandResultBody(
                ok=False, error_code=CommandError.UNKNOWN_DEVICE, error=f"{device_id!r} is not a device of {self.node_id!r}"
            )
            await self._answer(response_topic, correlation, self._result(failure, request.id))
            return
        deadline += request.body.timeout_s
        command = _Command(device_id, request.id, request.body.name, payload, deadline, response_topic, correlation)
        task = asyncio.create_task(self._relay_command(command))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _relay_command(self, command: _Command) -> None:
        """Forward ``command`` with our correlation id, wait for the device, answer the hub in any case."""
        loop = asyncio.get_running_loop()
        ours = uuid.uuid4().bytes
        pending = _Pending(command, loop.create_future())
        self._pending[ours] = pending
        props = Properties(PacketTypes.PUBLISH)
        props.ResponseTopic = DEVICE_CMD_REPLY.topic(device_id=command.device_id)
        props.CorrelationData = ours
        props.MessageExpiryInterval = max(1, math.ceil(command.deadline - loop.time()))  # no stale command runs
        what = f"command {command.name} ({command.request_id}) for {command.device_id}"
        try:
            try:
                topic = DEVICE_CMD.topic(device_id=command.device_id)
                await self.down.publish(topic, command.payload, qos=DEVICE_CMD.qos, properties=props)
            except aiomqtt.MqttError as exc:
                log.warning("%s not delivered: %s", what, exc)
                error = f"the devices' broker cannot be reached: {exc}"[:2048]
                await self._fail(command, CommandResultBody(ok=False, error_code=CommandError.DOWNSTREAM_UNAVAILABLE, error=error))
                return
            log.info("%s forwarded", what)
            try:
                answer = await asyncio.wait_for(pending.answer, max(0.0, command.deadline - loop.time()))
            except TimeoutError:
                log.warning("%s: no answer in time", what)
                error = f"{command.device_id!r} did not answer in time"
                await self._fail(
                    command, CommandResultBody(ok=False, error_code=CommandError.TIMEOUT.value, error=error)
                )
                return
            await self._answer(command.response_topic, command.correlation, answer)
        finally:
            self._pending.pop(ours, None)

    async def _fail(self, command: _Command, failure: CommandResultBody) -> None:
        await self._answer(command.response_topic, command.correlation, self._result(failure, command.request_id))

    async def on_device_reply(self, client: aiomqtt.Client, message: aiomqtt.Message, ids: dict[str, str]) -> None:
        device_id, payload = ids["device_id"], payload_bytes(message.payload)
        correlation = getattr(message.properties, "CorrelationData", None)
        pending = self._pending.get(bytes(correlation)) if correlation else None
        if pending is None or pending.command.device_id != device_id or pending.answer.done():
            log.info("dropping a late or unexpected command answer from %s", device_id)
            return
        try:
            DEVICE_CMD_REPLY.payload.model_validate_json(payload)
        except ValidationError as exc:
            self.rejections.count()
            log.warning(
                "%s answered command %s with a malformed result: %s errors",
                device_id,
                pending.command.request_id,
                exc.error_count(),
            )
            failure = CommandResultBody(ok=False, error_code=CommandError.INVALID_REPLY, error=str(exc)[:2048])
            payload = self._result(failure, pending.command.request_id)
        pending.answer.set_result(payload)

    def _result(self, body: CommandResultBody, request_id: str | None) -> bytes:
        return envelope(self.node_id, body, reply_to=request_id).model_dump_json().encode()

    async def _answer(self, topic: str, correlation: bytes | None, payload: bytes) -> None:
        props = Properties(PacketTypes.PUBLISH)
        if correlation is not None:
            props.CorrelationData = correlation
        try:
            await self.up.publish(topic, payload, qos=RELAY_CMD_REPLY.qos, properties=props)
        except aiomqtt.MqttError as exc:
            log.warning("a command answer for %s is lost: %s", topic, exc)
