"""Store-and-forward: while the hub's broker is away the devices keep working, their events wait in the
outbox, and after it comes back every event reaches the hub once, in order; heartbeats are not queued."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest

from interfaces.messages import ConnectionState, DesiredBody, EventBody, HeartbeatBody, StateBody, envelope
from interfaces.resources import Resources
from interfaces.topics import (
    DEVICE_DESIRED,
    DEVICE_EVENTS,
    DEVICE_HEARTBEAT,
    DEVICE_STATE,
    NODE_STATE,
    RELAY_DESIRED,
    RELAY_EVENTS,
    RELAY_HEARTBEAT,
    RELAY_STATE,
    Tier,
    own_subtree,
)
from tests.edge.support import (
    Mosquitto,
    Peer,
    Pki,
    body,
    edge_acl,
    enrol_node,
    needs_mosquitto,
    start_edge,
    stop_edge,
    wait_until,
)

pytestmark = [pytest.mark.broker, needs_mosquitto]

NODE, DEVICE = "nd-edge2", "dev-a"


EVENTS = [
    envelope(DEVICE, EventBody(seq=seq, type="progress", data={"seq": seq})).model_dump_json().encode()
    for seq in range(45)
]


def heartbeat(seq: int) -> bytes:
    resources = Resources.model_validate(
        {
            "cpu": {"cores": 1, "utilisation": 0},
            "memory": {"total_bytes": 1, "available_bytes": 1},
            "disk": {"path": "/", "total_bytes": 1, "free_bytes": 1},
            "network": {"bytes_sent": 0, "bytes_received": 0},
        }
    )
    return (
        envelope(DEVICE, HeartbeatBody(seq=seq, agent_version="1", uptime_s=seq, resources=resources))
        .model_dump_json()
        .encode()
    )


def outbox_rows(node_dir: Path) -> int:
    with sqlite3.connect(node_dir / "edge.db") as db:
        return int(db.execute("SELECT COUNT(*) FROM outbox").fetchone()[0])


def test_events_during_an_upstream_outage_arrive_once_and_in_order(
    tmp_path: Path, pki: Pki, cleanup: list[Callable[[], object]]
) -> None:
    # Prepare: the hub keeps its session on a persistent broker, as the real hub's is
    up = Mosquitto(tmp_path / "upstream", pki, edge_acl(NODE, [DEVICE]), persistent=True).start()
    down = Mosquitto(tmp_path / "downstream", pki, edge_acl(NODE, [DEVICE])).start()
    cleanup += [up.stop, down.stop]
    hub = Peer(up, pki, "hub", [own_subtree(Tier.NODE, NODE)], session_expiry_s=600)
    device = Peer(down, pki, DEVICE, [DEVICE_DESIRED.topic(device_id=DEVICE)])
    cleanup += [hub.close, lambda: device.close()]
    desired = envelope("hub", DesiredBody(version=2, spec={"rate": 5})).model_dump_json().encode()
    hub.publish(RELAY_DESIRED.topic(node_id=NODE, device_id=DEVICE), desired, retain=True)
    node_dir = enrol_node(tmp_path / "node", pki.ca, NODE, up.url).data_dir
    edge = start_edge(node_dir, NODE, "--downstream-mqtt-url", down.url, "--device-listen", "off")
    cleanup.append(lambda: stop_edge(edge))
    assert device.expect(DEVICE_DESIRED.topic(device_id=DEVICE)).payload == desired
    for seq in range(5):
        device.publish(DEVICE_EVENTS.topic(device_id=DEVICE), EVENTS[seq])
    events_topic = RELAY_EVENTS.topic(node_id=NODE, device_id=DEVICE)
    assert [hub.expect(events_topic).payload for _ in range(5)] == EVENTS[:5]
    # every PUBACK is in: otherwise the edge would rightly send again what the broker took but did not ack
    wait_until(lambda: outbox_rows(node_dir) == 0, what="an empty outbox")

    # Execute: the hub's broker goes away; the device goes on working
    up.stop()
    for seq in range(5, 45):
        device.publish(DEVICE_EVENTS.topic(device_id=DEVICE), EVENTS[seq])
    device.publish(DEVICE_HEARTBEAT.topic(device_id=DEVICE), heartbeat(100), qos=0)
    offline = envelope(DEVICE, StateBody(state=ConnectionState.OFFLINE, reason="will")).model_dump_json().encode()
    device.publish(DEVICE_STATE.topic(device_id=DEVICE), offline, retain=True)
    # the 40 events wait in the outbox; the state (the newest of the device) waits beside it, in memory
    wait_until(lambda: outbox_rows(node_dir) == 40, what="40 events in the outbox")
    device.close()  # a device that reconnects during the outage still finds its desired document
    device = Peer(down, pki, DEVICE, [DEVICE_DESIRED.topic(device_id=DEVICE)])
    assert device.expect(DEVICE_DESIRED.topic(device_id=DEVICE)).payload == desired
    up.start()

    # Assert: everything once, in order; the node itself is back online
    received = []
    while not set(EVENTS[5:]) <= {m.payload for m in received}:
        received.append(hub.expect(events_topic, timeout=60))
    # The broker may hand the hub again, flagged DUP, what it took before the outage without the hub's
    # PUBACK, and the edge sends first again what the broker acknowledged just before the session ended (a
    # broker that dies loses what it still held for the hub); the hub drops both by envelope id. After
    # that, what the edge sends carries no DUP flag: each once, in order.
    relayed = [m.payload for m in received if not m.dup]
    resent = 0
    while resent < len(relayed) and relayed[resent] in EVENTS[:5]:
        resent += 1
    assert relayed[:resent] == EVENTS[5 - resent : 5]
    assert relayed[resent:] == EVENTS[5:]
    assert all(m.payload in EVENTS[:5] for m in received if m.dup)
    assert hub.expect(RELAY_STATE.topic(node_id=NODE, device_id=DEVICE)).payload == offline
    hub.expect(NODE_STATE.topic(node_id=NODE), where=lambda m: body(m)["state"] == "online")
    assert hub.drain(events_topic, quiet_s=0.5) == []
    device.publish(DEVICE_HEARTBEAT.topic(device_id=DEVICE), heartbeat(200), qos=0)
    heartbeats = RELAY_HEARTBEAT.topic(node_id=NODE, device_id=DEVICE)
    assert [body(m)["seq"] for m in [hub.expect(heartbeats), *hub.drain(heartbeats, quiet_s=0.2)]] == [200]
    assert outbox_rows(node_dir) == 0
    assert stop_edge(edge) == 0


def test_a_gateway_rebooted_during_an_outage_still_serves_its_devices(
    tmp_path: Path, pki: Pki, cleanup: list[Callable[[], object]]
) -> None:
    # Prepare: the edge learned a desired document, then the hub's broker goes away
    up = Mosquitto(tmp_path / "upstream", pki, edge_acl(NODE, [DEVICE]), persistent=True).start()
    down = Mosquitto(tmp_path / "downstream", pki, edge_acl(NODE, [DEVICE])).start()
    cleanup += [up.stop, down.stop]
    hub = Peer(up, pki, "hub", [own_subtree(Tier.NODE, NODE)], session_expiry_s=600)
    cleanup.append(hub.close)
    desired = envelope("hub", DesiredBody(version=5, spec={"rate": 1})).model_dump_json().encode()
    hub.publish(RELAY_DESIRED.topic(node_id=NODE, device_id=DEVICE), desired, retain=True)
    node_dir = enrol_node(tmp_path / "node", pki.ca, NODE, up.url).data_dir
    options = ("--downstream-mqtt-url", down.url, "--device-listen", "off")
    edge = start_edge(node_dir, NODE, *options)
    cleanup.append(lambda: stop_edge(edge))
    hub.expect(NODE_STATE.topic(node_id=NODE), where=lambda m: body(m)["state"] == "online")
    wait_until(lambda: _stored_desired(node_dir) == desired, what="the desired document stored")
    up.stop()

    # Execute: the gateway reboots, and its devices' broker lost every retained message meanwhile
    assert stop_edge(edge) == 0
    down.stop()
    down.start()
    edge = start_edge(node_dir, NODE, *options)
    device = Peer(down, pki, DEVICE, [DEVICE_DESIRED.topic(device_id=DEVICE)])
    cleanup.append(device.close)

    # Assert: the device gets its desired document from the edge's store, and its events are kept
    assert device.expect(DEVICE_DESIRED.topic(device_id=DEVICE)).payload == desired
    for seq in range(3):
        device.publish(DEVICE_EVENTS.topic(device_id=DEVICE), EVENTS[seq])
    wait_until(lambda: outbox_rows(node_dir) == 3, what="3 messages in the outbox")
    up.start()
    events_topic = RELAY_EVENTS.topic(node_id=NODE, device_id=DEVICE)
    assert [hub.expect(events_topic, timeout=60).payload for _ in range(3)] == EVENTS[:3]
    assert stop_edge(edge) == 0


def _stored_desired(node_dir: Path) -> bytes | None:
    with sqlite3.connect(node_dir / "edge.db") as db:
        row = db.execute("SELECT payload FROM desired WHERE scope = 'device' AND target_id = ?", (DEVICE,)).fetchone()
    return bytes(row[0]) if row else None


def _state(state: ConnectionState, version: str) -> bytes:
    return envelope(DEVICE, StateBody(state=state, agent_version=version)).model_dump_json().encode()


def test_a_device_state_goes_ahead_of_the_events_queued_meanwhile_and_only_its_newest(
    tmp_path: Path, pki: Pki, cleanup: list[Callable[[], object]]
) -> None:
    # Prepare: the hub records the order in which the device's messages reach it
    up = Mosquitto(tmp_path / "upstream", pki, edge_acl(NODE, [DEVICE]), persistent=True).start()
    down = Mosquitto(tmp_path / "downstream", pki, edge_acl(NODE, [DEVICE])).start()
    cleanup += [up.stop, down.stop]
    arrived: list[str] = []
    hub = Peer(up, pki, "hub", [own_subtree(Tier.NODE, NODE)], session_expiry_s=600,
               on_message=lambda _peer, m: arrived.append(m.topic))  # fmt: skip
    device = Peer(down, pki, DEVICE)
    cleanup += [hub.close, device.close]
    node_dir = enrol_node(tmp_path / "node", pki.ca, NODE, up.url).data_dir
    edge = start_edge(node_dir, NODE, "--downstream-mqtt-url", down.url, "--device-listen", "off")
    cleanup.append(lambda: stop_edge(edge))
    hub.expect(NODE_STATE.topic(node_id=NODE), where=lambda m: body(m)["state"] == "online")
    # online upstream says nothing of the devices' broker: a first state relayed shows the edge listens there
    events_topic, state_topic = RELAY_EVENTS.topic(node_id=NODE, device_id=DEVICE), RELAY_STATE.topic(node_id=NODE, device_id=DEVICE)
    first = _state(ConnectionState.ONLINE, "0")
    device.publish(DEVICE_STATE.topic(device_id=DEVICE), first, retain=True)
    assert hub.expect(state_topic, timeout=60).payload == first
    arrived.clear()

    # Execute: during an outage the device sends 45 events and changes its state three times
    up.stop()
    for event in EVENTS:
        device.publish(DEVICE_EVENTS.topic(device_id=DEVICE), event)
    states = [_state(ConnectionState.ONLINE, "1"), _state(ConnectionState.OFFLINE, "1"), _state(ConnectionState.ONLINE, "2")]
    for state in states:
        device.publish(DEVICE_STATE.topic(device_id=DEVICE), state, retain=True)
    wait_until(lambda: outbox_rows(node_dir) == len(EVENTS), timeout=30, what=f"{len(EVENTS)} events in the outbox")
    up.start()

    # Assert: the newest state arrives first, alone; then every event in order
    assert hub.expect(state_topic, timeout=60).payload == states[-1]
    assert [hub.expect(events_topic, timeout=60).payload for _ in EVENTS] == EVENTS
    assert hub.drain(state_topic, quiet_s=0.5) == []
    mine = [topic for topic in arrived if topic in (events_topic, state_topic)]
    assert mine[0] == state_topic and mine.count(state_topic) == 1
    assert stop_edge(edge) == 0


def test_a_state_not_yet_relayed_when_the_edge_is_killed_reaches_the_hub_after_its_restart(
    tmp_path: Path, pki: Pki, cleanup: list[Callable[[], object]]
) -> None:
    # Prepare: the hub's broker is away, and the device's new state waits at the edge (in memory)
    up = Mosquitto(tmp_path / "upstream", pki, edge_acl(NODE, [DEVICE]), persistent=True).start()
    down = Mosquitto(tmp_path / "downstream", pki, edge_acl(NODE, [DEVICE])).start()
    cleanup += [up.stop, down.stop]
    hub = Peer(up, pki, "hub", [own_subtree(Tier.NODE, NODE)], session_expiry_s=600)
    device = Peer(down, pki, DEVICE)
    cleanup += [hub.close, device.close]
    node_dir = enrol_node(tmp_path / "node", pki.ca, NODE, up.url).data_dir
    options = ("--downstream-mqtt-url", down.url, "--device-listen", "off")
    edge = start_edge(node_dir, NODE, *options)
    cleanup.append(lambda: stop_edge(edge))
    hub.expect(NODE_STATE.topic(node_id=NODE), where=lambda m: body(m)["state"] == "online")
    first = _state(ConnectionState.ONLINE, "2")  # relayed: the edge listens on the devices' broker
    device.publish(DEVICE_STATE.topic(device_id=DEVICE), first, retain=True)
    assert hub.expect(RELAY_STATE.topic(node_id=NODE, device_id=DEVICE), timeout=60).payload == first
    up.stop()
    state = _state(ConnectionState.ONLINE, "3")
    device.publish(DEVICE_STATE.topic(device_id=DEVICE), state, retain=True)
    device.publish(DEVICE_EVENTS.topic(device_id=DEVICE), EVENTS[0])  # after the state: once it is stored,
    wait_until(lambda: outbox_rows(node_dir) == 1, what="the event in the outbox")  # the edge has the state

    # Execute: the edge dies before it could relay it; it starts again, then the hub's broker comes back
    edge.kill()
    edge.wait(5)
    edge = start_edge(node_dir, NODE, *options)
    up.start()

    # Assert: the device's broker still holds the state (retained) and hands it to the new edge
    assert hub.expect(RELAY_STATE.topic(node_id=NODE, device_id=DEVICE), timeout=60).payload == state
    assert hub.expect(RELAY_EVENTS.topic(node_id=NODE, device_id=DEVICE), timeout=60).payload == EVENTS[0]
    assert stop_edge(edge) == 0
