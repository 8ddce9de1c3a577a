"""Who may hand out a new identity for an enrolled node or device, what is recorded, and that a re-enrolment does
not cut the identity's earlier certificate off until an admin revokes it (DESIGN §6)."""

from __future__ import annotations

from typing import Any

from cryptography import x509

from cloud.pki import make_csr, new_private_key
from interfaces.auth import Role
from tests.hub.conftest import HubUnderTest, assert_problem


def _revoked(hub: HubUnderTest, serial: str) -> bool:
    crl = x509.load_pem_x509_crl((hub.settings.pki_dir / "crl.pem").read_bytes())
    return crl.get_revoked_certificate_by_serial_number(int(serial, 16)) is not None


def _hub_events(hub: HubUnderTest, node_id: str, type: str) -> list[dict[str, Any]]:
    items = hub.get(f"/nodes/{node_id}/events", Role.ADMIN, params={"limit": 500}).json()["items"]
    return [e for e in items if e["source"] == "hub" and e["type"] == type]


def _enrol_device(hub: HubUnderTest, device_id: str, token: str) -> dict[str, Any]:
    csr = make_csr(new_private_key(), device_id)
    r = hub.request("POST", f"/devices/{device_id}/certificate", None, json={"csr_pem": csr, "bootstrap_token": token})
    assert r.status_code == 201, r.text
    return r.json()  # type: ignore[no-any-return]


def test_an_operator_may_not_reissue_a_token_for_an_enrolled_node(hub: HubUnderTest) -> None:
    # Prepare
    registered = hub.register("gw-taken")
    node_id = registered["node"]["id"]
    assert hub.enrol(node_id, registered["bootstrap_token"]).status_code == 201
    before = hub.snapshot()

    # Execute
    r = hub.request("POST", f"/nodes/{node_id}/bootstrap-token", Role.OPERATOR, json={"ttl_s": 120})

    # Assert
    assert_problem(r, 403, "forbidden")
    assert hub.snapshot() == before


def test_an_operator_may_issue_a_token_for_a_node_that_never_enrolled_and_it_is_recorded(hub: HubUnderTest) -> None:
    # Prepare
    node_id = hub.register("gw-new")["node"]["id"]

    # Execute
    r = hub.request("POST", f"/nodes/{node_id}/bootstrap-token", Role.OPERATOR, json={"ttl_s": 120})

    # Assert
    assert r.status_code == 201, r.text
    assert hub.enrol(node_id, r.json()["bootstrap_token"]).status_code == 201
    [event] = _hub_events(hub, node_id, "bootstrap_token_issued")
    assert (event["data"]["role"], event["data"]["by_name"], event["data"]["enrolled"]) == ("operator", "test-operator", False)
    assert event["data"]["by"].startswith("tok-")


def test_an_admin_reissue_is_recorded_and_the_old_certificate_stays_valid_until_revoked(hub: HubUnderTest) -> None:
    # Prepare
    registered = hub.register("gw-reenrol")
    node_id = registered["node"]["id"]
    first = hub.enrol(node_id, registered["bootstrap_token"]).json()

    # Execute: reissue and enrol again
    r = hub.request("POST", f"/nodes/{node_id}/bootstrap-token", Role.ADMIN, json={"ttl_s": 120})
    assert r.status_code == 201, r.text
    second = hub.enrol(node_id, r.json()["bootstrap_token"]).json()

    # Assert: recorded with who; the first certificate still works
    [issued] = _hub_events(hub, node_id, "bootstrap_token_issued")
    assert (issued["data"]["role"], issued["data"]["by_name"], issued["data"]["enrolled"]) == ("admin", "test-admin", True)
    [enrolled] = _hub_events(hub, node_id, "certificate_issued")
    assert (enrolled["data"]["serial"], enrolled["data"]["still_valid"]) == (second["serial"], [first["serial"]])
    assert hub.get(f"/nodes/{node_id}").json()["certificate_serial"] == second["serial"]
    assert not _revoked(hub, first["serial"])

    # Execute: an operator may not revoke; an admin revokes the superseded one
    assert_problem(hub.request("POST", f"/nodes/{node_id}/certificates/revoke-superseded", Role.OPERATOR), 403, "forbidden")
    r = hub.request("POST", f"/nodes/{node_id}/certificates/revoke-superseded", Role.ADMIN)

    # Assert
    assert r.status_code == 200, r.text
    assert r.json() == {"revoked": [first["serial"]]}
    assert _revoked(hub, first["serial"]) and not _revoked(hub, second["serial"])
    [revoked] = _hub_events(hub, node_id, "certificates_revoked")
    assert (revoked["data"]["serials"], revoked["data"]["by_name"]) == ([first["serial"]], "test-admin")
    assert hub.request("POST", f"/nodes/{node_id}/certificates/revoke-superseded", Role.ADMIN).json() == {"revoked": []}


def test_device_reissue_and_delete_need_the_admin_role_once_it_enrolled_and_are_recorded(hub: HubUnderTest) -> None:
    # Prepare: a device enrolled with an operator's token
    node_id = hub.register("gw-dev")["node"]["id"]
    device_id = hub.add_device(node_id)["id"]
    token = hub.request("POST", f"/devices/{device_id}/bootstrap-token", Role.OPERATOR, json={}).json()["bootstrap_token"]
    first = _enrol_device(hub, device_id, token)
    before = hub.snapshot()

    # Execute: an operator may neither reissue nor delete
    reissue = hub.request("POST", f"/devices/{device_id}/bootstrap-token", Role.OPERATOR, json={})
    delete = hub.request("DELETE", f"/devices/{device_id}", Role.OPERATOR)

    # Assert
    assert_problem(reissue, 403, "forbidden")
    assert_problem(delete, 403, "forbidden")
    assert hub.snapshot() == before

    # Execute: an admin reissues, the device enrols again
    token = hub.request("POST", f"/devices/{device_id}/bootstrap-token", Role.ADMIN, json={}).json()["bootstrap_token"]
    second = _enrol_device(hub, device_id, token)

    # Assert: the first certificate still valid until revoked
    assert not _revoked(hub, first["serial"])
    issued = _hub_events(hub, node_id, "bootstrap_token_issued")
    assert [(e["data"]["device_id"], e["data"]["role"]) for e in issued] == [(device_id, "operator"), (device_id, "admin")]
    r = hub.request("POST", f"/devices/{device_id}/certificates/revoke-superseded", Role.ADMIN)
    assert r.json() == {"revoked": [first["serial"]]}
    assert _revoked(hub, first["serial"]) and not _revoked(hub, second["serial"])

    # Execute: an admin deletes it
    assert hub.request("DELETE", f"/devices/{device_id}", Role.ADMIN).status_code == 204

    # Assert
    [deleted] = _hub_events(hub, node_id, "device_deleted")
    assert (deleted["data"]["device_id"], deleted["data"]["by_name"], deleted["data"]["role"]) == (device_id, "test-admin", "admin")
    assert _revoked(hub, second["serial"])
