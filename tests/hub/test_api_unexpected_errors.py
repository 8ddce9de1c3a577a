"""An exception no handler takes is a 500 ``internal_error`` problem document, over a real server, and the
client's keep-alive connection serves its next request (DESIGN §4: errors as problem+json)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from cloud.api.routes import devices as device_routes
from interfaces import API_PREFIX
from interfaces.auth import Role
from tests.hub.conftest import HubUnderTest, assert_problem, hub_settings, running_hub
from tests.hub.live import serve


@pytest.fixture
def served(sqlite_url: str, tmp_path: Path) -> Iterator[tuple[HubUnderTest, str]]:
    for hub in running_hub(hub_settings(tmp_path, sqlite_url)):

        def boom() -> None:
            raise RuntimeError("a bug in a route")

        hub.app.add_api_route(API_PREFIX + "/test-only/boom", boom, methods=["GET"], include_in_schema=False)
        with serve(hub.app) as url:
            yield hub, url


def _local_port(response: httpx.Response) -> int:
    """The client's port of the connection that carried ``response``."""
    return int(response.extensions["network_stream"].get_extra_info("client_addr")[1])


def test_an_unexpected_error_is_a_problem_and_the_connection_serves_the_next_request(served: tuple[HubUnderTest, str]) -> None:
    # Prepare
    hub, url = served

    # Execute
    with httpx.Client(base_url=url, headers=hub.auth(Role.VIEWER)) as client:
        failed = client.get(API_PREFIX + "/test-only/boom")
        failed_port = _local_port(failed)
        after = client.get(API_PREFIX + "/nodes")
        after_port = _local_port(after)

    # Assert
    doc = assert_problem(failed, 500, "internal_error")
    assert "a bug" not in failed.text  # nothing of the exception leaks to the client
    assert doc["instance"] == API_PREFIX + "/test-only/boom"
    assert failed.headers.get("connection", "").lower() != "close"
    assert after.status_code == 200, after.text
    assert after_port == failed_port  # the same connection


def test_a_write_that_fails_unexpectedly_frees_its_idempotency_key(served: tuple[HubUnderTest, str], monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare
    hub, url = served
    node_id = hub.register("gw")["node"]["id"]
    body, key = {"node_id": node_id, "model": "rpi-5"}, {"Idempotency-Key": "create-cam"}

    def broken(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("the database went away")

    # Execute
    with httpx.Client(base_url=url, headers=hub.auth(Role.OPERATOR)) as client:
        monkeypatch.setattr(device_routes.device_service, "create", broken)
        failed = client.post(API_PREFIX + "/devices", json=body, headers=key)
        failed_port = _local_port(failed)
        monkeypatch.undo()
        retried = client.post(API_PREFIX + "/devices", json=body, headers=key)
        retried_port = _local_port(retried)

    # Assert
    assert_problem(failed, 500, "internal_error")
    assert retried.status_code == 201, retried.text
    assert "idempotent-replayed" not in retried.headers  # run, not replayed: a server error is not kept
    assert retried_port == failed_port
