"""8.2 deployment and update (DESIGN §4.2): artefacts, signed manifests, HTTP Range downloads, deployments,
rollout strategies, deployment control, failure policies and the execution state machine; with the
standard's 6.1.2 d (task images), 7.3.1 b 1 (lightweight deployment to edges and devices) and 7.3.1 e
(one graph format).

The targets are simulated edges (``SimEdge``) and devices they relay. What the suite adds to the
simulated agent lives here (:class:`Agent`): an install can be held (the order arrives, nothing is
reported until the case releases it) so that a rollout's progress can be watched batch by batch, and a
rollback order is carried out (the simulated endpoint otherwise ignores a second order with an execution
id it has seen, and rollback orders reuse the execution id).
"""

from __future__ import annotations

import base64
import hashlib
import os
import threading
from collections.abc import Callable, Iterable
from enum import Enum
from itertools import count, pairwise
from typing import Any

import httpx
from paho.mqtt.client import topic_matches_sub as mqtt_topic_matches
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from conformance.agents import Endpoint, SimEdge
from conformance.cases.common import PATIENCE_S, items, new_device, new_edge
from conformance.hub import RUN_LABEL, problem
from conformance.outcomes import Unexpected
from conformance.runner import Check, case
from interfaces.deployments import (
    DOWNLOAD_TOKEN_HEADER, EXECUTION_EVENT, INSTALLED_KEY, ArtifactPublic, DeploymentDetail, DeploymentOrder, DeploymentPublic,
    DeploymentState, ExecutionPublic, ExecutionState, OrderAction, manifest_signing_bytes,
)  # fmt: skip
from interfaces.errors import ErrorCode
from interfaces.ids import new_id
from interfaces.nodes import Twin
from interfaces.topics import Tier, own_subtree

_E = ExecutionState
_D = DeploymentState
INSTALL_PATH = [_E.QUEUED, _E.DOWNLOADING, _E.DOWNLOADED, _E.VERIFYING, _E.INSTALLING, _E.ACTIVE]
SETTLE_S = 1.5  # how long a case watches for something that must not happen (three rollout ticks at the default 0.5 s)
HOLD_LIMIT_S = 10 * PATIENCE_S  # a held install gives up after this (the case has failed or been cleaned up by then)
_serial = count(1)


# ---- the simulated agent, with what these cases need -------------------------------------------------


class Agent:
    """One simulated endpoint (a node or a relayed device) under the case's control.

    * ``hold()`` / ``release()``: while held, an order is received (it shows in ``desired``) but the
      endpoint does not start on it, so nothing is reported; ``release()`` lets it carry on.
    * A rollback order (``action: rollback``, the same execution id as the install) is carried out once.
    * ``drop()`` (at clean-up) makes held orders return without doing anything; ``skip(xid)`` does that for one.
    """

    def __init__(self, check: Check, endpoint: Endpoint) -> None:
        self.ep = endpoint
        self._gate = threading.Event()
        self._gate.set()
        self._dropped = False
        self._skipped: set[str] = set()
        self._rollbacks: set[str] = set()
        self._lock = threading.Lock()
        original: Callable[[DeploymentOrder], None] = endpoint._deploy

        def deploy(order: DeploymentOrder) -> None:
            self._gate.wait(HOLD_LIMIT_S)
            if self._dropped or order.execution_id in self._skipped:
                return
            if order.action is OrderAction.ROLLBACK:
                with self._lock:
                    if order.execution_id in self._rollbacks:
                        return
                    self._rollbacks.add(order.execution_id)
                with endpoint._lock:
                    endpoint.executions.pop(order.execution_id, None)
            original(order)

        endpoint._deploy = deploy  # type: ignore[method-assign]
        check.cleanup(f"drop held orders of {endpoint.ident}", self.drop)

    @property
    def ident(self) -> str:
        return self.ep.ident

    @property
    def is_node(self) -> bool:
        return self.ep is self.ep.edge.node

    @property
    def held(self) -> bool:
        return not self._gate.is_set()

    def hold(self) -> None:
        self._gate.clear()

    def release(self) -> None:
        self._gate.set()

    def drop(self) -> None:
        self._dropped = True
        self._gate.set()

    def skip(self, execution_id: str) -> None:
        self._skipped.add(execution_id)

    def orders(self) -> list[DeploymentOrder]:
        """Every order any desired document this endpoint received carried."""
        return [o for d in list(self.ep.desired) for o in d.deployments]

    def ordered(self, execution_id: str, action: OrderAction = OrderAction.INSTALL) -> DeploymentOrder | None:
        return next((o for o in self.orders() if o.execution_id == execution_id and o.action is action), None)

    def holds(self, execution_id: str) -> bool:
        """Whether the latest desired document (highest ``deployments_version``) still carries the order."""
        docs = list(self.ep.desired)
        if not docs:
            return False
        latest = max(docs, key=lambda d: d.deployments_version)
        return any(o.execution_id == execution_id for o in latest.deployments)

    def report(self, execution_id: str, state: str, detail: str = "") -> None:
        """Publish an execution progress event on this endpoint's own events channel (forged or not)."""
        self.ep.event(EXECUTION_EVENT, {"execution_id": execution_id, "state": state, "detail": detail})


def node_agent(check: Check, labels: dict[str, str] | None = None) -> tuple[SimEdge, Agent]:
    edge = new_edge(check, labels=labels)
    return edge, Agent(check, edge.node)


def device_agents(check: Check, edge: SimEdge, n: int, labels: dict[str, str] | None = None) -> list[Agent]:
    return [Agent(check, new_device(check, edge, labels=labels)) for _ in range(n)]


# ---- REST helpers ------------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """Enum members as their values (readable evidence); lists and tuples element by element."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, list | tuple):
        return type(value)(_plain(v) for v in value)
    return value


def equal(check: Check, actual: Any, expected: Any, what: str) -> None:
    check.equal(_plain(actual), _plain(expected), what)


def _name(check: Check, what: str) -> str:
    return f"conf-{check.target.run_id}-{what}{next(_serial)}"


def _upload(check: Check, kind: str, name: str, version: str, fmt: str, data: bytes, token: str | None = "admin") -> httpx.Response:
    return check.target.call("POST", "/artifacts", token=token, data={"kind": kind, "name": name, "version": version, "format": fmt},
                             files={"file": (f"{name}-{version}", data, "application/octet-stream")})  # fmt: skip


def _forget_artifact(check: Check, artifact_id: str) -> None:
    r = check.target.call("DELETE", f"/artifacts/{artifact_id}")
    if r.status_code in (204, 404):
        return
    if r.status_code == 409 and r.json().get("code") == ErrorCode.ARTIFACT_IN_USE:
        return  # an ACTIVE execution keeps it (deployments cannot be deleted); named with the run id
    raise RuntimeError(f"DELETE /artifacts/{artifact_id}: HTTP {r.status_code} {r.text[:200]}")


def new_artifact(check: Check, kind: str = "model", fmt: str = "onnx", data: bytes | None = None, name: str | None = None,
                 version: str = "1.0.0") -> tuple[ArtifactPublic, bytes]:  # fmt: skip
    """Upload random bytes (a few KB) as an artefact; deleted after the case where nothing holds it."""
    data = os.urandom(4096) if data is None else data
    name = name or _name(check, kind[:3])
    r = _upload(check, kind, name, version, fmt, data)
    if r.status_code != 201:
        raise Unexpected(f"POST /artifacts {kind} {name} {version}: HTTP {r.status_code} {r.text[:300]}")
    art = ArtifactPublic.model_validate(r.json())
    check.cleanup(f"delete artifact {art.id}", lambda: _forget_artifact(check, art.id))
    return art, data


def _cancel_unless_final(check: Check, deployment_id: str) -> None:
    r = check.target.call("POST", f"/deployments/{deployment_id}/cancel")
    if r.status_code not in (200, 409):
        raise RuntimeError(f"cancel {deployment_id}: HTTP {r.status_code} {r.text[:200]}")


def deploy(check: Check, artifact_id: str, kind: str, ids: list[str] | None = None, selector: str | None = None, **options: Any) -> DeploymentDetail:
    """``POST /deployments`` (must be 201); canceled after the case unless it is final by then."""
    target: dict[str, Any] = {"kind": kind, **({"ids": ids} if ids is not None else {}), **({"selector": selector} if selector is not None else {})}
    options.setdefault("timeout_s", 120)
    r = check.target.call("POST", "/deployments", json={"artifact_id": artifact_id, "target": target, **options})
    if r.status_code != 201:
        raise Unexpected(f"POST /deployments: HTTP {r.status_code} {r.text[:400]}")
    dep = DeploymentDetail.model_validate(r.json())
    check.cleanup(f"cancel deployment {dep.id}", lambda: _cancel_unless_final(check, dep.id))
    return dep


def held_rollout(check: Check, n: int, strategy: dict[str, Any], held: int | None = None) -> tuple[list[Agent], DeploymentDetail]:
    """``n`` simulated devices under a new edge, the first ``held`` of them (all by default) holding their installs,
    and a deployment of a new model to them (in that order) with ``strategy``."""
    edge, _ = node_agent(check)
    agents = device_agents(check, edge, n)
    for a in agents[:held]:
        a.hold()
    art, _ = new_artifact(check, "model", "onnx")
    return agents, deploy(check, art.id, "device", ids=[a.ident for a in agents], strategy=strategy)


def get_dep(check: Check, deployment_id: str) -> DeploymentDetail:
    return check.target.ok("GET", f"/deployments/{deployment_id}", DeploymentDetail)  # type: ignore[no-any-return]


def execution(dep: DeploymentDetail, target_id: str) -> ExecutionPublic:
    found = [e for e in dep.executions if e.target_id == target_id]
    if len(found) != 1:
        raise Unexpected(f"deployment {dep.id}: {len(found)} executions for {target_id}")
    return found[0]


def wait_dep(check: Check, deployment_id: str, state: DeploymentState, timeout: float = PATIENCE_S) -> DeploymentDetail:
    """Poll until the deployment is ``state`` with nothing ROLLING_BACK."""
    last: list[DeploymentDetail] = []

    def reached() -> Any:
        dep = get_dep(check, deployment_id)
        last[:] = [dep]
        return dep.state is state and all(e.state is not _E.ROLLING_BACK for e in dep.executions) and dep

    try:
        return check.wait(reached, timeout, f"deployment {deployment_id} {state}")  # type: ignore[no-any-return]
    except AssertionError:
        dep = last[0] if last else None
        summary = dep and f"{dep.state} ({dep.reason}); " + ", ".join(f"{e.target_id}:{e.state}" for e in dep.executions)
        raise Unexpected(f"deployment {deployment_id} did not become {state} within {timeout:g} s; last: {summary}") from None


def wait_execution(check: Check, deployment_id: str, target_id: str, predicate: Callable[[ExecutionPublic], bool], what: str,
                   timeout: float = PATIENCE_S) -> ExecutionPublic:  # fmt: skip
    def seen() -> ExecutionPublic | None:
        e = execution(get_dep(check, deployment_id), target_id)
        return e if predicate(e) else None

    return check.wait(seen, timeout, what)  # type: ignore[no-any-return]


def released(e: ExecutionPublic) -> bool:
    return e.released_at is not None


def states(e: ExecutionPublic) -> list[str]:
    return [t.to_state.value for t in e.history]


def twin(check: Check, agent: Agent) -> Twin:
    path = f"/nodes/{agent.ident}/twin" if agent.is_node else f"/devices/{agent.ident}/twin"
    return check.target.ok("GET", path, Twin)  # type: ignore[no-any-return]


def reported_sha(check: Check, agent: Agent, kind: str) -> str | None:
    entry = twin(check, agent).reported.get(INSTALLED_KEY, {})
    return entry.get(kind, {}).get("sha256") if isinstance(entry, dict) and isinstance(entry.get(kind), dict) else None


def wait_installed(check: Check, agents: Iterable[Agent], art: ArtifactPublic, timeout: float = PATIENCE_S) -> None:
    """The hub's view of each target (its reported document) says it runs ``art``."""
    for agent in agents:
        check.wait(lambda a=agent: reported_sha(check, a, art.kind.value) == art.sha256, timeout,  # type: ignore[misc]
                   f"{agent.ident} reports installed {art.kind.value} {art.name} {art.version}")
    check.note(f"ok: the reported documents of {', '.join(a.ident for a in agents)} say installed {art.kind.value} = {art.name} {art.version} ({art.sha256[:12]}…)")


def wait_ordered(check: Check, agent: Agent, execution_id: str, action: OrderAction = OrderAction.INSTALL, timeout: float = PATIENCE_S) -> DeploymentOrder:
    return check.wait(lambda: agent.ordered(execution_id, action), timeout, f"{action.value} order {execution_id} in the desired document of {agent.ident}")  # type: ignore[no-any-return]


def action(check: Check, deployment_id: str, verb: str) -> httpx.Response:
    return check.target.call("POST", f"/deployments/{deployment_id}/{verb}")


def refused_move(check: Check, deployment_id: str, verb: str, current: DeploymentState) -> None:
    """``verb`` is refused with 409 illegal_transition naming ``current``, and the deployment stays there."""
    before = get_dep(check, deployment_id)
    doc = problem(action(check, deployment_id, verb), 409, ErrorCode.ILLEGAL_TRANSITION)
    equal(check, doc.current_state, current.value, f"{verb} of a {current} deployment: 409 illegal_transition with current_state")
    after = get_dep(check, deployment_id)
    equal(check, after.state, current, f"state after the refused {verb}")
    equal(check, [(e.id, e.state) for e in after.executions], [(e.id, e.state) for e in before.executions], f"executions after the refused {verb}")


def never_ordered(check: Check, agents: Iterable[Agent], execution_ids: Iterable[str], why: str) -> None:
    pairs = list(zip(agents, execution_ids, strict=True))
    check.stays(lambda: all(agent.ordered(xid) is None for agent, xid in pairs), SETTLE_S,
                ", ".join(f"{agent.ident} gets no order for {xid}" for agent, xid in pairs) + f" ({why})")  # fmt: skip


def handled(check: Check, agent: Agent) -> None:
    """Wait until the hub has handled what ``agent``'s connection (its edge's) carried so far: a report the hub
    applies, sent after those on the same channel, is seen applied (a held order of a fresh application artefact,
    reported DOWNLOADING by hand; then canceled and never carried out). A check that reports changed nothing then
    cannot pass only because they had not been read yet."""
    was_held = agent.held
    agent.hold()
    art, _ = new_artifact(check, "application", "tar.gz")
    dep = deploy(check, art.id, "node" if agent.is_node else "device", ids=[agent.ident])
    xid = execution(dep, agent.ident).id
    wait_ordered(check, agent, xid)
    agent.report(xid, "DOWNLOADING", "sent after the reports under test")
    wait_execution(check, dep.id, agent.ident, lambda e: e.state is _E.DOWNLOADING, f"{agent.ident}'s later report applied")
    _cancel_unless_final(check, dep.id)
    agent.skip(xid)
    if not was_held:
        agent.release()


# ---- 8.2.1 artefacts ---------------------------------------------------------------------------------


@case("8.2.1", "Upload gives a signed, content-addressed manifest that verifies with /signing-key.pub; Range downloads; duplicates and bad uploads are refused and change nothing")
def artifact_upload_signed_ranges(check: Check) -> None:
    target = check.target
    data = os.urandom(6000)
    name = _name(check, "art")
    r = _upload(check, "model", name, "1.0.0", "onnx", data)
    equal(check, r.status_code, 201, "POST /artifacts (multipart: kind, name, version, format, file) status")
    art = ArtifactPublic.model_validate(r.json())
    check.cleanup(f"delete artifact {art.id}", lambda: _forget_artifact(check, art.id))
    check.check(r.headers.get("location", "").endswith(f"/artifacts/{art.id}"), f"Location names the artefact: {r.headers.get('location')}")
    equal(check, art.sha256, hashlib.sha256(data).hexdigest(), "sha256 of the stored artefact (the SHA-256 of the uploaded bytes)")
    equal(check, (art.size, art.kind.value, art.name, art.version, art.format.value), (len(data), "model", name, "1.0.0", "onnx"), "size, kind, name, version, format")
    m = art.signed_manifest.manifest
    equal(check, (m.name, m.version, m.kind, m.format, m.sha256, m.size), (art.name, art.version, art.kind, art.format, art.sha256, art.size), "the manifest describes the artefact")

    # the signature
    pub = target.call("GET", "/signing-key.pub", token=None)
    equal(check, pub.status_code, 200, "GET /signing-key.pub without credentials")
    key = serialization.load_pem_public_key(pub.content)
    check.check(isinstance(key, Ed25519PublicKey), "the signing key is an Ed25519 public key")
    assert isinstance(key, Ed25519PublicKey)
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    equal(check, art.signed_manifest.key_id, hashlib.sha256(raw).hexdigest()[:16], "key_id (first 16 hex of the SHA-256 of the raw key)")
    signature = base64.b64decode(art.signed_manifest.signature)
    try:
        key.verify(signature, manifest_signing_bytes(m))
    except InvalidSignature:
        check.fail("the manifest's Ed25519 signature does not verify over manifest_signing_bytes with /signing-key.pub")
    check.note("ok: the Ed25519 signature verifies over manifest_signing_bytes(manifest)")
    forged = m.model_copy(update={"size": m.size + 1})
    try:
        key.verify(signature, manifest_signing_bytes(forged))
        check.fail("the signature also verifies over a manifest with another size: it does not bind the manifest")
    except InvalidSignature:
        check.note("ok: the same signature does not verify over a manifest with another size")

    # content and ranges
    full = target.call("GET", f"/artifacts/{art.id}/content")
    check.check(full.status_code == 200 and full.content == data, f"GET content: 200 with the uploaded bytes (HTTP {full.status_code}, {len(full.content)} bytes)")
    part = target.call("GET", f"/artifacts/{art.id}/content", headers={"Range": "bytes=1000-1999"})
    equal(check, part.status_code, 206, "Range bytes=1000-1999 status")
    check.check(part.content == data[1000:2000], f"the 206 carries bytes 1000..1999 ({len(part.content)} bytes)")
    equal(check, part.headers.get("content-range"), f"bytes 1000-1999/{len(data)}", "Content-Range of the 206")
    tail = target.call("GET", f"/artifacts/{art.id}/content", headers={"Range": "bytes=-100"})
    check.check(tail.status_code == 206 and tail.content == data[-100:], f"Range bytes=-100: 206 with the last 100 bytes (HTTP {tail.status_code})")
    outside = target.call("GET", f"/artifacts/{art.id}/content", headers={"Range": f"bytes={len(data)}-{len(data) + 10}"})
    problem(outside, 416, ErrorCode.RANGE_NOT_SATISFIABLE)
    equal(check, outside.headers.get("content-range"), f"bytes */{len(data)}", "a range past the end: 416 range_not_satisfiable with Content-Range")
    problem(target.call("GET", f"/artifacts/{art.id}/content", token=None), 401, ErrorCode.UNAUTHENTICATED)
    check.note("ok: content without credentials: 401 unauthenticated")
    forged_token = target.call("GET", f"/artifacts/{art.id}/content", token=None, headers={DOWNLOAD_TOKEN_HEADER: "e30.AAAA"})
    problem(forged_token, 401, ErrorCode.INVALID_DOWNLOAD_TOKEN)
    check.note("ok: content with a forged X-Download-Token: 401 invalid_download_token")

    # the same kind/name/version again
    dup = _upload(check, "model", name, "1.0.0", "onnx", os.urandom(5000))
    doc = problem(dup, 409, ErrorCode.ARTIFACT_EXISTS)
    equal(check, (doc.model_extra or {}).get("artifact_id"), art.id, "409 artifact_exists names the stored artefact")
    again = target.ok("GET", f"/artifacts/{art.id}", ArtifactPublic)
    equal(check, again.model_dump(mode="json"), art.model_dump(mode="json"), "GET /artifacts/{id} after the refused duplicate (unchanged)")
    check.check(target.call("GET", f"/artifacts/{art.id}/content").content == data, "the stored bytes are unchanged")
    listed = items(target, "/artifacts", kind="model", name=name)
    equal(check, [a["id"] for a in listed], [art.id], "GET /artifacts?kind=model&name= lists exactly the one artefact")
    equal(check, ArtifactPublic.model_validate(listed[0]).model_dump(mode="json"), art.model_dump(mode="json"), "the listed artefact")

    # refusals store nothing
    other = _name(check, "bad")
    problem(_upload(check, "model", other, "1.0.0", "onnx", data, token=None), 401, ErrorCode.UNAUTHENTICATED)
    check.note("ok: an upload without credentials: 401 unauthenticated")
    problem(_upload(check, "model", other, "v1", "onnx", data), 422, ErrorCode.VALIDATION_FAILED)
    check.note("ok: an upload with version 'v1': 422 validation_failed")
    problem(_upload(check, "weights", other, "1.0.0", "onnx", data), 422, ErrorCode.VALIDATION_FAILED)
    check.note("ok: an upload of kind 'weights': 422 validation_failed")
    equal(check, items(target, "/artifacts", name=other), [], f"artefacts named {other} after the refused uploads")
    problem(target.call("GET", f"/artifacts/{new_id('art')}"), 404, ErrorCode.NOT_FOUND)
    check.note("ok: GET of an unknown artefact: 404 not_found")


# ---- 6.1.2 d task images ------------------------------------------------------------------------------


@case("6.1.2.d", "Application (task image) artefacts are managed like models: uploaded, listed by kind, read, refused deletion while deployed, deleted when unused")
def application_images(check: Check) -> None:
    target = check.target
    spare, spare_data = new_artifact(check, "application", "tar.gz", os.urandom(3000))
    used, used_data = new_artifact(check, "application", "zip", os.urandom(2500))
    equal(check, (spare.kind.value, spare.format.value, spare.sha256), ("application", "tar.gz", hashlib.sha256(spare_data).hexdigest()),
                "the application artefact's kind, format, sha256")  # fmt: skip
    apps = items(target, "/artifacts", kind="application")
    check.check({spare.id, used.id} <= {a["id"] for a in apps} and all(a["kind"] == "application" for a in apps),
                f"GET /artifacts?kind=application lists both and only applications ({len(apps)} items)")  # fmt: skip
    equal(check, items(target, "/artifacts", kind="model", name=spare.name), [], "GET /artifacts?kind=model&name= (it is not a model)")
    equal(check, target.ok("GET", f"/artifacts/{spare.id}", ArtifactPublic).model_dump(mode="json"), spare.model_dump(mode="json"), "GET /artifacts/{id}")

    _, agent = node_agent(check)
    agent.hold()
    dep = deploy(check, used.id, "node", ids=[agent.ident])
    order = wait_ordered(check, agent, execution(dep, agent.ident).id)
    equal(check, (order.artifact_id, order.signed_manifest.manifest.kind.value), (used.id, "application"), "the application is ordered like a model")
    doc = problem(target.call("DELETE", f"/artifacts/{used.id}"), 409, ErrorCode.ARTIFACT_IN_USE)
    check.note(f"ok: DELETE while its deployment runs: 409 artifact_in_use ({(doc.model_extra or {}).get('reason')})")
    equal(check, target.ok("GET", f"/artifacts/{used.id}", ArtifactPublic).sha256, used.sha256, "the artefact after the refused deletion")
    check.check(target.call("GET", f"/artifacts/{used.id}/content").content == used_data, "its bytes after the refused deletion")
    equal(check, DeploymentPublic.model_validate(action(check, dep.id, "cancel").json()).state, _D.CANCELED, "its deployment canceled")

    r = target.call("DELETE", f"/artifacts/{spare.id}")
    equal(check, r.status_code, 204, "DELETE of the unused application artefact")
    problem(target.call("GET", f"/artifacts/{spare.id}"), 404, ErrorCode.NOT_FOUND)
    check.note("ok: GET after the deletion: 404 not_found")
    equal(check, items(target, "/artifacts", kind="application", name=spare.name), [], "the list after the deletion")
    problem(target.call("GET", f"/artifacts/{spare.id}/content"), 404, ErrorCode.NOT_FOUND)
    check.note("ok: its content after the deletion: 404 not_found")
    equal(check, target.ok("GET", f"/artifacts/{used.id}", ArtifactPublic).sha256, used.sha256, "the other application artefact is still there")


# ---- 8.2.2 deployments ----------------------------------------------------------------------------------


@case("8.2.2", "A deployment by ids to two edge nodes: orders in their desired documents, executions QUEUED … ACTIVE, SUCCEEDED, installed reported")
def deploy_by_ids(check: Check) -> None:
    agents = [node_agent(check)[1] for _ in range(2)]
    art, data = new_artifact(check, "model", "onnx")
    dep = deploy(check, art.id, "node", ids=[a.ident for a in agents], name=f"conf-{check.target.run_id}")
    check.check(dep.state in (_D.PENDING, _D.RUNNING), f"201 with state {dep.state}")
    equal(check, (dep.total, dep.batches, dep.artifact_id), (2, 1, art.id), "total, batches (all_at_once), artifact_id")
    equal(check, dep.artifact.model_dump(mode="json"), art.signed_manifest.manifest.model_dump(mode="json"), "the deployment's artefact manifest")
    equal(check, sorted(e.target_id for e in dep.executions), sorted(a.ident for a in agents), "one execution per target")
    check.check(all(e.history and e.history[0].from_state is None and e.history[0].to_state is _E.QUEUED for e in dep.executions),
                "every execution starts QUEUED (first history row from nothing)")  # fmt: skip
    for agent in agents:
        order = wait_ordered(check, agent, execution(dep, agent.ident).id)
        equal(check, (order.deployment_id, order.artifact_id, order.action), (dep.id, art.id, OrderAction.INSTALL), f"{agent.ident}'s order")
        equal(check, order.signed_manifest.model_dump(mode="json"), art.signed_manifest.model_dump(mode="json"), f"{agent.ident}'s order carries the signed manifest")
    done = wait_dep(check, dep.id, _D.SUCCEEDED)
    for agent in agents:
        e = execution(done, agent.ident)
        equal(check, states(e), INSTALL_PATH, f"{agent.ident}'s execution history")
        one = check.target.ok("GET", f"/deployments/{dep.id}/executions/{e.id}", ExecutionPublic)
        equal(check, (one.state, one.target_kind.value, one.target_id), (_E.ACTIVE, "node", agent.ident), "GET /deployments/{id}/executions/{xid}")
        equal(check, agent.ep.installed.get("model") and agent.ep.installed["model"].sha256, hashlib.sha256(data).hexdigest(), f"{agent.ident} verified and installed the bytes")
    equal(check, done.counts.get(_E.ACTIVE), 2, "counts[ACTIVE]")
    wait_installed(check, agents, art)
    check.check(dep.id in {d["id"] for d in items(check.target, "/deployments", state="SUCCEEDED")}, "GET /deployments?state=SUCCEEDED lists it")


@case("8.2.2", "Once its deployment is final the artefact may be deleted; the deployment stays readable, its artefact null")
def deleted_artifact_keeps_deployment(check: Check) -> None:
    _, agent = node_agent(check)
    art, _ = new_artifact(check, "application", "tar.gz")
    agent.hold()
    dep = deploy(check, art.id, "node", ids=[agent.ident])
    wait_ordered(check, agent, execution(dep, agent.ident).id)
    problem(check.target.call("DELETE", f"/artifacts/{art.id}"), 409, ErrorCode.ARTIFACT_IN_USE)
    check.note("ok: while the deployment runs the artefact is in use: 409 artifact_in_use")
    check.target.ok("POST", f"/deployments/{dep.id}/cancel")
    wait_dep(check, dep.id, _D.CANCELED)
    r = check.target.call("DELETE", f"/artifacts/{art.id}")
    check.check(r.status_code == 204, f"DELETE /artifacts/{{id}} after the deployment ended: HTTP {r.status_code}")
    kept = check.target.ok("GET", f"/deployments/{dep.id}", DeploymentDetail)
    equal(check, (kept.state, kept.artifact_id, kept.artifact), (_D.CANCELED, art.id, None), "the deployment read back: state, artifact_id, artifact")
    check.check(dep.id in {d["id"] for d in items(check.target, "/deployments", state="CANCELED")}, "GET /deployments still lists it")


@case("8.2.2", "A deployment by label selector to relayed devices reaches exactly the matching ones")
def deploy_by_selector(check: Check) -> None:
    edge, _ = node_agent(check)
    group = f"g{check.target.run_id}{next(_serial)}"
    matching = device_agents(check, edge, 2, labels={"conf-group": group})
    other = device_agents(check, edge, 1, labels={"conf-group": group + "x"})[0]
    art, _ = new_artifact(check, "model", "onnx")
    dep = deploy(check, art.id, "device", selector=f"{RUN_LABEL}={check.target.run_id},conf-group={group}")
    equal(check, sorted(e.target_id for e in dep.executions), sorted(a.ident for a in matching), "the selector resolved to the two labelled devices")
    equal(check, (dep.target.selector, dep.target.ids), (f"{RUN_LABEL}={check.target.run_id},conf-group={group}", None), "the deployment keeps its selector")
    for agent in matching:
        wait_ordered(check, agent, execution(dep, agent.ident).id)
    done = wait_dep(check, dep.id, _D.SUCCEEDED)
    check.check(all(states(e) == INSTALL_PATH for e in done.executions), "every execution went QUEUED … ACTIVE")
    wait_installed(check, matching, art)
    equal(check, other.orders(), [], f"{other.ident} (another label value) got no order")


@case("8.2.2", "Deployments naming an unknown artefact or target, or both ids and a selector, or without credentials, are refused and order nothing")
def deployment_refusals(check: Check) -> None:
    target = check.target
    _, agent = node_agent(check)
    art, _ = new_artifact(check, "model", "onnx")

    def post(body: dict[str, Any], token: str | None = "admin") -> httpx.Response:
        return target.call("POST", "/deployments", token=token, json=body)

    node_target = {"kind": "node", "ids": [agent.ident]}
    problem(post({"artifact_id": new_id("art"), "target": node_target}), 404, ErrorCode.NOT_FOUND)
    check.note("ok: an unknown artefact: 404 not_found")
    problem(post({"artifact_id": art.id, "target": {"kind": "node", "ids": [agent.ident, new_id("n")]}}), 422, ErrorCode.VALIDATION_FAILED)
    check.note("ok: an unknown target id among known ones: 422 validation_failed")
    problem(post({"artifact_id": art.id, "target": {"kind": "node", "ids": [agent.ident], "selector": f"{RUN_LABEL}={target.run_id}"}}), 422, ErrorCode.VALIDATION_FAILED)
    check.note("ok: both ids and a selector: 422 validation_failed")
    problem(post({"artifact_id": art.id, "target": {"kind": "node", "selector": f"{RUN_LABEL}={target.run_id},conf-none=x"}}), 422, ErrorCode.VALIDATION_FAILED)
    check.note("ok: a selector that matches nothing: 422 validation_failed")
    problem(post({"artifact_id": art.id, "target": node_target, "strategy": {"type": "rolling", "batch_size": 0}}), 422, ErrorCode.VALIDATION_FAILED)
    check.note("ok: rolling batch_size 0: 422 validation_failed")
    problem(post({"artifact_id": art.id, "target": node_target}, token=None), 401, ErrorCode.UNAUTHENTICATED)
    check.note("ok: without credentials: 401 unauthenticated")
    if target.viewer_token:
        problem(post({"artifact_id": art.id, "target": node_target}, token="viewer"), 403, ErrorCode.FORBIDDEN)
        check.note("ok: as viewer: 403 forbidden")
    check.stays(lambda: agent.orders() == [], SETTLE_S, f"no order in {agent.ident}'s desired documents after the refused requests")
    equal(check, agent.orders(), [], f"orders in {agent.ident}'s desired document after the refused requests")


# ---- 8.2.3 strategies ----------------------------------------------------------------------------------


@case("8.2.3", "rolling{batch_size: 1} over three devices releases one target at a time, each only after the one before is final")
def rolling_in_order(check: Check) -> None:
    agents, dep = held_rollout(check, 3, {"type": "rolling", "batch_size": 1})
    equal(check, dep.batches, 3, "batches")
    equal(check, [execution(dep, a.ident).batch for a in agents], [0, 1, 2], "batch of each target, in the order of the ids")
    for i, agent in enumerate(agents):
        xid = execution(dep, agent.ident).id
        wait_ordered(check, agent, xid)
        now = get_dep(check, dep.id)
        equal(check, now.current_batch, i, f"current_batch while target {i + 1} is held")
        if i + 1 < len(agents):  # the next batch must not follow while this one is in flight
            rest = agents[i + 1 :]
            check.stays(lambda rest=rest: all(not released(e) and e.state is _E.QUEUED for e in (execution(get_dep(check, dep.id), a.ident) for a in rest)),  # type: ignore[misc]
                        SETTLE_S, f"targets after {i + 1} are QUEUED and unreleased while it is in flight")  # fmt: skip
            check.check(all(not a.orders() for a in rest), f"targets after {i + 1} got no order yet")
        agent.release()
        wait_execution(check, dep.id, agent.ident, lambda e: e.state is _E.ACTIVE, f"target {i + 1} ACTIVE")
    done = wait_dep(check, dep.id, _D.SUCCEEDED)
    for first, second in pairwise(agents):
        active_at = next(t.at for t in execution(done, first.ident).history if t.to_state is _E.ACTIVE)
        released_at = execution(done, second.ident).released_at
        check.check(released_at is not None and released_at >= active_at,
                    f"{second.ident} released ({released_at}) after {first.ident} was ACTIVE ({active_at})")  # fmt: skip


@case("8.2.3", "canary{percent: 25, then all_at_once} over three devices: one canary first, the other two together once it is ACTIVE")
def canary_first(check: Check) -> None:
    agents, dep = held_rollout(check, 3, {"type": "canary", "percent": 25, "then": {"type": "all_at_once"}})
    equal(check, dep.batches, 2, "batches (canary, then the rest)")
    equal(check, [execution(dep, a.ident).batch for a in agents], [0, 1, 1], "batch of each target (batch 0 = the canary: ceil(3 x 25%) = 1)")
    canary, rest = agents[0], agents[1:]
    wait_ordered(check, canary, execution(dep, canary.ident).id)
    check.stays(lambda: (now := get_dep(check, dep.id)) and all(not released(execution(now, a.ident)) for a in rest) and all(not a.orders() for a in rest),
                SETTLE_S, "the rest are not released while the canary is in flight")  # fmt: skip
    canary.release()
    for a in rest:
        wait_ordered(check, a, execution(dep, a.ident).id)
    both = get_dep(check, dep.id)
    check.check(all(released(execution(both, a.ident)) and execution(both, a.ident).state is _E.QUEUED for a in rest),
                "after the canary is ACTIVE both others are released together (both held, neither reported)")  # fmt: skip
    for a in rest:
        a.release()
    done = wait_dep(check, dep.id, _D.SUCCEEDED)
    equal(check, done.counts.get(_E.ACTIVE), 3, "counts[ACTIVE]")


# ---- 8.2.4 control -------------------------------------------------------------------------------------


@case("8.2.4", "pause holds further batches (in-flight ones finish), resume releases them; pause of a paused, resume of a running, cancel of a succeeded one: 409 illegal_transition")
def pause_resume(check: Check) -> None:
    (first, second), dep = held_rollout(check, 2, {"type": "rolling", "batch_size": 1})
    wait_ordered(check, first, execution(dep, first.ident).id)
    r = action(check, dep.id, "pause")
    equal(check, r.status_code, 200, "POST pause of a RUNNING deployment")
    equal(check, DeploymentPublic.model_validate(r.json()).state, _D.PAUSED, "the answer's state")
    refused_move(check, dep.id, "pause", _D.PAUSED)
    first.release()
    wait_execution(check, dep.id, first.ident, lambda e: e.state is _E.ACTIVE, "the in-flight target finishes while PAUSED")
    paused = check.stays(lambda: (d := get_dep(check, dep.id)).state is _D.PAUSED and not released(execution(d, second.ident)) and not second.orders() and d,
                         SETTLE_S, "PAUSED after the first batch finished, the second target unreleased and without an order")  # fmt: skip
    equal(check, paused.state, _D.PAUSED, "state after the first batch finished")
    check.check(not released(execution(paused, second.ident)) and not second.orders(), "PAUSED releases nothing: the second target has no order")
    r = action(check, dep.id, "resume")
    equal(check, (r.status_code, DeploymentPublic.model_validate(r.json()).state), (200, _D.RUNNING), "POST resume of the PAUSED deployment")
    refused_move(check, dep.id, "resume", _D.RUNNING)
    wait_ordered(check, second, execution(dep, second.ident).id)
    second.release()
    wait_dep(check, dep.id, _D.SUCCEEDED)
    refused_move(check, dep.id, "cancel", _D.SUCCEEDED)
    refused_move(check, dep.id, "pause", _D.SUCCEEDED)
    problem(action(check, new_id("dep"), "pause"), 404, ErrorCode.NOT_FOUND)
    check.note("ok: pause of an unknown deployment: 404 not_found")


@case("8.2.4", "cancel: in-flight and unreleased executions become CANCELED, the order is withdrawn; late reports change nothing; a second cancel is refused")
def cancel_withdraws(check: Check) -> None:
    (first, second), dep = held_rollout(check, 2, {"type": "rolling", "batch_size": 1}, held=1)
    x1, x2 = execution(dep, first.ident).id, execution(dep, second.ident).id
    wait_ordered(check, first, x1)
    r = action(check, dep.id, "cancel")
    equal(check, (r.status_code, DeploymentPublic.model_validate(r.json()).state), (200, _D.CANCELED), "POST cancel of a RUNNING deployment")
    now = get_dep(check, dep.id)
    equal(check, [execution(now, a.ident).state for a in (first, second)], [_E.CANCELED, _E.CANCELED], "both executions (in flight, unreleased)")
    check.wait(lambda: not first.holds(x1), PATIENCE_S, f"the order withdrawn from {first.ident}'s desired document")
    check.note(f"ok: {first.ident}'s latest desired document no longer carries {x1}")
    history = execution(now, first.ident).history
    first.release()  # the held agent now carries out the order it got before the cancel and reports every step
    check.wait(lambda: first.ep.executions.get(x1) is _E.ACTIVE, PATIENCE_S, f"{first.ident} reported ACTIVE for the withdrawn order")
    handled(check, first)
    late = get_dep(check, dep.id)
    equal(check, (late.state, execution(late, first.ident).state), (_D.CANCELED, _E.CANCELED), "deployment and execution after the late reports")
    equal(check, len(execution(late, first.ident).history), len(history), "history rows after the late reports")
    never_ordered(check, [second], [x2], "canceled before release")
    refused_move(check, dep.id, "cancel", _D.CANCELED)
    refused_move(check, dep.id, "resume", _D.CANCELED)


def _install(check: Check, agents: list[Agent], art: ArtifactPublic) -> None:
    """Deploy ``art`` to the agents (nodes or devices, not mixed) and wait until the hub knows they run it."""
    kind = "node" if agents[0].is_node else "device"
    dep = deploy(check, art.id, kind, ids=[a.ident for a in agents])
    wait_dep(check, dep.id, _D.SUCCEEDED)
    wait_installed(check, agents, art)


@case("8.2.4", "rollback of a SUCCEEDED deployment orders the previous version back: ROLLING_BACK, ROLLED_BACK, the target runs the old one; a second rollback is refused")
def rollback_on_request(check: Check) -> None:
    _, agent = node_agent(check)
    name = _name(check, "rb")
    v1, _ = new_artifact(check, "model", "onnx", name=name, version="1.0.0")
    v2, _ = new_artifact(check, "model", "onnx", name=name, version="2.0.0")
    _install(check, [agent], v1)
    dep = deploy(check, v2.id, "node", ids=[agent.ident])
    done = wait_dep(check, dep.id, _D.SUCCEEDED)
    e = execution(done, agent.ident)
    equal(check, e.previous and (e.previous.sha256, e.previous.version), (v1.sha256, "1.0.0"), "the execution's previous (what it ran before)")
    wait_installed(check, [agent], v2)
    r = action(check, dep.id, "rollback")
    equal(check, r.status_code, 200, "POST rollback of a SUCCEEDED deployment")
    order = wait_ordered(check, agent, e.id, OrderAction.ROLLBACK)
    equal(check, (order.artifact_id, order.signed_manifest.manifest.sha256), (v1.id, v1.sha256), "the rollback order names the previous artefact")
    back = wait_dep(check, dep.id, _D.ROLLED_BACK)
    equal(check, states(execution(back, agent.ident)), [*INSTALL_PATH, _E.ROLLING_BACK, _E.ROLLED_BACK], "the execution's history")
    wait_installed(check, [agent], v1)
    refused_move(check, dep.id, "rollback", _D.ROLLED_BACK)
    refused_move(check, dep.id, "cancel", _D.ROLLED_BACK)


# ---- 8.2.5 failures ------------------------------------------------------------------------------------


@case("8.2.5", "failure_policy rollback: one target's install fails, the one already updated is rolled back, the deployment ends ROLLED_BACK")
def failure_rolls_back(check: Check) -> None:
    edge, _ = node_agent(check)
    good, bad = device_agents(check, edge, 2)
    name = _name(check, "fr")
    v1, _ = new_artifact(check, "model", "onnx", name=name, version="1.0.0")
    v2, _ = new_artifact(check, "model", "onnx", name=name, version="2.0.0")
    _install(check, [good, bad], v1)
    bad.ep.install_outcome = _E.FAILED
    dep = deploy(check, v2.id, "device", ids=[good.ident, bad.ident], strategy={"type": "rolling", "batch_size": 1},
                 max_failure_percent=0, failure_policy="rollback")  # fmt: skip
    back = wait_dep(check, dep.id, _D.ROLLED_BACK)
    check.note(f"deployment reason: {back.reason}")
    g, b = execution(back, good.ident), execution(back, bad.ident)
    equal(check, states(g), [*INSTALL_PATH, _E.ROLLING_BACK, _E.ROLLED_BACK], "the updated target's history (ACTIVE, then rolled back)")
    equal(check, states(b), [*INSTALL_PATH[:-1], _E.FAILED, _E.ROLLING_BACK, _E.ROLLED_BACK], "the failing target's history (FAILED, then rolled back)")
    for agent, e in ((good, g), (bad, b)):
        order = agent.ordered(e.id, OrderAction.ROLLBACK)
        check.check(order is not None and order.artifact_id == v1.id, f"{agent.ident} got a rollback order for the previous artefact {v1.id}")
    wait_installed(check, [good, bad], v1)


@case("8.2.5", "failure_policy halt: the first batch fails, the deployment is FAILED and the remaining target never ordered; under max_failure_percent the rollout goes on")
def failure_halts(check: Check) -> None:
    edge, _ = node_agent(check)
    bad, rest = device_agents(check, edge, 2)
    bad.ep.install_outcome = _E.FAILED
    name = _name(check, "fh")
    art, _ = new_artifact(check, "model", "onnx", name=name, version="1.0.0")
    dep = deploy(check, art.id, "device", ids=[bad.ident, rest.ident], strategy={"type": "rolling", "batch_size": 1},
                 max_failure_percent=0, failure_policy="halt")  # fmt: skip
    failed = wait_dep(check, dep.id, _D.FAILED)
    check.note(f"deployment reason: {failed.reason}")
    equal(check, execution(failed, bad.ident).state, _E.FAILED, "the failing target's execution")
    r = execution(failed, rest.ident)
    equal(check, (r.state, r.released_at), (_E.CANCELED, None), "the remaining target's execution (CANCELED, never released)")
    never_ordered(check, [rest], [r.id], "halted before its batch")
    refused_move(check, dep.id, "resume", _D.FAILED)

    art2, _ = new_artifact(check, "model", "onnx", name=name, version="1.1.0")
    dep2 = deploy(check, art2.id, "device", ids=[bad.ident, rest.ident], strategy={"type": "rolling", "batch_size": 1},
                  max_failure_percent=50, failure_policy="halt")  # fmt: skip
    done = wait_dep(check, dep2.id, _D.SUCCEEDED)
    equal(check, (execution(done, bad.ident).state, execution(done, rest.ident).state), (_E.FAILED, _E.ACTIVE),
                "with max_failure_percent 50, one failure of two (50%) does not stop the rollout")  # fmt: skip


# ---- 8.2.6 execution state machine -----------------------------------------------------------------------


@case("8.2.6", "Forged and out-of-order progress is ignored: another node's or device's claim, a report before release, a malformed state, a step back after ACTIVE")
def forged_progress(check: Check) -> None:
    _, victim = node_agent(check)
    edge2, other = node_agent(check)
    device = device_agents(check, edge2, 1)[0]
    victim.hold()
    art, _ = new_artifact(check, "model", "onnx")
    dep = deploy(check, art.id, "node", ids=[victim.ident, other.ident], strategy={"type": "rolling", "batch_size": 1})
    x1, x2 = execution(dep, victim.ident).id, execution(dep, other.ident).id
    wait_ordered(check, victim, x1)

    other.report(x1, "ACTIVE", "forged by another node")
    device.report(x1, "ACTIVE", "forged by a device of another node")
    other.report(x2, "ACTIVE", "its own execution, before it is released")
    victim.report(x1, "INSTALLED", "not a state")
    victim.report(new_id("x"), "ACTIVE", "an execution that does not exist")
    victim.report(x1, "DOWNLOADING", "the true report that follows the forged ones")
    wait_execution(check, dep.id, victim.ident, lambda e: e.state is _E.DOWNLOADING, "the true DOWNLOADING report applied")
    handled(check, other)  # the forged reports of other and device came on the other edge's connection
    now = get_dep(check, dep.id)
    equal(check, states(execution(now, victim.ident)), [_E.QUEUED, _E.DOWNLOADING], "the victim's history (no ACTIVE from the forged reports)")
    e2 = execution(now, other.ident)
    equal(check, (e2.state, e2.released_at, len(e2.history)), (_E.QUEUED, None, 1), "the unreleased execution after its early ACTIVE claim")
    equal(check, now.state, _D.RUNNING, "the deployment")

    victim.release()
    done = wait_dep(check, dep.id, _D.SUCCEEDED)
    e1 = execution(done, victim.ident)
    equal(check, states(e1), INSTALL_PATH, "the victim's history once it really installed")
    for step in ("DOWNLOADING", "INSTALLING", "QUEUED", "CANCELED"):
        victim.report(x1, step, "a step back after ACTIVE")
    handled(check, victim)
    after = get_dep(check, dep.id)
    equal(check, (after.state, execution(after, victim.ident).state), (_D.SUCCEEDED, _E.ACTIVE), "deployment and execution after the steps back")
    equal(check, states(execution(after, victim.ident)), INSTALL_PATH, "the history after the steps back (no new rows)")


# ---- 7.3.1 the standard: models to edges and devices ---------------------------------------------------------


@case("7.3.1.b.1", "A lightweight model deploys from the cloud to an edge node and to a device behind it; both report it installed")
def model_to_edge_and_device(check: Check) -> None:
    edge, node = node_agent(check)
    device = device_agents(check, edge, 1)[0]
    art, _ = new_artifact(check, "model", "tflite", os.urandom(2048))
    to_node = deploy(check, art.id, "node", ids=[node.ident])
    to_device = deploy(check, art.id, "device", ids=[device.ident])
    for dep, agent in ((to_node, node), (to_device, device)):
        done = wait_dep(check, dep.id, _D.SUCCEEDED)
        equal(check, states(execution(done, agent.ident)), INSTALL_PATH, f"{dep.target.kind.value} {agent.ident}: execution history")
    check.check(mqtt_topic_matches(own_subtree(Tier.NODE, edge.node_id), device.ep.topics.desired), f"the device's order came through its edge ({device.ep.topics.desired})")
    wait_installed(check, [node, device], art)


@case("7.3.1.e", "One graph format: the same ONNX artefact (same id, same SHA-256, same bytes) is ordered unconverted to an edge node and to a device")
def one_graph_format(check: Check) -> None:
    edge, node = node_agent(check)
    device = device_agents(check, edge, 1)[0]
    art, data = new_artifact(check, "model", "onnx")
    deps = [deploy(check, art.id, "node", ids=[node.ident]), deploy(check, art.id, "device", ids=[device.ident])]
    orders = []
    for dep, agent in zip(deps, (node, device), strict=True):
        order = wait_ordered(check, agent, execution(dep, agent.ident).id)
        orders.append(order)
        fetched = check.target.call("GET", order.path, token=None, headers={DOWNLOAD_TOKEN_HEADER: order.token})
        check.check(fetched.status_code == 200 and fetched.content == data, f"{agent.ident} downloads, with its order's token, exactly the uploaded bytes")
    n, d = orders
    equal(check, (d.artifact_id, d.signed_manifest.manifest.sha256, d.signed_manifest.manifest.format.value, d.path),
                (n.artifact_id, n.signed_manifest.manifest.sha256, "onnx", n.path), "the device's order vs the edge's (artefact, sha256, format, path)")  # fmt: skip
    equal(check, n.artifact_id, art.id, "both name the uploaded artefact")
    for dep in deps:
        wait_dep(check, dep.id, _D.SUCCEEDED)
    equal(check, (node.ep.installed["model"].sha256, device.ep.installed["model"].sha256), (art.sha256, art.sha256), "what each target verified and installed")
    equal(check, [a["id"] for a in items(check.target, "/artifacts", name=art.name)], [art.id], "artefacts of that name (no converted copy was made)")

