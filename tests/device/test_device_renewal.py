"""The agent core renews its certificate from the identity it holds (DESIGN §6), against the real hub in-process:
due within RENEW_BEFORE, renewed also when it expired within the grace window, refused beyond it with a message
that says how to re-enrol, for the SDK and both CLIs."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cloud import pki
from device import renewal
from device.agent import Device
from device.enrol import DEVICE
from device.errors import IdentityError
from device.identity import IdentityStore, fingerprint
from edge.enrol import NODE
from edge.identity import IdentityStore as NodeIdentityStore
from interfaces.auth import Role
from interfaces.nodes import RENEWAL_GRACE, CertificateIssued, DeviceCertificateIssued
from tests.hub.conftest import HubUnderTest, hub_settings, running_hub

HUB = "http://testserver"  # the TestClient's base URL: what the identities enrolled with
REPO = Path(__file__).resolve().parents[2]
BEYOND_GRACE = dt.timedelta(days=365) + RENEWAL_GRACE + dt.timedelta(days=1)


@pytest.fixture
def hub(sqlite_url: str, tmp_path: Path) -> Iterator[HubUnderTest]:
    yield from running_hub(hub_settings(tmp_path / "hub", sqlite_url))


def _issued_ago(monkeypatch: pytest.MonkeyPatch, ago: dt.timedelta) -> None:
    """The hub CA signs as if ``ago`` earlier (its certificates are 365 days long)."""
    real = dt.datetime.now
    monkeypatch.setattr(pki, "_now", lambda: real(dt.UTC) - ago)


def _node(hub: HubUnderTest, data_dir: Path) -> NodeIdentityStore:
    registered = hub.register("gw-renewing")
    node_id, store = registered["node"]["id"], NodeIdentityStore(data_dir)
    body = {"csr_pem": store.make_csr(node_id), "bootstrap_token": registered["bootstrap_token"]}
    r = hub.request("POST", f"/nodes/{node_id}/certificate", None, json=body)
    assert r.status_code == 201, r.text
    store.save(CertificateIssued.model_validate(r.json()), HUB)
    return store


def _device(hub: HubUnderTest, data_dir: Path) -> IdentityStore:
    node_id = hub.register("gw-of-device")["node"]["id"]
    device_id = hub.add_device(node_id)["id"]
    token = hub.request("POST", f"/devices/{device_id}/bootstrap-token", Role.OPERATOR, json={"ttl_s": 120}).json()["bootstrap_token"]
    store = IdentityStore(data_dir)
    body = {"csr_pem": store.make_csr(device_id), "bootstrap_token": token}
    r = hub.request("POST", f"/devices/{device_id}/certificate", None, json=body)
    assert r.status_code == 201, r.text
    store.save(DeviceCertificateIssued.model_validate(r.json()), HUB, tls_server_name=node_id)
    return store


@pytest.mark.parametrize("ago", [dt.timedelta(days=320), dt.timedelta(days=375)], ids=["45-days-left", "expired-10-days-ago"])
def test_a_node_certificate_due_or_expired_within_the_grace_renews(
    hub: HubUnderTest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ago: dt.timedelta
) -> None:
    # Prepare
    _issued_ago(monkeypatch, ago)
    store = _node(hub, tmp_path / "node")
    monkeypatch.undo()
    held = store.load_enrolment()
    key_before = store.key_path.read_bytes()
    renewal.check_renewable(store, held)
    assert renewal.due(held)

    # Execute
    renewed = renewal.renew(store, NODE, held, transport=hub.client._transport)

    # Assert: the new certificate on disk and recorded, the same key, the hub's serial
    assert renewed is not None and renewed.serial != held.serial
    assert store.load_enrolment() == renewed
    assert renewed.certificate_sha256 == fingerprint(store.cert_path.read_text())
    assert store.key_path.read_bytes() == key_before
    assert not renewal.due(renewed) and renewed.not_after > dt.datetime.now(dt.UTC) + dt.timedelta(days=300)
    assert hub.get(f"/nodes/{held.node_id}").json()["certificate_serial"] == renewed.serial
    store.check_owner(held.node_id)


def test_a_device_certificate_renews_and_keeps_its_urls(hub: HubUnderTest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _issued_ago(monkeypatch, dt.timedelta(days=375))
    store = _device(hub, tmp_path / "device")
    monkeypatch.undo()
    held = store.load_enrolment()

    renewed = renewal.renew(store, DEVICE, held, transport=hub.client._transport)

    assert renewed is not None and renewed.serial != held.serial
    assert (renewed.enrol_url, renewed.tls_server_name, renewed.mqtt_url) == (held.enrol_url, held.tls_server_name, held.mqtt_url)
    assert hub.get(f"/devices/{held.device_id}").status_code == 200
    store.check_owner(held.device_id)


def test_a_refused_renewal_keeps_the_identity_held(hub: HubUnderTest, tmp_path: Path) -> None:
    # Prepare: the certificate revoked (the node deleted)
    store = _node(hub, tmp_path / "node")
    held = store.load_enrolment()
    assert hub.request("DELETE", f"/nodes/{held.node_id}").status_code == 204
    certificate = store.cert_path.read_bytes()

    # Execute
    renewed = renewal.renew(store, NODE, held, transport=hub.client._transport)

    # Assert
    assert renewed is None
    assert (store.load_enrolment(), store.cert_path.read_bytes()) == (held, certificate)


def test_an_identity_expired_beyond_the_grace_refuses_to_start_and_says_how_to_re_enrol(
    hub: HubUnderTest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: a node and a device whose certificates expired 31 days ago
    _issued_ago(monkeypatch, BEYOND_GRACE)
    node = _node(hub, tmp_path / "node")
    device = _device(hub, tmp_path / "device")
    monkeypatch.undo()
    node_id, device_id = node.load_enrolment().node_id, device.load_enrolment().device_id

    # Execute: the SDK, and both CLIs
    with pytest.raises(IdentityError) as refused:
        Device(device_id, tmp_path / "device").start()
    cli = {
        "device": subprocess.run([sys.executable, "-m", "device.cli", "run", "--device-id", device_id, "--data-dir", str(tmp_path / "device")],
                                 cwd=REPO, capture_output=True, text=True, timeout=60),
        "edge": subprocess.run([sys.executable, "-m", "edge.cli", "run", "--node-id", node_id, "--data-dir", str(tmp_path / "node")],
                               cwd=REPO, capture_output=True, text=True, timeout=60),
    }  # fmt: skip

    # Assert: the identity exit code (4) of each, and the way out
    message = str(refused.value)
    assert "can no longer be renewed" in message and "bootstrap token" in message and str(device.enrolment_path) in message
    for name, done in cli.items():
        assert done.returncode == 4, (name, done.stderr[-2000:])
        assert "can no longer be renewed" in done.stderr and "enrolment.json" in done.stderr, done.stderr[-2000:]
