"""Opaque identifiers that sort by creation time (ULID-like: 48-bit milliseconds + 80 random bits)."""

from __future__ import annotations

import os
import re
import time

_ALPHABET = "0123456789abcdefghjkmnpqrstvwxyz"  # Crockford base32, lower case
ID_PATTERN = r"^[a-z]{1,8}-[0-9a-hjkmnp-tv-z]{26}$"
_ID_RE = re.compile(ID_PATTERN)


def _b32(value: int, length: int) -> str:
    out = []
    for _ in range(length):
        out.append(_ALPHABET[value & 31])
        value >>= 5
    return "".join(reversed(out))


def new_id(prefix: str) -> str:
    """Return ``<prefix>-<26 chars>``; ids made later sort after ids made earlier (to the millisecond)."""
    millis = int(time.time() * 1000) & ((1 << 48) - 1)
    rand = int.from_bytes(os.urandom(10), "big")
    return f"{prefix}-{_b32(millis, 10)}{_b32(rand, 16)}"


def is_id(value: str) -> bool:
    return bool(_ID_RE.match(value))
