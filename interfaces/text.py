"""Text that every store can keep: no U+0000 anywhere (PostgreSQL refuses it in text and JSON)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, GetJsonSchemaHandler, model_validator
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema

NO_NUL_PATTERN = r"^[^\x00]*$"
"""The JSON Schema of the rule, on every string of an inbound model that no pattern, enum or format bounds already."""


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


def _no_nul_strings(schema: Any) -> None:
    if isinstance(schema, dict):
        if schema.get("type") == "string" and not {"pattern", "enum", "const", "format"} & schema.keys():
            schema["pattern"] = NO_NUL_PATTERN
        for value in schema.values():
            _no_nul_strings(value)
    elif isinstance(schema, list):
        for value in schema:
            _no_nul_strings(value)


class NoNul(BaseModel):
    """Base for inbound models: refuses U+0000 in any string, however deeply nested (its JSON Schema says so of
    every string it describes; a free-form object's strings are not described)."""

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        schema = handler(core_schema)
        _no_nul_strings(handler.resolve_ref_schema(schema))
        return schema

    @model_validator(mode="after")
    def _refuse_nul(self) -> Any:
        found = find_nul(self.__dict__)
        if found:
            raise ValueError(f"text must not contain U+0000 (at {found})")
        return self
