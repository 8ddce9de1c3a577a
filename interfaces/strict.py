"""Strict JSON for every MQTT payload model: a wrong type is refused, never coerced (DESIGN §6).

What the wire holds is taken as it is: ``"13"`` is not 13, ``true`` is not 1, ``13.0`` is not 13, a number is not
a date-time, and ``NaN`` and ``Infinity`` are not JSON at all. Integers fit a signed 64-bit integer (what SQLite
and PostgreSQL keep), and every string, list and object has a documented bound: a free-form object
(:data:`JsonObject`: a spec, a status, event data, command arguments) is JSON of at most
:data:`MAX_MESSAGE_BYTES` bytes, nested at most :data:`MAX_JSON_DEPTH` deep, with the same rules inside.
The JSON Schemas generated from these models (``interfaces/schemas/``) say the same, bar one thing JSON Schema
cannot say: to it 13.0 and 13 are one number, so a schema's ``integer`` admits 13.0, which the models refuse.

Python code builds the same models from what it holds: an enum member or its value (fields marked
:data:`BY_VALUE`), a datetime or the RFC 3339 text a stored document keeps (:data:`Timestamp`), a list or a
tuple where a tuple is meant (:data:`BY_VALUE` too). Nothing of that reaches the wire: JSON has only values
and strings there, and the models read JSON strictly.
"""

from __future__ import annotations

import math
import re
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, AwareDatetime, BeforeValidator, ConfigDict, Field, Strict
from pydantic_core import PydanticSerializationError, to_json

from interfaces.text import NoNul

MAX_MESSAGE_BYTES = 256 * 1024
"""The largest MQTT payload any tier accepts; a free-form object inside one is bounded by it too."""
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
"""The integers the wire carries (SQLite's INTEGER, PostgreSQL's BIGINT)."""
MAX_JSON_DEPTH = 32
"""How deep a free-form object may nest (a status or a spec needs a handful of levels)."""

STRICT_JSON = ConfigDict(strict=True, allow_inf_nan=False)
"""The configuration of every wire model: no coercion, no NaN or Infinity."""

BY_VALUE = Strict(False)
"""Marks an enum field (or a tuple) that Python code may fill with the member's value (a list); on the wire both
read the same, strictly: JSON holds an enum as its value, and an array for a tuple."""


class WireModel(NoNul):
    """Base of the models that travel on MQTT: strict JSON (see the module docstring), no U+0000 in any string."""

    model_config = STRICT_JSON


_RFC3339 = re.compile(r"^\d{4}-\d\d-\d\d[Tt]\d\d:\d\d:\d\d(\.\d{1,9})?([Zz]|[+-]\d\d:\d\d)?$")


def _rfc3339(value: Any) -> Any:
    # a datetime from Python code, or the text of one (on the wire, or from a stored document); not a number
    # (a Unix time), nor a date alone
    if isinstance(value, datetime) or (isinstance(value, str) and _RFC3339.match(value)):
        return value
    raise ValueError(f"a date-time is an RFC 3339 string (2030-01-01T00:00:00Z), not {value!r:.64}")


_RFC3339_SCHEMA = Field(json_schema_extra={"pattern": _RFC3339.pattern})
Timestamp = Annotated[datetime, Strict(False), BeforeValidator(_rfc3339), _RFC3339_SCHEMA]
"""A date-time: an RFC 3339 string on the wire, never a number; a datetime or its text in Python."""
AwareTimestamp = Annotated[AwareDatetime, Strict(False), BeforeValidator(_rfc3339), _RFC3339_SCHEMA]
"""A :data:`Timestamp` with its UTC offset."""


def _exactly_one(value: Any) -> Any:
    # Literal[1] alone admits true and 1.0 (they compare equal to 1)
    if type(value) is not int:
        raise ValueError(f"the protocol version is the integer 1, not {value!r}")
    return value


ProtocolVersion = Annotated[Literal[1], BeforeValidator(_exactly_one)]
"""``v`` of the envelope: the integer 1 and nothing that equals it."""


def _check_json(value: Any, path: str, depth: int) -> None:
    if depth > MAX_JSON_DEPTH:
        raise ValueError(f"nested more than {MAX_JSON_DEPTH} deep (at {path})")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{value} is not JSON (at {path or 'the top'})")
    elif isinstance(value, int) and not isinstance(value, bool):
        if not INT64_MIN <= value <= INT64_MAX:
            raise ValueError(f"{value} does not fit a signed 64-bit integer (at {path or 'the top'})")
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_json(item, f"{path}.{key}" if path else str(key), depth + 1)
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            _check_json(item, f"{path}[{index}]", depth + 1)


def _bounded_json(value: dict[str, Any]) -> dict[str, Any]:
    _check_json(value, "", 0)
    try:
        size = len(to_json(value))
    except PydanticSerializationError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if size > MAX_MESSAGE_BYTES:
        raise ValueError(f"{size} bytes of JSON exceed the {MAX_MESSAGE_BYTES} byte limit")
    return value


JsonObject = Annotated[dict[str, Any], AfterValidator(_bounded_json)]
"""A free-form JSON object (spec, status, event data, command arguments): at most :data:`MAX_MESSAGE_BYTES` bytes of
JSON nested at most :data:`MAX_JSON_DEPTH` deep, no NaN or Infinity inside, every integer within 64 bits."""
