"""Integrator tokens over the API (DESIGN §6): who the caller is (``GET /tokens/self``, any role), and for admins the
tokens themselves: create one bound to a role (its secret answered once, only its hash stored), list, revoke. The
same rows as ``aisynergy hub token``; a revoked token is refused at once by this hub (its cache forgets it) and by
other replicas within their token cache TTL. Also ``GET /summary``: the counts by state an overview shows."""

from __future__ import annotations

from fastapi import APIRouter, Request, status
from sqlalchemy import func, select

from cloud.api.deps import DEFAULT_PAGE, Admin, Cursor, IdempotencyKey, Limit, SessionDep, Viewer
from cloud.api.problems import PROBLEM_RESPONSES
from cloud.api.state import hub_state
from cloud.auth import create_api_token, revoke_api_token
from cloud.convert import utc
from cloud.errors import NotFound
from cloud.services.paging import page
from cloud.tables import ApiToken, Deployment, Device, Node, Task
from interfaces.auth import Caller, Role, Summary, TokenCreate, TokenIssued, TokenPublic
from interfaces.lifecycle import NodeState
from interfaces.pagination import Page

router = APIRouter(tags=["tokens"], responses=PROBLEM_RESPONSES)


def _public(row: ApiToken) -> TokenPublic:
    created = utc(row.created_at)
    assert created is not None
    return TokenPublic(id=row.id, role=Role(row.role), name=row.name, created_at=created, revoked_at=utc(row.revoked_at))


@router.get("/tokens/self")
def who_am_i(token: Viewer) -> Caller:
    """The presented token's id, role and name."""
    return Caller(id=token.id, role=Role(token.role), name=token.name)


@router.get("/tokens")
def list_tokens(session: SessionDep, _: Admin, limit: Limit = DEFAULT_PAGE, cursor: Cursor = None) -> Page[TokenPublic]:
    """Every token, in id order (revoked ones too, with when); never a secret."""
    rows, next_cursor = page(session, select(ApiToken), ApiToken.id, limit, cursor)
    return Page[TokenPublic](items=[_public(r) for r in rows], next_cursor=next_cursor)


@router.post("/tokens", status_code=status.HTTP_201_CREATED)
def create_token(body: TokenCreate, session: SessionDep, _: Admin, __: IdempotencyKey = None) -> TokenIssued:
    """A new token bound to ``role``; its secret is in this answer only."""
    row, secret = create_api_token(session, body.role, body.name)
    return TokenIssued(**_public(row).model_dump(), token=secret)


@router.delete("/tokens/{token_id}", status_code=status.HTTP_204_NO_CONTENT)
def revoke_token(token_id: str, request: Request, session: SessionDep, caller: Admin, __: IdempotencyKey = None) -> None:
    """Revoke a token (idempotent); it is refused from now on. An admin may revoke its own token too."""
    row = revoke_api_token(session, token_id)
    if row is None:
        raise NotFound(f"token {token_id} does not exist")
    hub_state(request).token_cache.forget(token_id)


@router.get("/summary")
def summary(session: SessionDep, _: Viewer) -> Summary:
    """Nodes, devices, deployments and tasks counted by state."""

    def counts(table: type, *where: object) -> dict[str, int]:
        query = select(table.state, func.count()).group_by(table.state)  # type: ignore[attr-defined]
        for clause in where:
            query = query.where(clause)  # type: ignore[arg-type]
        return {str(state): int(n) for state, n in session.execute(query).all()}

    return Summary(nodes=counts(Node, Node.state != NodeState.DELETED.value), devices=counts(Device), deployments=counts(Deployment), tasks=counts(Task))
