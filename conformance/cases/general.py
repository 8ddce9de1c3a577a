"""8.0: what DESIGN §4 requires of every interface (errors, tokens, lists, idempotency, the MQTT envelope).

Every negative case checks the documented answer (an RFC 9457 problem document with its stable code)
and that nothing stored changed; every list is scoped to this run with the ``conformance-run`` label.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx

import interfaces
from conformance.agents import AGENT_VERSION, resources
from conformance.cases.common import PATIENCE_S, items, new_device, new_edge, node_status
from conformance.hub import RUN_LABEL, problem
from conformance.outcomes import Unexpected
from conformance.runner import Check, case
from interfaces.errors import ERROR_TYPE_PREFIX, ErrorCode, Problem
from interfaces.ids import new_id
from interfaces.messages import (
    HUB_SRC,
    MAX_MESSAGE_BYTES,
    MESSAGE_REJECTED_EVENT,
    ConnectionState,
    DesiredBody,
    Envelope,
    EventBody,
    Health,
    HeartbeatBody,
    ReportedBody,
    StateBody,
    envelope,
)
from interfaces.nodes import DeviceEvent, NodeEvent, NodePublic, NodeRegistered, NodeStatus, Twin
from interfaces.pagination import MAX_LIMIT
from interfaces.topics import NODE_DESIRED, NODE_EVENTS, NODE_HEARTBEAT, NODE_REPORTED, NODE_STATE

BODY_LIMIT = 1024 * 1024  # README: "Bodies over 1 MiB are 413 payload_too_large"
JSON = {"content-type": "application/json"}
IDEMPOTENCY_KEY = "Idempotency-Key"
REPLAYED = "idempotent-replayed"  # README: a replay carries "Idempotent-Replayed: true"
FORGED_CURSORS = ["!!!!", "zzzz", "not a cursor", "AAAA"]
MALFORMED_SELECTORS = ["zone=a,,tier=x", "=a", "zone=a=b", "zo ne=a", "!"]


# ---- helpers ---------------------------------------------------------------------------------------
def _expect(check: Check, r: httpx.Response, status: int, code: ErrorCode, what: str) -> Problem:
    """``r`` is the documented problem document (status, code, problem+json, type URN)."""
    try:
        doc = problem(r, status, code)
    except Unexpected as exc:
        check.fail(f"{what}: {exc}")
    if doc.type != ERROR_TYPE_PREFIX + code.value:
        check.fail(f"{what}: problem type {doc.type!r}, expected {ERROR_TYPE_PREFIX + code.value!r}")
    check.note(f"ok: {what} -> {status} {code.value} (application/problem+json)")
    return doc


def _expect_errors(check: Check, doc: Problem, field: str, what: str) -> None:
    """A validation problem lists per-field ``errors``, one of them about ``field``."""
    errors = doc.errors or []
    check.check(bool(errors) and any(field in [str(p) for p in e.get("loc", [])] for e in errors),
                f"{what}: errors name the field {field!r} ({[e.get('loc') for e in errors]})")  # fmt: skip


def _delete_node(check: Check, node_id: str) -> None:
    r = check.target.call("DELETE", f"/nodes/{node_id}")
    if r.status_code not in (200, 202, 204, 404, 410):
        raise RuntimeError(f"DELETE /nodes/{node_id}: HTTP {r.status_code} {r.text[:200]}")


def _register(check: Check, token: str = "admin", **labels: str) -> NodePublic:
    """POST /nodes (no enrolment); deleted by the admin after the case."""
    name = f"conf-{check.target.run_id}-{new_id('g')[-8:]}"
    reg = check.target.ok("POST", "/nodes", NodeRegistered, token=token, json={"name": name, "labels": check.target.labels(**labels)})
    check.cleanup(f"delete node {reg.node.id}", lambda: _delete_node(check, reg.node.id))
    return reg.node


def _run_nodes(check: Check, **more: str) -> dict[str, dict[str, Any]]:
    """This run's nodes (by id), optionally narrowed by more labels."""
    selector = ",".join(f"{k}={v}" for k, v in check.target.labels(**more).items())
    return {n["id"]: n for n in items(check.target, "/nodes", selector=selector)}


def _node(check: Check, node_id: str) -> dict[str, Any]:
    return check.target.ok("GET", f"/nodes/{node_id}")  # type: ignore[no-any-return]


def _padded(doc: dict[str, Any], size: int) -> bytes:
    """``doc`` as JSON, padded with insignificant whitespace to exactly ``size`` bytes (still valid JSON)."""
    raw = json.dumps(doc).encode()
    if len(raw) > size:
        raise ValueError("document longer than the padding target")
    return raw[:-1] + b" " * (size - len(raw)) + b"}"


def _list_endpoints() -> list[tuple[str, set[str]]]:
    """The documented list routes without path parameters (``GET`` with a ``cursor``), and their query parameters."""
    spec = json.loads((Path(interfaces.__file__).parent / "openapi.json").read_text())
    out = []
    for path, ops in spec["paths"].items():
        params = {p["name"] for p in ops.get("get", {}).get("parameters", [])}
        if "{" not in path and "cursor" in params and path.startswith("/api/v1/"):
            out.append((path.removeprefix("/api/v1"), params))
    return out


# ---- 8.0.1 errors ----------------------------------------------------------------------------------
@case("8.0.1", "A bad PATCH (malformed JSON, unknown field, wrong type, wrong media type, oversized) is refused with its code and leaves the node as it was")
def errors_bad_patch_changes_nothing(check: Check) -> None:
    node = _register(check, zone="a")
    before = _node(check, node.id)
    path = f"/nodes/{node.id}"
    evil = check.target.labels(zone="evil")

    r = check.target.call("PATCH", path, content=b'{"labels": {"zone": "evil"', headers=JSON)
    _expect(check, r, 400, ErrorCode.MALFORMED_REQUEST, "PATCH with malformed JSON")
    r = check.target.call("PATCH", path, content=b'{"labels": {"zone": "\xff\xfe"}}', headers=JSON)
    _expect(check, r, 400, ErrorCode.MALFORMED_REQUEST, "PATCH with bytes that are not UTF-8")
    r = check.target.call("PATCH", path, json={"labels": evil, "colour": "red"})
    _expect_errors(check, _expect(check, r, 422, ErrorCode.VALIDATION_FAILED, "PATCH with an unknown field"), "colour", "unknown field")
    r = check.target.call("PATCH", path, json={"labels": "zone=evil"})
    _expect_errors(check, _expect(check, r, 422, ErrorCode.VALIDATION_FAILED, "PATCH with labels of the wrong type"), "labels", "wrong type")
    r = check.target.call("PATCH", path, json={"description": 5, "labels": evil})
    _expect_errors(check, _expect(check, r, 422, ErrorCode.VALIDATION_FAILED, "PATCH with a number for description"), "description", "wrong type")
    r = check.target.call("PATCH", path, json={"labels": {"zone": "not a label value"}})
    _expect(check, r, 422, ErrorCode.VALIDATION_FAILED, "PATCH with an invalid label value")
    r = check.target.call("PATCH", path, content=json.dumps({"labels": evil}).encode(), headers={"content-type": "text/plain"})
    _expect(check, r, 415, ErrorCode.UNSUPPORTED_MEDIA_TYPE, "PATCH with a valid body as text/plain")
    # a body that would be accepted but for its size: only the limit refuses it
    r = check.target.call("PATCH", path, content=_padded({"labels": evil, "description": "evil"}, BODY_LIMIT + 1), headers=JSON)
    _expect(check, r, 413, ErrorCode.PAYLOAD_TOO_LARGE, f"a valid PATCH padded to {BODY_LIMIT + 1} bytes")

    def chunked() -> Any:
        yield b'{"labels": ' + json.dumps(evil).encode() + b', "description": "evil"'
        for _ in range(BODY_LIMIT // 65536 + 2):
            yield b" " * 65536
        yield b"}"

    r = check.target.call("PATCH", path, content=chunked(), headers=JSON)
    _expect(check, r, 413, ErrorCode.PAYLOAD_TOO_LARGE, "the same oversized PATCH sent chunked (no Content-Length)")
    after = _node(check, node.id)
    check.equal(after, before, "the node after the refused PATCHes (labels, description, updated_at, ...)")
    # the control: a good PATCH does change it, so the comparison above could have failed
    good = check.target.call("PATCH", path, json={"labels": check.target.labels(zone="b")})
    check.check(good.status_code == 200 and _node(check, node.id)["labels"].get("zone") == "b", f"a valid PATCH is applied (HTTP {good.status_code})")


@case("8.0.1", "A refused POST /nodes (malformed, invalid, wrong media type, oversized) is answered with its code and registers nothing")
def errors_bad_post_stores_nothing(check: Check) -> None:
    _register(check)  # the run has at least one node, so that the comparison is not of empty lists
    before = _run_nodes(check)
    mark = new_id("x")[-10:]
    names = [f"conf-{check.target.run_id}-{mark}-{i}" for i in range(6)]
    labels = check.target.labels()

    body = json.dumps({"name": names[0], "labels": labels}).encode()
    r = check.target.call("POST", "/nodes", content=body[:-2], headers=JSON)
    _expect(check, r, 400, ErrorCode.MALFORMED_REQUEST, "POST /nodes with truncated JSON")
    r = check.target.call("POST", "/nodes", json={"name": names[1], "labels": labels, "bogus": True})
    _expect_errors(check, _expect(check, r, 422, ErrorCode.VALIDATION_FAILED, "POST /nodes with an unknown field"), "bogus", "unknown field")
    r = check.target.call("POST", "/nodes", json={"name": 12345, "labels": labels})
    _expect_errors(check, _expect(check, r, 422, ErrorCode.VALIDATION_FAILED, "POST /nodes with a number for name"), "name", "wrong type")
    r = check.target.call("POST", "/nodes", json={"labels": labels})
    _expect_errors(check, _expect(check, r, 422, ErrorCode.VALIDATION_FAILED, "POST /nodes without the required name"), "name", "missing field")
    r = check.target.call("POST", "/nodes", content=json.dumps({"name": names[2], "labels": labels}).encode(), headers={"content-type": "text/plain"})
    _expect(check, r, 415, ErrorCode.UNSUPPORTED_MEDIA_TYPE, "POST /nodes with a valid body as text/plain")
    r = check.target.call("POST", "/nodes", content=_padded({"name": names[3], "labels": labels}, BODY_LIMIT + 1), headers=JSON)
    _expect(check, r, 413, ErrorCode.PAYLOAD_TOO_LARGE, f"a valid POST /nodes padded to {BODY_LIMIT + 1} bytes")
    # exactly at the limit the body is read: it is refused for what it says (description too long), not for its size
    at_limit = {"name": names[4], "labels": labels, "description": ""}
    at_limit["description"] = "x" * (BODY_LIMIT - len(json.dumps(at_limit).encode()))
    raw = json.dumps(at_limit).encode()
    check.equal(len(raw), BODY_LIMIT, "size of the at-limit body")
    r = check.target.call("POST", "/nodes", content=raw, headers=JSON)
    _expect_errors(check, _expect(check, r, 422, ErrorCode.VALIDATION_FAILED, f"a {BODY_LIMIT}-byte body (at the limit) is read and validated"), "description", "too long")
    after = _run_nodes(check)
    check.equal(sorted(after), sorted(before), "this run's nodes after the refused POSTs")
    check.check(not any(n["name"] in names for n in after.values()), "no node carries a name from a refused request")


@case("8.0.1", "Unknown ids are 404 not_found; a method a route does not have is 405 method_not_allowed and does nothing")
def errors_not_found_and_method(check: Check) -> None:
    node = _register(check)
    missing = new_id("n")
    for method, path, kw in [("GET", f"/nodes/{missing}", {}), ("GET", f"/nodes/{missing}/status", {}),
                             ("PATCH", f"/nodes/{missing}", {"json": {"description": "x"}}), ("DELETE", f"/nodes/{missing}", {}),
                             ("GET", f"/devices/{new_id('d')}", {}), ("GET", f"/tasks/{new_id('task')}", {}),
                             ("GET", f"/deployments/{new_id('dep')}", {})]:  # fmt: skip
        _expect(check, check.target.call(method, path, **kw), 404, ErrorCode.NOT_FOUND, f"{method} {path}")
    before = _run_nodes(check)
    answered = {"/nodes": {"GET", "POST"}, f"/nodes/{node.id}": {"GET", "PATCH", "DELETE"}, f"/nodes/{node.id}/status": {"GET"}}  # DESIGN §4.1
    for method, path in [("DELETE", "/nodes"), ("PUT", "/nodes"), ("POST", f"/nodes/{node.id}"), ("PUT", f"/nodes/{node.id}/status")]:
        r = check.target.call(method, path, json={"name": "conf-x", "labels": check.target.labels()})
        _expect(check, r, 405, ErrorCode.METHOD_NOT_ALLOWED, f"{method} {path}")
        allow = {m.strip().upper() for m in r.headers.get("allow", "").split(",") if m.strip()}
        check.check(answered[path] <= allow and method not in allow, f"{method} {path}: Allow lists the methods the path answers (RFC 9110 15.5.6): {sorted(allow)}")
    check.equal(sorted(_run_nodes(check)), sorted(before), "this run's nodes after the 405s (DELETE /nodes deleted nothing)")
    check.equal(_node(check, node.id)["id"], node.id, "the node is still there")


# ---- 8.0.2 roles -----------------------------------------------------------------------------------
@case("8.0.2", "No token, an unknown token or another scheme is 401 unauthenticated (WWW-Authenticate: Bearer) and stores nothing")
def roles_unauthenticated(check: Check) -> None:
    _register(check)
    before = _run_nodes(check)
    name = f"conf-{check.target.run_id}-{new_id('u')[-8:]}"
    body = {"name": name, "labels": check.target.labels()}
    literal = "asy_" + new_id("bogus").replace("-", "")
    for label, token, headers in [("no token", None, {}), ("an unknown token", literal, {}),
                                  ("Basic credentials", None, {"Authorization": "Basic YWRtaW46YWRtaW4="}),
                                  ("a bearer without a token", None, {"Authorization": "Bearer"})]:  # fmt: skip
        for method, path, kw in [("GET", "/nodes", {}), ("POST", "/nodes", {"json": body})]:
            with check.target.client(token) as c:
                r = c.request(method, path, headers=headers, **kw)
            _expect(check, r, 401, ErrorCode.UNAUTHENTICATED, f"{method} {path} with {label}")
            challenge = r.headers.get("www-authenticate")
            if challenge is not None:
                check.check(challenge.lower().startswith("bearer"), f"{method} {path} with {label}: WWW-Authenticate {challenge!r} names Bearer")
            else:
                check.note(f"{method} {path} with {label}: no WWW-Authenticate header")
    after = _run_nodes(check)
    check.equal(sorted(after), sorted(before), "this run's nodes after the unauthenticated POSTs")
    check.check(all(n["name"] != name for n in after.values()), "no node with the refused name")


@case("8.0.2", "A viewer reads nodes, but every write is 403 forbidden and changes nothing")
def roles_viewer_reads_only(check: Check) -> None:
    with check.target.client("viewer"):  # skips when no viewer token was given
        pass
    node = _register(check, zone="a")
    before = _node(check, node.id)
    listed = check.target.ok("GET", "/nodes", token="viewer", params={"selector": f"{RUN_LABEL}={check.target.run_id}"})
    check.check(node.id in [n["id"] for n in listed["items"]], "the viewer lists this run's nodes")
    check.equal(check.target.ok("GET", f"/nodes/{node.id}", NodePublic, token="viewer").id, node.id, "the viewer reads the node")
    check.equal(check.target.ok("GET", f"/nodes/{node.id}/status", NodeStatus, token="viewer").node_id, node.id, "the viewer reads its status")
    runs_before = _run_nodes(check)
    name = f"conf-{check.target.run_id}-{new_id('v')[-8:]}"
    writes = [("POST", "/nodes", {"json": {"name": name, "labels": check.target.labels()}}),
              ("PATCH", f"/nodes/{node.id}", {"json": {"labels": check.target.labels(zone="viewer")}}),
              ("PUT", f"/nodes/{node.id}/admin-state", {"json": {"admin_state": "LOCKED"}}),
              ("PUT", f"/nodes/{node.id}/twin", {"json": {"desired": {"viewer": True}}}),
              ("POST", f"/nodes/{node.id}/bootstrap-token", {"json": {}}),
              ("DELETE", f"/nodes/{node.id}", {})]  # fmt: skip
    for method, path, kw in writes:
        _expect(check, check.target.call(method, path, token="viewer", **kw), 403, ErrorCode.FORBIDDEN, f"viewer {method} {path}")
    check.equal(_node(check, node.id), before, "the node after the viewer's writes")
    twin = check.target.ok("GET", f"/nodes/{node.id}/twin", Twin)
    check.check("viewer" not in twin.desired, f"the desired document has nothing of the viewer's (version {twin.desired_version})")
    after = _run_nodes(check)
    check.equal(sorted(after), sorted(runs_before), "this run's nodes after the viewer's POST")


@case("8.0.2", "An operator registers, changes and locks nodes; deleting (revoking) a node is the admin's: 403 forbidden")
def roles_operator_writes_nodes(check: Check) -> None:
    with check.target.client("operator"):  # skips when no operator token was given
        pass
    node = _register(check, token="operator", zone="a")
    check.note(f"the operator registered {node.id}")
    r = check.target.call("PATCH", f"/nodes/{node.id}", token="operator", json={"labels": check.target.labels(zone="b"), "description": "by operator"})
    check.equal(r.status_code, 200, "operator PATCH: HTTP status")
    got = _node(check, node.id)
    check.equal((got["labels"].get("zone"), got["description"]), ("b", "by operator"), "labels and description after the operator's PATCH")
    for state in ("LOCKED", "UNLOCKED"):
        r = check.target.call("PUT", f"/nodes/{node.id}/admin-state", token="operator", json={"admin_state": state})
        check.check(r.status_code // 100 == 2, f"operator PUT admin-state {state}: HTTP {r.status_code}")
        check.equal(node_status(check.target, node.id).admin_state, state, "admin state")
    before = _node(check, node.id)
    _expect(check, check.target.call("DELETE", f"/nodes/{node.id}", token="operator"), 403, ErrorCode.FORBIDDEN, "operator DELETE /nodes/{id}")
    check.equal(_node(check, node.id), before, "the node after the operator's DELETE")


# ---- 8.0.3 lists -----------------------------------------------------------------------------------
def _five(check: Check) -> tuple[str, list[str]]:
    """Five nodes under a label of their own: zone a, a, b, b and none; tier x on the first and third."""
    group = new_id("grp")[-12:]
    specs = [{"zone": "a", "tier": "x"}, {"zone": "a"}, {"zone": "b", "tier": "x"}, {"zone": "b"}, {}]
    return group, [_register(check, **{"conf-group": group}, **s).id for s in specs]


@case("8.0.3", "limit=2 pages with next_cursor through every node exactly once; forged cursors are 400 invalid_cursor; limits out of range 422")
def lists_paging(check: Check) -> None:
    group, ids = _five(check)
    selector = f"{RUN_LABEL}={check.target.run_id},conf-group={group}"
    seen: list[str] = []
    pages, cursor = 0, None
    while True:
        params = {"selector": selector, "limit": 2, **({"cursor": cursor} if cursor else {})}
        page = check.target.ok("GET", "/nodes", params=params)
        pages += 1
        check.check(set(page) >= {"items", "next_cursor"} and len(page["items"]) <= 2, f"page {pages}: {{items, next_cursor}}, {len(page['items'])} items <= 2")
        for item in page["items"]:
            NodePublic.model_validate(item)
        seen += [n["id"] for n in page["items"]]
        cursor = page["next_cursor"]
        if not cursor or pages > 10:
            break
    check.equal(sorted(seen), sorted(ids), f"the nodes seen over {pages} pages")
    check.equal(len(seen), len(set(seen)), "nodes seen (none twice)")
    check.check(pages in (3, 4), f"5 items at limit=2 take 3 pages (4 with an empty last one): {pages}")
    whole = check.target.ok("GET", "/nodes", params={"selector": selector, "limit": MAX_LIMIT})
    check.equal(sorted(n["id"] for n in whole["items"]), sorted(ids), f"limit={MAX_LIMIT}: one page with all five")
    for forged in FORGED_CURSORS:
        r = check.target.call("GET", "/nodes", params={"selector": selector, "limit": 2, "cursor": forged})
        _expect(check, r, 400, ErrorCode.INVALID_CURSOR, f"GET /nodes?cursor={forged!r}")
    for limit in (0, -1, MAX_LIMIT + 1, "ten"):
        r = check.target.call("GET", "/nodes", params={"selector": selector, "limit": limit})
        _expect_errors(check, _expect(check, r, 422, ErrorCode.VALIDATION_FAILED, f"GET /nodes?limit={limit}"), "limit", "limit")


@case("8.0.3", "Label selectors: =, ==, !=, key, !key and their conjunction select exactly the matching nodes; malformed ones are 400 invalid_selector")
def lists_selectors(check: Check) -> None:
    group, ids = _five(check)
    base = f"{RUN_LABEL}={check.target.run_id},conf-group={group}"
    expected = {"zone=a": {0, 1}, "zone==a": {0, 1}, "zone!=a": {2, 3, 4}, "zone": {0, 1, 2, 3}, "!zone": {4},
                "zone=b,tier=x": {2}, "tier!=x": {1, 3, 4}, "zone=c": set()}  # fmt: skip
    for selector, want in expected.items():
        got = {n["id"] for n in items(check.target, "/nodes", selector=f"{base},{selector}")}
        check.equal(sorted(got), sorted(ids[i] for i in want), f"selector {selector!r}")
    check.note("set-based requirements (in, notin) are not in the documented grammar (zone=a,tier!=x,gpu,!legacy): not tried")
    for selector in MALFORMED_SELECTORS:
        r = check.target.call("GET", "/nodes", params={"selector": f"{base},{selector}" if selector != "!" else selector})
        _expect(check, r, 400, ErrorCode.INVALID_SELECTOR, f"GET /nodes?selector={selector!r}")


@case("8.0.3", "Every documented list refuses a forged cursor (400 invalid_cursor), a limit out of range (422) and a malformed selector (400 invalid_selector)")
def lists_every_list(check: Check) -> None:
    endpoints = _list_endpoints()
    check.check(len(endpoints) >= 3, f"list routes in interfaces/openapi.json: {[p for p, _ in endpoints]}")
    for path, params in endpoints:
        page = check.target.ok("GET", path, params={"limit": 1})
        check.check(isinstance(page.get("items"), list) and "next_cursor" in page, f"GET {path}?limit=1 is {{items, next_cursor}}")
        _expect(check, check.target.call("GET", path, params={"cursor": FORGED_CURSORS[0]}), 400, ErrorCode.INVALID_CURSOR, f"GET {path} forged cursor")
        _expect(check, check.target.call("GET", path, params={"limit": 0}), 422, ErrorCode.VALIDATION_FAILED, f"GET {path}?limit=0")
        if "selector" in params:
            r = check.target.call("GET", path, params={"selector": MALFORMED_SELECTORS[0]})
            _expect(check, r, 400, ErrorCode.INVALID_SELECTOR, f"GET {path} malformed selector")


# ---- 8.0.4 Idempotency-Key -------------------------------------------------------------------------
@case("8.0.4", "POST /nodes twice with one Idempotency-Key: one node, the bootstrap token handed out once (the repeat is 409 idempotency_not_replayable); the key with another body is 422 idempotency_key_reused")
def idempotency_post(check: Check) -> None:
    group = new_id("idem")[-12:]
    key = f"conf-{check.target.run_id}-{new_id('k')}"
    labels = check.target.labels(**{"conf-group": group})
    body = {"name": f"conf-{check.target.run_id}-{group}", "labels": labels}
    first = check.target.call("POST", "/nodes", json=body, headers={IDEMPOTENCY_KEY: key})
    check.equal(first.status_code, 201, "first POST: HTTP status")
    node_id = NodeRegistered.model_validate(first.json()).node.id
    check.cleanup(f"delete node {node_id}", lambda: _delete_node(check, node_id))
    check.check(first.headers.get(REPLAYED) is None or first.headers.get(REPLAYED).lower() != "true", "the first answer is not marked replayed")
    second = check.target.call("POST", "/nodes", json=body, headers={IDEMPOTENCY_KEY: key})
    _expect(check, second, 409, ErrorCode.IDEMPOTENCY_NOT_REPLAYABLE, "repeat of an answer that carried a bootstrap token")
    check.check(first.json()["bootstrap_token"] not in second.text, "repeat: the bootstrap token is not handed out again")
    check.equal(sorted(_run_nodes(check, **{"conf-group": group})), [node_id], "nodes stored for the two requests")

    other = {"name": f"conf-{check.target.run_id}-{group}-b", "labels": labels}
    r = check.target.call("POST", "/nodes", json=other, headers={IDEMPOTENCY_KEY: key})
    _expect(check, r, 422, ErrorCode.IDEMPOTENCY_KEY_REUSED, "the key again with another body")
    stored = _run_nodes(check, **{"conf-group": group})
    check.equal(sorted(stored), [node_id], "nodes stored after the reuse")
    check.equal(stored[node_id]["name"], body["name"], "the stored node keeps the first request's name")

    r = check.target.call("POST", "/nodes", json=other, headers={IDEMPOTENCY_KEY: "k" * 256})
    _expect(check, r, 422, ErrorCode.VALIDATION_FAILED, "an Idempotency-Key longer than 255 characters")
    check.equal(sorted(_run_nodes(check, **{"conf-group": group})), [node_id], "nodes stored after the bad key")


@case("8.0.4", "A repeated PATCH with its Idempotency-Key replays the first answer and does not apply the change again")
def idempotency_patch_replays_not_reapplies(check: Check) -> None:
    node = _register(check, zone="a")
    path = f"/nodes/{node.id}"
    key = f"conf-{check.target.run_id}-{new_id('k')}"
    first = check.target.call("PATCH", path, json={"labels": check.target.labels(zone="one")}, headers={IDEMPOTENCY_KEY: key})
    check.equal(first.status_code, 200, "first PATCH: HTTP status")
    check.equal(_node(check, node.id)["labels"].get("zone"), "one", "zone after the first PATCH")
    check.target.ok("PATCH", path, json={"labels": check.target.labels(zone="two")})
    moved = _node(check, node.id)
    check.equal(moved["labels"].get("zone"), "two", "zone after a second PATCH without a key")
    again = check.target.call("PATCH", path, json={"labels": check.target.labels(zone="one")}, headers={IDEMPOTENCY_KEY: key})
    check.equal((again.status_code, again.json()), (first.status_code, first.json()), "the repeat answers with the first response")
    check.equal((again.headers.get(REPLAYED) or "").lower(), "true", "repeat: Idempotent-Replayed header")
    check.equal(_node(check, node.id), moved, "the node after the replay (the change was not applied again)")


@case("8.0.4", "Idempotency keys belong to their caller: another token's request with the same key is its own")
def idempotency_per_caller(check: Check) -> None:
    with check.target.client("operator"):  # skips when no operator token was given
        pass
    group = new_id("idem")[-12:]
    key = f"conf-{check.target.run_id}-{new_id('k')}"
    body = {"name": f"conf-{check.target.run_id}-{group}", "labels": check.target.labels(**{"conf-group": group})}
    ids = []
    for token in ("admin", "operator"):
        r = check.target.call("POST", "/nodes", token=token, json=body, headers={IDEMPOTENCY_KEY: key})
        check.equal(r.status_code, 201, f"{token} POST with the key: HTTP status")
        node_id = NodeRegistered.model_validate(r.json()).node.id
        check.cleanup(f"delete node {node_id}", lambda n=node_id: _delete_node(check, n))  # type: ignore[misc]
        check.check((r.headers.get(REPLAYED) or "").lower() != "true", f"{token}'s answer is not a replay")
        ids.append(node_id)
    check.check(ids[0] != ids[1], f"two callers, two nodes: {ids}")
    check.equal(sorted(_run_nodes(check, **{"conf-group": group})), sorted(ids), "nodes stored")


# ---- 8.0.5 MQTT ------------------------------------------------------------------------------------
_EVIL = {"agent_version": "conf-evil", "health": "degraded", "health_detail": "conf-evil", "uptime_s": 987654.0}


def _metrics_dropped(check: Check) -> dict[str, float]:
    """The hub's Prometheus MQTT drop counters, for evidence only (their names are not part of the contract)."""
    with check.target.client() as c:
        r = c.get(check.target.hub_url + "/metrics")  # outside the API base
    out = {}
    for line in r.text.splitlines() if r.status_code == 200 else []:
        if line.startswith("aisynergy_mqtt_dropped"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


@case("8.0.5", "Malformed, foreign and oversized messages on a node's own topics are dropped and answered with error events on the node: status, twin, history and device events unchanged, the node stays ONLINE")
def mqtt_malformed_dropped(check: Check) -> None:
    target = check.target
    edge = new_edge(check)
    dev = new_device(check, edge)
    other = _register(check)  # a real node id to forge as src
    node_id = edge.node_id
    hb, st, rp, ev = (t.topic(node_id=node_id) for t in (NODE_HEARTBEAT, NODE_STATE, NODE_REPORTED, NODE_EVENTS))
    dev_ev = dev.topics.events
    events_path = f"/devices/{dev.ident}/events"

    # control: a valid heartbeat with distinctive readings reaches the status
    edge.node.resources = resources(memory_available=1_234_567_890)
    check.wait(lambda: (s := node_status(target, node_id)).resources is not None and s.resources.memory.available_bytes == 1_234_567_890,
               PATIENCE_S + 5 * edge.heartbeat_interval_s, "a valid heartbeat's readings in the status")  # fmt: skip
    # control: a valid report reaches the twin
    good_mark = new_id("mk")
    edge.node.report(target.ok("GET", f"/nodes/{node_id}/twin", Twin).desired_version, {"conf-good": good_mark})
    check.wait(lambda: target.ok("GET", f"/nodes/{node_id}/twin", Twin).reported.get("conf-good") == good_mark, PATIENCE_S, "a valid report in the twin")
    timeout = edge.issued.offline_timeout_s or 3 * edge.heartbeat_interval_s
    metrics_before = _metrics_dropped(check)

    def sentinel() -> None:
        marker = new_id("mk")
        dev.event("conformance.sentinel", {"marker": marker})
        check.wait(lambda: any(e["data"].get("marker") == marker for e in items(target, events_path)), PATIENCE_S, f"the sentinel event {marker}", 0.05)

    # quiet: no valid heartbeat from now on; the sentinel shows that everything sent before it was taken in
    edge.node.heartbeats.clear()
    dev.heartbeats.clear()
    paused = time.monotonic()
    sentinel()
    status0 = node_status(target, node_id).model_dump()
    twin0 = target.ok("GET", f"/nodes/{node_id}/twin")
    history0 = target.ok("GET", f"/nodes/{node_id}/history")
    events0 = items(target, events_path)
    node_events0 = items(target, f"/nodes/{node_id}/events")

    good_hb = HeartbeatBody(seq=10_000, health=Health.DEGRADED, health_detail="conf-evil", agent_version="conf-evil", uptime_s=987654.0,
                            resources=resources(memory_available=42))  # fmt: skip
    own = json.loads(envelope(node_id, good_hb).model_dump_json())
    bad_body = {**own, "body": {**own["body"], "seq": -1}}
    extra_field = {**own, "body": {**own["body"], "colour": "red"}}
    wrong_version = {**own, "v": 2}
    no_id = {k: v for k, v in own.items() if k != "id"}
    offline_own = json.loads(envelope(node_id, StateBody(state=ConnectionState.OFFLINE, reason="conf-evil")).model_dump_json())
    reported_own = json.loads(envelope(node_id, ReportedBody(version=twin0["desired_version"], status={"conf-evil": True})).model_dump_json())
    event_own = json.loads(envelope(dev.ident, EventBody(seq=900_000, type="conformance.forged", data={"evil": True})).model_dump_json())
    junk: list[tuple[str, str, bytes]] = [
        ("not JSON", hb, b"\xff\xfe{ not json"), ("not JSON", st, b"offline"), ("not JSON", rp, b"{"), ("not JSON", dev_ev, b"\x00\x01"),
        ("not JSON", ev, b"]]"),
        ("JSON, not an envelope", hb, good_hb.model_dump_json().encode()), ("JSON, not an envelope", st, b'{"state": "offline"}'),
        ("JSON, not an envelope", rp, b'{"version": 0, "status": {"conf-evil": true}}'), ("JSON, not an envelope", dev_ev, b"[]"),
        ("JSON, not an envelope", hb, b'"heartbeat"'),
        ("src another node", hb, envelope(other.id, good_hb).model_dump_json().encode()),
        ("src another node", st, envelope(other.id, StateBody(state=ConnectionState.OFFLINE, reason="conf-evil")).model_dump_json().encode()),
        ("src another node", rp, envelope(other.id, ReportedBody(version=twin0["desired_version"], status={"conf-evil": True})).model_dump_json().encode()),
        ("src another node", dev_ev, envelope(other.id, EventBody(seq=900_001, type="conformance.forged")).model_dump_json().encode()),
        ("src another node", ev, envelope(other.id, EventBody(seq=900_002, type="conformance.forged")).model_dump_json().encode()),
        ("body fails the model (seq -1)", hb, json.dumps(bad_body).encode()),
        ("body with an unknown field", hb, json.dumps(extra_field).encode()),
        ("envelope v=2", hb, json.dumps(wrong_version).encode()),
        ("envelope without id", hb, json.dumps(no_id).encode()),
        ("state body fails the model", st, json.dumps({**offline_own, "body": {"state": "exploded"}}).encode()),
        ("reported body fails the model", rp, json.dumps({**reported_own, "body": {"version": -1, "status": {"conf-evil": True}}}).encode()),
        ("event body fails the model", dev_ev, json.dumps({**event_own, "body": {**event_own["body"], "severity": "fatal"}}).encode()),
        (f"over {MAX_MESSAGE_BYTES} bytes", hb, _padded(own, MAX_MESSAGE_BYTES + 1)),
        (f"over {MAX_MESSAGE_BYTES} bytes", rp, _padded(reported_own, MAX_MESSAGE_BYTES + 1)),
        (f"over {MAX_MESSAGE_BYTES} bytes", dev_ev, _padded(event_own, MAX_MESSAGE_BYTES + 1)),
    ]  # fmt: skip
    for what, topic, payload in junk:  # not waiting for each PUBACK: the quiet spell must stay within the offline timeout
        edge.peer.publish(topic, payload, qos=1, wait=False)
    check.note(f"published {len(junk)} malformed messages: " + "; ".join(f"{w} on .../{t.rsplit(node_id + '/', 1)[-1]}" for w, t, _ in junk))
    sentinel()
    status1 = node_status(target, node_id).model_dump()
    quiet = time.monotonic() - paused
    check.check(edge.peer.connected.is_set(), "the edge is still connected to the broker")
    check.equal(status1["state"], "ONLINE", f"node state ({quiet:.1f} s without heartbeats; offline timeout {timeout:g} s)")
    check.equal(status1, status0, "the node's status (last heartbeat, health, agent version, uptime, resources)")
    check.equal(target.ok("GET", f"/nodes/{node_id}/twin"), twin0, "the node's twin (reported document)")
    check.equal(target.ok("GET", f"/nodes/{node_id}/history"), history0, "the node's state history")
    events1 = items(target, events_path)
    new_events = [DeviceEvent.model_validate(e) for e in events1[len(events0):]]
    check.equal(events1[: len(events0)], events0, "the device's earlier events")
    check.equal([e.type for e in new_events], ["conformance.sentinel"], "events stored since (only the sentinel)")
    check.note(f"the node of the forged src ({other.id}) is {_node(check, other.id)['state']}")
    # DESIGN §6: each dropped message is answered with an error event, recorded on the node that sent it
    node_events1 = items(target, f"/nodes/{node_id}/events")
    check.equal(node_events1[: len(node_events0)], node_events0, "the node's earlier events")
    answers = [NodeEvent.model_validate(e) for e in node_events1[len(node_events0):]]
    rejected = [e for e in answers if e.type == MESSAGE_REJECTED_EVENT]
    check.equal([e.type for e in answers if e.type != MESSAGE_REJECTED_EVENT], [], "node events since other than the error events")
    check.check(bool(rejected) and all(e.source == "hub" and e.severity == "error" for e in rejected), "error events recorded by the hub, severity error")
    check.equal(sorted({str(e.data.get("topic")) for e in rejected}), sorted({t for _, t, _ in junk}), "the topics the error events name (every topic that got junk)")
    check.check(len(rejected) <= len(junk), f"{len(rejected)} error events for {len(junk)} dropped messages (none invented; a hub may count a flood instead of recording each)")

    # the sender's valid messages are still taken in
    edge.node.heartbeats.set()
    dev.heartbeats.set()
    last = status0["last_heartbeat_at"]
    back = check.wait(lambda: (s := node_status(target, node_id)).last_heartbeat_at is not None and (last is None or s.last_heartbeat_at > last) and s,
                      PATIENCE_S + 3 * edge.heartbeat_interval_s, "a valid heartbeat after the malformed ones")  # fmt: skip
    check.equal((back.state, back.agent_version, back.resources.memory.available_bytes if back.resources else None),
                ("ONLINE", AGENT_VERSION, 1_234_567_890), "status from the next valid heartbeat")  # fmt: skip
    after = _metrics_dropped(check)
    check.note("hub drop counters (evidence): " + ", ".join(f"{k} +{after.get(k, 0) - metrics_before.get(k, 0):g}" for k in sorted(after)) if after else "no drop counters in /metrics")


@case("8.0.5", "The hub's desired document for a node is an Envelope[DesiredBody] from 'hub', retained on the node's desired topic, with the twin's version")
def mqtt_desired_envelope(check: Check) -> None:
    edge = new_edge(check)
    topic = NODE_DESIRED.topic(node_id=edge.node_id)
    check.check(NODE_DESIRED.retain and NODE_DESIRED.payload is Envelope[DesiredBody], f"the topic table: {NODE_DESIRED.pattern} retained Envelope[DesiredBody]")
    marker = new_id("mk")
    twin = check.target.ok("PUT", f"/nodes/{edge.node_id}/twin", Twin, json={"desired": {"conf-marker": marker}})

    def has_marker(m: Any) -> bool:
        try:
            return bool(json.loads(m.payload).get("body", {}).get("spec", {}).get("conf-marker") == marker)
        except ValueError:
            return False

    live = edge.peer.wait_message(topic, has_marker, timeout=PATIENCE_S)
    check.check(live is not None, f"the desired document with the marker arrives on {topic}")
    assert live is not None
    doc = Envelope[DesiredBody].model_validate_json(live.payload)  # strict: unknown fields refused
    check.equal((doc.src, doc.kind, doc.v), (HUB_SRC, DesiredBody.KIND, 1), "envelope src, kind, v")
    check.equal(doc.body.version, twin.desired_version, "desired version = the twin's desired_version")
    check.equal(doc.body.spec.get("conf-marker"), marker, "spec carries the desired document")
    # a fresh subscription gets the retained copy, flagged retained
    since = time.monotonic()
    codes = edge.peer.subscribe(topic)
    check.check(not any(c.is_failure for c in codes), f"the node re-subscribes to its desired topic ({codes})")
    kept = edge.peer.wait_message(topic, lambda m: m.retain, timeout=PATIENCE_S, after=since)
    check.check(kept is not None, "a retained copy comes to a new subscription")
    assert kept is not None
    retained = Envelope[DesiredBody].model_validate_json(kept.payload)
    check.equal((retained.id, retained.body.version, retained.body.spec.get("conf-marker")), (doc.id, doc.body.version, marker), "the retained copy is the latest document")
