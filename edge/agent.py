"""The edge agent: the node's uplink to the hub, the downlink to its devices, and the relay between them.

::

    hub's broker  <--upstream link-->  EdgeAgent  <--downstream link-->  devices' broker
                    NodeService (own state, heartbeats, desired, commands)
                    NodeDeployments (the node's own models and apps, DIR/ota)
                    DeviceRelay (RELAY_* <-> DEVICE_*, outbox)            EnrolmentProxy (HTTP, devices)
                                         TailRouter (devices' infer -> split-inference tails)
                                         FlRouter (devices' fl -> federated aggregators)
                                         EdgeStore (DIR/edge.db)           ArtifactCache (DIR/artifacts)

When the devices use the hub's broker the agent keeps ONE connection for both roles: the broker takes the
certificate's CN as the client id, so a second connection would take the first one over. While the hub
or its broker is away, the downstream side keeps working and the outbox fills; it drains on reconnect.
The node's own deployment progress goes through the same outbox (see :mod:`edge.deployments`).
Every topic comes from :mod:`interfaces.topics` (DESIGN §4.4).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from dataclasses import dataclass, field
from pathlib import Path

from device import renewal
from device.resources import ResourceSampler
from edge.artifacts.cache import ArtifactCache
from edge.artifacts.store import DEFAULT_BUDGET_BYTES
from edge.deployments import NodeDeployments
from edge.enrol import NODE
from edge.enrol_proxy import EnrolmentProxy, server_context
from edge.identity import IdentityError, IdentityStore
from device.connection import parse_mqtt_url, tls_context
from device.tls import agent_context
from edge.link import Link
from edge.node import NodeService
from edge.relay import DeviceRelay
from edge.fl import FlRouter
from edge.split import TailRouter
from edge.store import EdgeStore, LearnedFrom
from edge.upload_relay import UploadRelay
from device.session import Presence, SessionPlan
from interfaces.reconnect import RECONNECT_CAP_S
from interfaces.topics import NODE_STATE

log = logging.getLogger("aisynergy.edge")

MIN_HEARTBEAT_S = 0.1
STORE_FILE = "edge.db"
ARTIFACTS_DIR = "artifacts"


@dataclass(frozen=True)
class AgentConfig:
    node_id: str
    mqtt_url: str
    data_dir: Path
    heartbeat_interval_s: float = 10.0
    reconnect_cap_s: float = RECONNECT_CAP_S
    keepalive_s: int = 30
    connect_timeout_s: float = 10.0
    downstream_mqtt_url: str | None = None  # the devices' broker; None: the hub's broker
    device_mqtt_url: str | None = None  # what enrolling devices are told; None: the downstream URL
    device_listen: tuple[str, int] | None = None  # the device enrolment proxy; None: off
    hub_url: str | None = None  # where the enrolment proxy forwards to and the node downloads its own artefacts
    downstream_session_expiry_s: int = 3600  # the devices' broker queues their messages this long while the edge is away
    artifact_cache_bytes: int = DEFAULT_BUDGET_BYTES  # the artefact cache served on device_listen keeps within this
    renewal_check_s: float = renewal.RENEWAL_CHECK_S  # how often the node looks at how long its certificate has left
    datasets: dict[str, Path] = field(default_factory=dict)  # the site's datasets by name (files or folders) for training tasks


class EdgeAgent:
    """Keeps the node's links up until :meth:`stop`; see the module docstring."""

    def __init__(self, config: AgentConfig, sampler: ResourceSampler | None = None) -> None:
        if config.heartbeat_interval_s < MIN_HEARTBEAT_S:
            raise ValueError(f"heartbeat interval {config.heartbeat_interval_s} s is below {MIN_HEARTBEAT_S} s")
        downstream_url = config.downstream_mqtt_url or config.mqtt_url
        shared = parse_mqtt_url(downstream_url) == parse_mqtt_url(config.mqtt_url)
        device_url = config.device_mqtt_url or downstream_url
        parse_mqtt_url(device_url)  # refuse now a URL that devices would only stumble over later
        if config.device_listen is not None and not config.hub_url:
            raise ValueError("the device enrolment proxy needs the hub URL")
        self.config = config
        self.node_id = config.node_id
        self.identity = IdentityStore(config.data_dir)
        tls = self._tls = tls_context(self.identity.ca_path, self.identity.cert_path, self.identity.key_path)
        self._server_tls: ssl.SSLContext | None = None  # the device listener's, the same certificate
        hub_tls = agent_context(self.identity.ca_path)  # the hub's HTTPS: its CA, or a certificate from elsewhere
        # the link that serves the devices keeps its session while the edge restarts (their events wait in the
        # broker); the hub's commands carry a message expiry, so none runs late
        node = Presence(NODE_STATE, config.node_id, {"node_id": config.node_id})
        expiry = config.downstream_session_expiry_s
        self.up = Link("upstream", config.mqtt_url, tls, self._plan(expiry if shared else 0, node))
        self.down = self.up
        if not shared:
            self.down = Link("downstream", downstream_url, tls, self._plan(expiry, None))
        self.store = EdgeStore(Path(config.data_dir) / STORE_FILE)
        self.split = TailRouter()  # split inference: the devices' requests to this node's tail workers
        self.split.attach(self.down)
        self.fl = FlRouter(config.node_id)  # federated training: the devices' updates to this node's aggregators
        self.fl.attach(self.down)
        self.artifacts: ArtifactCache | None = None
        try:
            sampler = sampler or ResourceSampler(Path(config.data_dir))
            self.deployments = NodeDeployments(
                config.node_id,
                Path(config.data_dir),
                self.identity.load_trusted_keys(),
                config.hub_url,
                lambda topic, payload, kind: self.relay.enqueue(topic, payload, kind),
                verify=hub_tls,
                signing_key_source=self.identity.load_trusted_keys,  # an older identity pins it later
                pin_signing_keys=self.identity.pin_signing_key,  # after a rotation of the hub's key
                infer=self.split,
                fl=self.fl,
                datasets=config.datasets,
            )
            self.node = NodeService(config.node_id, self.store, sampler, config.heartbeat_interval_s, self.deployments)
            self.node.attach(self.up)
            self.proxy: EnrolmentProxy | None = None
            if config.device_listen is not None:
                self.artifacts = ArtifactCache(
                    Path(config.data_dir) / ARTIFACTS_DIR,
                    hub_url=config.hub_url or "",
                    signing_key=self.identity.load_trusted_keys(),
                    pin_signing_key=self.identity.pin_signing_key,
                    signing_key_source=self.identity.load_trusted_keys,
                    budget_bytes=config.artifact_cache_bytes,
                    verify=hub_tls,
                )
                self._server_tls = server_context(self.identity.cert_path, self.identity.key_path)
                self.proxy = EnrolmentProxy(
                    config.device_listen,
                    hub_url=config.hub_url or "",
                    node_id=config.node_id,
                    device_mqtt_url=device_url,
                    on_enrolled=lambda device_id: self.store.add_device(device_id, LearnedFrom.ENROLMENT),
                    tls=self._server_tls,
                    ca_pem=self.identity.ca_path.read_text(),
                    verify=hub_tls,
                    artifacts=self.artifacts,
                    uploads=UploadRelay(config.hub_url or "", verify=hub_tls),
                    fl_intake=self.fl.intake,
                )
                self.fl.intake.keys = self.artifacts.keys.ensure  # a device's round grant is checked against the hub's keys pinned here
            prefetch = self.artifacts.prefetch if self.artifacts is not None else None
            self.relay = DeviceRelay(config.node_id, self.store, self.up, self.down, prefetch=prefetch, on_task_orders=self.split.learn_orders)
            if self.artifacts is not None:
                self.relay.on_hub_signing_key = self.artifacts.hub_signing_key  # a rotation: catch up before devices ask
        except BaseException:
            if self.artifacts is not None:
                self.artifacts.close()
            self.store.close()
            raise
        self._stop = asyncio.Event()

    async def _renew_periodically(self) -> None:
        """Every ``renewal_check_s`` until stopped: renew the node certificate at the hub when less than RENEW_BEFORE
        is left (:mod:`device.renewal`); both links and the device listener present it from their next connection."""
        wait = self.config.renewal_check_s
        while True:
            try:
                await asyncio.wait_for(self._stop.wait(), wait)
                return
            except TimeoutError:
                wait = self.config.renewal_check_s
            try:
                enrolment = self.identity.load_enrolment()
            except IdentityError as exc:
                log.error("cannot renew the node certificate: %s", exc)
                continue
            if not renewal.due(enrolment):
                continue
            if await renewal.renew_async(self.identity, NODE, enrolment) is None:
                wait = min(renewal.RENEWAL_RETRY_S, wait)
                continue
            chain = (str(self.identity.cert_path), str(self.identity.key_path))
            try:
                for context in (self._tls, self._server_tls):
                    if context is not None:
                        context.load_cert_chain(*chain)
            except OSError as exc:  # ssl.SSLError included
                log.error("cannot load the renewed node certificate: %s", exc)

    def _plan(self, session_expiry_s: int, presence: Presence | None) -> SessionPlan:
        c = self.config
        return SessionPlan(c.node_id, c.keepalive_s, c.connect_timeout_s, c.reconnect_cap_s, session_expiry_s, presence)

    @property
    def links(self) -> list[Link]:
        return [self.up] if self.down is self.up else [self.up, self.down]

    @property
    def rejected(self) -> int:
        return self.node.rejections.total + self.relay.rejections.total

    def stop(self) -> None:
        """Ask :meth:`run` to publish ``offline``, disconnect and return."""
        self._stop.set()

    async def run(self) -> None:
        """Serve until stopped: both links (or the one shared link) and the enrolment proxy."""
        if self.down is self.up:
            log.info("devices use the hub's broker: one connection serves both roles")
        if self.artifacts is not None:
            self.artifacts.start()
        if self.proxy is not None:
            self.proxy.start()
        await self.deployments.restore()  # the installed model serves before the node says it is online
        worker = asyncio.create_task(self.deployments.run())
        try:
            async with asyncio.TaskGroup() as group:
                for link in self.links:
                    group.create_task(link.run(self._stop))
                if self.identity.is_enrolled():
                    group.create_task(self._renew_periodically())
        finally:
            worker.cancel()
            await asyncio.gather(worker, return_exceptions=True)
            await self.deployments.close()
            await self.split.close()
            await self.node.close()
            await self.relay.close()
            if self.proxy is not None:
                await asyncio.to_thread(self.proxy.close)
            if self.artifacts is not None:
                self.artifacts.close()
            self.store.close()
