"""Label selectors, as in Kubernetes: ``zone=a,tier!=x,gpu,!legacy``.

Grammar (comma separated requirements, all must hold):
``key=value`` / ``key==value``, ``key!=value`` (also true when the key is absent), ``key`` (present),
``!key`` (absent).
"""

from __future__ import annotations

import re
from enum import StrEnum

from pydantic import BaseModel, ConfigDict

LABEL_KEY_PATTERN = r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
LABEL_VALUE_PATTERN = r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$"
_KEY = LABEL_KEY_PATTERN[1:-1]
_VALUE = LABEL_VALUE_PATTERN[1:-1]
_REQUIREMENT = f" *(!? *{_KEY}|{_KEY} *(==?|!=) *{_VALUE}) *"
SELECTOR_PATTERN = f"^( *|{_REQUIREMENT}(,{_REQUIREMENT})*)$"
"""The grammar as a regular expression, for the JSON Schema of a selector (the parser refuses what it does not match)."""
_KEY_RE = re.compile(LABEL_KEY_PATTERN)
_VALUE_RE = re.compile(LABEL_VALUE_PATTERN)
MAX_LABELS = 64


class SelectorError(ValueError):
    pass


class Op(StrEnum):
    EQ = "="
    NE = "!="
    EXISTS = "exists"
    NOT_EXISTS = "!exists"


class Requirement(BaseModel):
    model_config = ConfigDict(frozen=True)
    key: str
    op: Op
    value: str | None = None

    def matches(self, labels: dict[str, str]) -> bool:
        if self.op is Op.EQ:
            return labels.get(self.key) == self.value
        if self.op is Op.NE:
            return labels.get(self.key) != self.value
        if self.op is Op.EXISTS:
            return self.key in labels
        return self.key not in labels


def validate_labels(labels: dict[str, str]) -> dict[str, str]:
    if len(labels) > MAX_LABELS:
        raise ValueError(f"at most {MAX_LABELS} labels")
    for key, value in labels.items():
        if not _KEY_RE.fullmatch(key) or len(key) > 253:
            raise ValueError(f"invalid label key {key!r}")
        if not isinstance(value, str) or not _VALUE_RE.fullmatch(value):
            raise ValueError(f"invalid label value {value!r} for key {key!r}")
    return labels


def _check_key(key: str) -> str:
    if not _KEY_RE.fullmatch(key):
        raise SelectorError(f"invalid label key {key!r}")
    return key


def _check_value(value: str) -> str:
    if not _VALUE_RE.fullmatch(value):
        raise SelectorError(f"invalid label value {value!r}")
    return value


def parse_selector(text: str | None) -> list[Requirement]:
    """Parse a selector string; raise :class:`SelectorError` on anything malformed."""
    if text is None or not text.strip(" "):
        return []
    if len(text) > 4096:
        raise SelectorError("selector longer than 4096 characters")
    out: list[Requirement] = []
    for raw in text.split(","):
        part = raw.strip(" ")
        if not part:
            raise SelectorError("empty requirement in selector")
        if "!=" in part:
            key, value = part.split("!=", 1)
            out.append(Requirement(key=_check_key(key.strip(" ")), op=Op.NE, value=_check_value(value.strip(" "))))
        elif "=" in part:
            key, value = part.split("==", 1) if "==" in part else part.split("=", 1)
            out.append(Requirement(key=_check_key(key.strip(" ")), op=Op.EQ, value=_check_value(value.strip(" "))))
        elif part.startswith("!"):
            out.append(Requirement(key=_check_key(part[1:].strip(" ")), op=Op.NOT_EXISTS))
        else:
            out.append(Requirement(key=_check_key(part), op=Op.EXISTS))
    return out


def matches(requirements: list[Requirement], labels: dict[str, str]) -> bool:
    return all(r.matches(labels) for r in requirements)
