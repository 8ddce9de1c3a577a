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
    wait_for(lambda: stack.device_state(dev.device_id) == "ONLINE", 30, what="device ONLINE")
    device_first = dev.identity.load_enrolment()
    assert _get(stack, f"/nodes/{stack.node_id}")["certificate_serial"] == node_first.serial

    # Execute: the edge restarts
    assert stack.edge is not None
    stop(stack.edge)
    wait_for(lambda: _get(stack, f"/nodes/{stack.node_id}/status")["state"] == "OFFLINE", 20, what="node OFFLINE")
    stack.start_edge()

    # Assert: a new serial at the hub and on disk, and the node online with it
    wait_for(lambda: _get(stack, f"/nodes/{stack.node_id}")["certificate_serial"] != node_first.serial, 30, what="node renewed")
    wait_for(lambda: _get(stack, f"/nodes/{stack.node_id}/status")["state"] == "ONLINE", 30, what="node ONLINE again")
    node_now = node.load_enrolment()
    assert node_now.serial == _get(stack, f"/nodes/{stack.node_id}")["certificate_serial"]
    assert node_now.certificate_sha256 == fingerprint(node.cert_path.read_text())

    # Execute: the device restarts (it renews through the edge's listener)
    dev.stop()
    wait_for(lambda: stack.device_state(dev.device_id) == "OFFLINE", 20, what="device OFFLINE")
    again = stack.restart_device(dev)

    # Assert: renewed, its new certificate on disk, online with it; both renewals recorded on the node
    wait_for(lambda: stack.device_state(again.device_id) == "ONLINE", 30, what="device ONLINE again")
    device_now = again.identity.load_enrolment()
    assert device_now.serial != device_first.serial
    assert device_now.certificate_sha256 == fingerprint(again.identity.cert_path.read_text())
    assert (device_now.enrol_url, device_now.tls_server_name) == (device_first.enrol_url, device_first.tls_server_name)
    renewed = {(e["data"].get("device_id"), e["data"]["serial"]) for e in _renewed_events(stack)}
    assert renewed == {(None, node_now.serial), (dev.device_id, device_now.serial)}
