"""The edge relays between the hub (RELAY_* under its own subtree) and its devices (DEVICE_*), with real
brokers: desired documents, commands and their answers, and what devices send."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from interfaces.messages import (
    CommandBody,
    CommandResultBody,
    ConnectionState,
    DesiredBody,
    EventBody,
    HeartbeatBody,
    ReportedBody,
    StateBody,
    envelope,
)
from interfaces.resources import Resources
from interfaces.topics import (
    DEVICE_CMD,
    DEVICE_CMD_REPLY,
    DEVICE_DESIRED,
    DEVICE_EVENTS,
    DEVICE_HEARTBEAT,
    DEVICE_REPORTED,
    DEVICE_STATE,
    NODE_EVENTS,
    NODE_STATE,
    RELAY_CMD,
    RELAY_CMD_REPLY,
    RELAY_DESIRED,
    RELAY_EVENTS,
    RELAY_HEARTBEAT,
    RELAY_REPORTED,
    RELAY_STATE,
    Tier,
    own_subtree,
)
from tests.edge.support import Mosquitto, Peer, Pki, body, edge_acl, enrol_node, needs_mosquitto, start_edge, stop_edge

pytestmark = [pytest.mark.broker, needs_mosquitto]

NODE = "nd-edge1"
DEVICES = ("dev-a", "dev-b")


def wire(src: str, message_body: object) -> bytes:
    return envelope(src, message_body).model_dump_json().encode()  # type: ignore[arg-type]


def answer_commands(device: Peer, message: mqtt.MQTTMessage) -> None:
    """A device that answers every command with its arguments."""
    if message.topic != DEVICE_CMD.topic(device_id=device.cn):
        return
    request = json.loads(message.payload)
    reply = envelope(
        device.cn, CommandResultBody(ok=True, result={"echo": request["body"]["args"]}), reply_to=request["id"]
    )
    props = Properties(PacketTypes.PUBLISH)
    props.CorrelationData = message.properties.CorrelationData  # type: ignore[union-attr]
    device.client.publish(message.properties.ResponseTopic, reply.model_dump_json().encode(), qos=1, properties=props)  # type: ignore[union-attr]


def command(hub: Peer, device_id: str, correlation: bytes, payload: bytes) -> mqtt.MQTTMessage:
    """Send a command as the hub does and return the answer carrying ``correlation``."""
    props = Properties(PacketTypes.PUBLISH)
    reply_topic = RELAY_CMD_REPLY.topic(node_id=NODE, device_id=device_id)
    props.ResponseTopic, props.CorrelationData = reply_topic, correlation
    hub.publish(RELAY_CMD.topic(node_id=NODE, device_id=device_id), payload, properties=props)
    return hub.expect(reply_topic, where=lambda m: m.properties.CorrelationData == correlation)  # type: ignore[union-attr]


@pytest.fixture
def two_brokers(tmp_path: Path, pki: Pki, cleanup: list[Callable[[], object]]) -> tuple[Mosquitto, Mosquitto]:
    up = Mosquitto(tmp_path / "upstream", pki, edge_acl(NODE, DEVICES)).start()
    down = Mosquitto(tmp_path / "downstream", pki, edge_acl(NODE, DEVICES)).start()
    cleanup += [up.stop, down.stop]
    return up, down


def test_desired_documents_and_commands_reach_devices(
    tmp_path: Path, pki: Pki, two_brokers: tuple[Mosquitto, Mosquitto], cleanup: list[Callable[[], object]]
) -> None:
    # Prepare: the hub's retained desired documents are there before the edge starts
    up, down = two_brokers
    hub = Peer(up, pki, "hub", [own_subtree(Tier.NODE, NODE)])
    device = Peer(
        down,
        pki,
        "dev-a",
        [DEVICE_DESIRED.topic(device_id="dev-a"), DEVICE_CMD.topic(device_id="dev-a")],
        on_message=answer_commands,
    )
    cleanup += [hub.close, device.close]
    desired_a = wire("hub", DesiredBody(version=3, spec={"model": "m-1"}))
    hub.publish(RELAY_DESIRED.topic(node_id=NODE, device_id="dev-a"), desired_a, retain=True)
    hub.publish(RELAY_DESIRED.topic(node_id=NODE, device_id="dev-b"), wire("hub", DesiredBody(version=1)), retain=True)
    node_dir = enrol_node(tmp_path / "node", pki.ca, NODE, up.url).data_dir

    # Execute
    edge = start_edge(node_dir, NODE, "--downstream-mqtt-url", down.url, "--device-listen", "off")
    cleanup.append(lambda: stop_edge(edge))

    # Assert: the hub's envelope reaches the device unchanged, and stays retained on the devices' broker
    assert device.expect(DEVICE_DESIRED.topic(device_id="dev-a")).payload == desired_a
    device.close()
    late = Peer(down, pki, "dev-a", [DEVICE_DESIRED.topic(device_id="dev-a")])
    cleanup.append(late.close)
    retained = late.expect(DEVICE_DESIRED.topic(device_id="dev-a"))
    assert (retained.payload, retained.retain) == (desired_a, True)
    late.close()
    device = Peer(down, pki, "dev-a", [DEVICE_CMD.topic(device_id="dev-a")], on_message=answer_commands)
    cleanup.append(device.close)

    # a command round trip keeps the hub's correlation data; the device sees the edge's own
    request = wire("hub", CommandBody(name="blink", args={"times": 2}))
    answer = command(hub, "dev-a", b"corr-1", request)
    assert (json.loads(answer.payload)["src"], json.loads(answer.payload)["reply_to"]) == (
        "dev-a",
        json.loads(request)["id"],
    )
    assert body(answer) == {"ok": True, "result": {"echo": {"times": 2}}, "error_code": None, "error": None}
    seen = device.expect(DEVICE_CMD.topic(device_id="dev-a"))
    assert seen.payload == request
    assert seen.properties.ResponseTopic == DEVICE_CMD_REPLY.topic(device_id="dev-a")  # type: ignore[union-attr]
    assert seen.properties.CorrelationData != b"corr-1"  # type: ignore[union-attr]

    # never silence: unknown device, a device that does not answer, a malformed command
    assert (
        body(command(hub, "ghost", b"corr-2", wire("hub", CommandBody(name="blink"))))["error_code"] == "unknown_device"
    )
    timed_out = body(command(hub, "dev-b", b"corr-3", wire("hub", CommandBody(name="blink", timeout_s=0.5))))
    assert (timed_out["ok"], timed_out["error_code"]) == (False, "timeout")
    assert body(command(hub, "dev-a", b"corr-4", b'{"v": 1}'))["error_code"] == "validation_failed"

    # the hub clears a device's desired document: the edge forgets the device and clears it downstream
    hub.publish(RELAY_DESIRED.topic(node_id=NODE, device_id="dev-a"), b"", retain=True)
    forgotten = body(command(hub, "dev-a", b"corr-5", wire("hub", CommandBody(name="blink"))))
    assert forgotten["error_code"] == "unknown_device"
    device.close()
    late = Peer(down, pki, "dev-a", [DEVICE_DESIRED.topic(device_id="dev-a")])
    cleanup.append(late.close)
    assert late.drain(DEVICE_DESIRED.topic(device_id="dev-a"), quiet_s=0.3) == []
    assert down.connections_of("dev-a") == 4  # each peer connected once: no two fought over the client id

    assert stop_edge(edge) == 0


def test_device_messages_reach_the_hub_unchanged_and_in_order(
    tmp_path: Path, pki: Pki, two_brokers: tuple[Mosquitto, Mosquitto], cleanup: list[Callable[[], object]]
) -> None:
    # Prepare
    up, down = two_brokers
    hub = Peer(up, pki, "hub", [own_subtree(Tier.NODE, NODE)])
    device = Peer(down, pki, "dev-a")
    cleanup += [hub.close, device.close]
    edge = start_edge(
        enrol_node(tmp_path / "node", pki.ca, NODE, up.url).data_dir,
        NODE,
        "--downstream-mqtt-url",
        down.url,
        "--device-listen",
        "off",
    )
    cleanup.append(lambda: stop_edge(edge))
    hub.expect(NODE_STATE.topic(node_id=NODE), where=lambda m: body(m)["state"] == "online")
    # the downstream link is up once the device's retained state comes back relayed
    state = wire("dev-a", StateBody(state=ConnectionState.ONLINE, agent_version="1.0"))
    device.publish(DEVICE_STATE.topic(device_id="dev-a"), state, retain=True)
    assert hub.expect(RELAY_STATE.topic(node_id=NODE, device_id="dev-a")).payload == state

    # Execute
    events = [wire("dev-a", EventBody(seq=i, type="progress", data={"i": i})) for i in range(30)]
    for event in events:
        device.publish(DEVICE_EVENTS.topic(device_id="dev-a"), event)
    reported = wire("dev-a", ReportedBody(version=3, status={"model": "m-1"}))
    device.publish(DEVICE_REPORTED.topic(device_id="dev-a"), reported)
    heartbeat = wire(
        "dev-a", HeartbeatBody(seq=0, agent_version="1.0", uptime_s=1, resources=Resources.model_validate(_RESOURCES))
    )
    device.publish(DEVICE_HEARTBEAT.topic(device_id="dev-a"), heartbeat, qos=0)
    device.publish(DEVICE_EVENTS.topic(device_id="dev-a"), b'{"v": 1, "body": {}}')

    # Assert
    relayed = [hub.expect(RELAY_EVENTS.topic(node_id=NODE, device_id="dev-a")).payload for _ in events]
    assert relayed == events
    assert hub.expect(RELAY_REPORTED.topic(node_id=NODE, device_id="dev-a")).payload == reported
    assert hub.expect(RELAY_HEARTBEAT.topic(node_id=NODE, device_id="dev-a")).payload == heartbeat
    rejected = hub.expect(NODE_EVENTS.topic(node_id=NODE), where=lambda m: body(m)["type"] == "message_rejected")
    assert body(rejected)["data"]["device_id"] == "dev-a"
    assert hub.drain(RELAY_EVENTS.topic(node_id=NODE, device_id="dev-a"), quiet_s=0.3) == []  # each exactly once
    assert stop_edge(edge) == 0


def test_one_connection_serves_both_roles_when_devices_use_the_hubs_broker(
    tmp_path: Path, pki: Pki, cleanup: list[Callable[[], object]]
) -> None:
    # Prepare
    broker = Mosquitto(tmp_path / "broker", pki, edge_acl(NODE, DEVICES)).start()
    cleanup.append(broker.stop)
    hub = Peer(broker, pki, "hub", [own_subtree(Tier.NODE, NODE)])
    device = Peer(
        broker,
        pki,
        "dev-a",
        [DEVICE_DESIRED.topic(device_id="dev-a"), DEVICE_CMD.topic(device_id="dev-a")],
        on_message=answer_commands,
    )
    cleanup += [hub.close, device.close]
    desired = wire("hub", DesiredBody(version=1, spec={"x": 1}))

    # Execute
    edge = start_edge(enrol_node(tmp_path / "node", pki.ca, NODE, broker.url).data_dir, NODE, "--device-listen", "off")
    cleanup.append(lambda: stop_edge(edge))
    hub.expect(NODE_STATE.topic(node_id=NODE), where=lambda m: body(m)["state"] == "online")
    hub.publish(RELAY_DESIRED.topic(node_id=NODE, device_id="dev-a"), desired, retain=True)

    # Assert
    assert device.expect(DEVICE_DESIRED.topic(device_id="dev-a")).payload == desired
    assert body(command(hub, "dev-a", b"c-1", wire("hub", CommandBody(name="blink"))))["ok"] is True
    event = wire("dev-a", EventBody(seq=1, type="log", message="hello"))
    device.publish(DEVICE_EVENTS.topic(device_id="dev-a"), event)
    assert hub.expect(RELAY_EVENTS.topic(node_id=NODE, device_id="dev-a")).payload == event
    assert stop_edge(edge) == 0
    log = broker.log.read_text()
    assert broker.connections_of(NODE) == 1, log
    assert "already connected" not in log


_RESOURCES = {
    "cpu": {"cores": 4, "utilisation": 0.1},
    "memory": {"total_bytes": 1024, "available_bytes": 512},
    "disk": {"path": "/", "total_bytes": 2048, "free_bytes": 1024},
    "network": {"bytes_sent": 0, "bytes_received": 0},
    "accelerators": [],
}


def test_a_device_first_heard_of_by_its_heartbeat_gets_its_desired_document_again(
    tmp_path: Path, pki: Pki, cleanup: list[Callable[[], object]]
) -> None:
    # Prepare: the devices' broker does not know dev-c yet (its access list is rewritten, then reloaded, a moment
    # after the hub admits a device): dev-c connects and subscribes, but reads nothing and its "online" is dropped
    up = Mosquitto(tmp_path / "upstream", pki, edge_acl(NODE, (*DEVICES, "dev-c"))).start()
    before = f"user {NODE}\ntopic readwrite synergy/v1/devices/#\nuser hub\ntopic read synergy/v1/devices/#\n"
    down = Mosquitto(tmp_path / "downstream", pki, before).start()
    cleanup += [up.stop, down.stop]
    hub = Peer(up, pki, "hub", [own_subtree(Tier.NODE, NODE)])
    cleanup.append(hub.close)
    desired = wire("hub", DesiredBody(version=2, spec={"rate": 5}))
    hub.publish(RELAY_DESIRED.topic(node_id=NODE, device_id="dev-c"), desired, retain=True)
    node_dir = enrol_node(tmp_path / "node", pki.ca, NODE, up.url).data_dir
    edge = start_edge(node_dir, NODE, "--downstream-mqtt-url", down.url, "--device-listen", "off")
    cleanup.append(lambda: stop_edge(edge))
    watcher = Peer(down, pki, "hub", [DEVICE_DESIRED.topic(device_id="dev-c")])  # reads what the edge relays down
    cleanup.append(watcher.close)
    assert watcher.expect(DEVICE_DESIRED.topic(device_id="dev-c")).payload == desired  # relayed, retained
    device = Peer(down, pki, "dev-c", [DEVICE_DESIRED.topic(device_id="dev-c")])
    cleanup.append(device.close)
    device.publish(DEVICE_STATE.topic(device_id="dev-c"), wire("dev-c", StateBody(state=ConnectionState.ONLINE)), retain=True)

    # Execute: the broker learns dev-c (as it does on a reload); dev-c goes on with its heartbeats
    (down.dir / "acl").write_text(before + "user dev-c\ntopic readwrite synergy/v1/devices/dev-c/#\n")
    assert down.process is not None
    down.process.send_signal(signal.SIGHUP)
    heartbeat = wire(
        "dev-c", HeartbeatBody(seq=0, agent_version="1.0", uptime_s=1, resources=Resources.model_validate(_RESOURCES))
    )
    hub_heard = RELAY_HEARTBEAT.topic(node_id=NODE, device_id="dev-c")
    deadline = time.monotonic() + 60
    while True:  # a heartbeat sent before the reload is dropped like the online was; the hub hears the first after it
        device.publish(DEVICE_HEARTBEAT.topic(device_id="dev-c"), heartbeat, qos=0)
        try:
            hub.expect(hub_heard, timeout=0.5)
            break
        except AssertionError:
            assert time.monotonic() < deadline, "no heartbeat of dev-c got through the reloaded access list"

    # Assert: the edge took that heartbeat as the device's first sign of life and sent the document again
    assert device.expect(DEVICE_DESIRED.topic(device_id="dev-c"), timeout=30).payload == desired
