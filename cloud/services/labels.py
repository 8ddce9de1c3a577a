"""Labels of nodes and devices, kept as rows so that selectors run in SQL."""

from __future__ import annotations

from sqlalchemy import and_, delete, exists, not_, select
from sqlalchemy.sql.elements import ColumnElement
from sqlmodel import Session

from cloud.tables import Label
from interfaces.selectors import Op, Requirement


def set_labels(session: Session, owner_id: str, labels: dict[str, str]) -> None:
    session.execute(delete(Label).where(Label.owner_id == owner_id))
    for key, value in labels.items():
        session.add(Label(owner_id=owner_id, key=key, value=value))


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
