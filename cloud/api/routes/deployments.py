"""Deployment and update: /deployments (DESIGN §4.2). The rollout controller (cloud/rollout.py) does the releasing."""

from __future__ import annotations

from fastapi import APIRouter, Request, status

from cloud.api.deps import DEFAULT_PAGE, Cursor, IdempotencyKey, Limit, Operator, SessionDep, Viewer, poke_desired
from cloud.api.problems import PROBLEM_RESPONSES
from cloud.api.state import hub_state
from cloud.artifacts import prepare_deltas_in_background
from cloud.services import deployments as service
from interfaces.deployments import DeploymentAction, DeploymentCreate, DeploymentDetail, DeploymentPublic, DeploymentState, ExecutionPublic
from interfaces.pagination import Page

router = APIRouter(prefix="/deployments", tags=["deployments"], responses=PROBLEM_RESPONSES)


@router.post("", status_code=status.HTTP_201_CREATED)
def create_deployment(body: DeploymentCreate, request: Request, session: SessionDep, _: Operator, __: IdempotencyKey = None) -> DeploymentDetail:
    """Deploy an artefact to targets (ids or a label selector, resolved now) by a strategy; the rollout starts at once."""
    row = service.create(session, body)
    # the patches from what the targets run now are ready before their orders go out
    bases = [e.previous["sha256"] for e in service.executions(session, row.id) if e.previous and e.previous.get("sha256")]
    state = hub_state(request)
    prepare_deltas_in_background(state.engine, state.blobs, row.artifact_id, bases)
    return service.detail(session, row)


@router.get("")
def list_deployments(session: SessionDep, _: Viewer, state: DeploymentState | None = None, limit: Limit = DEFAULT_PAGE, cursor: Cursor = None) -> Page[DeploymentPublic]:
    """List deployments, oldest first, optionally in one state."""
    rows, next_cursor = service.list_deployments(session, state, limit, cursor)
    return Page[DeploymentPublic](items=service.to_wire(session, rows), next_cursor=next_cursor)


@router.get("/{deployment_id}")
def get_deployment(deployment_id: str, session: SessionDep, _: Viewer) -> DeploymentDetail:
    """A deployment's summary with every execution and its history."""
    return service.detail(session, service.get(session, deployment_id))


@router.get("/{deployment_id}/executions/{execution_id}")
def get_execution(deployment_id: str, execution_id: str, session: SessionDep, _: Viewer) -> ExecutionPublic:
    """One target's execution with its history."""
    return service.execution_detail(session, deployment_id, execution_id)


def _act(request: Request, session: SessionDep, deployment_id: str, action: DeploymentAction) -> DeploymentPublic:
    row = service.act(session, deployment_id, action)
    poke_desired(request)  # cancel withdraws orders
    return service.to_wire(session, [row])[0]


@router.post("/{deployment_id}/pause")
def pause_deployment(deployment_id: str, request: Request, session: SessionDep, _: Operator, __: IdempotencyKey = None) -> DeploymentPublic:
    """Stop releasing further targets (in-flight ones carry on). 409 illegal_transition with current_state if not PENDING or RUNNING."""
    return _act(request, session, deployment_id, DeploymentAction.PAUSE)


@router.post("/{deployment_id}/resume")
def resume_deployment(deployment_id: str, request: Request, session: SessionDep, _: Operator, __: IdempotencyKey = None) -> DeploymentPublic:
    """Continue a PAUSED deployment."""
    return _act(request, session, deployment_id, DeploymentAction.RESUME)


@router.post("/{deployment_id}/cancel")
def cancel_deployment(deployment_id: str, request: Request, session: SessionDep, _: Operator, __: IdempotencyKey = None) -> DeploymentPublic:
    """Cancel every queued and in-flight execution and withdraw its order; the deployment becomes CANCELED."""
    return _act(request, session, deployment_id, DeploymentAction.CANCEL)


@router.post("/{deployment_id}/rollback")
def rollback_deployment(deployment_id: str, request: Request, session: SessionDep, _: Operator, __: IdempotencyKey = None) -> DeploymentPublic:
    """Take every target that installed the artefact back to what it ran before; ROLLED_BACK when all are back."""
    return _act(request, session, deployment_id, DeploymentAction.ROLLBACK)
