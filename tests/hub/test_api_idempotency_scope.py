"""``Idempotency-Key`` is kept only for an existing route answering a caller it lets in (DESIGN §4, §6).

A path or method the API does not have (404, 405), a request without a valid token (401) and a role that
may not write (403) are answered as if no key had been sent: nothing is recorded, and the key stays free
for the request it was meant for.
"""

from __future__ import annotations

import pytest
from sqlalchemy import func, select
from sqlmodel import Session

from cloud.tables import IdempotencyRecord
from interfaces.auth import Role
from tests.hub.conftest import HubUnderTest, assert_problem


@pytest.fixture
def database_url(sqlite_url: str) -> str:
    """SQLite only: where the guard looks at a key does not depend on the dialect (test_idempotency covers both)."""
    return sqlite_url


def _records(hub: HubUnderTest) -> int:
    with Session(hub.engine) as session:
        return int(session.execute(select(func.count()).select_from(IdempotencyRecord)).scalar_one())


def test_a_key_sent_with_an_undeclared_method_is_not_recorded(hub: HubUnderTest) -> None:
    # Prepare
    key = {"Idempotency-Key": "k-405"}

    # Execute
    put = hub.request("PUT", "/nodes", json={"name": "gw"}, headers=key)
    patch = hub.request("PATCH", "/nodes", json={"name": "gw"}, headers=key)
    create = hub.request("POST", "/nodes", json={"name": "gw"}, headers=key)

    # Assert
    assert_problem(put, 405, "method_not_allowed")
    assert_problem(patch, 405, "method_not_allowed")
    assert put.headers["allow"] == "GET, POST"
    assert create.status_code == 201, create.text
    assert _records(hub) == 1  # the POST's only


def test_a_key_sent_to_an_unknown_path_is_not_recorded(hub: HubUnderTest) -> None:
    # Prepare
    key = {"Idempotency-Key": "k-404"}

    # Execute
    first = hub.request("POST", "/no-such-thing", json={"a": 1}, headers=key)
    second = hub.request("POST", "/no-such-thing/else", json={"b": 2}, headers=key)

    # Assert
    assert_problem(first, 404, "not_found")
    assert_problem(second, 404, "not_found")
    assert _records(hub) == 0


def test_a_refused_role_gets_403_whatever_the_key(hub: HubUnderTest) -> None:
    # Prepare
    key = {"Idempotency-Key": "k-used"}
    created = hub.request("POST", "/nodes", Role.OPERATOR, json={"name": "gw-a"}, headers=key)
    assert created.status_code == 201, created.text

    # Execute
    other_body = hub.request("POST", "/nodes", Role.VIEWER, json={"name": "gw-b"}, headers=key)
    same_body = hub.request("POST", "/nodes", Role.VIEWER, json={"name": "gw-a"}, headers=key)

    # Assert
    assert_problem(other_body, 403, "forbidden")
    assert_problem(same_body, 403, "forbidden")
    assert _records(hub) == 1


def test_no_token_gets_401_and_a_bad_key_is_looked_at_only_for_a_caller_let_in(hub: HubUnderTest) -> None:
    # Prepare
    bad = {"Idempotency-Key": b"\xe9"}  # not printable ASCII

    # Execute
    anonymous = hub.request("POST", "/nodes", None, json={"name": "gw"}, headers={"Idempotency-Key": "k"})
    viewer = hub.request("POST", "/nodes", Role.VIEWER, json={"name": "gw"}, headers=bad)
    unknown = hub.request("POST", "/nowhere", json={"name": "gw"}, headers=bad)
    operator = hub.request("POST", "/nodes", Role.OPERATOR, json={"name": "gw"}, headers=bad)

    # Assert
    assert_problem(anonymous, 401, "unauthenticated")
    assert_problem(viewer, 403, "forbidden")
    assert_problem(unknown, 404, "not_found")
    assert_problem(operator, 422, "validation_failed")
    assert _records(hub) == 0
