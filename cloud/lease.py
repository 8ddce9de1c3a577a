"""Leases: a background controller runs on the one replica that holds its lease row; ``drive_each`` is its tick loop."""

from __future__ import annotations

import logging
from collections.abc import Callable
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


def drive_each(engine: Engine, ids: list[str], drive: Callable[[Session, str, datetime], tuple[bool, bool]], at: datetime,
               on_change: Callable[[], None] | None, what: str, log: logging.Logger) -> int:  # fmt: skip
    """A controller's tick over ``ids``: ``drive(session, id, at)`` each in a transaction of its own (one that
    fails is logged and the others go on); ``on_change`` once if any said a target's orders changed.
    Returns how many changed."""
    changed, orders = 0, False
    for row_id in ids:
        try:
            with Session(engine, expire_on_commit=False) as session:
                did, touched = drive(session, row_id, at)
                session.commit()
            changed += did
            orders |= touched
        except Exception:  # noqa: BLE001 - one bad row must not stop the others
            log.exception("%s %s failed this tick", what, row_id)
    if orders and on_change is not None:
        on_change()
    return changed
