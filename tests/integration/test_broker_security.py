"""Broker-level security with the real Mosquitto: per-node ACLs, revocation, client certificates."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

from interfaces.messages import ConnectionState, HeartbeatBody, StateBody, envelope
from interfaces.resources import CpuReading, DiskReading, MemoryReading, NetworkReading, Resources
from interfaces.topics import NODE_HEARTBEAT, NODE_STATE
from tests.support import Broker, Hub, Identity, MqttProbe, enrol, start_hub, stop, wait_for

RESOURCES = Resources(
    cpu=CpuReading(cores=4, utilisation=0.25), memory=MemoryReading(total_bytes=8 << 30, available_bytes=4 << 30),
    disk=DiskReading(path="/", total_bytes=100 << 30, free_bytes=50 << 30), network=NetworkReading(bytes_sent=1, bytes_received=2),
)  # fmt: skip


@pytest.fixture
def hub(broker: Broker, sqlite_url: str):
    h = start_hub(broker.data_dir, sqlite_url, broker.url, heartbeat_interval=5, offline_after_missed=3)
    try:
        yield h
    finally:
        stop(h.proc)


def _node(hub: Hub, name: str, tmp_path: Path) -> Identity:
    with hub.client("operator") as api:
        reg = api.post("/nodes", json={"name": name}).json()
    return enrol(hub, reg["node"]["id"], reg["bootstrap_token"], tmp_path / name)


def _online(probe: MqttProbe, node_id: str, uptime: float) -> None:
    assert probe.publish(NODE_STATE.topic(node_id=node_id), envelope(node_id, StateBody(state=ConnectionState.ONLINE)).model_dump_json(), retain=True) == "Success"
    hb = envelope(node_id, HeartbeatBody(seq=1, agent_version="probe", uptime_s=uptime, resources=RESOURCES))
    probe.publish(NODE_HEARTBEAT.topic(node_id=node_id), hb.model_dump_json(), qos=1)


def _status(hub: Hub, node_id: str) -> dict:
    with hub.client("viewer") as api:
        return api.get(f"/nodes/{node_id}/status").json()


def test_node_cannot_publish_or_read_another_nodes_topics(broker: Broker, hub: Hub, tmp_path: Path) -> None:
    # Prepare: two enrolled nodes, both online
    a, b = _node(hub, "node-a", tmp_path), _node(hub, "node-b", tmp_path)
    probe_a, probe_b = MqttProbe(a, broker.port).connect(), MqttProbe(b, broker.port).connect()
    wait_for(lambda: probe_a.connected() and probe_b.connected(), 60, what="both connected")
    _online(probe_a, a.node_id, 1.0)
    _online(probe_b, b.node_id, 2.0)
    wait_for(lambda: _status(hub, b.node_id)["uptime_s"] == 2.0, 60, what="B online")
    before = _status(hub, b.node_id)
    probe_a.client.subscribe(f"synergy/v1/nodes/{b.node_id}/#", qos=1)

    # Execute: A impersonates B (B's envelope src, B's topics)
    forged_state = envelope(b.node_id, StateBody(state=ConnectionState.OFFLINE, reason="forged")).model_dump_json()
    forged_hb = envelope(b.node_id, HeartbeatBody(seq=9, agent_version="evil", uptime_s=999.0, resources=RESOURCES)).model_dump_json()
    reason_state = probe_a.publish(NODE_STATE.topic(node_id=b.node_id), forged_state, retain=True)
    reason_hb = probe_a.publish(NODE_HEARTBEAT.topic(node_id=b.node_id), forged_hb)
    # B keeps publishing its own heartbeats; A must not receive them
    probe_b.publish(NODE_HEARTBEAT.topic(node_id=b.node_id), envelope(b.node_id, HeartbeatBody(seq=2, agent_version="probe", uptime_s=3.0, resources=RESOURCES)).model_dump_json())
    wait_for(lambda: _status(hub, b.node_id)["uptime_s"] == 3.0, 60, what="B's own heartbeat")

    # Assert: the broker refused A, the hub's view of B is B's own
    assert reason_state == "Not authorized"
    assert reason_hb == "Not authorized"
    after = _status(hub, b.node_id)
    assert after["state"] == before["state"] == "ONLINE"
    assert after["agent_version"] == "probe"
    assert not [e for e in probe_a.events if e[0] == "message"]
    probe_a.close()
    probe_b.close()


def test_deleted_node_is_cut_off_and_refused(broker: Broker, hub: Hub, tmp_path: Path) -> None:
    # Prepare: an online node
    node = _node(hub, "node-doomed", tmp_path)
    probe = MqttProbe(node, broker.port).connect()
    wait_for(probe.connected, 60, what="connected")
    _online(probe, node.node_id, 1.0)
    wait_for(lambda: _status(hub, node.node_id)["state"] == "ONLINE", 60, what="ONLINE")

    # Execute: an admin deletes it
    with hub.client("admin") as api:
        assert api.delete(f"/nodes/{node.node_id}").status_code == 204
        assert api.get(f"/nodes/{node.node_id}").status_code == 404

    # Assert: its open connection is denied everything once the broker reloads ...
    wait_for(lambda: probe.publish(NODE_HEARTBEAT.topic(node_id=node.node_id), b"{}") == "Not authorized", 60, interval=0.3, what="open connection denied")
    probe.close()
    # ... and a new connection with the revoked certificate fails the TLS handshake
    again = MqttProbe(node, broker.port).connect()
    wait_for(lambda: any(e[0] in ("refused", "disconnect") for e in again.events), 60, what="refusal")
    assert not again.connected()
    again.client.loop_stop()
    # ... and re-enrolling a deleted node is refused
    with hub.client("admin") as api:
        assert api.post(f"/nodes/{node.node_id}/bootstrap-token", json={}).status_code == 404


def test_broker_refuses_clients_without_a_hub_certificate(broker: Broker, hub: Hub, tmp_path: Path) -> None:
    from cloud.pki import CertificateAuthority

    # Prepare: a certificate from a different CA, with a legitimate-looking CN
    CertificateAuthority.load_or_create(tmp_path / "rogue")
    rogue = Identity("hub", tmp_path / "rogue")
    (tmp_path / "rogue" / "node.crt").write_text((tmp_path / "rogue" / "hub.crt").read_text())
    (tmp_path / "rogue" / "node.key").write_text((tmp_path / "rogue" / "hub.key").read_text())
    (tmp_path / "rogue" / "ca.crt").write_text((broker.data_dir / "pki" / "ca.crt").read_text())

    # Execute / Assert: TLS refuses it
    probe = MqttProbe(rogue, broker.port).connect()
    wait_for(lambda: any(e[0] in ("refused", "disconnect") for e in probe.events), 60, what="refusal")
    assert not probe.connected()
    probe.client.loop_stop()

    # and a client without any certificate never gets a CONNACK
    import socket

    connect = bytes([0x10, 18, 0, 4]) + b"MQTT" + bytes([5, 2, 0, 30, 0, 0, 5]) + b"nocrt"  # MQTT 5 CONNECT, clean start
    ctx = ssl.create_default_context(cafile=str(broker.data_dir / "pki" / "ca.crt"))
    answer = b""
    with socket.create_connection(("127.0.0.1", broker.port), timeout=5) as raw:
        try:
            with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
                tls.sendall(connect)
                answer = tls.recv(4)
        except (ssl.SSLError, ConnectionResetError, BrokenPipeError):
            answer = b""
    assert not answer.startswith(b"\x20")
