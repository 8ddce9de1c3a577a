"""Text that every store can keep: no U+0000 anywhere (PostgreSQL refuses it in text and JSON)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, model_validator


def find_nul(value: Any, path: str = "") -> str | None:
    """The path of the first string (key or value) holding U+0000, or None."""
    if isinstance(value, str):
        return path or "value" if "\x00" in value else None
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and "\x00" in key:
                return f"{path}.{key!r}" if path else repr(key)
            found = find_nul(item, f"{path}.{key}" if path else str(key))
            if found:
                return found
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            found = find_nul(item, f"{path}[{i}]")
            if found:
                return found
    elif isinstance(value, BaseModel):
        return find_nul(value.__dict__, path)
    return None


class NoNul(BaseModel):
    """Base for inbound models: refuses U+0000 in any string, however deeply nested."""

    @model_validator(mode="after")
    def _refuse_nul(self) -> Any:
        found = find_nul(self.__dict__)
        if found:
            raise ValueError(f"text must not contain U+0000 (at {found})")
        return self
