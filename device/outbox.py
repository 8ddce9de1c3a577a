"""Store-and-forward on the device: every event it owes its edge, kept until the edge has *stored* it.

The twin of the edge's outbox one tier down (DESIGN §3 "nothing lost on the way up")::

    emit() --> staged --commit (group)--> outbox.db --sender--> events (QoS 1) --> edge commits
                                              ^                                        |
                                              +--- forget <= seq <--- events/ack {seq} +

``<data dir>/outbox.db`` (SQLite, WAL)::

    events  seq INTEGER PRIMARY KEY, payload BLOB   the envelope bytes, sent again unchanged (same id)
    meta    last_seq                                 the last seq committed, kept when the events are forgotten

**Sequence numbers** are given out here, one more per event, and stored in the same transaction as the
event; each event also names its predecessor (``prev_seq``), so that the edge stores a device's events only in
order and asks for the missing ones (``events/ack`` with ``resend``) instead of storing past a hole. A device
that kept the older ``event-seq`` ceiling file continues above it (:meth:`Outbox.open` reads it once).

**Durability** (``durable``):

- durable (the default): :meth:`Outbox.append` returns once the transaction holding the event has been
  committed with ``synchronous=FULL`` (an fsync): the event survives a power cut of the device. Events emitted
  together share one transaction and one fsync (group commit), so concurrent emitters cost one fsync a batch.
- fast: :meth:`Outbox.append` returns at once, and the committer commits what was staged every
  ``commit_window_s`` (default 50 ms): a power cut loses at most that window's events. Their numbers were
  never sent (only committed events leave), so a number is never seen twice with two different events.

**SD cards**: one write transaction per batch; acknowledged events are forgotten in the next write transaction,
or after ``forget_after_s`` without an fsync of their own (a forgotten row that comes back after a power cut is
sent again and dropped by the edge as a duplicate).

**Bounded**: at most ``max_events`` events and ``max_bytes`` bytes wait (stored or staged). Beyond that
:meth:`Outbox.append` raises :class:`~device.errors.OutboxFull` and nothing is stored: the policy is *refuse*,
never a silent drop and never a hole in the sequence.

**Sending** is a cursor over the committed events: :meth:`sendable` hands out the next ones (at most
``window`` beyond the last acknowledged), :meth:`acknowledge` moves the acknowledged mark and forgets, and
:meth:`rewind` goes back to the first unacknowledged one: on every (re)connect, and when the edge asks for a
resend. When no acknowledgement came for ``ack_timeout_s`` (doubling up to ``ack_timeout_cap_s``, so a device
behind an edge that is away does not flood its broker), only the newest event sent goes again, as a probe: an
edge that has the others answers it as a duplicate, an edge that lost them sees the hole before it and asks for
a resend. A thousand devices behind one slow edge thus add one message each per timeout, not their windows.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from device.errors import NotRunning, OutboxFull, StoredStateError
from device.sequence import read_ceiling

log = logging.getLogger("aisynergy.device")

OUTBOX_FILE = "outbox.db"
DEFAULT_MAX_EVENTS = 10_000
DEFAULT_MAX_BYTES = 32 * 1024 * 1024
DEFAULT_WINDOW = 128
COMMIT_WINDOW_S = 0.05
FORGET_AFTER_S = 1.0
ACK_TIMEOUT_S = 2.0
ACK_TIMEOUT_CAP_S = 30.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS events (seq INTEGER PRIMARY KEY, payload BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""

BuildPayload = Callable[[int, int | None], bytes]
"""``(seq, prev_seq) -> envelope bytes``; raising ``ValueError`` refuses the event and consumes no number."""


class Outbox:
    """The device's durable event queue and its send cursor; see the module docstring. Thread-safe."""

    def __init__(
        self,
        path: Path,
        *,
        durable: bool = True,
        commit_window_s: float = COMMIT_WINDOW_S,
        max_events: int = DEFAULT_MAX_EVENTS,
        max_bytes: int = DEFAULT_MAX_BYTES,
        window: int = DEFAULT_WINDOW,
        ack_timeout_s: float = ACK_TIMEOUT_S,
        ack_timeout_cap_s: float = ACK_TIMEOUT_CAP_S,
        forget_after_s: float = FORGET_AFTER_S,
        legacy_sequence: Path | None = None,
        on_committed: Callable[[], None] | None = None,
    ) -> None:
        if max_events < 1 or max_bytes < 1 or window < 1:
            raise ValueError("max_events, max_bytes and window must be at least 1")
        if not 0 <= commit_window_s <= 10:
            raise ValueError("commit_window_s must be within 0-10 s")
        self.path = Path(path)
        self.durable = durable
        self._window_s = commit_window_s
        self._max_events, self._max_bytes, self._window = max_events, max_bytes, window
        self._ack_timeout_s, self._ack_timeout_cap_s = ack_timeout_s, ack_timeout_cap_s
        self._forget_after_s = forget_after_s
        self._on_committed = on_committed
        try:
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(_SCHEMA)
            rows = self._db.execute("SELECT seq, LENGTH(payload) FROM events ORDER BY seq").fetchall()
            meta = self._db.execute("SELECT value FROM meta WHERE key = 'last_seq'").fetchone()
        except sqlite3.Error as exc:
            raise StoredStateError(f"cannot open the event outbox {self.path}: {exc}") from exc
        if meta is None and not rows:
            ceiling = read_ceiling(legacy_sequence) if legacy_sequence is not None else None
            self._next, self._prev = (ceiling or 0), None
        else:
            last = max(rows[-1][0] if rows else -1, meta[0] if meta else -1)
            self._next, self._prev = last + 1, last
        self._unacked: deque[tuple[int, int]] = deque((r[0], r[1]) for r in rows)  # (seq, bytes), staged included
        self._bytes = sum(size for _, size in self._unacked)
        self._committed = rows[-1][0] if rows else self._next - 1  # everything up to it is on disk
        self._acked = (rows[0][0] - 1) if rows else self._next - 1  # everything up to it the edge has stored
        self._sent = self._acked
        self._forget_upto: int | None = None
        self._acked_at = 0.0
        self._staged: list[tuple[int, bytes]] = []
        self._failure: BaseException | None = None
        self._closing = False
        self._closed = False  # the file is closed (after the committer's last write)
        self._last_progress = time.monotonic()
        self._timeout = ack_timeout_s
        self._cond = threading.Condition()
        self._db_lock = threading.Lock()
        self._thread = threading.Thread(target=self._commit_loop, name="aisynergy-outbox", daemon=True)
        self._thread.start()

    # ---- what the agent asks ------------------------------------------------------------------------
    @property
    def next_seq(self) -> int:
        """The number the next event gets."""
        with self._cond:
            return self._next

    @property
    def waiting(self) -> int:
        """Events not yet acknowledged by the edge (stored or staged)."""
        with self._cond:
            return len(self._unacked)

    @property
    def acknowledged(self) -> int:
        """The highest seq the edge has stored (-1 or the seed minus one: none yet)."""
        with self._cond:
            return self._acked

    def append(self, build: BuildPayload) -> int:
        """Queue one event; return its seq once it is as durable as the mode promises (see the module docstring).

        Raises :class:`OutboxFull` (nothing queued), :class:`NotRunning` after :meth:`close`, ``ValueError`` from
        ``build``, and :class:`StoredStateError` when the store cannot commit (durable mode).
        """
        with self._cond:
            if self._closing:
                raise NotRunning("the outbox is closed")
            seq, prev = self._next, self._prev
            payload = build(seq, prev)
            if len(self._unacked) >= self._max_events or self._bytes + len(payload) > self._max_bytes:
                raise OutboxFull(
                    f"{len(self._unacked)} events ({self._bytes} bytes) wait for the edge to store them "
                    f"(at most {self._max_events} events, {self._max_bytes} bytes)"
                )
            self._next, self._prev = seq + 1, seq
            self._staged.append((seq, payload))
            self._unacked.append((seq, len(payload)))
            self._bytes += len(payload)
            self._cond.notify_all()
            if self.durable:
                # a close() meanwhile still commits it: wait for the committer, not for the close
                while self._committed < seq and self._failure is None and self._thread.is_alive():
                    self._cond.wait(0.5)
                if self._committed < seq:
                    raise StoredStateError(f"event {seq} was not stored: {self._failure or 'the outbox closed'}")
        return seq

    def sendable(self, connected: bool) -> list[tuple[int, bytes]]:
        """The committed events to publish next, in order, and mark them sent; empty when there is none (or
        the window is full). Rewinds first when no acknowledgement came in time."""
        with self._cond:
            if not connected or self._closing:
                return []
            now = time.monotonic()
            if self._sent > self._acked and now - self._last_progress > self._timeout:
                # the newest event sent goes again, alone: it travels behind the others, so an edge that has them
                # (or is still working through them) answers it as a duplicate with what it has stored, and an edge
                # that lost them sees a hole before it and asks for the rest (``resend``). Resending all of them
                # instead would double the load of an edge that is only slow, and every device would do it at once.
                probe = self._sent
                log.info("no acknowledgement of events %s..%s for %.1f s; asking the edge with event %s",
                         self._acked + 1, probe, self._timeout, probe)  # fmt: skip
                self._last_progress = now
                self._timeout = min(self._timeout * 2, self._ack_timeout_cap_s)
                return self._rows(probe - 1, probe, 1)
            room = self._window - (self._sent - self._acked)
            start = self._sent
            if room <= 0 or self._committed <= start:
                return []
            if self._sent == self._acked:
                self._last_progress = now  # the clock runs from the first event in flight
        rows = self._rows(start, self._committed, room)
        with self._cond:
            if rows and self._sent == start:  # not rewound meanwhile
                self._sent = rows[-1][0]
        return rows

    def _rows(self, after: int, upto: int, limit: int) -> list[tuple[int, bytes]]:
        with self._db_lock:
            if self._closed:
                return []
            rows = self._db.execute(
                "SELECT seq, payload FROM events WHERE seq > ? AND seq <= ? ORDER BY seq LIMIT ?", (after, upto, limit)
            ).fetchall()
        return [(r[0], bytes(r[1])) for r in rows]

    def wait(self, timeout_s: float) -> None:
        """Block until something may be sendable (a commit, an acknowledgement, a rewind) or ``timeout_s``."""
        with self._cond:
            self._cond.wait(timeout_s)

    def acknowledge(self, seq: int | None, resend: bool = False) -> int:
        """The edge has stored every event up to ``seq``: forget them (``resend``: it wants the rest again).
        Returns how many were newly acknowledged."""
        with self._cond:
            done = 0
            if seq is not None and seq > self._acked:
                seq = min(seq, self._committed)  # never beyond what was sent
                while self._unacked and self._unacked[0][0] <= seq:
                    self._bytes -= self._unacked.popleft()[1]
                    done += 1
                self._acked = seq
                self._sent = max(self._sent, seq)
                self._forget_upto = seq
                self._acked_at = self._last_progress = time.monotonic()
                self._timeout = self._ack_timeout_s
            if resend:
                self._sent = self._acked
            self._cond.notify_all()
            return done

    def rewind(self) -> None:
        """Send again from the first unacknowledged event (after a reconnect)."""
        with self._cond:
            self._sent = self._acked
            self._last_progress = time.monotonic()
            self._cond.notify_all()

    def close(self, timeout_s: float = 5.0) -> None:
        """Commit what is staged, forget what is acknowledged, close the file."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        with self._db_lock:
            self._closed = True
            self._db.close()

    # ---- the committer ------------------------------------------------------------------------------
    def _commit_loop(self) -> None:
        while True:
            with self._cond:
                while not self._staged and not self._closing and not (
                    self._forget_upto is not None and time.monotonic() - self._acked_at >= self._forget_after_s
                ):
                    self._cond.wait(self._forget_after_s if self._forget_upto is not None else None)
                closing = self._closing
            if not closing and self._staged and not self.durable and self._window_s:
                with self._cond:  # fast mode: gather the window's events into one transaction (a close cuts it short)
                    self._cond.wait_for(lambda: self._closing, timeout=self._window_s)
            with self._cond:
                rows, self._staged = self._staged, []
                forget, self._forget_upto = self._forget_upto, None
            try:
                self._write(rows, forget)
            except sqlite3.Error as exc:
                log.error("cannot store %s events in %s: %s; retrying", len(rows), self.path, exc)
                with self._cond:
                    self._staged[:0] = rows
                    if forget is not None and self._forget_upto is None:
                        self._forget_upto = forget
                    self._failure = exc
                    self._cond.notify_all()
                if closing:
                    return
                time.sleep(1.0)
                continue
            with self._cond:
                if rows:
                    self._committed = rows[-1][0]
                self._failure = None
                self._cond.notify_all()
            if rows and self._on_committed is not None:
                self._on_committed()
            if closing:
                with self._cond:
                    if not self._staged:
                        return

    def _write(self, rows: list[tuple[int, bytes]], forget: int | None) -> None:
        if not rows and forget is None:
            return
        with self._db_lock:
            if not rows:  # only forgetting: no fsync of its own (a row that comes back is a duplicate)
                self._db.execute("PRAGMA synchronous=NORMAL")
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    if rows:
                        self._db.executemany("INSERT INTO events (seq, payload) VALUES (?, ?)", rows)
                        self._db.execute(
                            "INSERT INTO meta (key, value) VALUES ('last_seq', ?) "
                            "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                            (rows[-1][0],),
                        )
                    if forget is not None:
                        self._db.execute("DELETE FROM events WHERE seq <= ?", (forget,))
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
                self._db.execute("COMMIT")
            finally:
                if not rows:
                    self._db.execute("PRAGMA synchronous=FULL")
