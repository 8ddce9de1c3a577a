"""Tokens over the API (the console's sign-in and Tokens page), the counts of the overview, the conditional reads a
polling console relies on, and the console's own files."""

from __future__ import annotations

from interfaces.auth import Role
from tests.hub.conftest import SQLITE_ONLY, HubUnderTest, assert_problem


def test_who_am_i_answers_each_role_and_refuses_no_token(hub: HubUnderTest) -> None:
    for role in Role:
        r = hub.get("/tokens/self", role)
        assert r.status_code == 200 and r.json()["role"] == role.value, r.text
        assert set(r.json()) == {"id", "role", "name"}
    assert_problem(hub.get("/tokens/self", None), 401, "unauthenticated")


def test_an_admin_creates_lists_and_revokes_tokens_and_a_revoked_one_is_refused_at_once(hub: HubUnderTest) -> None:
    # Execute: a viewer token made through the API
    made = hub.request("POST", "/tokens", Role.ADMIN, json={"role": "viewer", "name": "console test"})
    assert made.status_code == 201, made.text
    issued = made.json()
    secret = issued["token"]
    works = hub.client.get("/api/v1/tokens/self", headers={"Authorization": f"Bearer {secret}"})

    # Assert: it works as a viewer; the list shows it without any secret
    assert works.status_code == 200 and works.json() == {"id": issued["id"], "role": "viewer", "name": "console test"}
    listed = hub.get("/tokens?limit=500", Role.ADMIN).json()["items"]
    mine = next(t for t in listed if t["id"] == issued["id"])
    assert "token" not in mine and mine["revoked_at"] is None
    assert secret not in hub.get("/tokens?limit=500", Role.ADMIN).text

    # Execute / Assert: revoked, it is refused at once (this hub's cache forgets it), and revoking again is fine
    assert hub.request("DELETE", f"/tokens/{issued['id']}", Role.ADMIN).status_code == 204
    assert_problem(hub.client.get("/api/v1/tokens/self", headers={"Authorization": f"Bearer {secret}"}), 401, "unauthenticated")
    assert hub.request("DELETE", f"/tokens/{issued['id']}", Role.ADMIN).status_code == 204
    assert_problem(hub.request("DELETE", "/tokens/tok-nope", Role.ADMIN), 404, "not_found")


@SQLITE_ONLY
def test_tokens_are_for_admins_and_bad_bodies_are_refused(hub: HubUnderTest) -> None:
    for role in (Role.VIEWER, Role.OPERATOR):
        assert_problem(hub.get("/tokens", role), 403, "forbidden")
        assert_problem(hub.request("POST", "/tokens", role, json={"role": "viewer"}), 403, "forbidden")
    for body in ({"role": "root"}, {"role": "viewer", "name": 5}, {"role": "viewer", "extra": 1}, {"role": "viewer", "name": "x" * 129}, {}):
        assert_problem(hub.request("POST", "/tokens", Role.ADMIN, json=body), 422, "validation_failed")
    assert_problem(hub.get("/tokens?cursor=%%%", Role.ADMIN), 400, "invalid_cursor")


def test_the_summary_counts_by_state(hub: HubUnderTest) -> None:
    hub.register("gw-a")
    hub.register("gw-b")
    counts = hub.get("/summary").json()
    assert counts["nodes"].get("REGISTERED", 0) >= 2
    assert set(counts) == {"nodes", "devices", "deployments", "tasks"}


@SQLITE_ONLY
def test_a_json_read_carries_an_etag_and_the_same_tag_is_answered_304_without_a_body(hub: HubUnderTest) -> None:
    hub.register("gw-etag")
    first = hub.get("/nodes")
    tag = first.headers["etag"]
    again = hub.get("/nodes", headers={"If-None-Match": tag})
    assert first.status_code == 200 and tag.startswith('W/"')
    assert again.status_code == 304 and again.content == b"" and again.headers["etag"] == tag
    assert first.headers["cache-control"] == "no-store" and again.headers["cache-control"] == "no-store"  # no cache on the way keeps it
    hub.register("gw-etag-2")
    changed = hub.get("/nodes", headers={"If-None-Match": tag})
    assert changed.status_code == 200 and changed.headers["etag"] != tag and "gw-etag-2" in changed.text
    # a refusal is never a 304, whatever tag is named
    assert hub.get("/nodes", None, headers={"If-None-Match": tag}).status_code == 401


@SQLITE_ONLY
def test_the_console_is_served_with_its_policy_and_the_root_leads_there(hub: HubUnderTest) -> None:
    root = hub.client.get("/", follow_redirects=False)
    assert root.status_code == 307 and root.headers["location"] == "/console/"
    page = hub.client.get("/console/")
    assert page.status_code == 200 and "console.js" in page.text
    policy = page.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy and "unsafe-inline" not in policy
    assert hub.client.get("/console/console.js").headers["content-type"].startswith("text/javascript")
    assert hub.client.get("/console/vendor/uPlot.iife.min.js").status_code == 200
    for sneaky in ("/console/../../cloud/auth.py", "/console/%2e%2e/__init__.py", "/console/nope.js", "/console/vendor/uPlot.LICENSE"):
        assert hub.client.get(sneaky).status_code == 404, sneaky


@SQLITE_ONLY
def test_a_bootstrap_token_is_reissued_without_a_body_or_with_an_empty_one(hub: HubUnderTest) -> None:
    node = hub.register("gw-bare")["node"]["id"]
    device = hub.request("POST", "/devices", Role.OPERATOR, json={"node_id": node, "name": "board", "model": "m"}).json()["id"]
    for path in (f"/nodes/{node}/bootstrap-token", f"/devices/{device}/bootstrap-token"):
        for kw in ({}, {"content": b"", "headers": {"content-type": "application/json"}}, {"json": {}}, {"json": {"ttl_s": 600}}):
            r = hub.request("POST", path, Role.ADMIN, **kw)
            assert r.status_code == 201 and r.json()["bootstrap_token"], (path, kw, r.text)
        assert_problem(hub.request("POST", path, Role.ADMIN, json={"ttl_s": 1}), 422, "validation_failed")


def test_an_error_raised_with_another_status_than_its_class_is_titled_by_that_status() -> None:
    from cloud.errors import ApiError, BadRequest
    from interfaces.errors import ErrorCode

    assert ApiError("late", code=ErrorCode.COMMAND_TIMEOUT, status=504).problem().title == "Gateway timeout"
    assert BadRequest("no", status=422).problem().title == "Validation failed"
    assert BadRequest("no").problem().title == "Bad request"
