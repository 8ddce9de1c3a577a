"""What the device keeps between runs besides its identity: the event sequence and the desired state."""

from __future__ import annotations

from pathlib import Path

import pytest

import device.sequence
from device.desired import DesiredStore
from device.errors import StoredStateError
from device.sequence import EventSequence
from interfaces.messages import DesiredBody


def test_sequence_continues_exactly_after_a_clean_restart(tmp_path: Path) -> None:
    first = EventSequence(tmp_path / "seq", block=100)
    used = [first.next() for _ in range(5)]
    first.close()

    second = EventSequence(tmp_path / "seq", block=100)

    assert used == [0, 1, 2, 3, 4]
    assert second.next() == 5


def test_sequence_never_repeats_after_a_crash_and_writes_once_per_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writes: list[bytes] = []
    real_write = device.sequence.write_atomic
    monkeypatch.setattr(
        device.sequence, "write_atomic", lambda path, data: (writes.append(data), real_write(path, data))
    )
    crashed = EventSequence(tmp_path / "seq", block=10)
    used = [crashed.next() for _ in range(25)]  # no close(): the process died
    durable_writes = len(writes)

    restarted = EventSequence(tmp_path / "seq", block=10)
    after = restarted.next()

    assert durable_writes == 3  # blocks [0,10), [10,20), [20,30)
    assert after > max(used)
    assert after == 30


def test_an_unreadable_sequence_is_refused_rather_than_restarted_at_zero(tmp_path: Path) -> None:
    (tmp_path / "seq").write_text("garbage")

    with pytest.raises(StoredStateError, match="sequence number"):
        EventSequence(tmp_path / "seq")


def test_desired_store_takes_only_newer_versions_and_remembers_what_was_applied(tmp_path: Path) -> None:
    store = DesiredStore(tmp_path / "desired.json")

    assert store.offer(DesiredBody(version=3, spec={"rate": 1}), "m-1")
    assert not store.offer(DesiredBody(version=3, spec={"rate": 1}))  # retained redelivery
    assert not store.offer(DesiredBody(version=2, spec={"rate": 0}))  # stale
    assert store.record.pending
    store.applied(3, {"rate": 1, "ok": True})

    restarted = DesiredStore(tmp_path / "desired.json").record
    assert (restarted.version, restarted.spec, restarted.applied_version, restarted.status) == (
        3,
        {"rate": 1},
        3,
        {"rate": 1, "ok": True},
    )
    assert not restarted.pending
    assert restarted.message_id == "m-1"


def test_desired_stored_but_not_applied_is_still_pending_after_a_restart(tmp_path: Path) -> None:
    DesiredStore(tmp_path / "desired.json").offer(DesiredBody(version=1, spec={"a": 1}))

    record = DesiredStore(tmp_path / "desired.json").record

    assert record.pending and record.version == 1 and record.applied_version == -1


def test_a_corrupt_desired_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "desired.json").write_text("{not json")

    with pytest.raises(StoredStateError, match="desired.json"):
        DesiredStore(tmp_path / "desired.json")
