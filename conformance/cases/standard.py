"""Sections 6 and 7 of the standard, where an interface can observe them: interoperability (6.1.2 c),
the edge's interfaces at both tiers (6.2.2 a), isolation (6.2.2 b), monitoring (6.2.2 f), runtime
configuration (7.2 a), real-time node state (7.2 d 2) and timeouts (7.2 d 3). Task placement clauses
(6.1.2 e, 6.2.2 g, 6.3.2 f, 7.2 c, 7.2 d 4, 7.3.x) are with the tasks; deployment ones with deployments."""

from __future__ import annotations

import time
from datetime import UTC, datetime

from conformance.agents import Identity, MqttPeer, device_peer, enrol_device, resources
from conformance.cases.common import PATIENCE_S, device_status, new_device, new_edge, node_status, wait_device, wait_node
from conformance.hub import problem
from conformance.runner import Check, case
from interfaces.errors import ErrorCode
from interfaces.messages import ConnectionState, Health, HeartbeatBody, StateBody, envelope
from interfaces.nodes import MAX_OFFLINE_TIMEOUT_S, CommandResult, Twin
from interfaces.topics import (
    DEVICE_CMD, DEVICE_HEARTBEAT, DEVICE_STATE, NODE_CMD, NODE_DESIRED, NODE_HEARTBEAT, NODE_STATE, PREFIX, RELAY_HEARTBEAT, Tier, own_subtree,
)  # fmt: skip

TOLERANCE_S = 3.0  # the hub's liveness check and heartbeat batching add at most a few seconds


@case("6.1.2.c", "an agent written from the published contract alone enrols, is ONLINE, follows its desired state, answers commands and reports events")
def interoperable_agent(check: Check) -> None:
    edge = new_edge(check)
    check.note(f"the simulated agent {edge.node_id} uses only the REST models, the topic table and the envelope")
    twin = check.target.ok("PUT", f"/nodes/{edge.node_id}/twin", Twin, json={"desired": {"interop": True}})
    check.wait(lambda: any(d.version == twin.desired_version for d in edge.node.desired), PATIENCE_S, "its desired document")
    res = check.target.ok("POST", f"/nodes/{edge.node_id}/commands", CommandResult, json={"name": "ping", "timeout_s": 30})
    check.check(res.ok, "it answered a command")
    edge.node.event("conformance.interop", {"run": check.target.run_id}, message="hello from a third-party agent")
    check.wait(lambda: check.target.ok("GET", f"/nodes/{edge.node_id}/twin", Twin).in_sync, PATIENCE_S, "its report is taken (twin in sync)")


@case("6.2.2.a", "the edge speaks for its devices at both tiers: a relayed device is ONLINE with its readings, and a command reaches it through the edge")
def edge_both_tiers(check: Check) -> None:
    edge = new_edge(check)
    ep = new_device(check, edge, online=False)
    ep.resources = resources(memory_available=123_456_789)
    edge.device_online(ep)
    st = wait_device(check, ep.ident, "ONLINE", PATIENCE_S)
    check.equal(st.node_id, edge.node_id, "the device is under its edge")
    st = check.wait(lambda: (s := device_status(check.target, ep.ident)).resources is not None and s, PATIENCE_S + 5 * edge.heartbeat_interval_s, "the device's readings")
    check.equal(st.resources.memory.available_bytes, 123_456_789, "the device's memory reading, relayed")
    res = check.target.ok("POST", f"/devices/{ep.ident}/commands", CommandResult, json={"name": "ping", "args": {"tier": "device"}, "timeout_s": 30})
    check.check(res.ok and res.result == {"pong": True, "tier": "device"}, "the device's answer came back through the edge")
    check.check(edge.peer.messages(ep.topics.cmd), f"the command came on the edge's relay topic {ep.topics.cmd}")


@case("6.2.2.b", "one edge cannot read, publish to or impersonate another edge: the broker refuses, the hub's view of the other is unchanged")
def isolation_between_edges(check: Check) -> None:
    a, b = new_edge(check), new_edge(check)
    wait_node(check, b.node_id, "ONLINE", PATIENCE_S)
    before = check.wait(lambda: (st := node_status(check.target, b.node_id)).health is not None and st, PATIENCE_S + 5 * b.heartbeat_interval_s, "B's first heartbeat")
    forged_hb = envelope(b.node_id, HeartbeatBody(seq=10_000, health=Health.DEGRADED, agent_version="forged", uptime_s=1e6, resources=resources(memory_available=1)))
    reason = a.peer.publish(NODE_HEARTBEAT.topic(node_id=b.node_id), forged_hb.model_dump_json(), qos=1)
    check.equal(reason, "Not authorized", "PUBACK for a heartbeat on another edge's topic")
    forged_state = envelope(b.node_id, StateBody(state=ConnectionState.OFFLINE, reason="forged"))
    check.equal(a.peer.publish(NODE_STATE.topic(node_id=b.node_id), forged_state.model_dump_json(), qos=1, retain=True), "Not authorized",
                "PUBACK for a retained state on another edge's topic")  # fmt: skip
    a.peer.subscribe(f"{NODE_CMD.filter(node_id=b.node_id)}")
    a.peer.subscribe(NODE_DESIRED.topic(node_id=b.node_id))
    a.peer.subscribe(f"{PREFIX}/#")
    mark = node_status(check.target, b.node_id).last_heartbeat_at
    res = check.target.ok("POST", f"/nodes/{b.node_id}/commands", CommandResult, json={"name": "ping", "args": {"secret": "b-only"}, "timeout_s": 30})
    check.check(res.ok, "B answered its own command")
    # what the broker would have given A has reached B and the hub: B's command (answered) and two more heartbeats
    beats = [mark]

    def two_more_beats() -> bool:
        last = node_status(check.target, b.node_id).last_heartbeat_at
        if last is not None and (beats[-1] is None or last > beats[-1]):
            beats.append(last)
        return len(beats) > 2

    check.wait(two_more_beats, PATIENCE_S + 3 * b.heartbeat_interval_s, "two heartbeats of B after A subscribed")
    leaked = [m.topic for m in a.peer.messages() if b.node_id in m.topic]
    check.equal(leaked, [], "messages of B that A received")
    after = node_status(check.target, b.node_id)
    check.equal(after.state, "ONLINE", "B's state")
    check.check(after.agent_version != "forged" and after.health == before.health, f"B's status is B's own (agent {after.agent_version}, health {after.health})")
    check.check(after.resources is not None and after.resources.memory.available_bytes != 1, "B's readings are B's own")


@case("6.2.2.b", "a device's certificate is confined to its own subtree: no edge topic, no other device, nothing through the hub")
def isolation_of_devices(check: Check) -> None:
    edge = new_edge(check)
    d1, d2 = new_device(check, edge, online=False), new_device(check, edge, online=False)
    ident = enrol_device(check.target, d1.ident)
    peer = device_peer(check.target, ident)
    check.check(peer.connect(), f"the device connects with its own certificate ({peer.refusal})")
    check.cleanup("disconnect device", peer.disconnect)
    own = envelope(d1.ident, StateBody(state=ConnectionState.ONLINE))
    # the broker takes up a device's access a moment after it is added: until then even its own subtree is refused,
    # and the refusals below would prove nothing
    reason = check.wait(lambda: (r := peer.publish(DEVICE_STATE.topic(device_id=d1.ident), own.model_dump_json(), qos=1)) in ("Success", "No matching subscribers") and r,
                        PATIENCE_S, "PUBACK on its own subtree", interval=0.5)  # fmt: skip
    check.note(f"ok: PUBACK on its own subtree: {reason}")
    hb = envelope(d2.ident, HeartbeatBody(seq=1, agent_version="forged", uptime_s=1, resources=resources()))
    check.equal(peer.publish(DEVICE_HEARTBEAT.topic(device_id=d2.ident), hb.model_dump_json(), qos=1), "Not authorized", "PUBACK on another device's topic")
    check.equal(peer.publish(RELAY_HEARTBEAT.topic(node_id=edge.node_id, device_id=d2.ident), hb.model_dump_json(), qos=1), "Not authorized",
                "PUBACK on the edge's relay topic")  # fmt: skip
    check.equal(peer.publish(NODE_HEARTBEAT.topic(node_id=edge.node_id), hb.model_dump_json(), qos=1), "Not authorized", "PUBACK on the edge's own topic")
    peer.subscribe(DEVICE_CMD.topic(device_id=d2.ident))
    peer.subscribe(own_subtree(Tier.NODE, edge.node_id))
    check.target.ok("PUT", f"/devices/{d2.ident}/twin", json={"desired": {"secret": "d2-only"}})
    check.wait(lambda: any(d.spec.get("secret") == "d2-only" for d in d2.desired), PATIENCE_S, "the other device's desired document at its edge (the broker sent it)")
    check.equal([m.topic for m in peer.messages() if d2.ident in m.topic or edge.node_id in m.topic], [], "messages of others the device received")
    check.equal(device_status(check.target, d2.ident).state, "REGISTERED", "the other device's state")


@case("6.2.2.b", "a certificate not issued by the hub's CA cannot connect")
def isolation_foreign_certificate(check: Check) -> None:
    from datetime import timedelta

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    edge = new_edge(check, start=False)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, edge.node_id)])
    now = datetime.now(UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(minutes=1)).not_valid_after(now + timedelta(days=1)).sign(key, hashes.SHA256()))  # fmt: skip
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    forged = edge.issued.model_copy(update={"certificate_pem": cert.public_bytes(serialization.Encoding.PEM).decode()})
    peer = MqttPeer(check.target, Identity(check.target.work_dir / "forged", edge.node_id, key_pem, forged, edge.issued.ca_pem))
    accepted = peer.connect()
    if accepted:
        peer.disconnect()
    check.check(not accepted and peer.refusal is not None, f"a self-signed certificate with the node's CN is refused ({peer.refusal})")
    check.equal(node_status(check.target, edge.node_id).state, "REGISTERED", "the node's state")


@case("6.2.2.f", "the edge's own monitoring reaches the cloud: degraded health shows as UNHEALTHY with its detail, recovery as ONLINE")
def monitoring(check: Check) -> None:
    edge = new_edge(check)
    edge.node.health, edge.node.health_detail = Health.DEGRADED, "conformance: temperature high"
    st = wait_node(check, edge.node_id, "UNHEALTHY", 5 * edge.heartbeat_interval_s + TOLERANCE_S)
    check.equal(st.health_detail, "conformance: temperature high", "health detail")
    edge.node.health, edge.node.health_detail = Health.OK, None
    wait_node(check, edge.node_id, "ONLINE", 5 * edge.heartbeat_interval_s + TOLERANCE_S)


@case("7.2.a", "runtime configuration is managed for edge and device alike: versioned desired documents reach both, survive a reconnect, and converge")
def runtime_configuration(check: Check) -> None:
    edge = new_edge(check)
    ep = new_device(check, edge)
    config = {"runtime": "onnxruntime", "threads": 2}
    for path, endpoint in ((f"/nodes/{edge.node_id}", edge.node), (f"/devices/{ep.ident}", ep)):
        twin = check.target.ok("PUT", f"{path}/twin", Twin, json={"desired": config})
        check.wait(lambda e=endpoint, v=twin.desired_version: any(d.version == v and d.spec == config for d in e.desired), PATIENCE_S, f"{path}: config at the agent")
        check.wait(lambda p=path: check.target.ok("GET", f"{p}/twin", Twin).in_sync, PATIENCE_S, f"{path}: converged")
    edge.stop()
    wait_node(check, edge.node_id, "OFFLINE", PATIENCE_S)
    newer = {"runtime": "onnxruntime", "threads": 4}
    version = check.target.ok("PUT", f"/devices/{ep.ident}/twin", Twin, json={"desired": newer}).desired_version
    peer = MqttPeer(check.target, edge.identity)  # the same certificate, a new session
    check.check(peer.connect(), "the edge reconnects")
    check.cleanup("disconnect", peer.disconnect)

    def retained_latest() -> object:  # the hub publishes a change a moment after the PUT: subscribe again until it has
        since = time.monotonic()
        peer.subscribe(ep.topics.desired)
        return peer.wait_message(ep.topics.desired, lambda m: m.retain and m.json()["body"]["version"] == version, 2.0, after=since)

    got = check.wait(retained_latest, PATIENCE_S, f"the retained desired document of version {version} on (re)subscribing", interval=0)
    check.check(got is not None and got.json()["body"]["version"] == version and got.json()["body"]["spec"] == newer,
                "the configuration changed while the edge was away is waiting for it (retained, latest version)")  # fmt: skip


@case("7.2.d.2", "node state is shared in real time: new readings show within two heartbeats; a vanished agent is OFFLINE within seconds")
def realtime_state(check: Check) -> None:
    edge = new_edge(check)
    interval = edge.heartbeat_interval_s
    edge.node.resources = resources(memory_available=777_000_000, cpu=0.9)
    started = time.monotonic()
    check.wait(lambda: (r := node_status(check.target, edge.node_id).resources) is not None and r.memory.available_bytes == 777_000_000,
               2 * interval + TOLERANCE_S, "the new memory reading in the status", interval=0.1)  # fmt: skip
    check.note(f"new readings visible after {time.monotonic() - started:.1f} s (heartbeat interval {interval:g} s)")
    edge.peer.disconnect(with_will=True)
    started = time.monotonic()
    wait_node(check, edge.node_id, "OFFLINE", 5)
    check.note(f"OFFLINE {time.monotonic() - started:.1f} s after the agent vanished (last will)")
    st = node_status(check.target, edge.node_id)
    check.check(not st.connected, "status says not connected")


@case("7.2.d.3", "the offline timeout is announced, within the documented maximum, and kept: a silent node is OFFLINE within it")
def offline_timeout(check: Check) -> None:
    edge = new_edge(check)
    timeout = edge.issued.offline_timeout_s
    check.check(timeout is not None, f"the enrolment announces the offline timeout ({timeout} s) beside the heartbeat interval ({edge.heartbeat_interval_s} s)")
    assert timeout is not None
    check.check(timeout <= MAX_OFFLINE_TIMEOUT_S, f"offline timeout {timeout:g} s is within the documented maximum {MAX_OFFLINE_TIMEOUT_S:g} s")
    if timeout + TOLERANCE_S > check.target.max_wait_s:
        check.skip(f"the announced offline timeout ({timeout:g} s) is longer than --max-wait ({check.target.max_wait_s:g} s)")
    edge.node.heartbeats.clear()  # connected, but silent: only the timeout can notice
    started = time.monotonic()
    wait_node(check, edge.node_id, "OFFLINE", timeout + edge.heartbeat_interval_s + TOLERANCE_S)
    took = time.monotonic() - started
    check.note(f"OFFLINE {took:.1f} s after the last heartbeat (announced timeout {timeout:g} s)")
    check.check(took >= timeout - edge.heartbeat_interval_s - 0.5, "not before the timeout (a node is not dropped early)")


@case("7.2.d.3", "a command to an agent that does not answer ends at its timeout with 504, not later; the node stays usable")
def command_timeout(check: Check) -> None:
    edge = new_edge(check)
    edge.node.answer_commands = False
    started = time.monotonic()
    problem(check.target.call("POST", f"/nodes/{edge.node_id}/commands", json={"name": "ping", "timeout_s": 2}), 504, ErrorCode.COMMAND_TIMEOUT)
    took = time.monotonic() - started
    check.check(1.9 <= took <= 2 + TOLERANCE_S, f"answered after {took:.1f} s for timeout_s 2")
    edge.node.answer_commands = True
    res = check.target.ok("POST", f"/nodes/{edge.node_id}/commands", CommandResult, json={"name": "ping", "timeout_s": 5})
    check.check(res.ok, "the next command is answered")
