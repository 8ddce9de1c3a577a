"""Certificate renewal from the identity an agent holds (DESIGN §6): proof of possession of the key, the hub CA's
certificate recorded for the id and not revoked, at most RENEWAL_GRACE expired; each refusal leaves nothing changed."""

from __future__ import annotations

import base64
import datetime as dt
from collections.abc import Iterator
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from cloud import pki
from cloud.pki import CertificateAuthority, make_csr, new_private_key
from interfaces.auth import Role
from interfaces.nodes import RENEWAL_GRACE, CertificateIssued, DeviceCertificateIssued
from tests.hub.conftest import SQLITE_ONLY, HubUnderTest, assert_problem


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[dt.timedelta]]:
    """The CA's clock, moved back by ``clock[0]``: certificates issued in the past (expired now, for one)."""
    shift = [dt.timedelta(0)]
    real = pki._now
    monkeypatch.setattr(pki, "_now", lambda: real() - shift[0])
    yield shift


def _enrolled_node(hub: HubUnderTest, name: str = "gw-renew") -> tuple[str, ec.EllipticCurvePrivateKey, dict[str, Any]]:
    registered = hub.register(name)
    node_id, key = registered["node"]["id"], new_private_key()
    body = {"csr_pem": make_csr(key, node_id), "bootstrap_token": registered["bootstrap_token"]}
    r = hub.request("POST", f"/nodes/{node_id}/certificate", None, json=body)
    assert r.status_code == 201, r.text
    return node_id, key, r.json()


def _renew(hub: HubUnderTest, collection: str, owner_id: str, certificate_pem: str, csr_pem: str) -> Any:
    body = {"certificate_pem": certificate_pem, "csr_pem": csr_pem}
    return hub.request("POST", f"/{collection}/{owner_id}/certificate/renewal", None, json=body)


def _hub_events(hub: HubUnderTest, node_id: str, type: str) -> list[dict[str, Any]]:
    items = hub.get(f"/nodes/{node_id}/events", Role.ADMIN, params={"limit": 500}).json()["items"]
    return [e for e in items if e["source"] == "hub" and e["type"] == type]


def _ca(hub: HubUnderTest) -> CertificateAuthority:
    return hub.state.ca


def test_a_node_renews_with_its_certificate_and_key_and_the_old_one_stays_valid(hub: HubUnderTest) -> None:
    # Prepare
    node_id, key, first = _enrolled_node(hub)

    # Execute
    r = _renew(hub, "nodes", node_id, first["certificate_pem"], make_csr(key, node_id))

    # Assert: a new serial for the same key, recorded, the node row follows, the old one not revoked
    assert r.status_code == 200, r.text
    renewed = CertificateIssued.model_validate(r.json())
    assert renewed.serial != first["serial"] and renewed.node_id == node_id
    cert = x509.load_pem_x509_certificate(renewed.certificate_pem.encode())
    assert cert.public_key() == key.public_key()
    assert hub.get(f"/nodes/{node_id}").json()["certificate_serial"] == renewed.serial
    [event] = _hub_events(hub, node_id, "certificate_renewed")
    assert (event["data"]["serial"], event["data"]["renewed"], event["data"]["by"]) == (renewed.serial, first["serial"], "hub")
    crl = x509.load_pem_x509_crl((hub.settings.pki_dir / "crl.pem").read_bytes())
    assert crl.get_revoked_certificate_by_serial_number(int(first["serial"], 16)) is None
    again = _renew(hub, "nodes", node_id, first["certificate_pem"], make_csr(key, node_id))
    assert again.status_code == 200, again.text  # the old certificate is still good until it expires


@SQLITE_ONLY
def test_a_device_renews_and_it_is_recorded_on_its_node(hub: HubUnderTest) -> None:
    # Prepare
    node_id, _, _ = _enrolled_node(hub, "gw-dev")
    device_id = hub.add_device(node_id)["id"]
    token = hub.request("POST", f"/devices/{device_id}/bootstrap-token", Role.OPERATOR, json={"ttl_s": 120}).json()["bootstrap_token"]
    key = new_private_key()
    first = hub.request("POST", f"/devices/{device_id}/certificate", None, json={"csr_pem": make_csr(key, device_id), "bootstrap_token": token}).json()

    # Execute
    r = _renew(hub, "devices", device_id, first["certificate_pem"], make_csr(key, device_id))

    # Assert
    assert r.status_code == 200, r.text
    renewed = DeviceCertificateIssued.model_validate(r.json())
    assert (renewed.device_id, renewed.node_id) == (device_id, node_id) and renewed.serial != first["serial"]
    [event] = _hub_events(hub, node_id, "certificate_renewed")
    assert (event["data"]["device_id"], event["data"]["serial"]) == (device_id, renewed.serial)


@SQLITE_ONLY
def test_a_certificate_expired_within_the_grace_window_renews(hub: HubUnderTest, clock: list[dt.timedelta]) -> None:
    # Prepare: issued 375 days ago, so expired 10 days ago
    clock[0] = dt.timedelta(days=375)
    node_id, key, first = _enrolled_node(hub)
    clock[0] = dt.timedelta(0)
    assert x509.load_pem_x509_certificate(first["certificate_pem"].encode()).not_valid_after_utc < dt.datetime.now(dt.UTC) - dt.timedelta(days=9)

    # Execute
    r = _renew(hub, "nodes", node_id, first["certificate_pem"], make_csr(key, node_id))

    # Assert
    assert r.status_code == 200, r.text
    assert CertificateIssued.model_validate(r.json()).not_after > dt.datetime.now(dt.UTC) + dt.timedelta(days=300)


def _refused(hub: HubUnderTest, collection: str, owner_id: str, certificate_pem: str, csr_pem: str, status: int, code: str) -> dict[str, Any]:
    before = hub.snapshot()
    doc = assert_problem(_renew(hub, collection, owner_id, certificate_pem, csr_pem), status, code)
    assert hub.snapshot() == before
    return doc


@SQLITE_ONLY
def test_a_certificate_expired_beyond_the_grace_window_is_refused_with_re_enrolment(hub: HubUnderTest, clock: list[dt.timedelta]) -> None:
    clock[0] = dt.timedelta(days=365) + RENEWAL_GRACE + dt.timedelta(days=1)
    node_id, key, first = _enrolled_node(hub)
    clock[0] = dt.timedelta(0)

    doc = _refused(hub, "nodes", node_id, first["certificate_pem"], make_csr(key, node_id), 403, "certificate_expired_beyond_grace")

    assert "bootstrap token" in doc["detail"]


@SQLITE_ONLY
def test_a_csr_of_another_key_is_refused(hub: HubUnderTest) -> None:
    node_id, _, first = _enrolled_node(hub)

    _refused(hub, "nodes", node_id, first["certificate_pem"], make_csr(new_private_key(), node_id), 403, "csr_key_mismatch")


@SQLITE_ONLY
def test_a_csr_for_another_subject_is_refused(hub: HubUnderTest) -> None:
    node_id, key, first = _enrolled_node(hub)

    _refused(hub, "nodes", node_id, first["certificate_pem"], make_csr(key, "nd-someone-else"), 422, "csr_invalid")


@SQLITE_ONLY
def test_a_csr_with_a_bad_signature_is_refused(hub: HubUnderTest) -> None:
    node_id, key, first = _enrolled_node(hub)
    csr = x509.load_pem_x509_csr(make_csr(key, node_id).encode())
    der = bytearray(csr.public_bytes(pki.serialization.Encoding.DER))
    der[-1] ^= 0x01  # the signature's last byte
    tampered = "-----BEGIN CERTIFICATE REQUEST-----\n" + base64.encodebytes(bytes(der)).decode() + "-----END CERTIFICATE REQUEST-----\n"

    _refused(hub, "nodes", node_id, first["certificate_pem"], tampered, 422, "csr_invalid")


@SQLITE_ONLY
def test_a_certificate_of_another_ca_is_refused(hub: HubUnderTest, tmp_path: Any) -> None:
    node_id, key, _ = _enrolled_node(hub)
    other = CertificateAuthority.load_or_create(tmp_path / "other-pki")
    forged = other.sign_csr(make_csr(key, node_id), node_id).certificate_pem

    _refused(hub, "nodes", node_id, forged, make_csr(key, node_id), 403, "certificate_unknown")


@SQLITE_ONLY
def test_a_certificate_of_another_identity_is_refused(hub: HubUnderTest) -> None:
    node_id, key, first = _enrolled_node(hub, "gw-a")
    other_id, _, _ = _enrolled_node(hub, "gw-b")

    _refused(hub, "nodes", other_id, first["certificate_pem"], make_csr(key, other_id), 403, "certificate_unknown")


@SQLITE_ONLY
def test_a_certificate_the_hub_never_recorded_is_refused(hub: HubUnderTest) -> None:
    node_id, key, _ = _enrolled_node(hub)
    unrecorded = _ca(hub).sign_csr(make_csr(key, node_id), node_id).certificate_pem  # signed, never issued through the API

    _refused(hub, "nodes", node_id, unrecorded, make_csr(key, node_id), 403, "certificate_unknown")


@SQLITE_ONLY
def test_a_revoked_certificate_is_refused(hub: HubUnderTest) -> None:
    # Prepare: re-enrolled with a new token, and the first certificate revoked as superseded
    node_id, key, first = _enrolled_node(hub)
    token = hub.request("POST", f"/nodes/{node_id}/bootstrap-token", Role.ADMIN, json={"ttl_s": 120}).json()["bootstrap_token"]
    assert hub.enrol(node_id, token).status_code == 201
    assert hub.request("POST", f"/nodes/{node_id}/certificates/revoke-superseded", Role.ADMIN).json()["revoked"] == [first["serial"]]

    _refused(hub, "nodes", node_id, first["certificate_pem"], make_csr(key, node_id), 403, "certificate_revoked")


@SQLITE_ONLY
def test_a_deleted_node_cannot_renew(hub: HubUnderTest) -> None:
    node_id, key, first = _enrolled_node(hub)
    assert hub.request("DELETE", f"/nodes/{node_id}").status_code == 204

    # deleting revokes its certificates: refused before the node row is read
    _refused(hub, "nodes", node_id, first["certificate_pem"], make_csr(key, node_id), 403, "certificate_revoked")


@SQLITE_ONLY
def test_an_unreadable_certificate_or_an_unknown_field_is_refused(hub: HubUnderTest) -> None:
    node_id, key, _ = _enrolled_node(hub)

    _refused(hub, "nodes", node_id, "-----BEGIN CERTIFICATE-----\n" + "A" * 80 + "\n-----END CERTIFICATE-----\n", make_csr(key, node_id), 422, "certificate_invalid")
    r = hub.request("POST", f"/nodes/{node_id}/certificate/renewal", None, json={"certificate_pem": "x" * 64, "csr_pem": "y" * 64, "extra": 1})
    assert_problem(r, 422, "validation_failed")
