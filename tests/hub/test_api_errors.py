"""Bad input gets a clear 4xx problem document and nothing already stored changes (DESIGN §6).

Every test compares a snapshot of all rows of all tables before and after the refused request.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import update
from sqlmodel import Session, select

from cloud.api.guards import WRITE_METHODS
from cloud.auth import hash_secret, revoke_api_token
from cloud.tables import ApiToken, BootstrapToken
from interfaces import API_PREFIX
from interfaces.auth import Role
from tests.hub.conftest import HubUnderTest, assert_problem, hub_settings, running_hub


@pytest.fixture
def database_url(sqlite_url: str) -> str:
    """SQLite only here: the problem documents and the guards do not depend on the dialect, and a refused
    request leaving PostgreSQL untouched is shown by the PostgreSQL variants of test_api_nodes and
    test_artifacts (the same snapshot comparison)."""
    return sqlite_url

# One valid request per authenticated write route, so that only the role can be the reason for a refusal.
WRITE_REQUESTS: dict[tuple[str, str], dict[str, Any] | None] = {
    ("POST", "/nodes"): {"name": "gw-new"},
    ("PATCH", "/nodes/{node_id}"): {"description": "changed"},
    ("DELETE", "/nodes/{node_id}"): None,
    ("PUT", "/nodes/{node_id}/admin-state"): {"admin_state": "LOCKED"},
    ("POST", "/nodes/{node_id}/bootstrap-token"): {"ttl_s": 600},
    ("POST", "/devices"): {"node_id": "{node_id}", "model": "rpi-5"},
    ("PATCH", "/devices/{device_id}"): {"model": "rpi-4"},
    ("DELETE", "/devices/{device_id}"): None,
    ("PUT", "/devices/{device_id}/twin"): {"desired": {"fps": 5}},
    ("POST", "/devices/{device_id}/bootstrap-token"): {"ttl_s": 600},
    ("POST", "/nodes/{node_id}/certificates/revoke-superseded"): None,
    ("POST", "/devices/{device_id}/certificates/revoke-superseded"): None,
    ("PUT", "/devices/{device_id}/privacy-budgets/{dataset}"): {"epsilon": 1.0, "delta": 1e-5},
    ("PUT", "/nodes/{node_id}/twin"): {"desired": {"log_level": "debug"}},
    ("POST", "/nodes/{node_id}/commands"): {"name": "ping"},
    ("POST", "/devices/{device_id}/commands"): {"name": "ping"},
    ("POST", "/deployments"): {"artifact_id": "art-00000000000000000000000000", "target": {"ids": ["{device_id}"]}},
    ("POST", "/deployments/{deployment_id}/pause"): None,
    ("POST", "/deployments/{deployment_id}/resume"): None,
    ("POST", "/deployments/{deployment_id}/cancel"): None,
    ("POST", "/deployments/{deployment_id}/rollback"): None,
    ("POST", "/artifacts"): {"kind": "model", "name": "m", "version": "1.0", "format": "onnx"},  # 401/403 come before the body is read
    ("DELETE", "/artifacts/{artifact_id}"): None,
    ("POST", "/artifacts/uploads"): {"kind": "model", "name": "m", "version": "1.0", "format": "onnx", "size": 1, "sha256": "0" * 64},
    ("PUT", "/artifacts/uploads/{upload_id}/chunks/{index}"): None,
    ("POST", "/artifacts/uploads/{upload_id}/commit"): None,
    ("DELETE", "/artifacts/uploads/{upload_id}"): None,
    ("POST", "/tasks"): {"type": "inference", "spec": {"model": {"name": "mlp"}}},
    ("DELETE", "/tasks/{task_id}"): None,
    **{("POST", f"/tasks/{{task_id}}/{action}"): None for action in ("start", "stop", "pause", "resume", "cancel", "retry")},
    ("POST", "/tokens"): {"role": "viewer", "name": "made by a test"},
    ("DELETE", "/tokens/{token_id}"): None,
}


@pytest.fixture
def seeded(hub: HubUnderTest) -> dict[str, str]:
    """One node (with its unused bootstrap token) and one device under it."""
    registered = hub.register("gw-seed", {"zone": "a"})
    node_id = registered["node"]["id"]
    device_id = hub.add_device(node_id, labels={"kind": "camera"})["id"]
    hub.request("PUT", f"/devices/{device_id}/twin", json={"desired": {"fps": 10}})
    return {"node_id": node_id, "device_id": device_id, "bootstrap_token": registered["bootstrap_token"], "deployment_id": "dep-00000000000000000000000000", "artifact_id": "art-00000000000000000000000000",
            "task_id": "task-00000000000000000000000000", "dataset": "camera", "upload_id": "upl-00000000000000000000000000", "index": "0",
            "token_id": "tok-00000000000000000000000000"}


@pytest.fixture
def unchanged(hub: HubUnderTest, seeded: dict[str, str]) -> Iterator[None]:
    """Asserts, after the test body, that the database holds exactly what it held before it."""
    before = hub.snapshot()
    yield
    assert hub.snapshot() == before


def _fill(template: Any, ids: dict[str, str]) -> Any:
    if isinstance(template, str):
        return template.format(**ids)
    if isinstance(template, dict):
        return {k: _fill(v, ids) for k, v in template.items()}
    return template


def _authenticated_write_routes(hub: HubUnderTest) -> set[tuple[str, str]]:
    """From the app's own OpenAPI document: every write operation that declares a security requirement."""
    return {
        (method.upper(), path.removeprefix(API_PREFIX))
        for path, operations in hub.app.openapi()["paths"].items()
        for method, operation in operations.items()
        if method.upper() in WRITE_METHODS and operation.get("security")
    }


# ---- enrolment --------------------------------------------------------------------------------------


def test_enrol_with_expired_bootstrap_token(hub: HubUnderTest, seeded: dict[str, str]) -> None:
    # Prepare
    with Session(hub.engine) as session:
        session.execute(update(BootstrapToken).where(BootstrapToken.owner_id == seeded["node_id"]).values(expires_at=datetime.now(UTC) - timedelta(seconds=1)))
        session.commit()
    before = hub.snapshot()

    # Execute
    r = hub.enrol(seeded["node_id"], seeded["bootstrap_token"])

    # Assert
    assert_problem(r, 403, "bootstrap_token_expired")
    assert hub.snapshot() == before


def test_enrol_twice_with_one_bootstrap_token(hub: HubUnderTest, seeded: dict[str, str]) -> None:
    # Prepare
    assert hub.enrol(seeded["node_id"], seeded["bootstrap_token"]).status_code == 201
    before = hub.snapshot()

    # Execute
    r = hub.enrol(seeded["node_id"], seeded["bootstrap_token"])

    # Assert
    assert_problem(r, 409, "bootstrap_token_used")
    assert hub.snapshot() == before


def test_enrol_with_another_nodes_token(hub: HubUnderTest, seeded: dict[str, str]) -> None:
    # Prepare
    other = hub.register("gw-other")["node"]["id"]
    before = hub.snapshot()

    # Execute
    r = hub.enrol(other, seeded["bootstrap_token"])

    # Assert
    assert_problem(r, 403, "bootstrap_token_invalid")
    assert hub.snapshot() == before
    assert hub.enrol(seeded["node_id"], seeded["bootstrap_token"]).status_code == 201  # the token is still good for its own node


def test_enrol_with_unknown_token_or_unknown_node(hub: HubUnderTest, seeded: dict[str, str], unchanged: None) -> None:
    # Execute
    unknown_token = hub.enrol(seeded["node_id"], "bst_" + "x" * 43)
    unknown_node = hub.enrol("n-00000000000000000000000000", seeded["bootstrap_token"])

    # Assert
    assert_problem(unknown_token, 403, "bootstrap_token_invalid")
    assert_problem(unknown_node, 403, "bootstrap_token_invalid")


def test_enrol_with_csr_for_another_common_name(hub: HubUnderTest, seeded: dict[str, str]) -> None:
    # Prepare
    before = hub.snapshot()

    # Execute
    r = hub.enrol(seeded["node_id"], seeded["bootstrap_token"], common_name="n-someoneelse")

    # Assert
    assert_problem(r, 422, "csr_invalid")
    assert hub.snapshot() == before
    assert hub.enrol(seeded["node_id"], seeded["bootstrap_token"]).status_code == 201  # the token was not spent


@pytest.mark.parametrize(
    "csr_pem",
    [
        "garbage " * 20,
        "-----BEGIN CERTIFICATE REQUEST-----\n" + "A" * 120 + "\n-----END CERTIFICATE REQUEST-----\n",
    ],
)
def test_enrol_with_garbage_csr(hub: HubUnderTest, seeded: dict[str, str], unchanged: None, csr_pem: str) -> None:
    # Execute
    r = hub.request("POST", f"/nodes/{seeded['node_id']}/certificate", None, json={"csr_pem": csr_pem, "bootstrap_token": seeded["bootstrap_token"]})

    # Assert
    assert_problem(r, 422, "csr_invalid")


def test_enrol_for_a_deleted_node(hub: HubUnderTest, seeded: dict[str, str]) -> None:
    # Prepare
    assert hub.request("DELETE", f"/nodes/{seeded['node_id']}").status_code == 204
    before = hub.snapshot()

    # Execute
    r = hub.enrol(seeded["node_id"], seeded["bootstrap_token"])

    # Assert
    assert_problem(r, 409, "node_deleted")
    assert hub.snapshot() == before


def test_enrol_with_a_malformed_body(hub: HubUnderTest, seeded: dict[str, str], unchanged: None) -> None:
    # Execute
    short_csr = hub.request("POST", f"/nodes/{seeded['node_id']}/certificate", None, json={"csr_pem": "x", "bootstrap_token": seeded["bootstrap_token"]})
    no_token = hub.request("POST", f"/nodes/{seeded['node_id']}/certificate", None, json={"csr_pem": "x" * 100})

    # Assert
    assert_problem(short_csr, 422, "validation_failed")
    assert_problem(no_token, 422, "validation_failed")


# ---- authentication and roles -----------------------------------------------------------------------


def test_every_authenticated_write_route_is_in_this_test(hub: HubUnderTest) -> None:
    assert _authenticated_write_routes(hub) == set(WRITE_REQUESTS)


@pytest.mark.parametrize(("method", "path"), sorted(WRITE_REQUESTS))
def test_no_token_is_401(hub: HubUnderTest, seeded: dict[str, str], unchanged: None, method: str, path: str) -> None:
    # Prepare
    body = _fill(WRITE_REQUESTS[(method, path)], seeded)

    # Execute
    r = hub.request(method, _fill(path, seeded), None, json=body)

    # Assert
    assert_problem(r, 401, "unauthenticated")
    assert r.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("path", ["/nodes", "/nodes/{node_id}", "/nodes/{node_id}/status", "/devices", "/devices/{device_id}/twin"])
def test_reads_need_a_token_too(hub: HubUnderTest, seeded: dict[str, str], path: str) -> None:
    # Execute
    r = hub.get(_fill(path, seeded), None)

    # Assert
    assert_problem(r, 401, "unauthenticated")
    assert r.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize(
    "authorization",
    ["Bearer asy_not-a-token-this-hub-issued", "Bearer ", "Basic dXNlcjpwYXNz", "asy_no_scheme"],
)
def test_unknown_or_malformed_token_is_401(hub: HubUnderTest, seeded: dict[str, str], unchanged: None, authorization: str) -> None:
    # Execute
    write = hub.request("POST", "/nodes", None, json={"name": "x"}, headers={"Authorization": authorization})
    read = hub.get("/nodes", None, headers={"Authorization": authorization})

    # Assert
    assert_problem(write, 401, "unauthenticated")
    assert_problem(read, 401, "unauthenticated")


def test_revoked_token_is_401(database_url: str, tmp_path: Path) -> None:
    """With the token cache off, a token revoked in the database is refused on the next request."""
    # Prepare
    for hub in running_hub(hub_settings(tmp_path, database_url, token_cache_ttl_s=0)):
        node = hub.register("gw")
        with Session(hub.engine) as session:
            session.execute(update(ApiToken).where(ApiToken.role == Role.ADMIN.value).values(revoked_at=datetime.now(UTC)))
            session.commit()
        before = hub.snapshot()

        # Execute
        r = hub.request("DELETE", f"/nodes/{node['node']['id']}", Role.ADMIN)

        # Assert
        assert_problem(r, 401, "unauthenticated")
        assert hub.snapshot() == before


def test_revoked_token_is_refused_within_the_cache_ttl(database_url: str, tmp_path: Path) -> None:
    """A token revoked by another process (the CLI) works at most ``token_cache_ttl_s`` longer."""
    # Prepare
    ttl = 1.0
    for hub in running_hub(hub_settings(tmp_path, database_url, token_cache_ttl_s=ttl)):
        assert hub.get("/nodes", Role.ADMIN).status_code == 200  # verified once: now cached
        with Session(hub.engine) as session:
            token_id = session.exec(select(ApiToken.id).where(ApiToken.role == Role.ADMIN.value)).one()
            assert revoke_api_token(session, token_id) is not None
        revoked_at = time.monotonic()

        # Execute
        statuses = []
        while time.monotonic() - revoked_at < ttl + 1.0:
            statuses.append((time.monotonic() - revoked_at, hub.get("/nodes", Role.ADMIN).status_code))
            time.sleep(0.05)

        # Assert: 200s, then only 401s; every request sent after the TTL was refused
        codes = [code for _, code in statuses]
        assert set(codes) <= {200, 401}
        assert codes[-1] == 401
        first_401 = codes.index(401)
        assert all(code == 401 for code in codes[first_401:])
        assert all(code == 401 for sent_at, code in statuses if sent_at > ttl + 0.05), statuses
        assert hub.get("/nodes", Role.VIEWER).status_code == 200  # other tokens unaffected


def test_unknown_token_is_not_cached(hub: HubUnderTest) -> None:
    """A token created after a failed attempt works at once (failures are not remembered)."""
    # Prepare
    r = hub.client.get(API_PREFIX + "/nodes", headers={"Authorization": "Bearer asy_not-yet"})
    assert_problem(r, 401, "unauthenticated")
    with Session(hub.engine) as session:
        session.add(ApiToken(id="tok-later", token_hash=hash_secret("asy_not-yet"), role=Role.VIEWER.value, created_at=datetime.now(UTC)))
        session.commit()

    # Execute
    r = hub.client.get(API_PREFIX + "/nodes", headers={"Authorization": "Bearer asy_not-yet"})

    # Assert
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("method", "path"), sorted(WRITE_REQUESTS))
def test_viewer_may_not_write(hub: HubUnderTest, seeded: dict[str, str], unchanged: None, method: str, path: str) -> None:
    # Prepare
    body = _fill(WRITE_REQUESTS[(method, path)], seeded)

    # Execute
    r = hub.request(method, _fill(path, seeded), Role.VIEWER, json=body)

    # Assert
    assert_problem(r, 403, "forbidden")


def test_operator_may_not_delete_a_node(hub: HubUnderTest, seeded: dict[str, str], unchanged: None) -> None:
    # Execute
    r = hub.request("DELETE", f"/nodes/{seeded['node_id']}", Role.OPERATOR)

    # Assert
    assert_problem(r, 403, "forbidden")
    assert hub.get(f"/nodes/{seeded['node_id']}").status_code == 200


# ---- malformed requests -----------------------------------------------------------------------------


@pytest.mark.parametrize("body", [b'{"name": ', b"not json", b'{"name": "x"} trailing', b"\xff\xfe"])
def test_malformed_json_is_400(hub: HubUnderTest, seeded: dict[str, str], unchanged: None, body: bytes) -> None:
    # Execute
    r = hub.request("POST", "/nodes", Role.OPERATOR, content=body, headers={"Content-Type": "application/json"})

    # Assert
    assert_problem(r, 400, "malformed_request")


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/nodes", {"name": "gw", "colour": "red"}),
        ("PATCH", "/nodes/{node_id}", {"labels": {"zone": "b"}, "state": "ONLINE"}),
        ("PUT", "/nodes/{node_id}/admin-state", {"admin_state": "LOCKED", "reason": "x"}),
        ("POST", "/devices", {"node_id": "{node_id}", "model": "m", "firmware": "1.0"}),
        ("PUT", "/devices/{device_id}/twin", {"desired": {}, "reported": {"fps": 1}}),
    ],
)
def test_unknown_fields_are_422(hub: HubUnderTest, seeded: dict[str, str], unchanged: None, method: str, path: str, body: dict[str, Any]) -> None:
    # Execute
    r = hub.request(method, _fill(path, seeded), Role.OPERATOR, json=_fill(body, seeded))

    # Assert
    problem = assert_problem(r, 422, "validation_failed")
    assert any(e["type"] == "extra_forbidden" for e in problem["errors"]), problem


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/nodes", {"name": ""}),
        ("POST", "/nodes", {"name": "gw", "labels": {"bad key": "x"}}),
        ("POST", "/nodes", {"name": "gw", "labels": {"zone": "not/valid"}}),
        ("POST", "/nodes", {"name": "gw", "kind": "cloud"}),
        ("POST", "/nodes", {"name": "gw", "bootstrap_ttl_s": 1}),
        ("PUT", "/nodes/{node_id}/admin-state", {"admin_state": "FROZEN"}),
        ("PUT", "/devices/{device_id}/twin", {"desired": {}, "expected_version": -1}),
        ("PUT", "/devices/{device_id}/twin", {"desired": {}, "expected_version": 2**63}),  # beyond 64 bits: was a 500
        ("PUT", "/nodes/{node_id}/twin", {"desired": {}, "expected_version": 2**63}),
        ("POST", "/nodes", ["a", "list"]),
    ],
)
def test_invalid_values_are_422(hub: HubUnderTest, seeded: dict[str, str], unchanged: None, method: str, path: str, body: Any) -> None:
    # Execute
    r = hub.request(method, _fill(path, seeded), Role.OPERATOR, json=_fill(body, seeded))

    # Assert
    assert_problem(r, 422, "validation_failed")


@pytest.mark.parametrize("after", [str(2**63), str(2**64 + 1), "-1"])
def test_a_log_cursor_beyond_64_bits_or_negative_is_422_and_the_connection_stays_usable(hub: HubUnderTest, after: str) -> None:
    # Execute
    r = hub.request("GET", f"/tasks/tk-none/logs?after={after}", Role.VIEWER)
    again = hub.request("GET", "/nodes", Role.VIEWER)

    # Assert
    assert_problem(r, 422, "validation_failed")
    assert again.status_code == 200


def test_a_last_event_id_beyond_64_bits_is_refused(hub: HubUnderTest) -> None:
    # Execute
    r = hub.request("GET", "/tasks/tk-none/logs", Role.VIEWER, headers={"Last-Event-ID": str(2**63), "Accept": "text/event-stream"})

    # Assert
    assert r.status_code in (400, 422), r.text
    assert r.json()["code"] == "validation_failed"


def test_oversized_body_with_content_length_is_413(hub: HubUnderTest, seeded: dict[str, str], unchanged: None) -> None:
    # Prepare
    body = b'{"name": "gw", "description": "' + b"x" * hub.settings.max_body_bytes + b'"}'

    # Execute
    r = hub.request("POST", "/nodes", Role.OPERATOR, content=body, headers={"Content-Type": "application/json"})

    # Assert
    assert r.request.headers["content-length"] == str(len(body))
    assert_problem(r, 413, "payload_too_large")


def test_oversized_chunked_body_without_content_length_is_413(hub: HubUnderTest, seeded: dict[str, str], unchanged: None) -> None:
    # Prepare
    chunk = b"x" * 64 * 1024
    count = hub.settings.max_body_bytes // len(chunk) + 2

    def chunks() -> Iterator[bytes]:
        yield b'{"name": "gw", "description": "'
        for _ in range(count):
            yield chunk
        yield b'"}'

    # Execute
    r = hub.request("POST", "/nodes", Role.OPERATOR, content=chunks(), headers={"Content-Type": "application/json"})

    # Assert
    assert "content-length" not in r.request.headers
    assert r.request.headers["transfer-encoding"] == "chunked"
    assert_problem(r, 413, "payload_too_large")


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "application/xml", None])
def test_wrong_content_type_is_415(hub: HubUnderTest, seeded: dict[str, str], unchanged: None, content_type: str | None) -> None:
    # Prepare
    headers = {"Content-Type": content_type} if content_type else {}

    # Execute
    r = hub.request("POST", "/nodes", Role.OPERATOR, content=b'{"name": "gw"}', headers=headers)

    # Assert
    assert assert_problem(r, 415, "unsupported_media_type")["instance"] == API_PREFIX + "/nodes"


@pytest.mark.parametrize(("method", "path"), [("GET", "/api/v1/nope"), ("POST", "/api/v1/nope"), ("GET", "/nope")])
def test_unknown_route_is_404_problem(hub: HubUnderTest, seeded: dict[str, str], unchanged: None, method: str, path: str) -> None:
    # Execute
    r = hub.client.request(method, path, headers=hub.auth(Role.ADMIN))

    # Assert
    assert_problem(r, 404, "not_found")


@pytest.mark.parametrize(
    ("method", "path"),
    [("PUT", "/nodes"), ("DELETE", "/nodes"), ("POST", "/nodes/{node_id}"), ("POST", "/nodes/{node_id}/status"), ("PATCH", "/devices/{device_id}/twin")],
)
def test_wrong_method_is_405_problem(hub: HubUnderTest, seeded: dict[str, str], unchanged: None, method: str, path: str) -> None:
    # Execute
    r = hub.request(method, _fill(path, seeded), Role.ADMIN)

    # Assert
    assert_problem(r, 405, "method_not_allowed")
    allowed = {m.strip() for m in r.headers["allow"].split(",")}
    expected = {("PUT", "/nodes"): {"GET", "POST"}, ("DELETE", "/nodes"): {"GET", "POST"}, ("POST", "/nodes/{node_id}"): {"GET", "PATCH", "DELETE"},
                ("POST", "/nodes/{node_id}/status"): {"GET"}, ("PATCH", "/devices/{device_id}/twin"): {"GET", "PUT"}}[(method, path)]  # fmt: skip
    assert expected <= allowed and method not in allowed, allowed


# ---- NUL characters -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "params", "body"),
    [
        ("POST", "/nodes", None, {"name": "gw", "description": "a\u0000b"}),
        ("PATCH", "/nodes/{node_id}", None, {"description": "a\u0000b"}),
        ("POST", "/devices", None, {"node_id": "{node_id}", "model": "rpi\u0000"}),
        ("GET", "/nodes/n-%00", None, None),
        ("GET", "/devices", {"node_id": "\u0000"}, None),
    ],
    ids=["node-description", "patch-description", "device-model", "node-id-path", "node-id-query"],
)
def test_nul_characters_never_cause_a_server_error(
    hub: HubUnderTest, seeded: dict[str, str],
    method: str, path: str, params: dict[str, str] | None, body: dict[str, str] | None,
) -> None:  # fmt: skip
    """PostgreSQL cannot store U+0000 in text; the hub must answer 4xx (or store it safely), never 500."""
    before = hub.snapshot()

    # Execute
    r = hub.request(method, _fill(path, seeded), Role.ADMIN, params=params, json=_fill(body, seeded))

    # Assert
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert_problem(r, r.status_code, r.json()["code"])
        assert hub.snapshot() == before
