"""The edge node as a deployment target, through the real ``aisynergy edge run`` and a real Mosquitto: the
order arrives in the node's retained desired document, progress leaves as node events with growing seq
numbers, the model answers ``infer`` on the node's ``cmd``, and the reported status lists it."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from cloud.signing import SigningKey
from interfaces.deployments import EXECUTION_EVENT, INSTALLED_KEY, ArtifactFormat, ArtifactKind, DeploymentOrder
from interfaces.ids import new_id
from interfaces.messages import CommandBody, DesiredBody, envelope
from interfaces.topics import NODE_CMD, NODE_CMD_REPLY, NODE_DESIRED, NODE_EVENTS, NODE_REPORTED
from tests.device.ota_support import V1, V2, BlobServer, blob_server, make_order
from tests.edge.support import (
    Mosquitto,
    Peer,
    Pki,
    ThrowawayCA,
    body,
    edge_acl,
    enrol_node,
    needs_mosquitto,
    start_edge,
    stop_edge,
)

pytestmark = [pytest.mark.broker, needs_mosquitto]

FINAL = {"ACTIVE", "REJECTED", "FAILED", "ROLLED_BACK", "ROLLBACK_FAILED", "TIMED_OUT"}
X = np.ones((1, 128), dtype=np.float32)


class Node:
    """One edge node under test: its broker, the hub's MQTT peer, the artefact server and the agent process."""

    def __init__(self, tmp_path: Path, pki: Pki, ca: ThrowawayCA, server: BlobServer) -> None:
        self.node_id = new_id("nd")
        self.signing = SigningKey.load_or_create(tmp_path / "hub-pki")
        self.server = server
        self.broker = Mosquitto(tmp_path / "broker", pki, edge_acl(self.node_id, [])).start()
        self.hub = Peer(self.broker, pki, "hub", [f"synergy/v1/nodes/{self.node_id}/#"])
        identity = enrol_node(tmp_path / "node", ca, self.node_id, self.broker.url, hub_url=server.url)
        identity.pin_signing_key(self.signing.public_pem)
        self.data_dir = identity.data_dir
        self.process: subprocess.Popen[bytes] | None = None
        self._desired_version = 0
        self._calls = 0

    def start(self) -> None:
        self.process = start_edge(self.data_dir, self.node_id, "--device-listen", "off")
        self.hub.expect(f"synergy/v1/nodes/{self.node_id}/state", where=lambda m: body(m)["state"] == "online")

    def stop(self) -> None:
        if self.process is not None:
            assert stop_edge(self.process) == 0
            self.process = None

    def close(self) -> None:
        self.stop()
        self.hub.close()
        self.broker.stop()

    def order(self, data: bytes, version: str, **options: object) -> DeploymentOrder:
        return make_order(self.signing, self.server, data, version, **options)  # type: ignore[arg-type]

    def desire(self, *orders: DeploymentOrder) -> int:
        """Publish a new retained desired document carrying ``orders``; its version."""
        self._desired_version += 1
        desired = DesiredBody(version=self._desired_version, deployments=list(orders), deployments_version=self._desired_version)
        payload = envelope("hub", desired).model_dump_json().encode()
        self.hub.publish(NODE_DESIRED.topic(node_id=self.node_id), payload, qos=NODE_DESIRED.qos, retain=True)
        return self._desired_version

    def progress(self, execution_id: str, timeout: float = 30.0) -> list[dict]:
        """The execution events of ``execution_id`` up to its final state, in arrival order."""
        events: list[dict] = []
        topic = NODE_EVENTS.topic(node_id=self.node_id)
        while not events or events[-1]["data"]["state"] not in FINAL:
            message = self.hub.expect(topic, timeout, where=lambda m: _execution(m) == execution_id)
            events.append(body(message))
        return events

    def reported(self, version: int, timeout: float = 15.0) -> list[dict]:
        """The statuses of both reports of desired ``version``: on arrival, and after its orders were applied."""
        topic = NODE_REPORTED.topic(node_id=self.node_id)
        return [body(self.hub.expect(topic, timeout, where=lambda m: body(m)["version"] == version))["status"] for _ in range(2)]

    def command(self, name: str, args: dict | None = None) -> dict:
        self._calls += 1
        correlation = f"c-{self._calls}".encode()
        props = Properties(PacketTypes.PUBLISH)
        props.ResponseTopic, props.CorrelationData = NODE_CMD_REPLY.topic(node_id=self.node_id), correlation
        request = envelope("hub", CommandBody(name=name, args=args or {})).model_dump_json().encode()
        self.hub.publish(NODE_CMD.topic(node_id=self.node_id), request, qos=NODE_CMD.qos, properties=props)
        reply = self.hub.expect(NODE_CMD_REPLY.topic(node_id=self.node_id), 15, where=lambda m: m.properties.CorrelationData == correlation)
        return body(reply)


def _execution(message: mqtt.MQTTMessage) -> str | None:
    event = body(message)
    return event["data"].get("execution_id") if event.get("type") == EXECUTION_EVENT else None


def _installed(order: DeploymentOrder) -> dict:
    """What the reported status lists for ``order`` (the ACTIVE event leaves out the empty ``slot``)."""
    m = order.signed_manifest.manifest
    return {"name": m.name, "version": m.version, "sha256": m.sha256, "artifact_id": order.artifact_id, "slot": None}


@pytest.fixture
def node(tmp_path: Path, pki: Pki, test_ca: ThrowawayCA) -> Iterator[Node]:
    with blob_server() as server:
        node = Node(tmp_path, pki, test_ca, server)
        try:
            yield node
        finally:
            node.close()


def test_a_retained_order_installs_a_model_that_answers_infer_and_survives_a_restart(node: Node) -> None:
    # Prepare: the order waits in the retained document before the edge starts
    v2 = node.order(V2, "1.1.0")
    version = node.desire(v2)

    # Execute
    node.start()
    events = node.progress(v2.execution_id)
    status = node.reported(version)
    answer = node.command("infer", {"inputs": {"x": X.tolist()}})
    listed = node.command("models")

    # Assert
    assert [e["data"]["state"] for e in events] == ["DOWNLOADING", "DOWNLOADED", "VERIFYING", "INSTALLING", "ACTIVE"]
    seqs = [e["seq"] for e in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert {**events[-1]["data"]["installed"], "slot": None} == _installed(v2)
    assert status == [{}, {INSTALLED_KEY: {"model": _installed(v2)}}]
    assert answer["ok"], answer
    assert answer["result"]["model"] == {"name": "classifier", "version": "1.1.0"}
    expected = ort.InferenceSession(V2, providers=["CPUExecutionProvider"]).run(None, {"x": X})[0]
    np.testing.assert_allclose(np.array(answer["result"]["outputs"]["probabilities"]), expected, rtol=1e-6)
    assert [m["version"] for m in listed["result"]["models"]] == ["1.1.0"]
    assert node.server.paths() == [v2.path]

    # Execute: a downgrade without allow_downgrade
    v1 = node.order(V1, "1.0.0")
    downgrade = node.desire(v1)
    refused = node.progress(v1.execution_id)

    # Assert: refused before a byte was fetched; 1.1.0 still installed and serving
    assert [e["data"]["state"] for e in refused] == ["REJECTED"]
    assert "downgrade" in refused[0]["data"]["detail"] and refused[0]["severity"] == "error"
    assert refused[0]["seq"] > seqs[-1]
    assert node.reported(downgrade) == [{INSTALLED_KEY: {"model": _installed(v2)}}] * 2
    assert node.server.paths() == [v2.path]

    # Execute: the edge restarts with the finished install retained again
    node.desire(v2)
    assert [e["data"]["state"] for e in node.progress(v2.execution_id)] == ["ACTIVE"]
    node.stop()
    node.start()
    again = node.progress(v2.execution_id)
    answer = node.command("infer", {"inputs": {"x": X.tolist()}})

    # Assert: only the final state is reported again; nothing downloaded or installed again; the model
    # loaded at start serves
    assert [e["data"]["state"] for e in again] == ["ACTIVE"]
    assert again[0]["seq"] > refused[0]["seq"]
    assert node.server.paths() == [v2.path]
    assert answer["ok"] and answer["result"]["model"]["version"] == "1.1.0"


def test_a_tampered_artefact_and_a_firmware_order_are_rejected_and_install_nothing(node: Node) -> None:
    # Prepare
    tampered = node.order(V1, "1.0.0", served=V1[:-1] + bytes([V1[-1] ^ 1]))
    firmware = node.order(b"firmware image", "2.0.0", kind=ArtifactKind.FIRMWARE, fmt=ArtifactFormat.FIRMWARE)
    node.start()

    # Execute
    version = node.desire(tampered)
    events = node.progress(tampered.execution_id)
    status = node.reported(version)
    answer = node.command("infer", {"inputs": {"x": X.tolist()}})
    listed = node.command("models")
    node.desire(firmware)
    refused = node.progress(firmware.execution_id)

    # Assert
    assert [e["data"]["state"] for e in events] == ["DOWNLOADING", "DOWNLOADED", "VERIFYING", "REJECTED"]
    assert events[-1]["data"]["detail"].startswith("SHA-256")
    assert status == [{}, {}]
    assert not answer["ok"] and "no model" in answer["error"]
    assert listed["result"] == {"models": []}
    assert not list((node.data_dir / "ota" / "models").glob("*/*"))
    assert [e["data"]["state"] for e in refused] == ["REJECTED"]
    assert "edge node takes no firmware" in refused[0]["data"]["detail"]
    assert node.server.paths() == [tampered.path]
    state = node.data_dir / "ota" / "state.json"
    assert not state.exists() or json.loads(state.read_text())["current"] == {}
