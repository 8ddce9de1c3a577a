"""Simulated agents that speak only the documented protocol (DESIGN §4.4, ``interfaces/topics.py``).

:class:`SimEdge` is an edge node the suite registers and enrols through the REST API (key and CSR made
here, certificate from the hub) and connects to the broker with mutual TLS. It carries one
:class:`Endpoint` for itself and one per device it relays (the device's channels under the edge's
subtree, as a real edge republishes them). An endpoint heartbeats with the readings a case gives it,
answers commands, follows its desired document and carries out deployment and task-worker orders the
way the catalogue describes: download with the order's token, check SHA-256 and the hub's Ed25519
signature, report each execution state as an event; report worker states while a worker runs.
:class:`SimDevice` is a device with its own certificate, for the broker's isolation cases.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.x509.oid import NameOID
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode
from pydantic import BaseModel

from conformance.hub import Target
from conformance.outcomes import Unexpected
from interfaces.deployments import (
    DOWNLOAD_TOKEN_HEADER, EXECUTION_EVENT, INSTALLED_KEY, DeploymentOrder, ExecutionProgress, ExecutionState, InstalledArtifact, OrderAction,
    manifest_signing_bytes,
)  # fmt: skip
from interfaces.messages import (
    CommandBody, CommandError, CommandResultBody, ConnectionState, DesiredBody, Envelope, EventBody, Health, HeartbeatBody, ReportedBody,
    StateBody, envelope,
)  # fmt: skip
from interfaces.nodes import CertificateIssued, DeviceCertificateIssued, DevicePublic, NodeRegistered
from interfaces.resources import Accelerator, CpuReading, DiskReading, MemoryReading, NetworkReading, Resources
from interfaces.tasks import TASK_WORKER_EVENT, InferenceOrder, WorkerAction, WorkerOrder, WorkerReport, WorkerState
from interfaces.topics import (
    DEVICE_STATE, NODE_CMD, NODE_CMD_REPLY, NODE_DESIRED, NODE_EVENTS, NODE_HEARTBEAT, NODE_REPORTED, NODE_STATE, RELAY_CMD, RELAY_CMD_REPLY,
    RELAY_DESIRED, RELAY_EVENTS, RELAY_HEARTBEAT, RELAY_REPORTED, RELAY_STATE,
)  # fmt: skip

AGENT_VERSION = "conformance-sim/1"
CONNECT_TIMEOUT_S = 60.0
ACK_TIMEOUT_S = 30.0  # how long a SUBACK or PUBACK may take on a busy machine


def make_csr(common_name: str) -> tuple[bytes, str]:
    """A fresh P-256 key (PEM) and a CSR for ``CN=common_name`` (PEM)."""
    key = ec.generate_private_key(ec.SECP256R1())
    csr = x509.CertificateSigningRequestBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])).sign(key, hashes.SHA256())
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return key_pem, csr.public_bytes(serialization.Encoding.PEM).decode()


def resources(memory_available: int = 2 * 1024**3, accelerators: list[Accelerator] | None = None, cpu: float = 0.1) -> Resources:
    return Resources(
        cpu=CpuReading(cores=4, utilisation=cpu), memory=MemoryReading(total_bytes=4 * 1024**3, available_bytes=memory_available),
        disk=DiskReading(path="/", total_bytes=32 * 1024**3, free_bytes=16 * 1024**3), network=NetworkReading(bytes_sent=0, bytes_received=0),
        accelerators=accelerators or [],
    )  # fmt: skip


@dataclass
class Received:
    topic: str
    payload: bytes
    properties: Properties | None
    retain: bool
    at: float = field(default_factory=time.monotonic)

    def json(self) -> Any:
        return json.loads(self.payload)


class Identity:
    """Key, certificate and the CA on disk, for paho's TLS."""

    def __init__(self, directory: Path, ident: str, key_pem: bytes, issued: CertificateIssued | DeviceCertificateIssued, ca_pem: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.ident, self.issued = ident, issued
        self.key = directory / f"{ident}.key"
        self.cert = directory / f"{ident}.crt"
        self.ca = directory / "ca.crt"
        self.key.write_bytes(key_pem)
        self.key.chmod(0o600)
        self.cert.write_text(issued.certificate_pem)
        self.ca.write_text(ca_pem)


class MqttPeer:
    """One MQTT 5 connection with mutual TLS; records every message it receives."""

    def __init__(self, target: Target, identity: Identity, will: tuple[str, bytes] | None = None) -> None:
        self.target, self.identity = target, identity
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=identity.ident, protocol=mqtt.MQTTv5)
        self.client.tls_set(ca_certs=str(identity.ca), certfile=str(identity.cert), keyfile=str(identity.key))
        if will is not None:
            self.client.will_set(will[0], will[1], qos=1, retain=True)
        self.received: list[Received] = []
        self.suback: dict[int, list[ReasonCode]] = {}
        self.puback: dict[int, ReasonCode] = {}
        self.connected = threading.Event()
        self.connect_reason: ReasonCode | None = None
        self.refusal: str | None = None
        self.disconnected = threading.Event()
        self._lock = threading.Lock()
        self.handlers: list[Callable[[Received], None]] = []
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = self._on_disconnect
        self.client.on_message = self._on_message
        self.client.on_subscribe = self._on_subscribe
        self.client.on_publish = self._on_publish

    def _on_connect(self, _c: Any, _u: Any, _f: Any, reason: ReasonCode, _p: Any) -> None:
        self.connect_reason = reason
        if not reason.is_failure:
            self.disconnected.clear()
            self.connected.set()

    def _on_disconnect(self, _c: Any, _u: Any, _f: Any, reason: ReasonCode, _p: Any) -> None:
        self.connected.clear()
        self.disconnected.set()

    def _on_subscribe(self, _c: Any, _u: Any, mid: int, reasons: list[ReasonCode], _p: Any) -> None:
        self.suback[mid] = list(reasons)

    def _on_publish(self, _c: Any, _u: Any, mid: int, reason: ReasonCode, _p: Any) -> None:
        self.puback[mid] = reason

    def _on_message(self, _c: Any, _u: Any, message: mqtt.MQTTMessage) -> None:
        item = Received(message.topic, bytes(message.payload), getattr(message, "properties", None), bool(message.retain))
        with self._lock:
            self.received.append(item)
        for handler in list(self.handlers):
            handler(item)

    def connect(self, timeout: float = CONNECT_TIMEOUT_S) -> bool:
        """Connect and start the network loop. False when the broker refused (``refusal`` says how: the TLS
        handshake, a failing CONNACK, the connection closed before any CONNACK) or when nothing was settled
        within ``timeout`` (``refusal`` None: slow is not refused)."""
        self.refusal = None
        self.disconnected.clear()
        try:
            self.client.connect(self.target.broker_host, self.target.broker_port, keepalive=30)
        except OSError as exc:
            self.refusal = f"{type(exc).__name__}: {exc}"
            return False
        self.client.loop_start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.connected.is_set():
                return True
            if self.connect_reason is not None and self.connect_reason.is_failure:
                self.refusal = f"CONNACK {self.connect_reason}"
                break
            if self.disconnected.is_set():
                self.refusal = "closed by the broker before any CONNACK"
                break
            time.sleep(0.05)
        self.client.loop_stop()
        return False

    def subscribe(self, topic_filter: str, qos: int = 1, timeout: float = ACK_TIMEOUT_S) -> list[ReasonCode]:
        """Subscribe and wait for the SUBACK; its reason codes (0x87: not authorised)."""
        result, mid = self.client.subscribe(topic_filter, qos)
        if result != mqtt.MQTT_ERR_SUCCESS:
            raise Unexpected(f"subscribe {topic_filter}: paho error {result}")
        deadline = time.monotonic() + timeout
        while mid not in self.suback:
            if time.monotonic() > deadline:
                raise Unexpected(f"no SUBACK for {topic_filter} within {timeout} s")
            time.sleep(0.02)
        return self.suback[mid]

    def publish(self, topic: str, payload: bytes | str, qos: int = 1, retain: bool = False, properties: Properties | None = None, wait: bool = True) -> str:
        """Publish; with QoS 1 wait for the PUBACK and return its reason ("Success", "Not authorized", ...)."""
        info = self.client.publish(topic, payload, qos=qos, retain=retain, properties=properties)
        if not (wait and qos > 0):
            return "sent"
        info.wait_for_publish(timeout=ACK_TIMEOUT_S)
        deadline = time.monotonic() + 2
        while info.mid not in self.puback and time.monotonic() < deadline:
            time.sleep(0.01)
        reason = self.puback.get(info.mid)
        return "no PUBACK" if reason is None else str(reason)

    def messages(self, topic: str | None = None) -> list[Received]:
        with self._lock:
            return [m for m in self.received if topic is None or mqtt.topic_matches_sub(topic, m.topic)]

    def wait_message(self, topic: str, predicate: Callable[[Received], bool] = lambda _m: True, timeout: float = 10, after: float = 0.0) -> Received | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for m in self.messages(topic):
                if m.at >= after and predicate(m):
                    return m
            time.sleep(0.05)
        return None

    def disconnect(self, with_will: bool = False) -> None:
        """A clean DISCONNECT, or (``with_will``) MQTT 5's "disconnect with will message" (0x04): the
        broker publishes the last will as if the agent had vanished."""
        if with_will:
            self.client.disconnect(reasoncode=ReasonCode(PacketTypes.DISCONNECT, identifier=0x04))
        else:
            self.client.disconnect()
        self.disconnected.wait(5)
        self.client.loop_stop()


def publish_model(peer: MqttPeer, topic: str, src: str, body: BaseModel, *, reply_to: str | None = None, retain: bool = False,
                  qos: int = 1, properties: Properties | None = None) -> Envelope[Any]:  # fmt: skip
    env = envelope(src, body, reply_to=reply_to)  # type: ignore[type-var]
    peer.publish(topic, env.model_dump_json(), qos=qos, retain=retain, properties=properties)
    return env


@dataclass
class _Topics:
    state: str
    heartbeat: str
    desired: str
    reported: str
    cmd: str
    cmd_reply: str
    events: str


class Endpoint:
    """One identity's channels: a node's own, or a device's as its edge relays them."""

    def __init__(self, edge: SimEdge, ident: str, topics: _Topics) -> None:
        self.edge, self.ident, self.topics = edge, ident, topics
        self.resources = resources()
        self.health, self.health_detail = Health.OK, None
        self.heartbeats = threading.Event()  # set: heartbeating
        self.seq = 0
        self.event_seq = 0
        self.commands: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {"ping": lambda args: {"pong": True, **args}}
        self.answer_commands = True
        self.desired: list[DesiredBody] = []
        self.installed: dict[str, InstalledArtifact] = {}
        self.install_outcome: ExecutionState = ExecutionState.ACTIVE  # FAILED: every install fails
        self.executions: dict[str, ExecutionState] = {}
        self.worker_mode = "run"  # run | silent | fail | reject
        self.workers: dict[str, WorkerOrder] = {}
        self.worker_reports: list[WorkerReport] = []
        self._lock = threading.Lock()

    # ---- outgoing ------------------------------------------------------------------------------------
    def publish(self, topic: str, body: BaseModel, **kw: Any) -> Envelope[Any]:
        return publish_model(self.edge.peer, topic, self.ident, body, **kw)

    def online(self) -> None:
        self.publish(self.topics.state, StateBody(state=ConnectionState.ONLINE, agent_version=AGENT_VERSION), retain=True)

    def offline(self, reason: str = "shutdown") -> None:
        self.publish(self.topics.state, StateBody(state=ConnectionState.OFFLINE, reason=reason), retain=True)

    def heartbeat(self) -> None:
        self.seq += 1
        body = HeartbeatBody(seq=self.seq, health=self.health, health_detail=self.health_detail, agent_version=AGENT_VERSION,
                             uptime_s=float(self.seq), resources=self.resources)  # fmt: skip
        self.publish(self.topics.heartbeat, body, qos=0)

    def event(self, type_: str, data: dict[str, Any], severity: str = "info", message: str | None = None) -> None:
        with self._lock:
            self.event_seq += 1
            seq = self.event_seq
        self.publish(self.topics.events, EventBody(seq=seq, type=type_, severity=severity, data=data, message=message))  # type: ignore[arg-type]

    def report(self, version: int, status: dict[str, Any] | None = None) -> None:
        status = dict(status or {})
        if self.installed:
            status[INSTALLED_KEY] = {k: a.model_dump(mode="json") for k, a in self.installed.items()}
        self.publish(self.topics.reported, ReportedBody(version=version, status=status))

    # ---- incoming ------------------------------------------------------------------------------------
    def handle(self, message: Received) -> None:
        if message.topic == self.topics.desired and message.payload:
            threading.Thread(target=self._on_desired, args=(message,), daemon=True).start()
        elif message.topic == self.topics.cmd:  # answered off the network thread, which must stay free for the PUBACKs
            threading.Thread(target=self._on_command, args=(message,), daemon=True).start()

    def _on_command(self, message: Received) -> None:
        if not self.answer_commands:
            return
        props = message.properties
        response_topic = getattr(props, "ResponseTopic", None) or self.topics.cmd_reply
        reply_props = Properties(PacketTypes.PUBLISH)
        correlation = getattr(props, "CorrelationData", None)
        if correlation is not None:
            reply_props.CorrelationData = correlation
        try:
            request = Envelope[CommandBody].model_validate_json(message.payload)
        except ValueError as exc:
            result = CommandResultBody(ok=False, error_code=CommandError.VALIDATION_FAILED, error=str(exc)[:2000])
            self.publish(response_topic, result, properties=reply_props)
            return
        handler = self.commands.get(request.body.name)
        if handler is None:
            result = CommandResultBody(ok=False, error_code=CommandError.UNKNOWN_COMMAND, error=f"no command {request.body.name!r}")
        else:
            result = CommandResultBody(ok=True, result=handler(request.body.args))
        self.publish(response_topic, result, reply_to=request.id, properties=reply_props)

    def _on_desired(self, message: Received) -> None:
        desired = Envelope[DesiredBody].model_validate_json(message.payload).body
        with self._lock:
            if self.desired and desired.version < self.desired[-1].version:
                return  # an older document handled after a newer one: the newer one stands
            self.desired.append(desired)
        for order in desired.deployments:
            self._deploy(order)
        self._tasks(desired.tasks)
        self.report(desired.version, dict(desired.spec))  # converged to what it was asked

    # ---- deployments (DESIGN §4.2) -------------------------------------------------------------------
    def _progress(self, order: DeploymentOrder, state: ExecutionState, detail: str = "", installed: InstalledArtifact | None = None) -> None:
        self.executions[order.execution_id] = state
        progress = ExecutionProgress(execution_id=order.execution_id, state=state, detail=detail, installed=installed)
        self.event(EXECUTION_EVENT, progress.model_dump(mode="json"))

    def _deploy(self, order: DeploymentOrder) -> None:
        with self._lock:
            if order.execution_id in self.executions:
                return
            self.executions[order.execution_id] = ExecutionState.QUEUED
        m = order.signed_manifest.manifest
        rollback = order.action is OrderAction.ROLLBACK
        try:
            key = self.edge.signing_key()
            key.verify(base64.b64decode(order.signed_manifest.signature), manifest_signing_bytes(m))
        except Exception as exc:  # noqa: BLE001 - any verification failure is a refusal
            self._progress(order, ExecutionState.ROLLBACK_FAILED if rollback else ExecutionState.REJECTED, f"manifest signature: {exc}")
            return
        if rollback:
            self._progress(order, ExecutionState.ROLLING_BACK)
        else:
            self._progress(order, ExecutionState.DOWNLOADING)
        with self.edge.target.client(token=None) as c:
            r = c.get(order.path, headers={DOWNLOAD_TOKEN_HEADER: order.token})
        if r.status_code != 200 or hashlib.sha256(r.content).hexdigest() != m.sha256:
            self._progress(order, ExecutionState.ROLLBACK_FAILED if rollback else ExecutionState.FAILED, f"download: HTTP {r.status_code}")
            return
        if not rollback:
            self._progress(order, ExecutionState.DOWNLOADED)
            self._progress(order, ExecutionState.VERIFYING)
            self._progress(order, ExecutionState.INSTALLING)
            if self.install_outcome is not ExecutionState.ACTIVE:
                self._progress(order, self.install_outcome, "the simulated install fails, as the case asked")
                return
        installed = InstalledArtifact(name=m.name, version=m.version, sha256=m.sha256, artifact_id=order.artifact_id)
        self.installed[m.kind.value] = installed
        self._progress(order, ExecutionState.ROLLED_BACK if rollback else ExecutionState.ACTIVE, installed=installed)

    # ---- task workers (DESIGN §4.3) ------------------------------------------------------------------
    def _tasks(self, orders: list[WorkerOrder]) -> None:
        current = {o.worker_id: o for o in orders}
        with self._lock:
            new = [o for w, o in current.items() if w not in self.workers]
            self.workers = current
        for order in new:
            threading.Thread(target=self._work, args=(order,), daemon=True).start()

    def _worker_report(self, order: WorkerOrder, state: WorkerState, detail: str = "", paused: bool = False) -> None:
        report = WorkerReport(worker_id=order.worker_id, task_id=order.task_id, state=state, detail=detail, paused=paused)  # type: ignore[arg-type]
        self.worker_reports.append(report)
        self.event(TASK_WORKER_EVENT, report.model_dump(mode="json"))

    def _work(self, order: WorkerOrder) -> None:
        if self.worker_mode == "silent":
            return
        if self.worker_mode == "reject":
            self._worker_report(order, WorkerState.REJECTED, "the simulated agent refuses, as the case asked")
            return
        if self.worker_mode == "fail":
            self._worker_report(order, WorkerState.FAILED, "the simulated worker fails, as the case asked")
            return
        try:
            self._serve(order)
        except RuntimeError:  # paho: the connection is gone (the case stopped the agent); the worker ends with it
            return

    def _serve(self, order: WorkerOrder) -> None:
        duration = order.spec.duration_s if isinstance(order, InferenceOrder) else None
        started = time.monotonic()
        while self.edge.running.is_set():
            current = self.workers.get(order.worker_id)
            if current is None:
                return  # withdrawn
            if duration is not None and time.monotonic() - started >= float(duration):
                self._worker_report(order, WorkerState.SUCCEEDED, "duration reached")
                return
            if self.heartbeats.is_set():
                self._worker_report(order, WorkerState.RUNNING, paused=current.action is WorkerAction.PAUSE)
            time.sleep(min(order.heartbeat_s, 1.0))


class SimEdge:
    """An edge node registered, enrolled and connected by the suite."""

    def __init__(self, target: Target, node_id: str, identity: Identity) -> None:
        self.target, self.node_id, self.identity = target, node_id, identity
        self.issued: CertificateIssued = identity.issued  # type: ignore[assignment]
        will = envelope(node_id, StateBody(state=ConnectionState.OFFLINE, reason="will")).model_dump_json().encode()
        self.peer = MqttPeer(target, identity, will=(NODE_STATE.topic(node_id=node_id), will))
        self.node = Endpoint(self, node_id, _node_topics(node_id))
        self.devices: dict[str, Endpoint] = {}
        self.running = threading.Event()
        self._beat: threading.Thread | None = None
        self._key: Ed25519PublicKey | None = None
        self.peer.handlers.append(self._dispatch)

    # ---- provisioning --------------------------------------------------------------------------------
    @classmethod
    def register(cls, target: Target, name: str, labels: dict[str, str] | None = None) -> SimEdge:
        """``POST /nodes``, a key and CSR made here, ``POST /nodes/{id}/certificate`` with the token."""
        reg = target.ok("POST", "/nodes", NodeRegistered, json={"name": name, "labels": target.labels(**(labels or {}))})
        key_pem, csr = make_csr(reg.node.id)
        issued = target.ok("POST", f"/nodes/{reg.node.id}/certificate", CertificateIssued, token=None,
                           json={"csr_pem": csr, "bootstrap_token": reg.bootstrap_token})  # fmt: skip
        if issued.node_id != reg.node.id:
            raise Unexpected(f"certificate issued for {issued.node_id}, asked for {reg.node.id}")
        return cls(target, reg.node.id, Identity(target.work_dir / reg.node.id, reg.node.id, key_pem, issued, issued.ca_pem))

    def signing_key(self) -> Ed25519PublicKey:
        if self._key is None:
            pem = self.issued.signing_key_pem or self.target.call("GET", "/signing-key.pub", token=None).text
            key = serialization.load_pem_public_key(pem.encode() if isinstance(pem, str) else pem)
            assert isinstance(key, Ed25519PublicKey), "the hub's signing key is not Ed25519"
            self._key = key
        return self._key

    @property
    def heartbeat_interval_s(self) -> float:
        return self.issued.heartbeat_interval_s

    # ---- connection ----------------------------------------------------------------------------------
    def start(self, heartbeat: bool = True) -> SimEdge:
        """Connect, subscribe to its own desired and cmd, publish online, heartbeat."""
        if not self.peer.connect():
            raise Unexpected(f"node {self.node_id}: the broker refused its certificate ({self.peer.connect_reason})")
        self.running.set()
        for topic in (NODE_DESIRED.topic(node_id=self.node_id), NODE_CMD.topic(node_id=self.node_id)):
            codes = self.peer.subscribe(topic)
            if any(c.is_failure for c in codes):
                raise Unexpected(f"node {self.node_id} may not subscribe to its own {topic}: {codes}")
        self.node.online()
        if heartbeat:
            self.node.heartbeats.set()
        self._beat = threading.Thread(target=self._beat_loop, daemon=True)
        self._beat.start()
        return self

    def _beat_loop(self) -> None:
        while self.running.is_set():
            for ep in [self.node, *self.devices.values()]:
                if ep.heartbeats.is_set() and self.peer.connected.is_set():
                    try:
                        ep.heartbeat()
                    except Exception:  # noqa: BLE001 - a lost connection ends the loop's use, not the suite
                        pass
            time.sleep(self.heartbeat_interval_s)

    def _dispatch(self, message: Received) -> None:
        for ep in [self.node, *self.devices.values()]:
            if message.topic in (ep.topics.desired, ep.topics.cmd):
                ep.handle(message)

    def stop(self, with_will: bool = False) -> None:
        """Leave: a clean offline (default) or the last will."""
        self.running.clear()
        if self.peer.connected.is_set():
            if not with_will:
                self.node.offline()
            self.peer.disconnect(with_will=with_will)

    # ---- devices it relays ---------------------------------------------------------------------------
    def add_device(self, name: str, labels: dict[str, str] | None = None, model: str = "conformance-board") -> Endpoint:
        """``POST /devices`` under this node; the device's channels as this edge relays them."""
        device = self.target.ok("POST", "/devices", DevicePublic, json={"node_id": self.node_id, "name": name, "model": model,
                                                                        "labels": self.target.labels(**(labels or {}))})  # fmt: skip
        ep = Endpoint(self, device.id, _relay_topics(self.node_id, device.id))
        self.devices[device.id] = ep
        for topic in (ep.topics.desired, ep.topics.cmd):
            codes = self.peer.subscribe(topic)
            if any(c.is_failure for c in codes):
                raise Unexpected(f"edge {self.node_id} may not subscribe to its device's {topic}: {codes}")
        return ep

    def device_online(self, ep: Endpoint, heartbeat: bool = True) -> None:
        ep.online()
        if heartbeat:
            ep.heartbeats.set()


def _node_topics(node_id: str) -> _Topics:
    t = {"node_id": node_id}
    return _Topics(NODE_STATE.topic(**t), NODE_HEARTBEAT.topic(**t), NODE_DESIRED.topic(**t), NODE_REPORTED.topic(**t), NODE_CMD.topic(**t),
                   NODE_CMD_REPLY.topic(**t), NODE_EVENTS.topic(**t))  # fmt: skip


def _relay_topics(node_id: str, device_id: str) -> _Topics:
    t = {"node_id": node_id, "device_id": device_id}
    return _Topics(RELAY_STATE.topic(**t), RELAY_HEARTBEAT.topic(**t), RELAY_DESIRED.topic(**t), RELAY_REPORTED.topic(**t),
                   RELAY_CMD.topic(**t), RELAY_CMD_REPLY.topic(**t), RELAY_EVENTS.topic(**t))  # fmt: skip


def enrol_device(target: Target, device_id: str) -> Identity:
    """A device's own certificate: ``POST /devices/{id}/bootstrap-token`` then ``/certificate`` with a CSR."""
    token = target.ok("POST", f"/devices/{device_id}/bootstrap-token", json={})["bootstrap_token"]
    key_pem, csr = make_csr(device_id)
    issued = target.ok("POST", f"/devices/{device_id}/certificate", DeviceCertificateIssued, token=None,
                       json={"csr_pem": csr, "bootstrap_token": token})  # fmt: skip
    return Identity(target.work_dir / device_id, device_id, key_pem, issued, issued.ca_pem)


def device_peer(target: Target, identity: Identity) -> MqttPeer:
    will = envelope(identity.ident, StateBody(state=ConnectionState.OFFLINE, reason="will")).model_dump_json().encode()
    return MqttPeer(target, identity, will=(DEVICE_STATE.topic(device_id=identity.ident), will))


__all__ = ["SimEdge", "Endpoint", "MqttPeer", "Identity", "enrol_device", "device_peer", "resources", "make_csr", "publish_model"]
