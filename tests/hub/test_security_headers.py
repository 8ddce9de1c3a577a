"""Responses say nosniff everywhere; what carries tokens or anyone's data is never kept by a cache on the way."""

from __future__ import annotations

from interfaces.auth import Role
from tests.hub.conftest import HubUnderTest
from tests.hub.test_artifacts import stored


def test_a_bootstrap_token_answer_is_no_store_and_every_answer_is_nosniff(hub: HubUnderTest) -> None:
    # Execute
    registered = hub.request("POST", "/nodes", Role.OPERATOR, json={"name": "gw-headers"})
    reissued = hub.request("POST", f"/nodes/{registered.json()['node']['id']}/bootstrap-token", Role.ADMIN)
    listing = hub.get("/nodes")
    refused = hub.get("/nodes", role=None)
    health = hub.client.get("/healthz")

    # Assert
    assert registered.status_code == 201 and "bootstrap_token" in registered.json()
    for response in (registered, reissued, listing, refused):
        assert response.headers["cache-control"] == "no-store", response.request.url
    for response in (registered, reissued, listing, refused, health):
        assert response.headers["x-content-type-options"] == "nosniff", response.request.url


def test_an_artefact_s_bytes_keep_their_etag_and_may_be_cached_by_it(hub: HubUnderTest) -> None:
    created = stored(hub)

    content = hub.get(f"/artifacts/{created['id']}/content")

    assert content.status_code == 200 and content.headers["etag"]
    assert "no-store" not in content.headers.get("cache-control", "")
    assert content.headers["x-content-type-options"] == "nosniff"
