"""HTTP byte ranges (RFC 9110 §14) as the hub and the edges serve artefacts: one parser for both."""

from __future__ import annotations

import re

_RANGE_RE = re.compile(r"^bytes=([0-9]*)-([0-9]*)$")  # ASCII digits only (\d takes any script's)
# a position of more digits than this is beyond any content (and int() refuses more than 4,300 digits)
MAX_DIGITS = 18


class RangeNotSatisfiable(ValueError):
    """The range lies outside the content: answer 416 with ``Content-Range: bytes */<size>``."""


def parse_byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """The inclusive (first, last) byte of a single ``bytes=`` range of content of ``size`` bytes.

    ``None`` means "send everything": no header, several ranges, another unit, a malformed range or one
    whose last byte precedes its first (RFC 9110 lets a server ignore those). Raises
    :class:`RangeNotSatisfiable` when the range starts beyond the content or asks for a zero-length suffix.
    """
    if header is None or "," in header:
        return None
    match = _RANGE_RE.match(header.strip())
    if match is None or match.group(1) == match.group(2) == "":
        return None
    first, last = (g.lstrip("0") or ("0" if g else "") for g in match.groups())
    if first == "":  # a suffix: the last N bytes (more than there are: all of them)
        suffix = int(last) if len(last) <= MAX_DIGITS else size
        if suffix == 0 or size == 0:
            raise RangeNotSatisfiable(f"a zero-length suffix, or content of {size} bytes")
        return max(0, size - suffix), size - 1
    if len(first) > MAX_DIGITS:
        raise RangeNotSatisfiable(f"a range starting beyond the {size} bytes")
    start = int(first)
    end = size - 1 if not last or len(last) > MAX_DIGITS else int(last)
    if last and len(last) <= MAX_DIGITS and end < start:
        return None  # its last byte before its first: ignored (the whole content)
    if start >= size:
        raise RangeNotSatisfiable(f"bytes={start}- of {size} bytes")
    return start, min(end, size - 1)
