"""Certificate renewal end to end (DESIGN §6): a node and a device whose certificates have less than RENEW_BEFORE
left renew at their next start (the node at the hub, the device through its edge's listener) and connect with
the new certificate. Real processes: the hub (issuing 30-day certificates, so that every one is due at once), both
brokers, the edge; the device runs in the test process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from device.identity import fingerprint
from edge.identity import IdentityStore as NodeIdentityStore
from tests import support
from tests.integration.devstack import DevStack, start_devstack
from tests.support import stop, wait_for


@pytest.fixture
def stack(tmp_path: Path, sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[DevStack]:
    monkeypatch.setitem(support.HUB_ENV, "AISYNERGY_CERTIFICATE_VALIDITY_DAYS", "30")  # less than RENEW_BEFORE
    s = start_devstack(tmp_path, sqlite_url)
    try:
        yield s
    finally:
        s.close()


def _get(stack: DevStack, path: str) -> dict:  # type: ignore[type-arg]
    with stack.hub.client("admin") as api:
        return api.get(path).json()  # type: ignore[no-any-return]


def _renewed_events(stack: DevStack) -> list[dict]:  # type: ignore[type-arg]
    items = _get(stack, f"/nodes/{stack.node_id}/events?limit=500")["items"]
    return [e for e in items if e["source"] == "hub" and e["type"] == "certificate_renewed"]


def test_a_node_and_a_device_due_for_renewal_renew_at_start_and_connect_with_the_new_certificate(stack: DevStack) -> None:
    # Prepare: both enrolled with 30-day certificates, online
    node = NodeIdentityStore(stack.data / "edge")
    node_first = node.load_enrolment()
    dev = stack.add_device("cam-renewing")
    wait_for(lambda: stack.device_state(dev.device_id) == "ONLINE", 60, what="device ONLINE")
    device_first = dev.identity.load_enrolment()
    assert _get(stack, f"/nodes/{stack.node_id}")["certificate_serial"] == node_first.serial

    # Execute: the edge restarts
    assert stack.edge is not None
    stop(stack.edge)
    wait_for(lambda: _get(stack, f"/nodes/{stack.node_id}/status")["state"] == "OFFLINE", 60, what="node OFFLINE")
    stack.start_edge()

    # Assert: a new serial at the hub and on disk, and the node online with it
    wait_for(lambda: _get(stack, f"/nodes/{stack.node_id}")["certificate_serial"] != node_first.serial, 60, what="node renewed")
    wait_for(lambda: _get(stack, f"/nodes/{stack.node_id}/status")["state"] == "ONLINE", 60, what="node ONLINE again")
    node_now = node.load_enrolment()
    assert node_now.serial == _get(stack, f"/nodes/{stack.node_id}")["certificate_serial"]
    assert node_now.certificate_sha256 == fingerprint(node.cert_path.read_text())

    # Execute: the device restarts (it renews through the edge's listener)
    dev.stop()
    wait_for(lambda: stack.device_state(dev.device_id) == "OFFLINE", 60, what="device OFFLINE")
    again = stack.restart_device(dev)

    # Assert: renewed, its new certificate on disk, online with it; both renewals recorded on the node
    wait_for(lambda: stack.device_state(again.device_id) == "ONLINE", 60, what="device ONLINE again")
    device_now = again.identity.load_enrolment()
    assert device_now.serial != device_first.serial
    assert device_now.certificate_sha256 == fingerprint(again.identity.cert_path.read_text())
    assert (device_now.enrol_url, device_now.tls_server_name) == (device_first.enrol_url, device_first.tls_server_name)
    renewed = {(e["data"].get("device_id"), e["data"]["serial"]) for e in _renewed_events(stack)}
    assert renewed == {(None, node_now.serial), (dev.device_id, device_now.serial)}


def test_a_running_device_renews_when_its_periodic_check_finds_the_certificate_due_and_stays_online(tmp_path: Path, sqlite_url: str,
                                                                                                    monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    from datetime import UTC, datetime, timedelta

    from device import renewal
    from device.agent import Device

    # Prepare: 365-day certificates (not due at start); a device that looks every half second
    s = start_devstack(tmp_path, sqlite_url)
    try:
        with s.hub.client("operator") as api:
            device_id = api.post("/devices", json={"node_id": s.node_id, "name": "cam-long-running", "model": "test-board"}).json()["id"]
            issued = api.post(f"/devices/{device_id}/bootstrap-token", json={}).json()
        acl = s.data / "devices-broker" / "acl"
        wait_for(lambda: acl.exists() and device_id in acl.read_text(), 60, what="the devices' broker knows the device")
        dev = Device(device_id, s.data / "cam-long-running", enrol_url=s.enrol_url, bootstrap_token=issued["bootstrap_token"],
                     ca_sha256=issued["ca_sha256"], tls_server_name=issued["tls_server_name"], renewal_check_s=0.5)  # fmt: skip
        s.devices.append(dev)
        dev.start()
        wait_for(lambda: s.device_state(device_id) == "ONLINE", 60, what="device ONLINE")
        first = dev.identity.load_enrolment()
        assert not renewal.due(first)

        # Execute: 310 days pass for the running agent (less than RENEW_BEFORE left)
        later = datetime.now(UTC) + timedelta(days=310)
        monkeypatch.setattr(renewal, "_now", lambda: later)

        # Assert: renewed in the running agent
        wait_for(lambda: dev.identity.load_enrolment().serial != first.serial, 60, what="the running device renewed")

        # Execute: the clock back to now (a renewed certificate has 365 days again: not due); the agent's periodic
        # check reads the clock, so counting the reads counts the checks
        looked: list[datetime] = []

        def clock() -> datetime:
            looked.append(datetime.now(UTC))
            return looked[-1]

        def checks(n: int) -> None:
            since = len(looked)
            wait_for(lambda: len(looked) >= since + n, 60, what=f"{n} more checks of the running agent")

        monkeypatch.setattr(renewal, "_now", clock)
        checks(3)
        settled = dev.identity.load_enrolment()
        checks(3)

        # Assert: stored, recorded by the hub, and not renewed again once not due
        now = dev.identity.load_enrolment()
        assert now.serial == settled.serial != first.serial
        assert now.certificate_sha256 == fingerprint(dev.identity.cert_path.read_text())
        renewed = [e["data"]["serial"] for e in _renewed_events(s) if e["data"].get("device_id") == device_id]
        assert now.serial in renewed
        assert s.device_state(device_id) == "ONLINE"
    finally:
        s.close()
