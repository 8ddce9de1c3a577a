"""``Idempotency-Key`` on writes (DESIGN §4): a retry replays the first answer and does the work once."""

from __future__ import annotations

import hashlib
import json

from sqlalchemy import func, select, text, update
from sqlmodel import Session

from cloud.auth import lookup_api_token, revoke_api_token
from cloud.db import make_engine, upgrade
from cloud.tables import Device, IdempotencyRecord, Node
from interfaces.auth import Role
from tests.hub.conftest import HubUnderTest, assert_problem


def _node_count(hub: HubUnderTest) -> int:
    with Session(hub.engine) as session:
        return int(session.execute(select(func.count()).select_from(Node)).scalar_one())


def _device_count(hub: HubUnderTest) -> int:
    with Session(hub.engine) as session:
        return int(session.execute(select(func.count()).select_from(Device)).scalar_one())


def test_same_key_same_body_replays_the_first_response(hub: HubUnderTest) -> None:
    # Prepare
    node_id = hub.register()["node"]["id"]
    key = {"Idempotency-Key": "create-cam-1"}
    body = {"node_id": node_id, "name": "cam-1", "model": "rpi-5"}

    # Execute
    first = hub.request("POST", "/devices", Role.OPERATOR, json=body, headers=key)
    second = hub.request("POST", "/devices", Role.OPERATOR, json=body, headers=key)

    # Assert
    assert first.status_code == 201, first.text
    assert "idempotent-replayed" not in first.headers
    assert second.status_code == 201
    assert second.headers["idempotent-replayed"] == "true"
    assert second.headers["content-type"] == first.headers["content-type"]
    assert second.json() == first.json()  # the same device
    assert _device_count(hub) == 1


def _records(hub: HubUnderTest) -> list[IdempotencyRecord]:
    with Session(hub.engine) as session:
        return list(session.execute(select(IdempotencyRecord)).scalars())


def test_an_answer_with_a_bootstrap_token_is_kept_as_a_hash_and_not_replayed(hub: HubUnderTest) -> None:
    # Prepare
    key = {"Idempotency-Key": "create-gw-1"}

    # Execute
    first = hub.request("POST", "/nodes", Role.OPERATOR, json={"name": "gw-1"}, headers=key)
    second = hub.request("POST", "/nodes", Role.OPERATOR, json={"name": "gw-1"}, headers=key)

    # Assert: the caller saw the token once; the hub kept no copy of it
    assert first.status_code == 201, first.text
    token = first.json()["bootstrap_token"]
    assert_problem(second, 409, "idempotency_not_replayable")
    assert token not in second.text
    assert "issue a new one" in second.json()["detail"]
    assert _node_count(hub) == 1
    [record] = _records(hub)
    assert record.status_code == 201
    assert record.response_body is None and record.response_headers is None
    assert record.response_sha256 == hashlib.sha256(first.content).hexdigest()
    assert token not in str(hub.snapshot())


def test_a_reissued_bootstrap_token_is_not_replayed_and_not_issued_twice(hub: HubUnderTest) -> None:
    # Prepare
    node_id = hub.register()["node"]["id"]
    key = {"Idempotency-Key": "reissue-1"}

    # Execute
    first = hub.request("POST", f"/nodes/{node_id}/bootstrap-token", Role.OPERATOR, json={"ttl_s": 600}, headers=key)
    second = hub.request("POST", f"/nodes/{node_id}/bootstrap-token", Role.OPERATOR, json={"ttl_s": 600}, headers=key)
    enrolled = hub.enrol(node_id, first.json()["bootstrap_token"])

    # Assert: the retry issued nothing, so the first token is still the valid one
    assert first.status_code == 201, first.text
    assert_problem(second, 409, "idempotency_not_replayable")
    assert first.json()["bootstrap_token"] not in str(hub.snapshot())
    assert enrolled.status_code == 201, enrolled.text


def test_a_revoked_token_gets_no_replay(hub: HubUnderTest) -> None:
    # Prepare
    node_id = hub.register()["node"]["id"]
    key = {"Idempotency-Key": "before-revocation"}
    body = {"node_id": node_id, "model": "rpi-5"}
    first = hub.request("POST", "/devices", Role.OPERATOR, json=body, headers=key)
    with Session(hub.engine) as session:
        token = lookup_api_token(session, hub.tokens[Role.OPERATOR])
        assert token is not None
        token_id = token.id
        revoke_api_token(session, token_id)
    hub.state.token_cache.forget(token_id)

    # Execute
    again = hub.request("POST", "/devices", Role.OPERATOR, json=body, headers=key)

    # Assert
    assert first.status_code == 201, first.text
    assert_problem(again, 401, "unauthenticated")
    assert "idempotent-replayed" not in again.headers
    assert first.json()["id"] not in again.text


def test_callers_without_a_token_share_no_answer_under_one_key(hub: HubUnderTest) -> None:
    # Prepare: a node enrols with a key; another caller sends the same key with its own body
    registered = hub.register()
    node_id, token = registered["node"]["id"], registered["bootstrap_token"]
    key = {"Idempotency-Key": "enrol"}
    csr = {"csr_pem": "-----BEGIN CERTIFICATE REQUEST-----\n" + "A" * 64 + "\n-----END CERTIFICATE REQUEST-----\n"}
    first = hub.request("POST", f"/nodes/{node_id}/certificate", None, json={**csr, "bootstrap_token": token}, headers=key)

    # Execute
    other = hub.request("POST", f"/nodes/{node_id}/certificate", None, json={**csr, "bootstrap_token": "x" * 32}, headers=key)

    # Assert
    assert first.status_code != 201
    assert_problem(other, 422, "idempotency_key_reused")


def test_the_migration_withholds_secrets_stored_by_an_earlier_version(sqlite_url: str) -> None:
    # Prepare: records as an earlier version stored them, one with a bootstrap token in clear
    upgrade(sqlite_url, "0007")
    secret_body = json.dumps({"node": {"id": "n-1"}, "bootstrap_token": "bt_secret_value_0123456789"})
    plain_body = json.dumps({"id": "d-1", "name": "cam"})
    engine = make_engine(sqlite_url)
    try:
        with engine.begin() as conn:
            for key, body in (("secret", secret_body), ("plain", plain_body)):
                conn.execute(
                    text("INSERT INTO idempotency_records (principal, key, request_hash, status_code, response_headers, response_body, created_at) "
                         "VALUES ('p', :key, 'h', 201, '[[\"content-type\", \"application/json\"]]', :body, CURRENT_TIMESTAMP)"),
                    {"key": key, "body": body},
                )  # fmt: skip

        # Execute
        upgrade(sqlite_url)

        # Assert
        with engine.connect() as conn:
            rows = {r.key: r for r in conn.execute(text("SELECT key, response_body, response_sha256 FROM idempotency_records"))}
    finally:
        engine.dispose()
    assert rows["secret"].response_body is None
    assert rows["secret"].response_sha256 == hashlib.sha256(secret_body.encode()).hexdigest()
    assert rows["plain"].response_body == plain_body and rows["plain"].response_sha256 is None


def test_replay_of_a_delete(hub: HubUnderTest) -> None:
    # Prepare
    node_id = hub.register()["node"]["id"]
    key = {"Idempotency-Key": "delete-it"}

    # Execute
    first = hub.request("DELETE", f"/nodes/{node_id}", headers=key)
    second = hub.request("DELETE", f"/nodes/{node_id}", headers=key)
    without_key = hub.request("DELETE", f"/nodes/{node_id}")

    # Assert
    assert first.status_code == second.status_code == 204
    assert second.headers["idempotent-replayed"] == "true"
    assert second.content == b""
    assert_problem(without_key, 404, "not_found")


def test_replay_of_an_error_response(hub: HubUnderTest) -> None:
    # Prepare
    key = {"Idempotency-Key": "device-under-missing-node"}
    body = {"node_id": "n-00000000000000000000000000", "model": "m"}

    # Execute
    first = hub.request("POST", "/devices", json=body, headers=key)
    second = hub.request("POST", "/devices", json=body, headers=key)

    # Assert
    assert_problem(first, 404, "not_found")
    assert_problem(second, 404, "not_found")
    assert second.headers["idempotent-replayed"] == "true"
    assert second.json() == first.json()


def test_same_key_different_body_is_refused(hub: HubUnderTest) -> None:
    # Prepare
    key = {"Idempotency-Key": "k-1"}
    hub.request("POST", "/nodes", Role.OPERATOR, json={"name": "gw-1"}, headers=key)
    before = hub.snapshot()

    # Execute
    other_body = hub.request("POST", "/nodes", Role.OPERATOR, json={"name": "gw-2"}, headers=key)
    other_route = hub.request("PATCH", f"/nodes/{hub.get('/nodes').json()['items'][0]['id']}", Role.OPERATOR, json={"name": "gw-1"}, headers=key)

    # Assert
    assert_problem(other_body, 422, "idempotency_key_reused")
    assert_problem(other_route, 422, "idempotency_key_reused")
    assert hub.snapshot() == before
    assert _node_count(hub) == 1


def test_keys_are_scoped_per_bearer_token(hub: HubUnderTest) -> None:
    # Prepare
    key = {"Idempotency-Key": "shared-key"}

    # Execute
    as_operator = hub.request("POST", "/nodes", Role.OPERATOR, json={"name": "gw"}, headers=key)
    as_admin = hub.request("POST", "/nodes", Role.ADMIN, json={"name": "gw"}, headers=key)
    admin_other_body = hub.request("POST", "/nodes", Role.ADMIN, json={"name": "gw-x"}, headers=key)

    # Assert
    assert as_operator.status_code == as_admin.status_code == 201
    assert "idempotent-replayed" not in as_admin.headers
    assert as_admin.json()["node"]["id"] != as_operator.json()["node"]["id"]
    assert_problem(admin_other_body, 422, "idempotency_key_reused")
    assert _node_count(hub) == 2


def test_without_a_key_every_request_creates(hub: HubUnderTest) -> None:
    # Execute
    responses = [hub.request("POST", "/nodes", Role.OPERATOR, json={"name": "gw"}) for _ in range(3)]

    # Assert
    assert [r.status_code for r in responses] == [201, 201, 201]
    assert all("idempotent-replayed" not in r.headers for r in responses)
    assert len({r.json()["node"]["id"] for r in responses}) == 3
    assert _node_count(hub) == 3
    with Session(hub.engine) as session:
        assert session.execute(select(func.count()).select_from(IdempotencyRecord)).scalar_one() == 0


def test_a_request_still_running_under_the_key_is_409(hub: HubUnderTest) -> None:
    # Prepare: the request under this key has been claimed but has not answered yet
    key = {"Idempotency-Key": "busy"}
    hub.request("POST", "/nodes", Role.OPERATOR, json={"name": "gw"}, headers=key)
    with Session(hub.engine) as session:
        session.execute(update(IdempotencyRecord).where(IdempotencyRecord.key == "busy").values(status_code=None, response_headers=None, response_body=None))
        session.commit()
    before = hub.snapshot()

    # Execute
    r = hub.request("POST", "/nodes", Role.OPERATOR, json={"name": "gw"}, headers=key)

    # Assert
    assert_problem(r, 409, "idempotency_in_progress")
    assert hub.snapshot() == before
    assert _node_count(hub) == 1


def test_an_empty_key_is_what_the_committed_schema_says(hub: HubUnderTest) -> None:
    # Prepare
    operation = hub.app.openapi()["paths"]["/api/v1/nodes"]["post"]
    parameter = next(p for p in operation["parameters"] if p["name"] == "Idempotency-Key")
    string_schema = next(s for s in parameter["schema"].get("anyOf", [parameter["schema"]]) if s.get("type") == "string")
    before = hub.snapshot()

    # Execute
    r = hub.request("POST", "/nodes", Role.OPERATOR, json={"name": "gw"}, headers={"Idempotency-Key": ""})

    # Assert: refused exactly when the schema says it is invalid
    if string_schema.get("minLength", 0) >= 1:
        assert_problem(r, 422, "validation_failed")
        assert hub.snapshot() == before
    else:
        assert r.status_code == 201, r.text


def test_an_unauthenticated_request_with_a_key_stores_nothing(hub: HubUnderTest) -> None:
    # Prepare
    before = hub.snapshot()

    # Execute
    r = hub.request("POST", "/nodes", None, json={"name": "gw"}, headers={"Authorization": "Bearer asy_unknown", "Idempotency-Key": "k" * 255})

    # Assert
    assert_problem(r, 401, "unauthenticated")
    assert hub.snapshot() == before


def test_a_repeated_401_still_says_how_to_authenticate(hub: HubUnderTest) -> None:
    # Prepare
    headers = {"Authorization": "Bearer asy_unknown", "Idempotency-Key": "retry-me"}
    hub.request("POST", "/nodes", None, json={"name": "gw"}, headers=headers)

    # Execute
    r = hub.request("POST", "/nodes", None, json={"name": "gw"}, headers=headers)

    # Assert
    assert_problem(r, 401, "unauthenticated")
    assert r.headers.get("www-authenticate") == "Bearer"
