"""Devices enrol through their edge: the proxy forwards to a (stand-in) hub, keeps its own devices only,
tells them to use the devices' broker, and passes the hub's refusals through."""

from __future__ import annotations

import hashlib
import json
import shutil
import ssl
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import NameOID
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from device.enrol import CA_PIN_MISMATCH, request_certificate
from device.errors import EnrolmentError, EnrolmentUnreachable
from edge.enrol_proxy import EnrolmentProxy, FailureLimit, server_context
from edge.identity import IdentityStore
from interfaces.messages import CommandBody, envelope
from interfaces.nodes import CertificateRenewal, CertificateRequest, DeviceCertificateIssued
from interfaces.topics import DEVICE_CMD, NODE_STATE, RELAY_CMD, RELAY_CMD_REPLY, Tier, own_subtree
from tests.edge.support import (
    Mosquitto,
    Peer,
    Pki,
    ThrowawayCA,
    body,
    edge_acl,
    enrol_node,
    free_port,
    listening,
    needs_mosquitto,
    start_edge,
    stop_edge,
    wait_until,
)
from tests.edge.test_edge_relay import answer_commands

NODE = "nd-edge3"
TOKEN = "bst-device-token-0001"
HUB_BROKER = "mqtts://hub-broker.example:8883"
DEVICES_BROKER = "mqtts://gateway.local:8883"


class HubStandIn:
    """Just the hub's ``POST /api/v1/devices/{id}/certificate``, signing with the test CA."""

    def __init__(self, ca: ThrowawayCA, owners: dict[str, str]) -> None:
        self.ca, self.owners = ca, owners
        self.requests: list[tuple[str, dict[str, str], bytes]] = []
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers["content-length"]))
                stand_in.requests.append((self.path, {k.lower(): v for k, v in self.headers.items()}, raw))
                parts = self.path.split("/")  # /api/v1/devices/{id}/certificate[/renewal]
                if parts[-1] == "renewal":
                    status, document = stand_in.renew(parts[-3], raw)
                else:
                    status, document = stand_in.answer(parts[-2], raw)
                payload = json.dumps(document).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json" if status < 300 else "application/problem+json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.1,), daemon=True).start()

    def answer(self, device_id: str, raw: bytes) -> tuple[int, dict]:
        request = CertificateRequest.model_validate_json(raw)
        if request.bootstrap_token != TOKEN:
            return 401, {
                "type": "urn:aisynergy:error:bootstrap_token_invalid",
                "title": "Bootstrap token invalid",
                "status": 401,
                "code": "bootstrap_token_invalid",
            }
        if device_id == "dev-garbled":
            return 201, {"device_id": device_id}
        issued = self.ca.issue_device(request.csr_pem, device_id, self.owners[device_id], HUB_BROKER)
        return 201, issued.model_dump(mode="json")

    def renew(self, device_id: str, raw: bytes) -> tuple[int, dict]:
        request = CertificateRenewal.model_validate_json(raw)
        if "BEGIN CERTIFICATE" not in request.certificate_pem:
            return 403, {"type": "urn:aisynergy:error:certificate_unknown", "title": "Unknown", "status": 403, "code": "certificate_unknown"}
        return 200, self.ca.issue_device(request.csr_pem, device_id, self.owners[device_id], HUB_BROKER).model_dump(mode="json")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hub(test_ca: ThrowawayCA) -> Iterator[HubStandIn]:
    stand_in = HubStandIn(test_ca, {"dev-c": NODE, "dev-x": "nd-other", "dev-garbled": NODE})
    yield stand_in
    stand_in.close()


def start_proxy(tmp_path: Path, ca: ThrowawayCA, hub_url: str, on_enrolled: Callable[[str], object] = lambda d: None,
                failures: FailureLimit | None = None) -> EnrolmentProxy:  # fmt: skip
    """The proxy as the edge runs it: HTTPS with the node's certificate (as the hub issues it: named by the node id)."""
    node = IdentityStore(tmp_path / "node-identity")
    node.save(ca.issue(node.make_csr(NODE), NODE), hub_url)
    running = EnrolmentProxy(
        ("127.0.0.1", 0), hub_url=hub_url, node_id=NODE, device_mqtt_url=DEVICES_BROKER, on_enrolled=on_enrolled,
        tls=server_context(node.cert_path, node.key_path), ca_pem=ca.pem, failures=failures,
    )  # fmt: skip
    running.start()
    return running


@pytest.fixture
def proxy(tmp_path: Path, test_ca: ThrowawayCA, hub: HubStandIn) -> Iterator[tuple[EnrolmentProxy, list[str]]]:
    enrolled: list[str] = []
    running = start_proxy(tmp_path, test_ca, hub.url, enrolled.append)
    yield running, enrolled
    running.close()


def base_url(proxy: EnrolmentProxy) -> str:
    return "https://{}:{}".format(*proxy.address)


def as_device(method: str, url: str, ca_pem: str, **kwargs: object) -> httpx.Response:
    """A request as a device makes it: trusting the hub CA, and checking the node id in its edge's certificate."""
    with httpx.Client(verify=ssl.create_default_context(cadata=ca_pem), timeout=10) as client:
        return client.request(method, url, extensions={"sni_hostname": NODE}, **kwargs)  # type: ignore[arg-type]


def csr(tmp_path: Path, device_id: str) -> str:
    return IdentityStore(tmp_path / device_id).make_csr(device_id)


def post(proxy: EnrolmentProxy, device_id: str, content: bytes, route: str = "certificate", **headers: str) -> httpx.Response:
    url = f"{base_url(proxy)}/api/v1/devices/{device_id}/{route}"
    return as_device("POST", url, proxy.ca_pem.decode(), content=content, headers={"content-type": "application/json", **headers})


def request_body(tmp_path: Path, device_id: str, token: str = TOKEN) -> bytes:
    return CertificateRequest(csr_pem=csr(tmp_path, device_id), bootstrap_token=token).model_dump_json().encode()


def test_a_device_of_this_edge_gets_a_certificate_for_the_devices_broker(
    tmp_path: Path, hub: HubStandIn, proxy: tuple[EnrolmentProxy, list[str]], test_ca: ThrowawayCA
) -> None:
    running, enrolled = proxy
    content = request_body(tmp_path, "dev-c")

    response = post(running, "dev-c", content, **{"Idempotency-Key": "enrol-dev-c"})

    assert response.status_code == 201, response.text
    issued = DeviceCertificateIssued.model_validate_json(response.content)
    assert (issued.device_id, issued.node_id, issued.mqtt_url) == ("dev-c", NODE, DEVICES_BROKER)
    cert = x509.load_pem_x509_certificate(issued.certificate_pem.encode())
    cert.verify_directly_issued_by(test_ca.cert)
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "dev-c"
    assert enrolled == ["dev-c"]
    assert (response.headers["cache-control"], response.headers["x-content-type-options"]) == ("no-store", "nosniff")
    path, headers, forwarded = hub.requests[0]
    assert (path, forwarded, headers["idempotency-key"]) == (
        "/api/v1/devices/dev-c/certificate",
        content,
        "enrol-dev-c",
    )


def test_a_device_of_another_node_is_refused(
    tmp_path: Path, hub: HubStandIn, proxy: tuple[EnrolmentProxy, list[str]]
) -> None:
    running, enrolled = proxy

    response = post(running, "dev-x", request_body(tmp_path, "dev-x"))

    assert response.status_code == 403
    assert response.headers["content-type"] == "application/problem+json"
    assert response.json()["code"] == "forbidden"
    assert enrolled == []


def test_the_hubs_refusal_passes_through_unchanged(
    tmp_path: Path, hub: HubStandIn, proxy: tuple[EnrolmentProxy, list[str]]
) -> None:
    running, enrolled = proxy

    response = post(running, "dev-c", request_body(tmp_path, "dev-c", token="bst-wrong-token-00000"))

    assert response.status_code == 401
    assert response.headers["content-type"] == "application/problem+json"
    assert response.json()["code"] == "bootstrap_token_invalid"
    assert enrolled == []


def _renewal(tmp_path: Path, device_id: str, certificate_pem: str) -> bytes:
    return CertificateRenewal(certificate_pem=certificate_pem, csr_pem=csr(tmp_path, device_id)).model_dump_json().encode()


def test_a_renewal_is_forwarded_and_answered_with_the_devices_broker(
    tmp_path: Path, hub: HubStandIn, proxy: tuple[EnrolmentProxy, list[str]], test_ca: ThrowawayCA
) -> None:
    # Prepare: a device holding a certificate
    running, _ = proxy
    held = test_ca.issue_device(csr(tmp_path, "dev-c"), "dev-c", NODE, HUB_BROKER).certificate_pem
    content = _renewal(tmp_path, "dev-c", held)

    # Execute
    response = post(running, "dev-c", content, route="certificate/renewal")

    # Assert: the hub's path, the body unchanged; the answer checked and rewritten as an enrolment's
    assert response.status_code == 200, response.text
    issued = DeviceCertificateIssued.model_validate_json(response.content)
    assert (issued.device_id, issued.node_id, issued.mqtt_url) == ("dev-c", NODE, DEVICES_BROKER)
    assert [(path, forwarded) for path, _, forwarded in hub.requests] == [("/api/v1/devices/dev-c/certificate/renewal", content)]


def test_a_renewal_for_another_nodes_device_or_refused_by_the_hub_counts_as_a_failure(
    tmp_path: Path, hub: HubStandIn, test_ca: ThrowawayCA
) -> None:
    # Prepare: a limit of 2 refusals a minute
    running = start_proxy(tmp_path, test_ca, hub.url, failures=FailureLimit(limit=2, window_s=60))
    held = test_ca.issue_device(csr(tmp_path, "dev-x"), "dev-x", "nd-other", HUB_BROKER).certificate_pem
    try:
        # Execute
        other = post(running, "dev-x", _renewal(tmp_path, "dev-x", held), route="certificate/renewal")
        refused = post(running, "dev-c", _renewal(tmp_path, "dev-c", "x" * 64), route="certificate/renewal")
        later = post(running, "dev-c", _renewal(tmp_path, "dev-c", held), route="certificate/renewal")
    finally:
        running.close()

    # Assert
    assert (other.status_code, other.json()["code"]) == (403, "forbidden")
    assert (refused.status_code, refused.json()["code"]) == (403, "certificate_unknown")
    assert (later.status_code, later.json()["code"]) == (429, "too_many_requests")
    assert len(hub.requests) == 2


@pytest.mark.parametrize(
    ("device_id", "size", "status", "code"),
    [
        ("dev-c", 64 * 1024 + 1, 413, "payload_too_large"),
        ("dev-garbled", 0, 502, "invalid_response"),
        ("bad+id", 0, 422, "validation_failed"),
    ],
)
def test_what_the_proxy_refuses_itself(
    tmp_path: Path, proxy: tuple[EnrolmentProxy, list[str]], device_id: str, size: int, status: int, code: str
) -> None:
    running, enrolled = proxy
    content = b"x" * size if size else request_body(tmp_path, "dev-garbled")

    response = post(running, device_id, content)

    assert (response.status_code, response.json()["code"]) == (status, code)
    assert response.headers["content-type"] == "application/problem+json"
    assert enrolled == []


def test_other_paths_and_methods_are_refused(proxy: tuple[EnrolmentProxy, list[str]]) -> None:
    running, _ = proxy
    base, ca = base_url(running), running.ca_pem.decode()

    assert as_device("GET", f"{base}/api/v1/devices/dev-c/certificate", ca).status_code == 405
    assert as_device("POST", f"{base}/api/v1/nodes/dev-c/certificate", ca, content=b"{}").json()["code"] == "not_found"


def test_the_listener_speaks_tls_only_with_the_node_certificate_and_answers_the_hub_ca(
    proxy: tuple[EnrolmentProxy, list[str]], test_ca: ThrowawayCA
) -> None:
    running, enrolled = proxy
    host, port = running.address

    # plain HTTP gets no answer: the connection is closed at the failed handshake
    with pytest.raises(httpx.TransportError):
        httpx.post(f"http://{host}:{port}/api/v1/devices/dev-c/certificate", content=b"{}", timeout=10)
    # a client that checks the name finds the node id in the certificate, not the address
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"https://{host}:{port}/api/v1/ca.crt", verify=ssl.create_default_context(cadata=test_ca.pem), timeout=10)
    # TLS 1.1 is refused
    old = ssl.create_default_context(cadata=test_ca.pem)
    old.minimum_version = old.maximum_version = ssl.TLSVersion.TLSv1_1
    with pytest.raises(httpx.ConnectError), httpx.Client(verify=old, timeout=10) as client:
        client.get(f"https://{host}:{port}/api/v1/ca.crt", extensions={"sni_hostname": NODE})
    ca = as_device("GET", f"https://{host}:{port}/api/v1/ca.crt", test_ca.pem)

    assert (ca.status_code, ca.headers["content-type"], ca.text) == (200, "application/x-pem-file", test_ca.pem)
    assert enrolled == []


def test_an_unreachable_hub_is_503(tmp_path: Path, test_ca: ThrowawayCA) -> None:
    running = start_proxy(tmp_path, test_ca, f"http://127.0.0.1:{free_port()}", lambda d: None)
    try:
        response = post(running, "dev-c", request_body(tmp_path, "dev-c"))
    finally:
        running.close()

    assert (response.status_code, response.json()["code"]) == (503, "hub_unreachable")


@needs_mosquitto
@pytest.mark.broker
def test_a_device_enrolled_through_the_running_edge_takes_commands(
    tmp_path: Path, pki: Pki, hub: HubStandIn, cleanup: list[Callable[[], object]]
) -> None:
    # Prepare: no desired document announces dev-c; only its enrolment through the edge does
    broker = Mosquitto(tmp_path / "broker", pki, edge_acl(NODE, ["dev-c"])).start()
    cleanup.append(broker.stop)
    hub_peer = Peer(broker, pki, "hub", [own_subtree(Tier.NODE, NODE)])
    cleanup.append(hub_peer.close)
    node_dir = enrol_node(tmp_path / "node", pki.ca, NODE, broker.url, hub_url=hub.url).data_dir
    port = free_port()
    edge = start_edge(node_dir, NODE, "--device-listen", f"127.0.0.1:{port}", "--device-mqtt-url", broker.url)
    cleanup.append(lambda: stop_edge(edge))
    hub_peer.expect(NODE_STATE.topic(node_id=NODE), where=lambda m: body(m)["state"] == "online")
    wait_until(lambda: listening(port), what="the enrolment proxy")

    # Execute: enrol through the edge, connect with the certificate it returned
    device_store = IdentityStore(tmp_path / "dev-c")
    content = CertificateRequest(csr_pem=device_store.make_csr("dev-c"), bootstrap_token=TOKEN).model_dump_json()
    url = f"https://127.0.0.1:{port}/api/v1/devices/dev-c/certificate"
    response = as_device("POST", url, pki.ca.pem, content=content)
    assert response.status_code == 201, response.text
    issued = DeviceCertificateIssued.model_validate_json(response.content)
    (pki.dir / "dev-c.crt").write_text(issued.certificate_pem)
    shutil.copy(device_store.key_path, pki.dir / "dev-c.key")
    device = Peer(broker, pki, "dev-c", [DEVICE_CMD.topic(device_id="dev-c")], on_message=answer_commands)
    cleanup.append(device.close)
    props = Properties(PacketTypes.PUBLISH)
    props.ResponseTopic = RELAY_CMD_REPLY.topic(node_id=NODE, device_id="dev-c")
    props.CorrelationData = b"c-9"
    hub_peer.publish(
        RELAY_CMD.topic(node_id=NODE, device_id="dev-c"),
        envelope("hub", CommandBody(name="hello")).model_dump_json().encode(),
        properties=props,
    )

    # Assert
    assert issued.mqtt_url == broker.url
    answer = hub_peer.expect(RELAY_CMD_REPLY.topic(node_id=NODE, device_id="dev-c"))
    assert (answer.properties.CorrelationData, body(answer)["ok"]) == (b"c-9", True)  # type: ignore[union-attr]
    assert stop_edge(edge) == 0


# ---- a device's trust: the CA fingerprint it was given, checked before the token leaves it -------------------------


def _pin(ca: ThrowawayCA) -> str:
    return "sha256:" + hashlib.sha256(ca.cert.public_bytes(serialization.Encoding.DER)).hexdigest()


def test_a_device_with_the_right_pin_and_name_enrols_through_the_listener(
    tmp_path: Path, hub: HubStandIn, proxy: tuple[EnrolmentProxy, list[str]], test_ca: ThrowawayCA
) -> None:
    running, enrolled = proxy
    store = IdentityStore(tmp_path / "dev-c")

    issued = request_certificate(
        base_url(running), "dev-c", store.make_csr("dev-c"), TOKEN, ca_sha256=_pin(test_ca), server_name=NODE, attempts=1
    )

    assert (issued.device_id, issued.ca_pem, enrolled) == ("dev-c", test_ca.pem, ["dev-c"])


def test_a_listener_with_another_ca_gets_neither_the_token_nor_the_csr(
    tmp_path: Path, hub: HubStandIn, proxy: tuple[EnrolmentProxy, list[str]]
) -> None:
    # Prepare: the device was given the fingerprint of another CA (the listener is not its edge's)
    running, enrolled = proxy
    store = IdentityStore(tmp_path / "dev-c")

    # Execute
    with pytest.raises(EnrolmentError) as refused:
        request_certificate(base_url(running), "dev-c", store.make_csr("dev-c"), TOKEN, ca_sha256=_pin(ThrowawayCA.create()), server_name=NODE)

    # Assert: refused at once, before any certificate request left the device
    assert refused.value.code == CA_PIN_MISMATCH
    assert (hub.requests, enrolled) == ([], [])


def test_a_listener_whose_certificate_names_another_node_is_not_sent_the_token(
    tmp_path: Path, hub: HubStandIn, proxy: tuple[EnrolmentProxy, list[str]], test_ca: ThrowawayCA
) -> None:
    running, enrolled = proxy
    store = IdentityStore(tmp_path / "dev-c")

    with pytest.raises(EnrolmentUnreachable, match="CERTIFICATE_VERIFY_FAILED"):
        request_certificate(
            base_url(running), "dev-c", store.make_csr("dev-c"), TOKEN, ca_sha256=_pin(test_ca), server_name="nd-other", attempts=1
        )

    assert (hub.requests, enrolled) == ([], [])


def test_an_answer_naming_another_ca_than_the_pinned_one_is_refused(tmp_path: Path, test_ca: ThrowawayCA) -> None:
    # Prepare: a stand-in hub over plain HTTP whose answer carries its own CA (no CA to fetch over HTTP first)
    stand_in = HubStandIn(test_ca, {"dev-c": NODE})
    store = IdentityStore(tmp_path / "dev-c")
    try:
        # Execute
        with pytest.raises(EnrolmentError) as refused:
            request_certificate(stand_in.url, "dev-c", store.make_csr("dev-c"), TOKEN, ca_sha256=_pin(ThrowawayCA.create()), attempts=1)
    finally:
        stand_in.close()

    # Assert
    assert refused.value.code == CA_PIN_MISMATCH and not store.is_enrolled()


def test_an_address_with_too_many_refused_enrolments_waits_and_reaches_the_hub_no_more(
    tmp_path: Path, test_ca: ThrowawayCA, hub: HubStandIn
) -> None:
    # Prepare: a limit of 3 refused enrolments a minute per address
    running = start_proxy(tmp_path, test_ca, hub.url, failures=FailureLimit(limit=3, window_s=60))
    try:
        # Execute: two wrong tokens (the hub refuses), an invalid device id (the edge refuses), then the right token
        wrong = [post(running, "dev-c", request_body(tmp_path, "dev-c", token=f"bst-wrong-token-0000{i}")) for i in range(2)]
        wrong.append(post(running, "dev+x", b"{}"))
        later = post(running, "dev-c", request_body(tmp_path, "dev-c"))
    finally:
        running.close()

    # Assert: each refusal counted; then 429 with Retry-After, and the hub saw only the two forwarded attempts
    assert [r.status_code for r in wrong] == [401, 401, 422]
    assert (later.status_code, later.json()["code"]) == (429, "too_many_requests")
    assert 1 <= int(later.headers["retry-after"]) <= 60
    assert len(hub.requests) == 2


def test_the_failure_limit_forgets_what_left_its_window() -> None:
    now = [0.0]
    limit = FailureLimit(limit=2, window_s=10, max_addresses=2, clock=lambda: now[0])
    limit.failed("a")
    limit.failed("a")
    assert limit.retry_after("a") == 10 and limit.retry_after("b") is None
    now[0] = 10.5  # the first failure left the window
    assert limit.retry_after("a") is None
    limit.failed("b")
    limit.failed("c")  # a third address: the one seen longest ago ("a") is forgotten
    limit.failed("c")
    assert limit.retry_after("c") == 10 and limit.retry_after("a") is None
