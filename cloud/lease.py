"""Leases: a background controller runs on the one replica that holds its lease row."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy import insert, or_, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session

from cloud.tables import Lease


def acquire(engine: Engine, name: str, holder: str, ttl_s: float) -> bool:
    """Take or renew ``name`` for ``holder``; False while another holder's lease is still valid."""
    now = datetime.now(UTC)
    expires = now + timedelta(seconds=ttl_s)
    with Session(engine) as session:
        renewed = session.execute(
            update(Lease)
            .where(Lease.name == name, or_(Lease.holder == holder, Lease.expires_at < now))
            .values(holder=holder, expires_at=expires)
        )
        if renewed.rowcount == 1:  # type: ignore[attr-defined]
            session.commit()
            return True
        try:
            session.execute(insert(Lease).values(name=name, holder=holder, expires_at=expires))
            session.commit()
            return True
        except IntegrityError:
            session.rollback()
            return False
