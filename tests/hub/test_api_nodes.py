"""REST API of edge node management (DESIGN §4.1): nodes, pagination, selectors, devices and twins.

Every test runs on SQLite and on PostgreSQL (``database_url``).
"""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID

from interfaces.auth import Role
from tests.hub.conftest import SQLITE_ONLY, HubUnderTest, assert_problem


def _ts(value: str) -> datetime:
    return datetime.fromisoformat(value)


def _list_ids(hub: HubUnderTest, path: str, **params: str | int) -> list[str]:
    """Every id of a list endpoint, following next_cursor to the end."""
    ids: list[str] = []
    cursor: str | None = None
    while True:
        query = {**params, **({"cursor": cursor} if cursor else {})}
        r = hub.get(path, params=query)
        assert r.status_code == 200, r.text
        page = r.json()
        ids += [item["id"] for item in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            return ids


# ---- nodes ------------------------------------------------------------------------------------------


def test_node_lifecycle_over_rest(hub: HubUnderTest) -> None:
    # Prepare
    registered = hub.register("gw-1", {"zone": "a", "tier": "edge"}, description="first gateway", bootstrap_ttl_s=600)
    node = registered["node"]
    node_id = node["id"]

    # Execute + Assert: register
    assert node["name"] == "gw-1"
    assert node["kind"] == "edge"
    assert node["labels"] == {"zone": "a", "tier": "edge"}
    assert node["description"] == "first gateway"
    assert (node["state"], node["admin_state"]) == ("REGISTERED", "UNLOCKED")
    assert node["certificate_serial"] is None
    assert registered["bootstrap_token"].startswith("bst_")
    ttl = _ts(registered["bootstrap_expires_at"]) - _ts(node["created_at"])
    assert timedelta(seconds=590) < ttl <= timedelta(seconds=610)

    # get
    r = hub.get(f"/nodes/{node_id}")
    assert r.status_code == 200
    assert r.json() == node

    # list
    r = hub.get("/nodes")
    assert r.status_code == 200
    assert [n["id"] for n in r.json()["items"]] == [node_id]
    assert r.json()["next_cursor"] is None

    # patch: labels replace the whole set; absent fields stay
    r = hub.request("PATCH", f"/nodes/{node_id}", Role.OPERATOR, json={"labels": {"zone": "b"}})
    assert r.status_code == 200, r.text
    patched = r.json()
    assert patched["labels"] == {"zone": "b"}
    assert (patched["name"], patched["description"]) == ("gw-1", "first gateway")
    assert _ts(patched["updated_at"]) >= _ts(node["updated_at"])
    assert hub.get(f"/nodes/{node_id}").json()["labels"] == {"zone": "b"}

    # admin state
    r = hub.request("PUT", f"/nodes/{node_id}/admin-state", Role.OPERATOR, json={"admin_state": "LOCKED"})
    assert r.status_code == 200, r.text
    assert r.json()["admin_state"] == "LOCKED"
    assert r.json()["state"] == "REGISTERED"

    # status
    r = hub.get(f"/nodes/{node_id}/status")
    assert r.status_code == 200
    status = r.json()
    assert status["node_id"] == node_id
    assert (status["state"], status["admin_state"], status["connected"]) == ("REGISTERED", "LOCKED", False)
    assert status["last_heartbeat_at"] is None
    assert status["resources"] is None

    # history
    r = hub.get(f"/nodes/{node_id}/history")
    assert r.status_code == 200
    assert [(t["from_state"], t["to_state"], t["reason"]) for t in r.json()] == [(None, "REGISTERED", "registered")]

    # delete, then everything about it is gone
    r = hub.request("DELETE", f"/nodes/{node_id}", Role.ADMIN)
    assert r.status_code == 204
    assert r.content == b""
    for path in (f"/nodes/{node_id}", f"/nodes/{node_id}/status", f"/nodes/{node_id}/history", f"/nodes/{node_id}/devices"):
        assert_problem(hub.get(path), 404, "not_found")
    assert_problem(hub.request("DELETE", f"/nodes/{node_id}"), 404, "not_found")
    assert_problem(hub.request("PATCH", f"/nodes/{node_id}", json={"description": "x"}), 404, "not_found")
    assert hub.get("/nodes").json()["items"] == []


def test_missing_node_is_404(hub: HubUnderTest) -> None:
    # Execute
    responses = [
        hub.get("/nodes/n-00000000000000000000000000"),
        hub.request("PATCH", "/nodes/n-00000000000000000000000000", json={"description": "x"}),
        hub.request("PUT", "/nodes/n-00000000000000000000000000/admin-state", json={"admin_state": "LOCKED"}),
        hub.request("POST", "/nodes/n-00000000000000000000000000/bootstrap-token", json={}),
    ]

    # Assert
    for r in responses:
        assert_problem(r, 404, "not_found")


def test_enrolment_issues_certificate_and_delete_revokes_it(hub: HubUnderTest) -> None:
    # Prepare
    registered = hub.register("gw-enrol")
    node_id = registered["node"]["id"]

    # Execute
    r = hub.enrol(node_id, registered["bootstrap_token"])

    # Assert: a client certificate for CN = node id, signed by the CA that GET /ca.crt serves
    assert r.status_code == 201, r.text
    issued = r.json()
    cert = x509.load_pem_x509_certificate(issued["certificate_pem"].encode())
    ca_pem = hub.client.get("/api/v1/ca.crt").text
    assert issued["ca_pem"] == ca_pem
    ca = x509.load_pem_x509_certificate(ca_pem.encode())
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == node_id
    assert cert.issuer == ca.subject
    cert.verify_directly_issued_by(ca)
    assert issued["serial"] == format(cert.serial_number, "x")
    node = hub.get(f"/nodes/{node_id}").json()
    assert node["certificate_serial"] == issued["serial"]
    assert node["state"] == "REGISTERED"  # connecting to the broker is what makes it ONLINE

    # Execute: delete
    assert hub.request("DELETE", f"/nodes/{node_id}").status_code == 204

    # Assert: the certificate is on the CRL and the identity on the broker's deny list
    crl = x509.load_pem_x509_crl((hub.settings.pki_dir / "crl.pem").read_bytes())
    assert crl.get_revoked_certificate_by_serial_number(cert.serial_number) is not None
    assert node_id in (hub.settings.pki_dir / "revoked.txt").read_text().split()


def test_reissued_bootstrap_token_enrols_again_and_supersedes_the_first_certificate(hub: HubUnderTest) -> None:
    # Prepare
    registered = hub.register("gw-reenrol")
    node_id = registered["node"]["id"]
    first = hub.enrol(node_id, registered["bootstrap_token"]).json()

    # Execute
    r = hub.request("POST", f"/nodes/{node_id}/bootstrap-token", Role.ADMIN, json={"ttl_s": 120})
    assert r.status_code == 201, r.text
    second = hub.enrol(node_id, r.json()["bootstrap_token"])
    assert hub.request("POST", f"/nodes/{node_id}/certificates/revoke-superseded", Role.ADMIN).status_code == 200

    # Assert
    assert second.status_code == 201, second.text
    assert second.json()["serial"] != first["serial"]
    assert hub.get(f"/nodes/{node_id}").json()["certificate_serial"] == second.json()["serial"]
    crl = x509.load_pem_x509_crl((hub.settings.pki_dir / "crl.pem").read_bytes())
    assert crl.get_revoked_certificate_by_serial_number(int(first["serial"], 16)) is not None
    assert crl.get_revoked_certificate_by_serial_number(int(second.json()["serial"], 16)) is None


# ---- pagination and selectors -----------------------------------------------------------------------


def test_pagination_returns_every_node_exactly_once(hub: HubUnderTest) -> None:
    # Prepare
    registered = [hub.register(f"gw-{i}")["node"]["id"] for i in range(7)]

    # Execute
    first = hub.get("/nodes", params={"limit": 3}).json()
    ids = _list_ids(hub, "/nodes", limit=3)

    # Assert
    assert len(first["items"]) == 3
    assert first["next_cursor"] is not None
    assert len(ids) == len(set(ids)) == 7
    assert set(ids) == set(registered)
    assert ids == sorted(ids)  # ids sort by creation: the order is stable across pages


def test_pagination_exact_multiple_ends_without_empty_page(hub: HubUnderTest) -> None:
    # Prepare
    for i in range(4):
        hub.register(f"gw-{i}")

    # Execute
    first = hub.get("/nodes", params={"limit": 2}).json()
    second = hub.get("/nodes", params={"limit": 2, "cursor": first["next_cursor"]}).json()

    # Assert
    assert len(first["items"]) == len(second["items"]) == 2
    assert second["next_cursor"] is None


def test_pagination_skips_deleted_nodes(hub: HubUnderTest) -> None:
    # Prepare
    ids = [hub.register(f"gw-{i}")["node"]["id"] for i in range(5)]
    hub.request("DELETE", f"/nodes/{ids[1]}")
    hub.request("DELETE", f"/nodes/{ids[3]}")

    # Execute
    listed = _list_ids(hub, "/nodes", limit=2)

    # Assert
    assert listed == [ids[0], ids[2], ids[4]]


@pytest.fixture
def labelled(hub: HubUnderTest) -> dict[str, str]:
    """Four nodes with different labels; name -> id."""
    labels = {
        "a": {"zone": "a", "tier": "gold", "gpu": "true"},
        "b": {"zone": "b", "tier": "silver"},
        "c": {"zone": "a"},
        "d": {},
    }
    return {name: hub.register(f"gw-{name}", lab)["node"]["id"] for name, lab in labels.items()}


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ("zone=a", "ac"),
        ("zone==a", "ac"),
        ("zone!=a", "bd"),  # != also holds where the key is absent
        ("gpu", "a"),
        ("!gpu", "bcd"),
        ("zone=a,!gpu", "c"),
        ("zone, tier != gold", "bc"),
        ("zone=a,tier=silver", ""),
        ("", "abcd"),
    ],
)
def test_label_selectors(hub: HubUnderTest, labelled: dict[str, str], selector: str, expected: str) -> None:
    # Execute
    ids = _list_ids(hub, "/nodes", selector=selector, limit=2)

    # Assert
    assert sorted(ids) == sorted(labelled[name] for name in expected)


def test_selector_follows_label_changes(hub: HubUnderTest, labelled: dict[str, str]) -> None:
    # Prepare
    hub.request("PATCH", f"/nodes/{labelled['d']}", json={"labels": {"gpu": "false"}})
    hub.request("PATCH", f"/nodes/{labelled['a']}", json={"labels": {}})

    # Execute
    with_gpu = _list_ids(hub, "/nodes", selector="gpu")

    # Assert
    assert with_gpu == [labelled["d"]]


@SQLITE_ONLY
@pytest.mark.parametrize("selector", ["zone=a,,tier", ",", "bad key=1", "=a", "!", "zone=a b", "zone!=x/y", "a" * 300])
def test_invalid_selector_is_400(hub: HubUnderTest, labelled: dict[str, str], selector: str) -> None:
    # Execute
    nodes = hub.get("/nodes", params={"selector": selector})
    devices = hub.get("/devices", params={"selector": selector})

    # Assert
    assert_problem(nodes, 400, "invalid_selector")
    assert_problem(devices, 400, "invalid_selector")


@SQLITE_ONLY
@pytest.mark.parametrize("cursor", ["!!!", "%%%", "A", "AA"])
def test_invalid_cursor_is_400(hub: HubUnderTest, cursor: str) -> None:
    # Prepare
    hub.register()

    # Execute
    nodes = hub.get("/nodes", params={"cursor": cursor})
    devices = hub.get("/devices", params={"cursor": cursor})

    # Assert
    assert_problem(nodes, 400, "invalid_cursor")
    assert_problem(devices, 400, "invalid_cursor")


@SQLITE_ONLY
@pytest.mark.parametrize("limit", [0, -1, 501, "x"])
def test_out_of_range_limit_is_422(hub: HubUnderTest, limit: object) -> None:
    # Execute
    r = hub.get("/nodes", params={"limit": limit})

    # Assert
    assert_problem(r, 422, "validation_failed")


def test_state_filter(hub: HubUnderTest) -> None:
    # Prepare
    node_id = hub.register()["node"]["id"]

    # Execute
    registered = hub.get("/nodes", params={"state": "REGISTERED"}).json()["items"]
    online = hub.get("/nodes", params={"state": "ONLINE"}).json()["items"]
    bad = hub.get("/nodes", params={"state": "SLEEPING"})

    # Assert
    assert [n["id"] for n in registered] == [node_id]
    assert online == []
    assert_problem(bad, 422, "validation_failed")


# ---- devices and twins ------------------------------------------------------------------------------


def test_devices_under_a_node(hub: HubUnderTest) -> None:
    # Prepare
    node_a = hub.register("gw-a")["node"]["id"]
    node_b = hub.register("gw-b")["node"]["id"]

    # Execute: create
    r = hub.request("POST", "/devices", Role.OPERATOR, json={"node_id": node_a, "name": "cam-1", "model": "rpi-5", "labels": {"kind": "camera"}})
    assert r.status_code == 201, r.text
    device = r.json()
    other = hub.add_device(node_a, "jetson", {"kind": "npu"})
    elsewhere = hub.add_device(node_b, "rpi-4")

    # Assert: create, get, list by node, selectors
    assert device["node_id"] == node_a
    assert (device["name"], device["model"], device["labels"], device["state"]) == ("cam-1", "rpi-5", {"kind": "camera"}, "REGISTERED")
    assert hub.get(f"/devices/{device['id']}").json() == device
    assert sorted(_list_ids(hub, f"/nodes/{node_a}/devices", limit=1)) == sorted([device["id"], other["id"]])
    assert sorted(_list_ids(hub, "/devices", node_id=node_a)) == sorted([device["id"], other["id"]])
    assert _list_ids(hub, "/devices", node_id=node_b) == [elsewhere["id"]]
    assert len(_list_ids(hub, "/devices", limit=1)) == 3
    assert _list_ids(hub, f"/nodes/{node_a}/devices", selector="kind=npu") == [other["id"]]
    assert _list_ids(hub, "/devices", selector="!kind") == [elsewhere["id"]]
    assert_problem(hub.get("/devices", params={"node_id": "n-00000000000000000000000000"}), 404, "not_found")

    # Execute: patch
    r = hub.request("PATCH", f"/devices/{device['id']}", Role.OPERATOR, json={"model": "rpi-5b", "labels": {"kind": "cam"}})

    # Assert
    assert r.status_code == 200, r.text
    assert (r.json()["model"], r.json()["labels"], r.json()["name"]) == ("rpi-5b", {"kind": "cam"}, "cam-1")
    assert _list_ids(hub, "/devices", selector="kind=camera") == []
    assert _list_ids(hub, "/devices", selector="kind=cam") == [device["id"]]

    # Execute: delete
    r = hub.request("DELETE", f"/devices/{device['id']}", Role.ADMIN)

    # Assert
    assert r.status_code == 204
    assert_problem(hub.get(f"/devices/{device['id']}"), 404, "not_found")
    assert_problem(hub.get(f"/devices/{device['id']}/twin"), 404, "not_found")
    assert_problem(hub.request("PATCH", f"/devices/{device['id']}", json={"model": "x"}), 404, "not_found")
    assert_problem(hub.request("DELETE", f"/devices/{device['id']}"), 404, "not_found")
    assert _list_ids(hub, f"/nodes/{node_a}/devices") == [other["id"]]
    assert _list_ids(hub, "/devices", selector="kind") == [other["id"]]


def test_twin_versions_and_optimistic_concurrency(hub: HubUnderTest) -> None:
    # Prepare
    device_id = hub.add_device(hub.register()["node"]["id"])["id"]

    # Execute + Assert: a fresh twin
    twin = hub.get(f"/devices/{device_id}/twin").json()
    node_id = twin["node_id"]
    assert twin == {
        "device_id": device_id, "node_id": node_id, "desired": {}, "desired_version": 0, "reported": {}, "reported_version": 0,
        "reported_at": None, "in_sync": True, "diff": {},
    }  # fmt: skip

    # every PUT replaces the desired document and bumps its version
    r = hub.request("PUT", f"/devices/{device_id}/twin", Role.OPERATOR, json={"desired": {"fps": 10, "model": {"name": "m", "v": 1}}})
    assert r.status_code == 200, r.text
    assert (r.json()["desired"], r.json()["desired_version"], r.json()["in_sync"]) == ({"fps": 10, "model": {"name": "m", "v": 1}}, 1, False)
    r = hub.request("PUT", f"/devices/{device_id}/twin", Role.OPERATOR, json={"desired": {"fps": 30}, "expected_version": 1})
    assert r.status_code == 200, r.text
    assert (r.json()["desired"], r.json()["desired_version"]) == ({"fps": 30}, 2)

    # a stale expected_version is refused and changes nothing
    before = hub.snapshot()
    r = hub.request("PUT", f"/devices/{device_id}/twin", Role.OPERATOR, json={"desired": {"fps": 1}, "expected_version": 1})
    problem = assert_problem(r, 409, "conflict")
    assert problem["current_version"] == 2
    assert hub.snapshot() == before
    assert hub.get(f"/devices/{device_id}/twin").json()["desired"] == {"fps": 30}


def test_device_under_missing_or_deleted_node_is_404(hub: HubUnderTest) -> None:
    # Prepare
    deleted = hub.register("gone")["node"]["id"]
    hub.request("DELETE", f"/nodes/{deleted}")
    before = hub.snapshot()

    # Execute
    missing = hub.request("POST", "/devices", Role.OPERATOR, json={"node_id": "n-00000000000000000000000000", "model": "m"})
    under_deleted = hub.request("POST", "/devices", Role.OPERATOR, json={"node_id": deleted, "model": "m"})

    # Assert
    assert_problem(missing, 404, "not_found")
    assert_problem(under_deleted, 404, "not_found")
    assert hub.snapshot() == before


def test_deleting_a_node_deletes_its_devices(hub: HubUnderTest) -> None:
    # Prepare
    node_id = hub.register()["node"]["id"]
    kept_node = hub.register("kept")["node"]["id"]
    devices = [hub.add_device(node_id, labels={"x": "1"})["id"] for _ in range(2)]
    kept = hub.add_device(kept_node, labels={"x": "1"})["id"]

    # Execute
    assert hub.request("DELETE", f"/nodes/{node_id}").status_code == 204

    # Assert
    for device_id in devices:
        assert_problem(hub.get(f"/devices/{device_id}"), 404, "not_found")
    assert _list_ids(hub, "/devices") == [kept]
    assert _list_ids(hub, "/devices", selector="x=1") == [kept]
