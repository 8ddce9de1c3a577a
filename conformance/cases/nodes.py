"""8.1 edge node management (DESIGN §4.1): registration, enrolment, nodes, admin state, status,
lifecycle, devices, twins and commands."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

from cryptography import x509

from conformance.agents import AGENT_VERSION, Identity, MqttPeer, SimEdge, make_csr
from conformance.cases.common import PATIENCE_S, device_status, new_device, new_edge, node_status, wait_device, wait_node
from conformance.hub import problem
from conformance.runner import Check, case
from interfaces.errors import ErrorCode
from interfaces.messages import Health
from interfaces.nodes import CertificateIssued, CommandResult, DevicePublic, NodePublic, NodeRegistered, NodeTransition, Twin


def _register(check: Check, **extra: object) -> NodeRegistered:
    reg = check.target.ok("POST", "/nodes", NodeRegistered, json={"name": f"conf-{check.target.run_id}-reg", "labels": check.target.labels(), **extra})
    check.cleanup(f"delete node {reg.node.id}", lambda: check.target.call("DELETE", f"/nodes/{reg.node.id}"))
    return reg  # type: ignore[no-any-return]


@case("8.1.1", "POST /nodes gives a REGISTERED edge node, its labels, and a bootstrap token that expires within its TTL")
def register(check: Check) -> None:
    before = datetime.now(UTC)
    reg = _register(check, description="conformance", bootstrap_ttl_s=600)
    check.equal(reg.node.state, "REGISTERED", "state of a new node")
    check.equal(reg.node.kind, "edge", "kind")
    check.equal(reg.node.labels, check.target.labels(), "labels")
    check.check(len(reg.bootstrap_token) >= 16, "a bootstrap token is returned")
    check.check(before < reg.bootstrap_expires_at <= before + timedelta(seconds=600 + 30), f"the token expires within its TTL ({reg.bootstrap_expires_at.isoformat()})")
    again = check.target.ok("GET", f"/nodes/{reg.node.id}", NodePublic)
    check.check("bootstrap_token" not in again.model_dump() and reg.bootstrap_token not in check.target.call("GET", f"/nodes/{reg.node.id}").text,
                "GET /nodes/{id} never shows the token again")  # fmt: skip


@case("8.1.1", "a reissued bootstrap token replaces the old one: the old one no longer enrols")
def reissue_token(check: Check) -> None:
    reg = _register(check)
    fresh = check.target.ok("POST", f"/nodes/{reg.node.id}/bootstrap-token", json={"ttl_s": 300})["bootstrap_token"]
    check.check(fresh != reg.bootstrap_token, "a new token is issued")
    _, csr = make_csr(reg.node.id)
    r = check.target.call("POST", f"/nodes/{reg.node.id}/certificate", token=None, json={"csr_pem": csr, "bootstrap_token": reg.bootstrap_token})
    problem(r, 403, ErrorCode.BOOTSTRAP_TOKEN_EXPIRED)
    check.note("the replaced token: 403 bootstrap_token_expired")
    check.equal(check.target.ok("GET", f"/nodes/{reg.node.id}", NodePublic).state, "REGISTERED", "state after the refused enrolment")
    check.target.ok("POST", f"/nodes/{reg.node.id}/certificate", CertificateIssued, token=None, json={"csr_pem": csr, "bootstrap_token": fresh})
    check.note("the new token enrols")


@case("8.1.2", "enrolment: the CA is served, the certificate has CN = node id, is signed by that CA, and the token works once")
def enrol(check: Check) -> None:
    reg = _register(check)
    r = check.target.call("GET", "/ca.crt", token=None)
    check.equal(r.status_code, 200, "GET /ca.crt status")
    ca = x509.load_pem_x509_certificate(r.content)
    basic = ca.extensions.get_extension_for_class(x509.BasicConstraints).value
    check.check(basic.ca, "the served certificate is a CA")
    key_pem, csr = make_csr(reg.node.id)
    issued = check.target.ok("POST", f"/nodes/{reg.node.id}/certificate", CertificateIssued, token=None, json={"csr_pem": csr, "bootstrap_token": reg.bootstrap_token})
    cert = x509.load_pem_x509_certificate(issued.certificate_pem.encode())
    cn = cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value
    check.equal(cn, reg.node.id, "certificate CN")
    cert.verify_directly_issued_by(ca)
    check.note("the certificate verifies against the served CA")
    check.check(cert.not_valid_after_utc > datetime.now(UTC) + timedelta(days=1), f"valid until {cert.not_valid_after_utc.isoformat()}")
    check.check(issued.mqtt_url.startswith(("mqtts://", "ssl://")), f"the broker is announced with TLS: {issued.mqtt_url}")
    _, csr2 = make_csr(reg.node.id)
    problem(check.target.call("POST", f"/nodes/{reg.node.id}/certificate", token=None, json={"csr_pem": csr2, "bootstrap_token": reg.bootstrap_token}),
            409, ErrorCode.BOOTSTRAP_TOKEN_USED)  # fmt: skip
    check.note("a second use of the token: 409 bootstrap_token_used")
    peer = MqttPeer(check.target, Identity(check.target.work_dir / f"{reg.node.id}-enrol", reg.node.id, key_pem, issued, issued.ca_pem))
    check.check(peer.connect(), f"the broker accepts the issued certificate ({peer.refusal})")
    peer.disconnect()


@case("8.1.2", "enrolment refusals: a CSR for another CN, a wrong token, garbage instead of a CSR; the node stays REGISTERED")
def enrol_refusals(check: Check) -> None:
    reg = _register(check)
    other = _register(check)
    _, wrong_cn = make_csr(other.node.id)
    problem(check.target.call("POST", f"/nodes/{reg.node.id}/certificate", token=None, json={"csr_pem": wrong_cn, "bootstrap_token": reg.bootstrap_token}),
            422, ErrorCode.CSR_INVALID)  # fmt: skip
    check.note("CSR with another node's CN: 422 csr_invalid")
    _, csr = make_csr(reg.node.id)
    problem(check.target.call("POST", f"/nodes/{reg.node.id}/certificate", token=None, json={"csr_pem": csr, "bootstrap_token": other.bootstrap_token}),
            403, ErrorCode.BOOTSTRAP_TOKEN_INVALID)  # fmt: skip
    check.note("another node's token: 403 bootstrap_token_invalid")
    garbage = "-----BEGIN CERTIFICATE REQUEST-----\n" + "A" * 80 + "\n-----END CERTIFICATE REQUEST-----\n"
    problem(check.target.call("POST", f"/nodes/{reg.node.id}/certificate", token=None, json={"csr_pem": garbage, "bootstrap_token": reg.bootstrap_token}),
            422, ErrorCode.CSR_INVALID)  # fmt: skip
    check.note("an unparseable CSR: 422 csr_invalid")
    check.equal(check.target.ok("GET", f"/nodes/{reg.node.id}", NodePublic).state, "REGISTERED", "state after the refusals")
    check.target.ok("POST", f"/nodes/{reg.node.id}/certificate", CertificateIssued, token=None, json={"csr_pem": csr, "bootstrap_token": reg.bootstrap_token})
    check.note("the refusals did not use up the token: the right CSR still enrols")


@case("8.1.3", "nodes are read and updated (labels replaced, description); deletion revokes: the broker refuses the certificate")
def read_update_delete(check: Check) -> None:
    edge = new_edge(check)
    node = check.target.ok("GET", f"/nodes/{edge.node_id}", NodePublic)
    check.equal(node.id, edge.node_id, "GET /nodes/{id}")
    labels = check.target.labels(zone="conf-b")
    patched = check.target.ok("PATCH", f"/nodes/{edge.node_id}", NodePublic, json={"labels": labels, "description": "patched"})
    check.equal((patched.labels, patched.description), (labels, "patched"), "labels and description after PATCH")
    check.equal(check.target.ok("GET", f"/nodes/{edge.node_id}", NodePublic).labels, labels, "labels read back")
    r = check.target.call("DELETE", f"/nodes/{edge.node_id}")
    check.check(r.status_code in (200, 202, 204), f"DELETE /nodes/{{id}}: HTTP {r.status_code}")
    r = check.target.call("GET", f"/nodes/{edge.node_id}")
    check.check(r.status_code == 404 or r.json().get("state") == "DELETED", f"the node is gone or DELETED (HTTP {r.status_code})")

    def refused() -> bool:  # the broker drops the revoked identity's permissions (or its session)
        if not edge.peer.connected.is_set():
            return True
        return edge.peer.publish(edge.node.topics.reported, b"{}", qos=1) == "Not authorized"

    check.wait(refused, PATIENCE_S, "the broker refuses the deleted node its own subtree", interval=0.5)
    check.note("the deleted node lost its permissions at the broker")
    edge.stop()
    fresh = MqttPeer(check.target, edge.identity)
    accepted = fresh.connect()
    if accepted:
        fresh.disconnect()
    check.check(not accepted and fresh.refusal is not None, f"a new connection with the revoked certificate is refused ({fresh.refusal})")


@case("8.1.4", "a LOCKED node gets no new deployment (409 target_locked, nothing created); UNLOCKED it does")
def admin_lock(check: Check) -> None:
    edge = new_edge(check)
    locked = check.target.ok("PUT", f"/nodes/{edge.node_id}/admin-state", NodePublic, json={"admin_state": "LOCKED"})
    check.equal(locked.admin_state, "LOCKED", "admin state")
    check.equal(node_status(check.target, edge.node_id).admin_state, "LOCKED", "admin state in the status")
    problem(check.target.call("PUT", f"/nodes/{edge.node_id}/admin-state", json={"admin_state": "FROZEN"}), 422, ErrorCode.VALIDATION_FAILED)
    art = check.target.ok("POST", "/artifacts", data={"kind": "application", "name": f"conf-lock-{check.target.run_id}", "version": "1.0.0", "format": "tar.gz"},
                          files={"file": ("app.tar.gz", b"conformance lock case " * 20, "application/octet-stream")})  # fmt: skip
    check.cleanup("delete artefact", lambda: check.target.call("DELETE", f"/artifacts/{art['id']}"))
    before = len(check.target.ok("GET", "/deployments", params={"limit": 500})["items"])
    body = {"artifact_id": art["id"], "target": {"kind": "node", "ids": [edge.node_id]}}
    problem(check.target.call("POST", "/deployments", json=body), 409, ErrorCode.TARGET_LOCKED)
    check.equal(len(check.target.ok("GET", "/deployments", params={"limit": 500})["items"]), before, "deployments after the refusal")
    check.check(not edge.node.desired or not any(d.deployments for d in edge.node.desired), "no deployment order reached the locked node")
    check.target.ok("PUT", f"/nodes/{edge.node_id}/admin-state", json={"admin_state": "UNLOCKED"})
    dep = check.target.ok("POST", "/deployments", json=body)
    check.cleanup("cancel deployment", lambda: check.target.call("POST", f"/deployments/{dep['id']}/cancel"))
    check.wait(lambda: any(d.deployments for d in edge.node.desired), PATIENCE_S, "the order reaches the unlocked node")


@case("8.1.5", "status shows the connection, a fresh heartbeat, the reported resources (with accelerators) and the agent version")
def status(check: Check) -> None:
    from interfaces.resources import Accelerator

    edge = new_edge(check, start=False)
    gpu = Accelerator(type="gpu", model="conf-gpu", count=2, memory_bytes=8 * 1024**3, utilisation=0.25, purpose="both")  # type: ignore[arg-type]
    edge.node.resources = edge.node.resources.model_copy(update={"accelerators": [gpu]})
    edge.start()
    wait_node(check, edge.node_id, "ONLINE", PATIENCE_S)
    st = check.wait(lambda: (s := node_status(check.target, edge.node_id)).resources is not None and s, PATIENCE_S + 5 * edge.heartbeat_interval_s, "resources in the status")
    check.check(st.connected, "connected")
    check.check(st.last_heartbeat_at is not None and datetime.now(UTC) - st.last_heartbeat_at < timedelta(seconds=5 * edge.heartbeat_interval_s + 5),
                f"last heartbeat is recent ({st.last_heartbeat_at})")  # fmt: skip
    check.equal(st.agent_version, AGENT_VERSION, "agent version")
    check.equal(st.resources.memory, edge.node.resources.memory, "memory reading")
    check.equal(st.resources.cpu.cores, 4, "CPU cores")
    check.equal(st.resources.disk.total_bytes, edge.node.resources.disk.total_bytes, "disk reading")
    check.equal([a.model_dump() for a in st.resources.accelerators], [gpu.model_dump()], "accelerators (type, model, count, memory, utilisation)")


@case("8.1.6", "ONLINE on connect, OFFLINE by the last will, ONLINE again on reconnect; every transition in the history")
def lifecycle_will(check: Check) -> None:
    edge = new_edge(check, start=False)
    check.equal(node_status(check.target, edge.node_id).state, "REGISTERED", "state before the agent connects")
    edge.start()
    wait_node(check, edge.node_id, "ONLINE", PATIENCE_S)
    edge.peer.disconnect(with_will=True)
    wait_node(check, edge.node_id, "OFFLINE", PATIENCE_S)
    check.note("OFFLINE after the broker published the last will")
    again = SimEdge(check.target, edge.node_id, edge.identity)
    check.cleanup("stop the reconnected agent", again.stop)
    again.start()
    wait_node(check, edge.node_id, "ONLINE", PATIENCE_S)
    check.note("ONLINE again after reconnecting with the same certificate (no token needed)")
    history = [NodeTransition.model_validate(t) for t in check.target.ok("GET", f"/nodes/{edge.node_id}/history")]
    moves = [(t.from_state, t.to_state) for t in history]
    for move in (("REGISTERED", "ONLINE"), ("ONLINE", "OFFLINE"), ("OFFLINE", "ONLINE")):
        check.check(move in moves, f"history has {move[0]} -> {move[1]}")


@case("8.1.6", "ONLINE -> UNHEALTHY when the agent reports degraded health, back to ONLINE when it recovers; a clean stop is OFFLINE")
def lifecycle_health(check: Check) -> None:
    edge = new_edge(check)
    edge.node.health, edge.node.health_detail = Health.DEGRADED, "conformance: disk almost full"
    st = wait_node(check, edge.node_id, "UNHEALTHY", PATIENCE_S + 5 * edge.heartbeat_interval_s)
    check.equal(st.health, "degraded", "health in the status")
    edge.node.health, edge.node.health_detail = Health.OK, None
    wait_node(check, edge.node_id, "ONLINE", PATIENCE_S + 5 * edge.heartbeat_interval_s)
    edge.stop()
    wait_node(check, edge.node_id, "OFFLINE", PATIENCE_S)
    check.note("a clean stop (retained offline state) is OFFLINE")


@case("8.1.7", "devices under a node: created, listed under the node, updated, ONLINE through their edge, deleted")
def devices(check: Check) -> None:
    edge = new_edge(check)
    ep = new_device(check, edge, online=False)
    dev = check.target.ok("GET", f"/devices/{ep.ident}", DevicePublic)
    check.equal(dev.node_id, edge.node_id, "the device's node")
    listed = [d["id"] for d in check.target.ok("GET", f"/nodes/{edge.node_id}/devices")["items"]]
    check.equal(listed, [ep.ident], "GET /nodes/{id}/devices")
    labels = check.target.labels(kind="camera")
    check.equal(check.target.ok("PATCH", f"/devices/{ep.ident}", DevicePublic, json={"labels": labels}).labels, labels, "labels after PATCH")
    check.equal(device_status(check.target, ep.ident).state, "REGISTERED", "device state before its edge relays it")
    edge.device_online(ep)
    st = wait_device(check, ep.ident, "ONLINE", PATIENCE_S)
    check.equal(st.node_id, edge.node_id, "status names the edge")
    check.wait(lambda: device_status(check.target, ep.ident).resources is not None, PATIENCE_S + 5 * edge.heartbeat_interval_s, "the relayed heartbeat's resources")
    r = check.target.call("DELETE", f"/devices/{ep.ident}")
    check.check(r.status_code in (200, 202, 204), f"DELETE /devices/{{id}}: HTTP {r.status_code}")
    problem(check.target.call("GET", f"/devices/{ep.ident}"), 404, ErrorCode.NOT_FOUND)
    check.equal(check.target.ok("GET", f"/nodes/{edge.node_id}/devices")["items"], [], "the node's devices after deletion")


@case("8.1.7", "a device for an unknown node is refused and nothing is stored")
def device_refusals(check: Check) -> None:
    before = check.target.ok("GET", "/devices", params={"selector": f"conformance-run={check.target.run_id}"})["items"]
    r = check.target.call("POST", "/devices", json={"node_id": "n-00000000000000000000000000", "model": "x", "labels": check.target.labels()})
    check.check(r.status_code in (404, 409, 422), f"unknown node: HTTP {r.status_code}")
    problem(r, r.status_code, r.json().get("code"))
    after = check.target.ok("GET", "/devices", params={"selector": f"conformance-run={check.target.run_id}"})["items"]
    check.equal(len(after), len(before), "devices of this run")


def _twin_case(check: Check, path: str, endpoint) -> None:  # type: ignore[no-untyped-def]
    twin = check.target.ok("PUT", f"{path}/twin", Twin, json={"desired": {"fps": 15, "mode": "conformance"}})
    version = twin.desired_version
    check.wait(lambda: any(d.version == version and d.spec.get("fps") == 15 for d in endpoint.desired), PATIENCE_S, f"desired version {version} at the agent")
    twin = check.wait(lambda: (t := check.target.ok("GET", f"{path}/twin", Twin)).reported_version == version and t, PATIENCE_S, "the reported document")
    check.check(twin.in_sync and not twin.diff, f"in sync after the agent reported (diff {twin.diff})")
    problem(check.target.call("PUT", f"{path}/twin", json={"desired": {"fps": 30}, "expected_version": version + 5}), 409, ErrorCode.CONFLICT)
    check.equal(check.target.ok("GET", f"{path}/twin", Twin).desired, {"fps": 15, "mode": "conformance"}, "desired after the refused update")
    newer = check.target.ok("PUT", f"{path}/twin", Twin, json={"desired": {"fps": 30}, "expected_version": version})
    check.check(newer.desired_version > version, f"the version goes up ({version} -> {newer.desired_version})")


@case("8.1.8", "a node's twin: the desired document reaches the agent with its version; the report makes it in sync; stale versions are refused")
def node_twin(check: Check) -> None:
    edge = new_edge(check)
    _twin_case(check, f"/nodes/{edge.node_id}", edge.node)


@case("8.1.8", "a device's twin, through its edge; the desired document is retained: a reconnecting edge gets it again")
def device_twin(check: Check) -> None:
    edge = new_edge(check)
    ep = new_device(check, edge)
    _twin_case(check, f"/devices/{ep.ident}", ep)
    version = check.target.ok("GET", f"/devices/{ep.ident}/twin", Twin).desired_version
    watcher = MqttPeer(check.target, edge.identity)  # the same certificate, a new session
    edge.stop()
    check.check(watcher.connect(), f"the edge reconnects ({watcher.refusal})")
    check.cleanup("disconnect watcher", watcher.disconnect)
    watcher.subscribe(ep.topics.desired)
    got = watcher.wait_message(ep.topics.desired, lambda m: m.retain, timeout=PATIENCE_S)
    check.check(got is not None, "the retained desired document is delivered on subscribe")
    check.equal(got.json()["body"]["version"], version, "its version")


@case("8.1.9", "a command is answered through the response topic: the agent's result; an unknown command gets an error answer")
def commands(check: Check) -> None:
    edge = new_edge(check)
    res = check.target.ok("POST", f"/nodes/{edge.node_id}/commands", CommandResult, json={"name": "ping", "args": {"n": 7}, "timeout_s": 30})
    check.check(res.ok and res.result == {"pong": True, "n": 7}, f"the agent's answer comes back: {res.result}")
    cmd = edge.peer.messages(edge.node.topics.cmd)[-1]
    check.check(getattr(cmd.properties, "ResponseTopic", None) and getattr(cmd.properties, "CorrelationData", None),
                f"the request carries a response topic ({getattr(cmd.properties, 'ResponseTopic', None)}) and correlation data")  # fmt: skip
    res = check.target.ok("POST", f"/nodes/{edge.node_id}/commands", CommandResult, json={"name": "no-such-command", "timeout_s": 30})
    check.check(not res.ok and res.error_code == "unknown_command", f"unknown command: ok={res.ok} error_code={res.error_code}")
    ep = new_device(check, edge)
    res = check.target.ok("POST", f"/devices/{ep.ident}/commands", CommandResult, json={"name": "ping", "args": {"d": 1}, "timeout_s": 30})
    check.check(res.ok and res.result == {"pong": True, "d": 1}, "a device's command goes through its edge and the answer comes back")


@case("8.1.9", "commands: 504 command_timeout when the agent stays silent, 409 target_offline when it is not connected, 422 for a bad request")
def command_errors(check: Check) -> None:
    edge = new_edge(check)
    problem(check.target.call("POST", f"/nodes/{edge.node_id}/commands", json={"name": "Bad Name!"}), 422, ErrorCode.VALIDATION_FAILED)
    edge.node.answer_commands = False
    started = time.monotonic()
    problem(check.target.call("POST", f"/nodes/{edge.node_id}/commands", json={"name": "ping", "timeout_s": 1.5}), 504, ErrorCode.COMMAND_TIMEOUT)
    took = time.monotonic() - started
    check.check(1.4 <= took < 10, f"504 after the command's timeout ({took:.1f} s for timeout_s 1.5)")
    edge.stop()
    wait_node(check, edge.node_id, "OFFLINE", PATIENCE_S)
    problem(check.target.call("POST", f"/nodes/{edge.node_id}/commands", json={"name": "ping", "timeout_s": 2}), 409, ErrorCode.TARGET_OFFLINE)
    check.note("offline target: 409 target_offline")
