"""List pages: ``?limit=&cursor=`` in, ``{items, next_cursor}`` out."""

from __future__ import annotations

import base64
import binascii
from typing import Generic, TypeVar

from pydantic import BaseModel

T = TypeVar("T")

DEFAULT_LIMIT = 50
MAX_LIMIT = 500


class Page(BaseModel, Generic[T]):
    items: list[T]
    next_cursor: str | None = None


class CursorError(ValueError):
    pass


def encode_cursor(last_id: str) -> str:
    return base64.urlsafe_b64encode(last_id.encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> str:
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        value = base64.urlsafe_b64decode(padded.encode("ascii")).decode("utf-8")
    except (binascii.Error, UnicodeError, ValueError) as exc:
        raise CursorError("cursor is not one this server issued") from exc
    if not value or len(value) > 64 or not value.isprintable():
        raise CursorError("cursor is not one this server issued")
    return value
