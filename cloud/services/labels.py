"""Labels of nodes and devices, kept as rows so that selectors run in SQL."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel
from sqlalchemy import and_, delete, exists, not_, select
from sqlalchemy.sql.elements import ColumnElement
from sqlmodel import Session

from cloud.tables import Label
from interfaces.selectors import Op, Requirement


def set_labels(session: Session, owner_id: str, labels: dict[str, str]) -> None:
    session.execute(delete(Label).where(Label.owner_id == owner_id))
    for key, value in labels.items():
        session.add(Label(owner_id=owner_id, key=key, value=value))


def apply_patch(session: Session, row: Any, body: BaseModel) -> Any:
    """Apply a PATCH body to a node or device row: absent fields stay, ``labels`` replaces the set."""
    changes = body.model_dump(exclude_none=True)
    for field, value in changes.items():
        setattr(row, field, dict(value) if field == "labels" else value)
    if "labels" in changes:
        set_labels(session, row.id, row.labels)
    row.updated_at = datetime.now(UTC)
    session.add(row)
    session.commit()
    return row


def clear_labels(session: Session, owner_id: str) -> None:
    session.execute(delete(Label).where(Label.owner_id == owner_id))


def selector_clause(owner_column: ColumnElement, requirements: list[Requirement]) -> list[ColumnElement[bool]]:
    """SQL conditions for a parsed selector against the owner id column."""
    clauses: list[ColumnElement[bool]] = []
    for req in requirements:
        cond = [Label.owner_id == owner_column, Label.key == req.key]
        if req.op in (Op.EQ, Op.NE):
            cond.append(Label.value == req.value)
        found = exists(select(Label.owner_id).where(and_(*cond)))
        clauses.append(found if req.op in (Op.EQ, Op.EXISTS) else not_(found))
    return clauses
