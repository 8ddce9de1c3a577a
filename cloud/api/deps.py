"""Dependencies shared by the routes (``SessionDep``, ``require(role)``, ...)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from typing import Annotated, TypeVar

from fastapi import Depends, Header, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlmodel import Session

from cloud.auth import TokenCache, TokenIdentity
from cloud.config import Settings
from cloud.errors import Forbidden, Unauthenticated
from cloud.pki import CertificateAuthority
from interfaces.auth import Role
from interfaces.pagination import DEFAULT_LIMIT, MAX_LIMIT


def get_db(request: Request) -> Iterator[Session]:
    with Session(request.app.state.engine, expire_on_commit=False) as session:
        yield session


def get_settings(request: Request) -> Settings:
    return request.app.state.settings  # type: ignore[no-any-return]


def get_ca(request: Request) -> CertificateAuthority:
    return request.app.state.ca  # type: ignore[no-any-return]


T = TypeVar("T")

SessionDep = Annotated[Session, Depends(get_db)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
CADep = Annotated[CertificateAuthority, Depends(get_ca)]

_bearer = HTTPBearer(auto_error=False, description="An integrator token (`aisynergy hub token create --role R`)")


def require(role: Role) -> Callable[..., Awaitable[TokenIdentity]]:
    async def dependency(request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> TokenIdentity:
        if credentials is None or credentials.scheme.lower() != "bearer":
            raise Unauthenticated("a bearer token is required")
        cache: TokenCache = request.app.state.token_cache
        # a cached token costs no thread hop; a miss reads the database in a worker thread
        token = cache.cached(credentials.credentials)
        if token is None:
            engine = request.app.state.engine
            token = await run_in_threadpool(cache.lookup, lambda: Session(engine), credentials.credentials)
        if token is None:
            raise Unauthenticated("the bearer token is not valid")
        if not Role(token.role).allows(role):
            raise Forbidden(f"this needs the {role.value} role; the token has {token.role}")
        return token

    return dependency


Viewer = Annotated[TokenIdentity, Depends(require(Role.VIEWER))]
Operator = Annotated[TokenIdentity, Depends(require(Role.OPERATOR))]
Admin = Annotated[TokenIdentity, Depends(require(Role.ADMIN))]

# Documents the header; RequestGuard does the work.
IdempotencyKey = Annotated[
    str | None,
    Header(alias="Idempotency-Key", min_length=1, max_length=255, pattern=r"^[\x20-\x7e]+$", description="Retry-safe writes: the same key replays the first response (one that carried a token is not kept: 409)"),
]
Limit = Annotated[int, Query(ge=1, le=MAX_LIMIT, description="page size")]
Cursor = Annotated[str | None, Query(max_length=128, description="next_cursor of the previous page")]
Selector = Annotated[str | None, Query(max_length=4096, description="label selector, e.g. zone=a,tier!=x,gpu,!legacy")]
DEFAULT_PAGE = DEFAULT_LIMIT


def read_one(request: Request, getter: Callable[[Session, str], T], key: str) -> T:
    """Run ``getter(session, key)`` with a session of its own (for async routes, in a worker thread)."""
    with Session(request.app.state.engine, expire_on_commit=False) as session:
        return getter(session, key)


def poke_desired(request: Request) -> None:
    """A desired document changed: let the bridge publish it now (it also catches up on its own)."""
    bridge = getattr(request.app.state, "bridge", None)
    if bridge is not None:
        bridge.poke_desired()
