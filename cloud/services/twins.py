"""Desired / reported documents of nodes and devices (the twin), with optimistic concurrency."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import update
from sqlmodel import Session

from cloud.errors import Conflict
from interfaces.errors import ErrorCode
from interfaces.nodes import TwinUpdate


def diff(desired: dict[str, Any], reported: dict[str, Any]) -> dict[str, Any]:
    """What desired wants changed: key -> desired value; ``None`` for a reported key desired dropped."""
    out = {k: v for k, v in desired.items() if reported.get(k, object()) != v}
    out.update({k: None for k in reported if k not in desired})
    return out


def put_desired(session: Session, table: type[Any], get: Any, row_id: str, body: TwinUpdate) -> Any:
    """Replace the desired document and bump its version.

    The version check and the bump are one conditional UPDATE, so two writers holding the same
    ``expected_version`` cannot both win; without ``expected_version`` the last writer wins.
    """
    expected = body.expected_version
    for _attempt in range(5):
        row = get(session, row_id)
        expected = row.desired_version if body.expected_version is None else body.expected_version
        result = session.execute(
            update(table)
            .where(table.id == row_id, table.desired_version == expected)
            .values(desired=dict(body.desired), desired_version=expected + 1, updated_at=datetime.now(UTC))
        )
        if result.rowcount == 1:  # type: ignore[attr-defined]
            session.commit()
            session.refresh(row)
            return row
        session.rollback()
        if body.expected_version is not None:
            break
    current = get(session, row_id).desired_version
    raise Conflict(f"desired version is {current}, not {expected}", code=ErrorCode.CONFLICT, current_version=current)
