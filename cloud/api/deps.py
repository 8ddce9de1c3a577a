"""Dependencies shared by the routes (``SessionDep``, ``require(role)``, ...)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, TypeVar

from fastapi import Depends, Header, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlmodel import Session

from cloud.api.guards import SLOT_KEY, IdempotencySlot
from cloud.api.state import hub_state
from cloud.auth import TokenIdentity
from cloud.config import Settings
from cloud.errors import Forbidden, Unauthenticated
from cloud.pki import CertificateAuthority
from interfaces.auth import Role
from interfaces.pagination import DEFAULT_LIMIT, MAX_LIMIT
from interfaces.selectors import SELECTOR_PATTERN
from interfaces.uploads import PUBLISH_TOKEN_PREFIX, PublishClaims


def get_db(request: Request) -> Iterator[Session]:
    with Session(hub_state(request).engine, expire_on_commit=False) as session:
        yield session


def get_settings(request: Request) -> Settings:
    return hub_state(request).settings


def get_ca(request: Request) -> CertificateAuthority:
    return hub_state(request).ca


T = TypeVar("T")

SessionDep = Annotated[Session, Depends(get_db)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
CADep = Annotated[CertificateAuthority, Depends(get_ca)]

_bearer = HTTPBearer(auto_error=False, description="An integrator token (`aisynergy hub token create --role R`)")


def require(role: Role) -> Callable[..., Awaitable[TokenIdentity]]:
    async def dependency(request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> TokenIdentity:
        if credentials is None or credentials.scheme.lower() != "bearer":
            raise Unauthenticated("a bearer token is required")
        state = hub_state(request)
        cache = state.token_cache
        # a cached token costs no thread hop; a miss reads the database in a worker thread
        token = cache.cached(credentials.credentials)
        if token is None:
            engine = state.engine
            token = await run_in_threadpool(cache.lookup, lambda: Session(engine), credentials.credentials)
        if token is None:
            raise Unauthenticated("the bearer token is not valid")
        if not Role(token.role).allows(role):
            raise Forbidden(f"this needs the {role.value} role; the token has {token.role}")
        return token

    dependency.required_role = role  # type: ignore[attr-defined]  # read by RequestGuard before it handles Idempotency-Key
    return dependency


def required_role(route: object) -> Role | None:
    """The role a route's dependencies demand (the highest of them), None for a route open to anyone."""
    found: list[Role] = []
    pending = list(getattr(getattr(route, "dependant", None), "dependencies", ()))
    while pending:
        dependant = pending.pop()
        role = getattr(dependant.call, "required_role", None)
        if isinstance(role, Role):
            found.append(role)
        pending.extend(dependant.dependencies)
    return max(found, key=lambda r: r.rank) if found else None


@dataclass(frozen=True)
class Publisher:
    """The caller of a route that a task's publish grant may use too (the chunked upload API, reading an artefact it
    published): an integrator's token, or the grant's claims."""

    token: TokenIdentity | None = None
    grant: PublishClaims | None = None

    def check(self, kind: str, name: str, version: str) -> None:
        """403 when the caller is a grant that does not cover this artefact."""
        if self.grant is not None and not self.grant.allows(kind, name, version):
            raise Forbidden(
                f"the publish grant of worker {self.grant.worker_id} allows models {', '.join(self.grant.names)} {self.grant.version}, "
                f"not the {kind} {name} {version}",
            )  # fmt: skip

    @property
    def caller(self) -> str:
        """Who this is, for an idempotency key's owner."""
        if self.grant is not None:
            return f"grant:{self.grant.worker_id}"
        assert self.token is not None
        return f"token:{self.token.id}:{self.token.role}"


def _grant(request: Request, credentials: HTTPAuthorizationCredentials | None) -> PublishClaims | None:
    """The claims of a publish grant presented as the bearer credential (401 when it is forged or expired), else None."""
    from cloud.signing import TokenRejected

    if credentials is None or credentials.scheme.lower() != "bearer" or not credentials.credentials.startswith(PUBLISH_TOKEN_PREFIX):
        return None
    try:
        return hub_state(request).signing.verify_publish_token(credentials.credentials)
    except TokenRejected as exc:
        raise Unauthenticated(str(exc)) from None


def publisher(role: Role) -> Callable[..., Awaitable[Publisher]]:
    """``require(role)``, or a publish grant (whose scope the route checks with :meth:`Publisher.check`)."""
    inner = require(role)

    async def dependency(request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> Publisher:
        grant = _grant(request, credentials)
        return Publisher(grant=grant) if grant is not None else Publisher(token=await inner(request, credentials))

    dependency.required_role = role  # type: ignore[attr-defined]
    dependency.accepts_grant = True  # type: ignore[attr-defined]  # read by idempotency_key
    return dependency


Viewer = Annotated[TokenIdentity, Depends(require(Role.VIEWER))]
Operator = Annotated[TokenIdentity, Depends(require(Role.OPERATOR))]
Admin = Annotated[TokenIdentity, Depends(require(Role.ADMIN))]
UploadCaller = Annotated[Publisher, Depends(publisher(Role.OPERATOR))]
ArtifactCaller = Annotated[Publisher, Depends(publisher(Role.VIEWER))]

async def idempotency_key(
    request: Request,
    key: Annotated[str | None, Header(
        alias="Idempotency-Key", min_length=1, max_length=255, pattern=r"^[\x20-\x7e]+$",
        description="Retry-safe writes: the same key replays the first response (one that carried a token is not kept: 409)",
    )] = None,
) -> str | None:  # fmt: skip
    """Claim the request's key for its caller, once the route has let the caller in (RequestGuard stores the answer).

    Runs the route's role check itself (cached: the token was just verified), so a caller the route refuses gets
    its 401 or 403 and no key is looked at, whatever the order of the route's parameters."""
    slot: IdempotencySlot | None = request.scope.get(SLOT_KEY)
    if key is None or slot is None:
        return key
    role = required_role(request.scope.get("route"))
    if role is None:
        caller = f"anonymous:{request.url.path}"
    else:
        credentials = await _bearer(request)
        grant = _grant(request, credentials) if _accepts_grant(request.scope.get("route")) else None
        caller = Publisher(grant=grant).caller if grant is not None else Publisher(token=await require(role)(request, credentials)).caller
    await slot.claim(caller)
    return key


def _accepts_grant(route: object) -> bool:
    return any(getattr(d.call, "accepts_grant", False) for d in getattr(getattr(route, "dependant", None), "dependencies", ()))


IdempotencyKey = Annotated[str | None, Depends(idempotency_key)]
Limit = Annotated[int, Query(ge=1, le=MAX_LIMIT, description="page size")]
Cursor = Annotated[str | None, Query(max_length=128, description="next_cursor of the previous page")]
# The pattern documents the grammar; the route's parser checks it (400 invalid_selector, not a 422 of the schema).
Selector = Annotated[str | None, Query(max_length=4096, description="label selector, e.g. zone=a,tier!=x,gpu,!legacy", json_schema_extra={"pattern": SELECTOR_PATTERN})]
DEFAULT_PAGE = DEFAULT_LIMIT


def read_one(request: Request, getter: Callable[[Session, str], T], key: str) -> T:
    """Run ``getter(session, key)`` with a session of its own (for async routes, in a worker thread)."""
    with Session(hub_state(request).engine, expire_on_commit=False) as session:
        return getter(session, key)


def poke_desired(request: Request) -> None:
    """A desired document changed: let the bridge publish it now (it also catches up on its own)."""
    bridge = hub_state(request).bridge
    if bridge is not None:
        bridge.poke_desired()
