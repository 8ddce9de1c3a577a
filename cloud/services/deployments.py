"""Deployments and their per-target executions (DESIGN §4.2): creation, actions, progress reports, wire models.

Rules:

* **Creation** (``create``). The artefact must exist (404). Targets are resolved once: explicit ``ids`` must
  all exist and not be DELETED (422 listing the unknown ones); a ``selector`` runs in SQL over the labels.
  A target whose node is admin-state LOCKED (for a device: its edge's node) is refused: named by id, the
  request fails with 409 ``target_locked`` listing them; matched by selector, it is skipped and the
  deployment's ``reason`` says so. No target left is a 422. Targets are split into batches:
  ``all_at_once`` is one batch, ``rolling`` is ``ceil(n / batch_size)`` batches, ``canary`` is batch 0 of
  ``max(1, ceil(n * percent / 100))`` targets, then the rest as one batch or in rolling batches. Every
  execution starts QUEUED (a first history row from nothing) and remembers, as ``previous``, what its
  target reported it runs for the artefact's kind (``reported["installed"][kind]``): the rollback target.
* **Supersede.** A new deployment of an artefact kind cancels every unfinished (QUEUED .. INSTALLING)
  execution of an older deployment of that kind on the same target (reason ``superseded by <id>``) and
  sets the older deployment's ``superseded_by``; the target's order for that kind is replaced when the
  new deployment's batch is released.
* **Progress** (``apply_progress``). A target reports the latest state of an execution; missing steps are
  filled in along ``execution_path`` and every step is a history row. A report for an unknown execution,
  from another target, for an execution not released yet, or that the state machine refuses (a late
  report after a final state, say) is ignored and its outcome returned for the caller to count. The
  rollback moves (ACTIVE, FAILED or TIMED_OUT to ROLLING_BACK to ROLLED_BACK or ROLLBACK_FAILED) are legal
  after a final state.
* **Actions** (``act``). ``pause`` (PENDING or RUNNING): no more releases. ``resume`` (PAUSED). ``cancel``
  (PENDING, RUNNING, PAUSED): every QUEUED or in-flight execution becomes CANCELED and its order is
  withdrawn. ``rollback`` (RUNNING, PAUSED, SUCCEEDED, FAILED, CANCELED, once): unreleased executions are
  CANCELED and every released one that is ACTIVE, FAILED, TIMED_OUT or still in flight is marked for
  rollback; the rollout controller (cloud/rollout.py) orders the previous artefact back. An action the
  deployment's state refuses is a 409 ``illegal_transition`` with ``current_state``.

Batch releases, time-outs and the failure threshold belong to the rollout controller alone.

It stays one module: creation, reading, actions and progress reports apply the rules above to the same rows
(deployments, executions and their orders), and the rules read best in one place.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError
from sqlalchemy import func, select
from sqlmodel import Session

from cloud.convert import utc
from cloud.errors import BadRequest, Conflict, NotFound
from cloud.services.labels import selector_clause
from cloud.services.paging import page, parse_selector_or_400
from cloud.tables import Artifact, Deployment, Device, Execution, ExecutionTransitionRow, Node
from interfaces.deployments import (
    DEPLOYMENT_FINAL, DEPLOYMENT_TRANSITIONS, IN_FLIGHT, INSTALLED_KEY, AllAtOnce, ArtifactKind, Canary, DeploymentAction,
    DeploymentCreate, DeploymentDetail, DeploymentOrder, DeploymentPublic, DeploymentState, DeploymentTarget, ExecutionProgress,
    ExecutionPublic, ExecutionState, ExecutionTransition, FailurePolicy, IllegalExecutionTransition, InstalledArtifact,
    Rolling, Strategy, TargetKind, execution_path,
)  # fmt: skip
from interfaces.errors import ErrorCode
from interfaces.ids import is_id, new_id
from interfaces.lifecycle import AdminState, NodeState

log = logging.getLogger("aisynergy.hub.deployments")

_E = ExecutionState
ROLLBACK_FROM = frozenset({_E.ACTIVE, _E.FAILED, _E.TIMED_OUT})
"""Executions that a rollback order can take back (the target reports ROLLING_BACK when it starts)."""
ROLLBACK_DONE = frozenset({_E.ROLLED_BACK, _E.ROLLBACK_FAILED, _E.CANCELED, _E.REJECTED})
"""A rolled-back deployment has every execution in one of these."""
ACTIVE_DEPLOYMENT = frozenset({DeploymentState.PENDING, DeploymentState.RUNNING, DeploymentState.PAUSED})

# outcomes of apply_progress
APPLIED, UNCHANGED, UNKNOWN, WRONG_TARGET, NOT_RELEASED, ILLEGAL = "applied", "unchanged", "unknown", "wrong_target", "not_released", "illegal"


def now() -> datetime:
    return datetime.now(UTC)


def target_table(kind: TargetKind | str) -> Any:
    return Device if TargetKind(kind) is TargetKind.DEVICE else Node


# --- executions and orders -------------------------------------------------------------------------


def move(session: Session, execution: Execution, target: ExecutionState, reason: str, at: datetime, implied: bool = False) -> None:
    """Take ``execution`` to ``target`` along the legal path, one history row per step (raises if illegal)."""
    steps = execution_path(ExecutionState(execution.state), target)
    for i, step in enumerate(steps):
        why = "implied by a later report" if implied and i < len(steps) - 1 else reason
        session.add(ExecutionTransitionRow(execution_id=execution.id, from_state=execution.state, to_state=step.value, at=at, reason=why))
        execution.state = step.value
    execution.updated_at = at
    session.add(execution)


def order_kind(order: dict[str, Any]) -> str:
    return str(order.get("signed_manifest", {}).get("manifest", {}).get("kind", ""))


def put_order(session: Session, kind: TargetKind | str, target_id: str, order: DeploymentOrder) -> bool:
    """Make ``order`` the target's order for its artefact kind (replacing the old one); False if the target is gone."""
    row = session.get(target_table(kind), target_id, with_for_update=True)
    if row is None or row.state == NodeState.DELETED.value:
        return False
    doc = order.model_dump(mode="json")
    row.orders = [o for o in row.orders if order_kind(o) != order_kind(doc)] + [doc]
    row.orders_version += 1
    session.add(row)
    return True


def withdraw_order(session: Session, kind: TargetKind | str, target_id: str, execution_id: str) -> bool:
    """Remove the target's order of ``execution_id`` if it still holds one."""
    row = session.get(target_table(kind), target_id, with_for_update=True)
    if row is None:
        return False
    kept = [o for o in row.orders if o.get("execution_id") != execution_id]
    if len(kept) == len(row.orders):
        return False
    row.orders = kept
    row.orders_version += 1
    session.add(row)
    return True


def current_order(session: Session, kind: TargetKind | str, target_id: str, artifact_kind: str) -> dict[str, Any] | None:
    row = session.get(target_table(kind), target_id)
    if row is None:
        return None
    return next((o for o in row.orders if order_kind(o) == artifact_kind), None)


def installed(row: Any, artifact_kind: str) -> InstalledArtifact | None:
    """What a node or device reported it runs for ``artifact_kind`` (``reported["installed"][kind]``)."""
    entry = (row.reported or {}).get(INSTALLED_KEY, {})
    entry = entry.get(artifact_kind) if isinstance(entry, dict) else None
    if not isinstance(entry, dict):
        return None
    try:
        return InstalledArtifact.model_validate(entry)
    except ValidationError:
        return None


def apply_progress(session: Session, target_kind: TargetKind | str, target_id: str, progress: ExecutionProgress, at: datetime | None = None) -> str:
    """Apply one target's progress report to its execution (the caller commits); returns the outcome."""
    at = at or now()
    execution = session.get(Execution, progress.execution_id, with_for_update=True) if is_id(progress.execution_id) else None
    if execution is None:
        return UNKNOWN
    if execution.target_kind != TargetKind(target_kind).value or execution.target_id != target_id:
        return WRONG_TARGET
    if execution.released_at is None:
        return NOT_RELEASED
    if execution.state == progress.state.value:
        if progress.detail and progress.detail != execution.detail:
            execution.detail = progress.detail
            execution.updated_at = at
            session.add(execution)
        return UNCHANGED
    try:
        move(session, execution, progress.state, progress.detail or f"reported by {target_id}", at, implied=True)
    except IllegalExecutionTransition as exc:
        log.info("ignoring report of %s for execution %s: %s", target_id, execution.id, exc)
        return ILLEGAL
    execution.detail = progress.detail
    return APPLIED


# --- creation --------------------------------------------------------------------------------------


def plan_batches(n: int, strategy: Strategy) -> list[int]:
    """The batch sizes of ``n`` targets under ``strategy`` (they add up to ``n``)."""
    def rest(count: int, how: AllAtOnce | Rolling) -> list[int]:
        if count <= 0:
            return []
        if isinstance(how, Rolling):
            return [min(how.batch_size, count - start) for start in range(0, count, how.batch_size)]
        return [count]

    if isinstance(strategy, Canary):
        first = min(n, max(1, math.ceil(n * strategy.percent / 100)))
        return [first] + rest(n - first, strategy.then)
    return rest(n, strategy)


def _resolve_targets(session: Session, target: DeploymentTarget) -> tuple[list[Any], list[str]]:
    """The target rows (ids in the given order, selector matches by id) and the ids skipped as LOCKED."""
    table = target_table(target.kind)
    alive = table.state != NodeState.DELETED.value
    if target.ids is not None:
        found = {row.id: row for row in session.execute(select(table).where(table.id.in_(target.ids), alive)).scalars()}
        unknown = [i for i in target.ids if i not in found]
        if unknown:
            raise BadRequest(f"unknown targets: {', '.join(unknown[:20])}", status=422, unknown_ids=unknown)
        rows = [found[i] for i in target.ids]
    else:
        requirements = parse_selector_or_400(target.selector)
        rows = list(session.execute(select(table).where(alive, *selector_clause(table.id, requirements)).order_by(table.id)).scalars())
    node_ids = {row.node_id if target.kind is TargetKind.DEVICE else row.id for row in rows}
    locked_nodes = set(session.execute(
        select(Node.id).where(Node.id.in_(node_ids), Node.admin_state == AdminState.LOCKED.value)  # type: ignore[attr-defined]
    ).scalars()) if node_ids else set()  # fmt: skip
    locked = [row.id for row in rows if (row.node_id if target.kind is TargetKind.DEVICE else row.id) in locked_nodes]
    if locked and target.ids is not None:
        raise Conflict(f"targets on a LOCKED node: {', '.join(locked[:20])}", code=ErrorCode.TARGET_LOCKED, locked_ids=locked)
    return [row for row in rows if row.id not in set(locked)], locked


def create(session: Session, body: DeploymentCreate) -> Deployment:
    from cloud.artifacts.records import get_artifact  # the ingest imports this module; artefacts are only needed here

    artifact = get_artifact(session, body.artifact_id, lock=True)  # no deletion slips in before this commits
    if artifact.kind == ArtifactKind.DATASET.value:
        raise BadRequest(f"artefact {artifact.id} is a dataset: it is the input of a task (POST /tasks), not something to install", status=422)
    if artifact.kind == ArtifactKind.ALGORITHM.value:
        raise BadRequest(f"artefact {artifact.id} is an algorithm: training tasks run it on their sites (POST /tasks), it is not something to install", status=422)
    rows, locked = _resolve_targets(session, body.target)
    if not rows:
        why = f" ({len(locked)} on LOCKED nodes)" if locked else ""
        raise BadRequest(f"no target matches{why}", status=422)
    at = now()
    sizes = plan_batches(len(rows), body.strategy)
    deployment = Deployment(
        id=new_id("dep"), name=body.name, artifact_id=artifact.id, kind=artifact.kind,
        target=body.target.model_dump(mode="json", exclude_none=True), strategy=body.strategy.model_dump(mode="json"),
        max_failure_percent=body.max_failure_percent, failure_policy=body.failure_policy.value, timeout_s=body.timeout_s,
        allow_downgrade=body.allow_downgrade, state=DeploymentState.PENDING.value, batches=len(sizes), current_batch=0,
        reason=f"skipped {len(locked)} targets on LOCKED nodes: {', '.join(locked[:20])}" if locked else "",
        created_at=at, updated_at=at,
    )  # fmt: skip
    session.add(deployment)
    _supersede(session, deployment, [row.id for row in rows], at)
    batch_of = [b for b, size in enumerate(sizes) for _ in range(size)]
    for row, batch in zip(rows, batch_of, strict=True):
        previous = installed(row, artifact.kind)
        execution = Execution(
            id=new_id("x"), deployment_id=deployment.id, target_kind=body.target.kind.value, target_id=row.id, batch=batch,
            state=ExecutionState.QUEUED.value, previous=previous.model_dump(mode="json") if previous else None, updated_at=at,
        )  # fmt: skip
        session.add(execution)
        session.add(ExecutionTransitionRow(execution_id=execution.id, from_state=None, to_state=ExecutionState.QUEUED.value, at=at, reason="created"))
    session.commit()
    log.info("deployment %s of %s %s to %d targets in %d batches", deployment.id, artifact.name, artifact.version, len(rows), len(sizes))
    return deployment


def _supersede(session: Session, deployment: Deployment, target_ids: list[str], at: datetime) -> None:
    kind = TargetKind(deployment.target["kind"]).value
    older = session.execute(
        select(Execution).join(Deployment, Deployment.id == Execution.deployment_id).where(  # type: ignore[arg-type]
            Deployment.kind == deployment.kind, Deployment.id != deployment.id, Execution.target_kind == kind,
            Execution.target_id.in_(target_ids), Execution.state.in_([s.value for s in IN_FLIGHT]),  # type: ignore[attr-defined]
        )
    ).scalars().all()  # fmt: skip
    touched: set[str] = set()
    for execution in older:
        move(session, execution, ExecutionState.CANCELED, f"superseded by {deployment.id}", at)
        touched.add(execution.deployment_id)
    for dep_id in touched:
        old = session.get(Deployment, dep_id)
        assert old is not None
        old.superseded_by = deployment.id
        old.updated_at = at
        session.add(old)


# --- reading ---------------------------------------------------------------------------------------


def get(session: Session, deployment_id: str) -> Deployment:
    row = session.get(Deployment, deployment_id) if is_id(deployment_id) else None
    if row is None:
        raise NotFound(f"deployment {deployment_id} does not exist")
    return row


def get_execution(session: Session, deployment_id: str, execution_id: str) -> Execution:
    get(session, deployment_id)
    row = session.get(Execution, execution_id) if is_id(execution_id) else None
    if row is None or row.deployment_id != deployment_id:
        raise NotFound(f"execution {execution_id} of deployment {deployment_id} does not exist")
    return row


def list_deployments(session: Session, state: DeploymentState | None, limit: int, cursor: str | None) -> tuple[list[Deployment], str | None]:
    query = select(Deployment)
    if state is not None:
        query = query.where(Deployment.state == state.value)
    return page(session, query, Deployment.id, limit, cursor)


def executions(session: Session, deployment_id: str) -> list[Execution]:
    query = select(Execution).where(Execution.deployment_id == deployment_id).order_by(Execution.batch, Execution.id)
    return list(session.execute(query).scalars())


def history(session: Session, execution_ids: list[str]) -> dict[str, list[ExecutionTransitionRow]]:
    out: dict[str, list[ExecutionTransitionRow]] = defaultdict(list)
    for start in range(0, len(execution_ids), 500):
        chunk = execution_ids[start : start + 500]
        query = select(ExecutionTransitionRow).where(ExecutionTransitionRow.execution_id.in_(chunk)).order_by(ExecutionTransitionRow.id)  # type: ignore[attr-defined]
        for row in session.execute(query).scalars():
            out[row.execution_id].append(row)
    return out


def counts(session: Session, deployment_ids: list[str]) -> dict[str, dict[ExecutionState, int]]:
    out: dict[str, dict[ExecutionState, int]] = defaultdict(dict)
    if deployment_ids:
        query = select(Execution.deployment_id, Execution.state, func.count()).where(Execution.deployment_id.in_(deployment_ids))  # type: ignore[attr-defined]
        for dep_id, state, n in session.execute(query.group_by(Execution.deployment_id, Execution.state)).all():
            out[dep_id][ExecutionState(state)] = n
    return out


def execution_to_wire(row: Execution, transitions: list[ExecutionTransitionRow] | None = None) -> ExecutionPublic:
    return ExecutionPublic(
        id=row.id, deployment_id=row.deployment_id, target_kind=TargetKind(row.target_kind), target_id=row.target_id,
        state=ExecutionState(row.state), batch=row.batch, released_at=utc(row.released_at),
        previous=InstalledArtifact.model_validate(row.previous) if row.previous else None, delta=row.delta, detail=row.detail,
        updated_at=utc(row.updated_at),  # type: ignore[arg-type]
        history=[
            ExecutionTransition(from_state=ExecutionState(t.from_state) if t.from_state else None, to_state=ExecutionState(t.to_state), at=utc(t.at), reason=t.reason)  # type: ignore[arg-type]
            for t in transitions or []
        ],
    )  # fmt: skip


def to_wire(session: Session, rows: list[Deployment]) -> list[DeploymentPublic]:
    from cloud.artifacts.records import artifact_manifest

    per_state = counts(session, [r.id for r in rows])
    artifacts = {a.id: a for a in session.execute(select(Artifact).where(Artifact.id.in_({r.artifact_id for r in rows}))).scalars()} if rows else {}  # type: ignore[attr-defined]
    out = []
    for row in rows:
        c = per_state.get(row.id, {})
        out.append(DeploymentPublic(
            id=row.id, name=row.name, artifact_id=row.artifact_id, artifact=artifact_manifest(artifacts[row.artifact_id]) if row.artifact_id in artifacts else None,
            target=DeploymentTarget.model_validate(row.target), strategy=row.strategy,  # type: ignore[arg-type]
            max_failure_percent=row.max_failure_percent, failure_policy=FailurePolicy(row.failure_policy), timeout_s=row.timeout_s,
            allow_downgrade=row.allow_downgrade, state=DeploymentState(row.state), reason=row.reason, superseded_by=row.superseded_by,
            counts={s: c.get(s, 0) for s in ExecutionState}, total=sum(c.values()), batches=row.batches, current_batch=row.current_batch,
            created_at=utc(row.created_at), updated_at=utc(row.updated_at),  # type: ignore[arg-type]
        ))  # fmt: skip
    return out


def detail(session: Session, row: Deployment) -> DeploymentDetail:
    public = to_wire(session, [row])[0]
    rows = executions(session, row.id)
    transitions = history(session, [e.id for e in rows])
    return DeploymentDetail(**public.model_dump(), executions=[execution_to_wire(e, transitions.get(e.id, [])) for e in rows])


def execution_detail(session: Session, deployment_id: str, execution_id: str) -> ExecutionPublic:
    row = get_execution(session, deployment_id, execution_id)
    return execution_to_wire(row, history(session, [row.id]).get(row.id, []))


# --- actions ---------------------------------------------------------------------------------------


def set_state(deployment: Deployment, target: DeploymentState, reason: str | None, at: datetime) -> None:
    deployment.state = target.value
    if reason is not None:
        deployment.reason = reason
    deployment.updated_at = at


def cancel_unreleased(session: Session, rows: list[Execution], reason: str, at: datetime) -> None:
    for e in rows:
        if e.state == ExecutionState.QUEUED.value and e.released_at is None:
            move(session, e, ExecutionState.CANCELED, reason, at)


def start_rollback(session: Session, deployment: Deployment, rows: list[Execution], reason: str, at: datetime) -> None:
    """Cancel what was not released; mark every released execution that can still be taken back."""
    cancel_unreleased(session, rows, reason, at)
    marked = 0
    for e in rows:
        state = ExecutionState(e.state)
        if e.released_at is not None and (state in ROLLBACK_FROM or state in IN_FLIGHT or state is ExecutionState.ROLLING_BACK):
            e.rollback_requested = True
            e.updated_at = at
            session.add(e)
            marked += 1
    deployment.reason = reason
    deployment.updated_at = at
    if not marked:
        set_state(deployment, DeploymentState.ROLLED_BACK, f"{reason}; nothing was installed", at)
    session.add(deployment)


def rolling_back(rows: list[Execution]) -> bool:
    return any(e.rollback_requested for e in rows)


def act(session: Session, deployment_id: str, action: DeploymentAction) -> Deployment:
    deployment = session.get(Deployment, deployment_id, with_for_update=True) if is_id(deployment_id) else None
    if deployment is None:
        raise NotFound(f"deployment {deployment_id} does not exist")
    current = DeploymentState(deployment.state)
    rows = executions(session, deployment.id)
    at = now()
    target = {
        DeploymentAction.PAUSE: DeploymentState.PAUSED, DeploymentAction.RESUME: DeploymentState.RUNNING,
        DeploymentAction.CANCEL: DeploymentState.CANCELED, DeploymentAction.ROLLBACK: DeploymentState.ROLLED_BACK,
    }[action]  # fmt: skip
    allowed = target in DEPLOYMENT_TRANSITIONS[current]
    if action is DeploymentAction.PAUSE:
        allowed = current in (DeploymentState.PENDING, DeploymentState.RUNNING)
    elif action is DeploymentAction.RESUME:
        allowed = current is DeploymentState.PAUSED
    elif action is DeploymentAction.CANCEL:
        allowed = current in ACTIVE_DEPLOYMENT
    if allowed and rolling_back(rows) and action is not DeploymentAction.PAUSE:
        allowed = False  # a rollback runs to its end
    if not allowed:
        raise Conflict(f"cannot {action.value} a deployment that is {current.value}" + (" (rolling back)" if rolling_back(rows) else ""),
                       code=ErrorCode.ILLEGAL_TRANSITION, current_state=current.value)  # fmt: skip
    if action is DeploymentAction.PAUSE:
        set_state(deployment, DeploymentState.PAUSED, None, at)
    elif action is DeploymentAction.RESUME:
        set_state(deployment, DeploymentState.RUNNING, None, at)
    elif action is DeploymentAction.CANCEL:
        for e in rows:
            if ExecutionState(e.state) in IN_FLIGHT:
                if e.released_at is not None:
                    withdraw_order(session, e.target_kind, e.target_id, e.id)
                move(session, e, ExecutionState.CANCELED, "deployment canceled", at)
        set_state(deployment, DeploymentState.CANCELED, "canceled by integrator", at)
    else:
        start_rollback(session, deployment, rows, "rollback requested by integrator", at)
    session.add(deployment)
    session.commit()
    log.info("deployment %s: %s (was %s, now %s)", deployment.id, action.value, current.value, deployment.state)
    return deployment


def is_final(row: Deployment) -> bool:
    return DeploymentState(row.state) in DEPLOYMENT_FINAL

