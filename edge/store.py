"""The edge's local store ``DIR/edge.db`` (SQLite, WAL): what the edge needs through a cloud outage.

Tables::

    desired   the latest desired document per node and per device (version + the hub's envelope bytes)
    devices   the device registry: ids learned from relayed desired documents and from enrolments
    outbox    store-and-forward queue of messages for the hub, delivered in ``id`` order
    device_seq  per device, the highest event seq stored (committed with the outbox rows that carry it): what
              the edge acknowledges to the device, and below which a device's event is a duplicate

One connection guarded by a lock: the asyncio loop and the enrolment proxy's HTTP threads share it.
Every write commits at once with ``synchronous=FULL``, so a message in the outbox survives a crash or a
power cut of the gateway.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path

SCHEMA_VERSION = 2

_SCHEMA = """
CREATE TABLE IF NOT EXISTS desired (
    scope      TEXT NOT NULL CHECK (scope IN ('node', 'device')),
    target_id  TEXT NOT NULL,
    version    INTEGER NOT NULL,
    payload    BLOB NOT NULL,
    updated_at TEXT NOT NULL,
    PRIMARY KEY (scope, target_id)
);
CREATE TABLE IF NOT EXISTS devices (
    device_id    TEXT PRIMARY KEY,
    learned_from TEXT NOT NULL,
    added_at     TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS outbox (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    topic      TEXT NOT NULL,
    payload    BLOB NOT NULL,
    qos        INTEGER NOT NULL,
    retain     INTEGER NOT NULL,
    created_at TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS device_seq (
    device_id TEXT PRIMARY KEY,
    seq       INTEGER NOT NULL
);
"""


class Scope(StrEnum):
    NODE = "node"
    DEVICE = "device"


class LearnedFrom(StrEnum):
    DESIRED = "desired"  # the hub relayed a desired document for it
    ENROLMENT = "enrolment"  # it enrolled through this edge's proxy


@dataclass(frozen=True)
class StoredDesired:
    target_id: str
    version: int
    payload: bytes


@dataclass(frozen=True)
class OutboxRow:
    id: int
    topic: str
    payload: bytes
    qos: int
    retain: bool


def _now() -> str:
    return datetime.now(UTC).isoformat()


_UPSERT_DESIRED = (
    "INSERT INTO desired (scope, target_id, version, payload, updated_at) VALUES (?, ?, ?, ?, ?) "
    "ON CONFLICT (scope, target_id) DO UPDATE SET version = excluded.version, "
    "payload = excluded.payload, updated_at = excluded.updated_at"
)
_FORGET_DESIRED = "DELETE FROM desired WHERE scope = ? AND target_id = ?"
_ADD_DEVICE = "INSERT INTO devices (device_id, learned_from, added_at) VALUES (?, ?, ?) ON CONFLICT DO NOTHING"


class EdgeStore:
    """The edge's SQLite store; see the module docstring."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA busy_timeout=5000")
        with self._lock:
            self._db.executescript(_SCHEMA)
            self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            self._outbox_size = int(self._db.execute("SELECT COUNT(*) FROM outbox").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # ---- desired documents --------------------------------------------------------------------------
    def put_desired(self, scope: Scope, target_id: str, version: int, payload: bytes) -> None:
        with self._lock:
            self._db.execute(
                _UPSERT_DESIRED,
                (scope.value, target_id, version, payload, _now()),
            )

    def desired(self, scope: Scope, target_id: str) -> StoredDesired | None:
        with self._lock:
            row = self._db.execute(
                "SELECT target_id, version, payload FROM desired WHERE scope = ? AND target_id = ?",
                (scope.value, target_id),
            ).fetchone()
        return StoredDesired(row[0], row[1], bytes(row[2])) if row else None

    def all_desired(self, scope: Scope) -> list[StoredDesired]:
        with self._lock:
            rows = self._db.execute(
                "SELECT target_id, version, payload FROM desired WHERE scope = ? ORDER BY target_id", (scope.value,)
            ).fetchall()
        return [StoredDesired(r[0], r[1], bytes(r[2])) for r in rows]

    def forget_desired(self, scope: Scope, target_id: str) -> None:
        with self._lock:
            self._db.execute(_FORGET_DESIRED, (scope.value, target_id))

    def store_device_desired(
        self, documents: list[tuple[str, int, bytes]], cleared: Iterable[str], learned_from: LearnedFrom
    ) -> set[str]:
        """In one transaction: register each device of ``documents`` (device id, version, document) and keep its
        document, and forget the ``cleared`` devices with their documents. Returns the devices whose document
        changed (a document stored already, byte for byte, is not written again)."""
        changed: set[str] = set()
        now = _now()
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for device_id in cleared:
                    self._db.execute(_FORGET_DESIRED, (Scope.DEVICE.value, device_id))
                    self._forget_device(device_id)
                for device_id, version, payload in documents:
                    self._db.execute(
                        _ADD_DEVICE,
                        (device_id, learned_from.value, now),
                    )
                    row = self._db.execute(
                        "SELECT payload FROM desired WHERE scope = ? AND target_id = ?", (Scope.DEVICE.value, device_id)
                    ).fetchone()
                    if row is not None and bytes(row[0]) == payload:
                        continue
                    self._db.execute(
                        _UPSERT_DESIRED,
                        (Scope.DEVICE.value, device_id, version, payload, now),
                    )
                    changed.add(device_id)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return changed

    # ---- device registry ----------------------------------------------------------------------------
    def add_device(self, device_id: str, learned_from: LearnedFrom) -> bool:
        """Register ``device_id``; ``True`` when it was not known before."""
        with self._lock:
            cursor = self._db.execute(
                _ADD_DEVICE,
                (device_id, learned_from.value, _now()),
            )
        return cursor.rowcount == 1

    def has_device(self, device_id: str) -> bool:
        with self._lock:
            return self._db.execute("SELECT 1 FROM devices WHERE device_id = ?", (device_id,)).fetchone() is not None

    def devices(self) -> list[str]:
        with self._lock:
            return [r[0] for r in self._db.execute("SELECT device_id FROM devices ORDER BY device_id")]

    def forget_device(self, device_id: str) -> None:
        with self._lock:
            self._forget_device(device_id)

    def _forget_device(self, device_id: str) -> None:  # the lock held
        self._db.execute("DELETE FROM devices WHERE device_id = ?", (device_id,))
        self._db.execute("DELETE FROM device_seq WHERE device_id = ?", (device_id,))

    # ---- outbox -------------------------------------------------------------------------------------
    def enqueue(self, topic: str, payload: bytes, qos: int, retain: bool) -> int:
        """Append a message for the hub; returns its outbox id (delivery order)."""
        with self._lock:
            cursor = self._db.execute(
                "INSERT INTO outbox (topic, payload, qos, retain, created_at) VALUES (?, ?, ?, ?, ?)",
                (topic, payload, qos, int(retain), _now()),
            )
            self._outbox_size += 1
        return int(cursor.lastrowid or 0)

    def enqueue_many(self, rows: list[tuple[str, bytes, int, bool]], seqs: dict[str, int] | None = None) -> None:
        """Append messages for the hub in one transaction (one fsync for a burst), in order; ``seqs``: the
        devices' highest event seq among them, recorded in the same transaction."""
        if not rows and not seqs:
            return
        created = _now()
        with self._lock:
            self._db.execute("BEGIN")
            try:
                self._db.executemany(
                    "INSERT INTO outbox (topic, payload, qos, retain, created_at) VALUES (?, ?, ?, ?, ?)",
                    [(topic, payload, qos, int(retain), created) for topic, payload, qos, retain in rows],
                )
                if seqs:
                    self._db.executemany(
                        "INSERT INTO device_seq (device_id, seq) VALUES (?, ?) "
                        "ON CONFLICT (device_id) DO UPDATE SET seq = MAX(seq, excluded.seq)",
                        list(seqs.items()),
                    )
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
            self._outbox_size += len(rows)

    def device_seqs(self) -> dict[str, int]:
        """Per device, the highest event seq stored."""
        with self._lock:
            return dict(self._db.execute("SELECT device_id, seq FROM device_seq").fetchall())

    def outbox_head(self, limit: int) -> list[OutboxRow]:
        """The oldest ``limit`` messages, oldest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT id, topic, payload, qos, retain FROM outbox ORDER BY id LIMIT ?", (limit,)
            ).fetchall()
        return [OutboxRow(r[0], r[1], bytes(r[2]), r[3], bool(r[4])) for r in rows]

    def delete_outbox(self, ids: Iterable[int]) -> None:
        """Drop delivered messages (one transaction)."""
        ids = list(ids)
        if not ids:
            return
        with self._lock:
            self._db.execute("BEGIN")
            try:
                deleted = self._db.executemany("DELETE FROM outbox WHERE id = ?", [(i,) for i in ids]).rowcount
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
            self._outbox_size -= deleted

    def outbox_size(self) -> int:
        """Messages waiting for the hub (kept in memory: asked for every enqueue)."""
        return self._outbox_size
