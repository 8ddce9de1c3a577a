"""Keyset pagination over id-ordered queries (ids sort by creation time)."""

from __future__ import annotations

from typing import Any, TypeVar

from sqlalchemy.sql import Select
from sqlmodel import Session

from cloud.errors import BadRequest
from interfaces.errors import ErrorCode
from interfaces.pagination import CursorError, decode_cursor, encode_cursor
from interfaces.selectors import SelectorError, parse_selector, Requirement

T = TypeVar("T")


def parse_selector_or_400(text: str | None) -> list[Requirement]:
    try:
        return parse_selector(text)
    except SelectorError as exc:
        raise BadRequest(str(exc), code=ErrorCode.INVALID_SELECTOR) from exc


def page(session: Session, query: Select, id_column: Any, limit: int, cursor: str | None, numeric: bool = False) -> tuple[list[Any], str | None]:
    """One page of ``query`` in ``id_column`` order after ``cursor``; ``numeric``: the ids are integers (event logs)."""
    if cursor:
        try:
            after: Any = decode_cursor(cursor)
            if numeric:
                after = int(after)
        except (CursorError, ValueError) as exc:
            raise BadRequest("cursor is not one this server issued", code=ErrorCode.INVALID_CURSOR) from exc
        query = query.where(id_column > after)
    rows = list(session.exec(query.order_by(id_column).limit(limit + 1)).scalars())  # type: ignore[call-overload]
    next_cursor = encode_cursor(str(rows[limit - 1].id)) if len(rows) > limit else None
    return rows[:limit], next_cursor
