"""Integrator bearer tokens bound to roles, and hashing of every secret the hub keeps."""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlmodel import Session, select

from cloud.tables import ApiToken
from interfaces.auth import Role
from interfaces.ids import new_id

TOKEN_PREFIX = "asy_"


def hash_secret(secret: str) -> str:
    """Tokens are random 256-bit values, so a plain SHA-256 is a sufficient one-way store."""
    return hashlib.sha256(secret.encode()).hexdigest()


def new_secret(prefix: str = "") -> str:
    return prefix + secrets.token_urlsafe(32)


def create_api_token(session: Session, role: Role, name: str = "") -> tuple[ApiToken, str]:
    """Store a new token and return it with its secret (shown once, never stored)."""
    secret = new_secret(TOKEN_PREFIX)
    row = ApiToken(id=new_id("tok"), token_hash=hash_secret(secret), role=role.value, name=name, created_at=datetime.now(UTC))
    session.add(row)
    session.commit()
    return row, secret


def lookup_api_token(session: Session, secret: str) -> ApiToken | None:
    row = session.exec(select(ApiToken).where(ApiToken.token_hash == hash_secret(secret))).first()
    if row is None or row.revoked_at is not None:
        return None
    return row


def revoke_api_token(session: Session, token_id: str) -> ApiToken | None:
    """Mark a token revoked (idempotent); None when there is no such token."""
    row = session.get(ApiToken, token_id)
    if row is None:
        return None
    if row.revoked_at is None:
        row.revoked_at = datetime.now(UTC)
        session.add(row)
        session.commit()
    return row


@dataclass(frozen=True, slots=True)
class TokenIdentity:
    """What a request learns about its caller: enough to authorise, detached from any session."""

    id: str
    role: str
    name: str


class TokenCache:
    """Remembers verified tokens for ``ttl_s`` so most requests skip the database.

    A token revoked through another process (``aisynergy hub token revoke``, another hub replica) stops
    working within ``ttl_s``, the window Kubernetes' webhook token cache also allows. Unknown tokens are
    not cached: a token created a moment ago works at once. ``ttl_s=0`` turns the cache off.
    """

    def __init__(self, ttl_s: float, max_entries: int = 10_000) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: dict[str, tuple[float, TokenIdentity]] = {}
        self._lock = threading.Lock()

    def cached(self, secret: str) -> TokenIdentity | None:
        """The token if it was verified less than ``ttl_s`` ago (no I/O); None means ask ``lookup``."""
        with self._lock:
            hit = self._entries.get(hash_secret(secret))
        return hit[1] if hit is not None and hit[0] > time.monotonic() else None

    def lookup(self, session_factory: Callable[[], Session], secret: str) -> TokenIdentity | None:
        """Verify a token against the database (blocking) and remember it when valid."""
        hit = self.cached(secret)
        if hit is not None:
            return hit
        key = hash_secret(secret)
        now = time.monotonic()
        with session_factory() as session:
            row = session.exec(select(ApiToken).where(ApiToken.token_hash == key)).first()
            identity = None if row is None or row.revoked_at is not None else TokenIdentity(row.id, row.role, row.name)
        with self._lock:
            if identity is None or self.ttl_s <= 0:
                self._entries.pop(key, None)
            else:
                if len(self._entries) >= self.max_entries:
                    self._entries = {k: v for k, v in self._entries.items() if v[0] > now}
                    if len(self._entries) >= self.max_entries:
                        self._entries.clear()
                self._entries[key] = (now + self.ttl_s, identity)
        return identity

    def forget(self, token_id: str) -> None:
        """Drop a token at once (revoked in this process)."""
        with self._lock:
            self._entries = {k: v for k, v in self._entries.items() if v[1].id != token_id}
