"""The node's own channels to the hub: state, heartbeats, desired document and commands.

On connect the node's link publishes its retained ``online`` state (the session core,
:mod:`device.session`, with the ``offline`` will and the clean stop's ``offline``), and the node a heartbeat
every ``heartbeat_interval_s``. A desired document is kept in the local
store and acknowledged on ``reported``; ``ping`` is the one command the node answers itself. With a
:class:`~edge.deployments.NodeDeployments`, the document's deployment orders go to it, ``reported`` carries
what is installed, and ``infer`` and ``models`` are answered from the installed models (off the event loop).
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from typing import TYPE_CHECKING, Any

import aiomqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from pydantic import BaseModel, ValidationError

from device.commands import Commands
from device.connection import encode
from device.heartbeat import AGENT_VERSION, HeartbeatBuilder
from device.rejections import Rejections
from device.resources import ResourceSampler
from edge.link import Link
from edge.store import EdgeStore, Scope
from interfaces.messages import (
    CommandBody,
    CommandError,
    CommandResultBody,
    EventBody,
    HeartbeatBody,
    ReportedBody,
)
from interfaces.topics import (
    NODE_CMD,
    NODE_CMD_REPLY,
    NODE_DESIRED,
    NODE_EVENTS,
    NODE_HEARTBEAT,
    NODE_REPORTED,
    Topic,
)

if TYPE_CHECKING:
    from edge.deployments import NodeDeployments

log = logging.getLogger("aisynergy.edge")

class NodeService:
    """Serves the node's own subtree on the upstream link; see the module docstring."""

    def __init__(
        self,
        node_id: str,
        store: EdgeStore,
        sampler: ResourceSampler,
        heartbeat_interval_s: float,
        deployments: NodeDeployments | None = None,
    ) -> None:
        self.node_id = node_id
        self.deployments = deployments
        self.rejections = Rejections(log)
        self._store = store
        self._interval = heartbeat_interval_s
        # the node's own commands: the deployments' (models) when it hosts them, else the built-ins alone
        self._node_commands = deployments.commands if deployments is not None else Commands()
        self._heartbeats = HeartbeatBuilder(sampler, AGENT_VERSION)
        self._commands: set[asyncio.Task[None]] = set()

    def attach(self, link: Link) -> None:
        """Serve the node's subtree on ``link``, whose session (:mod:`device.session`) carries the node's
        presence: its will, ``online`` once subscribed and ``offline`` (shutdown) on a clean stop."""
        link.route(NODE_DESIRED, self._on_desired, node_id=self.node_id)
        link.route(NODE_CMD, self._on_command, node_id=self.node_id)
        link.during_session(self._beat)

    async def _beat(self, client: aiomqtt.Client) -> None:
        while True:
            body = await self._heartbeat()
            if body is not None:
                await self._publish(client, NODE_HEARTBEAT, body)
                log.debug("heartbeat %s sent", body.seq)
            await asyncio.sleep(self._interval)

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
        await client.publish(
            to or topic.topic(node_id=self.node_id),
            encode(topic, self.node_id, body, reply_to),
            qos=topic.qos,
            retain=topic.retain,
            properties=properties,
        )

    async def _heartbeat(self) -> HeartbeatBody | None:
        return await asyncio.to_thread(self._heartbeats.next_body)  # the reading may take a moment

    # ---- incoming -----------------------------------------------------------------------------------
    async def _on_desired(self, client: aiomqtt.Client, message: aiomqtt.Message, ids: dict[str, str]) -> None:
        if not message.payload:
            log.info("the desired document was cleared")
            return
        try:
            request = NODE_DESIRED.payload.model_validate_json(message.payload)  # type: ignore[arg-type]
        except ValidationError as exc:
            await self._reject(client, message, exc)
            return
        try:
            self._store.put_desired(Scope.NODE, self.node_id, request.body.version, request.model_dump_json().encode())
        except sqlite3.Error as exc:
            log.error("cannot store desired version %s: %s", request.body.version, exc)
            error = EventBody(
                type="desired_not_stored", severity="error", message=str(exc), data={"version": request.body.version}
            )
            await self._publish(client, NODE_EVENTS, error)
            return
        log.info("desired version %s stored", request.body.version)
        status = self.deployments.status() if self.deployments is not None else {}
        await self._publish(client, NODE_REPORTED, ReportedBody(version=request.body.version, status=status), reply_to=request.id)
        if self.deployments is not None:
            self.deployments.offer(request.body)

    async def _on_command(self, client: aiomqtt.Client, message: aiomqtt.Message, ids: dict[str, str]) -> None:
        props = message.properties
        response_topic = getattr(props, "ResponseTopic", None)
        reply_props = Properties(PacketTypes.PUBLISH)
        correlation = getattr(props, "CorrelationData", None)
        if correlation is not None:
            reply_props.CorrelationData = correlation
        request_id = None
        try:
            request = NODE_CMD.payload.model_validate_json(message.payload)  # type: ignore[arg-type]
        except ValidationError as exc:
            self.rejections.count()
            log.warning("rejected a malformed command: %s", exc.error_count())
            log.debug("malformed command payload: %r", message.payload)
            result = CommandResultBody(ok=False, error_code=CommandError.VALIDATION_FAILED.value, error=str(exc)[:2048])
        else:
            request_id = request.id
            if self.deployments is not None and self.deployments.commands.runs_a_handler(request.body):
                task = asyncio.create_task(self._answer_later(client, request.body, request_id, response_topic, reply_props))
                self._commands.add(task)
                task.add_done_callback(self._commands.discard)
                return
            result = self._execute(request.body)
            log.info("command %s (%s) answered ok=%s", request.body.name, request_id, result.ok)
        await self._publish(
            client, NODE_CMD_REPLY, result, to=response_topic, reply_to=request_id, properties=reply_props
        )

    async def _answer_later(
        self, client: aiomqtt.Client, command: CommandBody, request_id: str, response_topic: str | None, props: Properties
    ) -> None:
        """Answer a command that runs a model off the event loop, so the session goes on meanwhile."""
        assert self.deployments is not None
        result = await asyncio.to_thread(self.deployments.commands.execute, command)
        try:
            try:
                await self._publish(client, NODE_CMD_REPLY, result, to=response_topic, reply_to=request_id, properties=props)
            except ValueError as exc:  # a result JSON cannot carry
                result = CommandResultBody(ok=False, error_code=CommandError.FAILED.value, error=f"the result cannot be serialised: {exc}"[:2048])
                await self._publish(client, NODE_CMD_REPLY, result, to=response_topic, reply_to=request_id, properties=props)
        except aiomqtt.MqttError as exc:
            log.warning("the answer to command %s (%s) is lost: %s", command.name, request_id, exc)
            return
        log.info("command %s (%s) answered ok=%s", command.name, request_id, result.ok)

    async def close(self) -> None:
        """Cancel the commands still running."""
        for task in list(self._commands):
            task.cancel()
        await asyncio.gather(*self._commands, return_exceptions=True)

    def _execute(self, command: CommandBody) -> CommandResultBody:
        """``ping`` and unknown names, answered at once by the commands the device answers with too."""
        return self._node_commands.execute(command)

    async def _reject(self, client: aiomqtt.Client, message: aiomqtt.Message, exc: ValidationError) -> None:
        """Drop a malformed message, count it and say so on ``events`` (DESIGN §6)."""
        event = self.rejections.reject(message.topic.value, exc, bytes(message.payload or b""))  # type: ignore[arg-type]
        await self._publish(client, NODE_EVENTS, event)
