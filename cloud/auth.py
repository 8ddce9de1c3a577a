"""Integrator bearer tokens bound to roles, and hashing of every secret the hub keeps."""

from __future__ import annotations

import hashlib
import secrets
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
