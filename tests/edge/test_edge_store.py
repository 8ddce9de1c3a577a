"""The edge's SQLite store: desired documents, the device registry and the outbox survive a restart."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from edge.store import EdgeStore, LearnedFrom, Scope


def test_outbox_keeps_order_and_survives_a_restart(tmp_path: Path) -> None:
    store = EdgeStore(tmp_path / "edge.db")
    ids = [store.enqueue(f"t/{i}", f"p{i}".encode(), 1, i == 0) for i in range(5)]

    store.delete_outbox(ids[:2])
    store.close()
    reopened = EdgeStore(tmp_path / "edge.db")

    head = reopened.outbox_head(10)
    assert [(r.topic, r.payload, r.qos, r.retain) for r in head] == [
        (f"t/{i}", f"p{i}".encode(), 1, False) for i in (2, 3, 4)
    ]
    assert reopened.outbox_size() == 3
    assert [r.id for r in reopened.outbox_head(2)] == ids[2:4]
    later = reopened.enqueue("t/5", b"p5", 1, False)
    assert later > ids[-1]  # AUTOINCREMENT: an id is never reused, so order holds across deletions


def test_deleting_an_unknown_id_does_not_skew_the_size(tmp_path: Path) -> None:
    store = EdgeStore(tmp_path / "edge.db")
    first = store.enqueue("t", b"p", 1, False)

    store.delete_outbox([first, first + 100])
    store.delete_outbox([])

    assert store.outbox_size() == 0


def test_desired_documents_are_kept_per_scope_and_replaced(tmp_path: Path) -> None:
    store = EdgeStore(tmp_path / "edge.db")

    store.put_desired(Scope.DEVICE, "dev-1", 1, b"one")
    store.put_desired(Scope.DEVICE, "dev-1", 2, b"two")
    store.put_desired(Scope.NODE, "dev-1", 7, b"node")
    store.put_desired(Scope.DEVICE, "dev-2", 1, b"other")

    assert store.desired(Scope.DEVICE, "dev-1") is not None
    assert (store.desired(Scope.DEVICE, "dev-1").version, store.desired(Scope.DEVICE, "dev-1").payload) == (2, b"two")  # type: ignore[union-attr]
    assert store.desired(Scope.NODE, "dev-1").payload == b"node"  # type: ignore[union-attr]
    assert [d.target_id for d in store.all_desired(Scope.DEVICE)] == ["dev-1", "dev-2"]
    store.forget_desired(Scope.DEVICE, "dev-1")
    assert store.desired(Scope.DEVICE, "dev-1") is None


def test_registry_learns_each_device_once(tmp_path: Path) -> None:
    store = EdgeStore(tmp_path / "edge.db")

    assert store.add_device("dev-1", LearnedFrom.DESIRED) is True
    assert store.add_device("dev-1", LearnedFrom.ENROLMENT) is False
    store.add_device("dev-0", LearnedFrom.ENROLMENT)

    assert store.devices() == ["dev-0", "dev-1"]
    assert store.has_device("dev-1") and not store.has_device("dev-9")
    store.forget_device("dev-1")
    assert not store.has_device("dev-1")


def test_the_store_is_in_wal_mode(tmp_path: Path) -> None:
    EdgeStore(tmp_path / "edge.db").close()

    with sqlite3.connect(tmp_path / "edge.db") as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
