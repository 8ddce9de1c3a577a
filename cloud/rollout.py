"""The rollout controller: drives every unfinished deployment from the database (DESIGN §4.2).

``RolloutController.tick()`` runs every ``rollout_interval_s`` on the one hub replica that holds the
``rollout`` lease. Every decision is derived from the rows alone (deployment state, ``current_batch``,
each execution's state, ``released_at``, ``deadline_at``, ``rollback_requested`` and the target's orders),
so a tick may run twice, or on a freshly started hub in the middle of a rollout, and it does the same
thing: it resumes where the last one stopped and never orders an execution twice.

One tick, per deployment (each in its own transaction):

1. PENDING becomes RUNNING.
2. A released execution still in flight past its ``deadline_at`` becomes TIMED_OUT and its order is
   withdrawn from the target's desired document.
3. Failure share = failed executions / all executions * 100, where failed is a state in
   ``EXECUTION_FAILURES`` or ROLLED_BACK on the target's own (a firmware slot that did not confirm: it
   failed, then went back, without this deployment asking for a rollback). Above
   ``max_failure_percent``: policy ``halt`` cancels the unreleased executions and fails the deployment;
   policy ``rollback`` cancels the unreleased executions and marks every released one for rollback.
4. Rolling back: an execution marked for rollback that is ACTIVE, FAILED or TIMED_OUT gets a rollback
   order (same execution id, action ``rollback``, the artefact whose SHA-256 is ``previous.sha256``,
   downgrade allowed) with a fresh deadline; none known gives ROLLBACK_FAILED with the reason, and so
   does a rollback that is not reported done by its deadline. When every execution is ROLLED_BACK,
   ROLLBACK_FAILED, CANCELED or REJECTED the deployment is ROLLED_BACK.
5. RUNNING: every QUEUED execution of ``current_batch`` is released (its order, with a download token
   and, when the target runs other bytes of that kind, a delta offer, goes into the target's ``orders``
   and ``orders_version`` goes up; ``released_at`` and ``deadline_at = now + timeout_s`` are set). When
   every execution of the batch is in ``EXECUTION_FINAL`` the next batch follows; after the last one the
   deployment is SUCCEEDED. PAUSED releases nothing (time-outs and the threshold still apply).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import and_, or_, select
from sqlalchemy.engine import Engine
from sqlmodel import Session

from cloud.artifacts.deltas import offer_delta
from cloud.artifacts.records import find_by_sha256, signed_manifest
from cloud.lease import drive_each
from cloud.convert import utc
from cloud.services import deployments as svc
from cloud.signing import SigningKey
from cloud.tables import Artifact, Deployment, Execution
from interfaces.deployments import (
    EXECUTION_FAILURES, EXECUTION_FINAL, IN_FLIGHT, DeploymentOrder, DeploymentState, ExecutionState, FailurePolicy, InstalledArtifact,
    OrderAction,
)  # fmt: skip
from interfaces.lifecycle import NodeState

log = logging.getLogger("aisynergy.hub.rollout")
TOKEN_GRACE_S = 3600
_E = ExecutionState


class RolloutController:
    def __init__(self, engine: Engine, signing: SigningKey, blobs: Any = None, on_change: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.signing = signing
        self.blobs = blobs
        self.on_change = on_change
        self.counters: dict[str, int] = {"ticks": 0, "released": 0, "timed_out": 0, "rollback_orders": 0}

    def tick(self, at: datetime | None = None) -> int:
        """Drive every unfinished deployment one step; returns how many deployments changed."""
        at = at or datetime.now(UTC)
        with Session(self.engine) as session:
            rolling = select(Execution.deployment_id).where(Execution.rollback_requested.is_(True))  # type: ignore[attr-defined]
            ids = list(session.execute(
                select(Deployment.id).where(or_(
                    Deployment.state.in_([s.value for s in svc.ACTIVE_DEPLOYMENT]),  # type: ignore[attr-defined]
                    and_(Deployment.state != DeploymentState.ROLLED_BACK.value, Deployment.id.in_(rolling)),  # type: ignore[attr-defined]
                )).order_by(Deployment.id)
            ).scalars())  # fmt: skip
        changed = drive_each(self.engine, ids, self._drive, at, self.on_change, "rollout of deployment", log)
        self.counters["ticks"] += 1
        return changed

    # --- one deployment ----------------------------------------------------------------------------

    def _drive(self, session: Session, dep_id: str, at: datetime) -> tuple[bool, bool]:
        deployment = session.get(Deployment, dep_id, with_for_update=True)
        if deployment is None:
            return False, False
        rows = list(session.execute(
            select(Execution).where(Execution.deployment_id == dep_id).order_by(Execution.id).with_for_update()
        ).scalars())  # fmt: skip
        before = (deployment.state, deployment.current_batch, deployment.reason)
        self._changed = False
        self._orders = False
        state = DeploymentState(deployment.state)
        if state is DeploymentState.PENDING:
            svc.set_state(deployment, DeploymentState.RUNNING, None, at)
            state = DeploymentState.RUNNING
        self._time_out(session, deployment, rows, at)
        rolling_back = svc.rolling_back(rows)
        if not rolling_back and state in svc.ACTIVE_DEPLOYMENT and self._breached(deployment, rows):
            share = _failure_share(rows)
            reason = f"{share:.4g}% of targets failed (more than {deployment.max_failure_percent:g}%)"
            if FailurePolicy(deployment.failure_policy) is FailurePolicy.HALT:
                svc.cancel_unreleased(session, rows, f"halted: {reason}", at)
                svc.set_state(deployment, DeploymentState.FAILED, f"halted: {reason}", at)
            else:
                svc.start_rollback(session, deployment, rows, f"rolling back: {reason}", at)
            rolling_back = svc.rolling_back(rows)
            state = DeploymentState(deployment.state)
        if rolling_back:
            self._roll_back(session, deployment, rows, at)
        elif state is DeploymentState.RUNNING:
            self._advance(session, deployment, rows, at)
        session.add(deployment)
        changed = self._changed or before != (deployment.state, deployment.current_batch, deployment.reason)
        if before[0] != deployment.state:
            log.info("deployment %s: %s -> %s %s", dep_id, before[0], deployment.state, deployment.reason)
        return changed, self._orders

    def _breached(self, deployment: Deployment, rows: list[Execution]) -> bool:
        return _failure_share(rows) > deployment.max_failure_percent

    def _time_out(self, session: Session, deployment: Deployment, rows: list[Execution], at: datetime) -> None:
        for e in rows:
            deadline = utc(e.deadline_at)
            if e.released_at is None or deadline is None or deadline > at:
                continue
            state = _E(e.state)
            if state in IN_FLIGHT:
                svc.move(session, e, _E.TIMED_OUT, f"no ACTIVE report within {deployment.timeout_s} s", at)
                self._orders |= svc.withdraw_order(session, e.target_kind, e.target_id, e.id)
                self.counters["timed_out"] += 1
                self._changed = True
            elif e.rollback_requested and state in (svc.ROLLBACK_FROM | {_E.ROLLING_BACK}) and self._rollback_ordered(session, deployment, e):
                svc.move(session, e, _E.ROLLBACK_FAILED, f"no rollback report within {deployment.timeout_s} s", at)
                self._changed = True

    def _rollback_ordered(self, session: Session, deployment: Deployment, e: Execution) -> bool:
        order = svc.current_order(session, e.target_kind, e.target_id, deployment.kind)
        return order is not None and order.get("execution_id") == e.id and order.get("action") == OrderAction.ROLLBACK.value

    def _roll_back(self, session: Session, deployment: Deployment, rows: list[Execution], at: datetime) -> None:
        for e in rows:
            if not e.rollback_requested or _E(e.state) not in svc.ROLLBACK_FROM:
                continue
            order = svc.current_order(session, e.target_kind, e.target_id, deployment.kind)
            if order is not None and order.get("execution_id") == e.id and order.get("action") == OrderAction.ROLLBACK.value:
                continue  # ordered already; waiting for the target
            if order is not None and order.get("execution_id") != e.id:
                svc.move(session, e, _E.ROLLBACK_FAILED, f"the target's {deployment.kind} order now belongs to deployment {order.get('deployment_id')}", at)
                self._changed = True
                continue
            previous = InstalledArtifact.model_validate(e.previous) if e.previous else None
            artifact = find_by_sha256(session, previous.sha256, deployment.kind) if previous else None
            if artifact is None:
                why = f"the hub holds no artefact with SHA-256 {previous.sha256}" if previous else "the target reported no previous version"
                svc.move(session, e, _E.ROLLBACK_FAILED, f"cannot roll back: {why}", at)
                self._changed = True
                continue
            current = session.get(Artifact, deployment.artifact_id)
            order_doc = self._order(session, e, artifact, OrderAction.ROLLBACK, True, deployment.timeout_s, base_sha256=current.sha256 if current else None)
            if svc.put_order(session, e.target_kind, e.target_id, order_doc):
                e.deadline_at = at + timedelta(seconds=deployment.timeout_s)
                e.updated_at = at
                session.add(e)
                self._orders = True
                self.counters["rollback_orders"] += 1
            else:
                svc.move(session, e, _E.ROLLBACK_FAILED, "the target was deleted", at)
            self._changed = True
        if all(_E(e.state) in svc.ROLLBACK_DONE for e in rows):
            svc.set_state(deployment, DeploymentState.ROLLED_BACK, deployment.reason or "rolled back", at)

    def _advance(self, session: Session, deployment: Deployment, rows: list[Execution], at: datetime) -> None:
        artifact = session.get(Artifact, deployment.artifact_id)
        while True:
            batch = [e for e in rows if e.batch == deployment.current_batch]
            for e in batch:
                if e.state == _E.QUEUED.value and e.released_at is None:
                    self._release(session, deployment, artifact, e, at)
            if not all(_E(e.state) in EXECUTION_FINAL for e in batch):
                return
            if deployment.current_batch + 1 >= deployment.batches:
                done = sum(1 for e in rows if e.state == _E.ACTIVE.value)
                svc.set_state(deployment, DeploymentState.SUCCEEDED, f"{done} of {len(rows)} targets ACTIVE", at)
                return
            deployment.current_batch += 1
            deployment.updated_at = at

    def _release(self, session: Session, deployment: Deployment, artifact: Artifact | None, e: Execution, at: datetime) -> None:
        self._changed = True
        target = session.get(svc.target_table(e.target_kind), e.target_id)
        if artifact is None or target is None or target.state == NodeState.DELETED.value:
            svc.move(session, e, _E.CANCELED, "the artefact is gone" if artifact is None else "the target was deleted", at)
            return
        running = svc.installed(target, deployment.kind)
        base = running.sha256 if running is not None and running.sha256 != artifact.sha256 else None
        order = self._order(session, e, artifact, OrderAction.INSTALL, deployment.allow_downgrade, deployment.timeout_s, base_sha256=base)
        svc.put_order(session, e.target_kind, e.target_id, order)
        e.released_at = at
        e.deadline_at = at + timedelta(seconds=deployment.timeout_s)
        e.delta = order.delta is not None
        e.updated_at = at
        session.add(e)
        self._orders = True
        self.counters["released"] += 1

    def _order(self, session: Session, e: Execution, artifact: Artifact, action: OrderAction, allow_downgrade: bool, timeout_s: int,
               base_sha256: str | None) -> DeploymentOrder:  # fmt: skip
        delta = None
        base_sha256 = base_sha256 if base_sha256 != artifact.sha256 else None
        if base_sha256 and self.blobs is not None:
            try:
                delta = offer_delta(session, self.blobs, base_sha256, artifact)
            except Exception:  # noqa: BLE001 - a delta is an optimisation; the full artefact always works
                log.exception("no delta from %s to artefact %s", base_sha256, artifact.id)
        return DeploymentOrder(
            execution_id=e.id, deployment_id=e.deployment_id, action=action, artifact_id=artifact.id, signed_manifest=signed_manifest(artifact, self.signing),
            path=f"/artifacts/{artifact.id}/content", delta=delta, allow_downgrade=allow_downgrade,
            token=self.signing.issue_download_token(artifact.id, artifact.sha256, e.target_id, ttl_s=timeout_s + TOKEN_GRACE_S, base_sha256=base_sha256 or None),
        )  # fmt: skip


def _failure_share(rows: list[Execution]) -> float:
    if not rows:
        return 0.0
    return sum(1 for e in rows if _failed(e)) / len(rows) * 100


def _failed(e: Execution) -> bool:
    state = _E(e.state)
    return state in EXECUTION_FAILURES or (state is _E.ROLLED_BACK and not e.rollback_requested)
