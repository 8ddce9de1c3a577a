"""HTTP byte ranges (RFC 9110 §14) as the hub and the edges serve artefacts: one parser for both."""

from __future__ import annotations

import re

_RANGE_RE = re.compile(r"^bytes=(\d*)-(\d*)$")


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
    first, last = match.groups()
    if first == "":  # a suffix: the last N bytes
        suffix = int(last)
        if suffix == 0 or size == 0:
            raise RangeNotSatisfiable(f"bytes=-{suffix} of {size} bytes")
        return max(0, size - suffix), size - 1
    start = int(first)
    if last and int(last) < start:
        return None
    if start >= size:
        raise RangeNotSatisfiable(f"bytes={start}- of {size} bytes")
    return start, min(int(last) if last else size - 1, size - 1)
