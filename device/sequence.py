"""Event sequence numbers that only grow, across restarts and power cuts.

The hub keeps each (sender, seq) once, so a number used twice would silently drop an event. The file
holds a *ceiling*: every number below it may already have been used. Numbers are reserved in blocks,
so a durable write (two fsyncs) happens once per ``block`` events rather than once per event; a crash
skips at most one block, which is harmless (gaps are allowed, repeats are not). A clean :meth:`close`
records the exact next number, so ordinary restarts leave no gap.
"""

from __future__ import annotations

import threading
from pathlib import Path

from device.errors import StoredStateError
from device.files import write_atomic

DEFAULT_BLOCK = 1024


def read_ceiling(path: Path) -> int | None:
    """The number a sequence file records (``None``: there is no file); :class:`StoredStateError` if unreadable."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StoredStateError(f"cannot read the event sequence {path}: {exc}") from exc
    try:
        value = int(text.strip())
    except ValueError:
        value = -1
    if value < 0:
        # Restarting at 0 would make the hub discard new events as duplicates: refuse instead.
        raise StoredStateError(
            f"{path} does not hold a sequence number ({text[:40]!r}); write a number above the last "
            "event seq the hub has seen for this device, or remove the file if the device is new"
        )
    return value


class EventSequence:
    def __init__(self, path: Path, block: int = DEFAULT_BLOCK) -> None:
        if block < 1:
            raise ValueError("block must be at least 1")
        self.path = Path(path)
        self.block = block
        self._lock = threading.Lock()
        self._next = self._read()
        self._ceiling = self._next  # nothing reserved yet in this run

    def _read(self) -> int:
        ceiling = read_ceiling(self.path)
        return 0 if ceiling is None else ceiling

    @property
    def peek(self) -> int:
        """The number :meth:`next` will return."""
        with self._lock:
            return self._next

    def next(self) -> int:
        """The next number; reserves (durably) a new block when the current one is used up."""
        with self._lock:
            if self._next >= self._ceiling:
                ceiling = self._next + self.block
                write_atomic(self.path, f"{ceiling}\n".encode())
                self._ceiling = ceiling
            value = self._next
            self._next += 1
            return value

    def close(self) -> None:
        """Record the exact next number, releasing the unused rest of the block."""
        with self._lock:
            if self._ceiling != self._next:
                write_atomic(self.path, f"{self._next}\n".encode())
                self._ceiling = self._next
