"""The edge agent against a real Mosquitto over mutual TLS: state, heartbeats, commands, desired, will."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from edge.identity import IdentityStore
from edge.store import EdgeStore, Scope
from interfaces.ids import new_id
from interfaces.messages import CommandBody, DesiredBody, envelope
from interfaces.topics import NODE_CMD, NODE_CMD_REPLY, NODE_DESIRED, NODE_STATE, Tier, acl_pattern, own_subtree
from tests.edge.support import MOSQUITTO, REPO, free_port, listening, needs_mosquitto

pytestmark = [pytest.mark.broker, needs_mosquitto]


@pytest.fixture
def broker(tmp_path: Path, test_ca) -> Iterator[tuple[int, Path]]:  # type: ignore[no-untyped-def]
    port, pki = free_port(), tmp_path / "pki"
    pki.mkdir()
    (pki / "ca.crt").write_text(test_ca.pem)
    crt, key = test_ca.write_identity(pki, "broker", server=True)
    test_ca.write_identity(pki, "hub")
    (pki / "acl").write_text(f"user hub\ntopic readwrite synergy/v1/#\npattern readwrite {acl_pattern(Tier.NODE)}\n")
    (pki / "mosquitto.conf").write_text(
        f"allow_anonymous false\npersistence false\nacl_file {pki / 'acl'}\nlistener {port} 127.0.0.1\n"
        f"cafile {pki / 'ca.crt'}\ncertfile {crt}\nkeyfile {key}\n"
        "require_certificate true\nuse_identity_as_username true\n" + ("user root\n" if os.geteuid() == 0 else "")
    )
    process = subprocess.Popen(
        [str(MOSQUITTO), "-c", str(pki / "mosquitto.conf")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 5
    while not listening(port):
        assert time.monotonic() < deadline and process.poll() is None, "mosquitto did not start"
        time.sleep(0.05)
    yield port, pki
    process.terminate()
    process.wait(5)


class Hub:
    """A paho client with the hub's identity that records everything under one node's subtree."""

    def __init__(self, port: int, pki: Path, node_id: str) -> None:
        self.node_id, self.received = node_id, queue.Queue[mqtt.MQTTMessage]()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=new_id("hub"), protocol=mqtt.MQTTv5)
        self.client.tls_set(ca_certs=str(pki / "ca.crt"), certfile=str(pki / "hub.crt"), keyfile=str(pki / "hub.key"))
        self.client.on_message = lambda client, userdata, message: self.received.put(message)
        self.client.connect("127.0.0.1", port)
        self.client.subscribe(own_subtree(Tier.NODE, node_id), qos=1)
        self.client.loop_start()

    def expect(self, channel: str, timeout: float = 60.0, **body: object) -> tuple[mqtt.MQTTMessage, dict]:
        """The next message on ``channel`` whose body contains ``body``."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                message = self.received.get(timeout=left)
            except queue.Empty:
                break
            payload = json.loads(message.payload)
            if message.topic.endswith(f"/{self.node_id}/{channel}") and body.items() <= payload["body"].items():
                return message, payload
        raise AssertionError(f"nothing on {channel} with {body} within {timeout} s")

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()

    def publish(
        self, topic: str, payload: bytes, qos: int, retain: bool = False, properties: Properties | None = None
    ) -> None:
        self.client.publish(topic, payload, qos=qos, retain=retain, properties=properties).wait_for_publish(5)


def _start_agent(node_dir: Path, node_id: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "edge.cli", "run", "--node-id", node_id, "--data-dir", str(node_dir)], cwd=REPO
    )


def test_agent_session_over_mutual_tls(tmp_path: Path, broker: tuple[int, Path], test_ca) -> None:  # type: ignore[no-untyped-def]
    port, pki = broker
    node_id = new_id("nd")
    store = IdentityStore(tmp_path / "node")
    store.save(
        test_ca.issue(store.make_csr(node_id), node_id, f"mqtts://127.0.0.1:{port}", heartbeat_s=0.2), "http://hub"
    )
    hub = Hub(port, pki, node_id)
    agent = _start_agent(store.data_dir, node_id)
    try:
        hub.expect("state", state="online")
        hub.expect("heartbeat", seq=1)

        request = envelope("hub", CommandBody(name="ping"))
        props = Properties(PacketTypes.PUBLISH)
        props.ResponseTopic, props.CorrelationData = NODE_CMD_REPLY.topic(node_id=node_id), b"corr-1"
        hub.publish(NODE_CMD.topic(node_id=node_id), request.model_dump_json().encode(), NODE_CMD.qos, properties=props)
        reply, body = hub.expect("cmd/reply", ok=True)
        assert (reply.properties.CorrelationData, body["reply_to"], body["body"]["result"]["pong"]) == (
            b"corr-1",
            request.id,
            True,
        )

        props.CorrelationData = b"corr-2"
        unknown = envelope("hub", CommandBody(name="format-disk")).model_dump_json().encode()
        hub.publish(NODE_CMD.topic(node_id=node_id), unknown, NODE_CMD.qos, properties=props)
        reply, body = hub.expect("cmd/reply", ok=False, error_code="unknown_command")
        assert reply.properties.CorrelationData == b"corr-2"

        desired = envelope("hub", DesiredBody(version=4, spec={"models": []})).model_dump_json().encode()
        hub.publish(NODE_DESIRED.topic(node_id=node_id), desired, NODE_DESIRED.qos, retain=NODE_DESIRED.retain)
        hub.expect("reported", version=4)
        stored = EdgeStore(store.data_dir / "edge.db")
        assert json.loads(stored.desired(Scope.NODE, node_id).payload)["body"]["version"] == 4  # type: ignore[union-attr]
        stored.close()

        agent.send_signal(signal.SIGTERM)
        assert agent.wait(10) == 0
        hub.expect("state", state="offline", reason="shutdown")

        agent = _start_agent(store.data_dir, node_id)
        hub.expect("state", state="online")
        hub.expect("reported", version=4)  # the retained desired document comes back after a restart
        agent.kill()
        agent.wait(5)
        hub.expect("state", state="offline", reason="will")
        late = Hub(port, pki, node_id)  # a subscriber arriving later still learns the node is offline
        message, _ = late.expect("state", state="offline", reason="will")
        assert message.retain and NODE_STATE.retain
        late.close()
    finally:
        agent.kill()
        agent.wait(5)
        hub.close()
