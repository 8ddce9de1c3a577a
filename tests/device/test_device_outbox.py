"""The device's event outbox (:mod:`device.outbox`) on real SQLite files: numbering, restarts, durability,
bounds, forgetting and the send cursor."""

from __future__ import annotations

import contextlib
import json
import signal
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from device.errors import NotRunning, OutboxFull, StoredStateError
from device.outbox import OUTBOX_FILE, BuildPayload, Outbox
from tests.support import wait_for

REPO = Path(__file__).resolve().parents[2]
PATIENCE_S = 30.0  # generous: the machine may be busy

Open = Callable[..., Outbox]


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / OUTBOX_FILE


@pytest.fixture
def opened(path: Path) -> Iterator[Open]:
    """Open an outbox on ``path`` (no timed resend unless asked); every one is closed at teardown."""
    outboxes: list[Outbox] = []

    def open_outbox(**options: object) -> Outbox:
        outbox = Outbox(path, **{"ack_timeout_s": 600.0, **options})  # type: ignore[arg-type]
        outboxes.append(outbox)
        return outbox

    yield open_outbox
    for outbox in outboxes:
        outbox.close()


def event(n: int, pad: int = 0) -> BuildPayload:
    """A payload builder like the agent's: the event names its seq and its predecessor's."""
    return lambda seq, prev: json.dumps({"seq": seq, "prev_seq": prev, "n": n, "pad": "x" * pad}).encode()


def stored(path: Path) -> list[dict]:
    """The events on disk, read through a connection of our own."""
    with contextlib.closing(sqlite3.connect(path)) as db:
        return [json.loads(payload) for (payload,) in db.execute("SELECT payload FROM events ORDER BY seq")]


def stored_seqs(path: Path) -> list[int]:
    return [e["seq"] for e in stored(path)]


@contextlib.contextmanager
def write_lock_held(path: Path) -> Iterator[None]:
    """Another connection holds the file's write lock, so the outbox cannot commit until the block ends
    (its committer waits within SQLite's busy timeout, 5 s)."""
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as db:
        db.execute("BEGIN IMMEDIATE")
        try:
            yield
        finally:
            db.execute("ROLLBACK")


def seqs_of(rows: list[tuple[int, bytes]]) -> list[int]:
    return [seq for seq, _ in rows]


# ---- numbering --------------------------------------------------------------------------------------


def test_numbers_are_contiguous_and_each_event_names_its_predecessor(opened: Open, path: Path) -> None:
    outbox = opened()

    seqs = [outbox.append(event(n)) for n in range(5)]

    assert seqs == [0, 1, 2, 3, 4]
    assert [(e["seq"], e["prev_seq"], e["n"]) for e in stored(path)] == [
        (0, None, 0), (1, 0, 1), (2, 1, 2), (3, 2, 3), (4, 3, 4)
    ]  # fmt: skip
    assert outbox.next_seq == 5
    assert outbox.waiting == 5


def test_a_restart_continues_the_sequence(opened: Open, path: Path) -> None:
    first = opened()
    for n in range(3):
        first.append(event(n))
    first.close()

    second = opened()
    seq = second.append(event(3))

    assert seq == 3
    assert stored(path)[-1]["prev_seq"] == 2
    assert second.waiting == 4  # nothing was acknowledged: all of them still wait


def test_a_restart_continues_the_sequence_after_every_event_was_acknowledged_and_forgotten(
    opened: Open, path: Path
) -> None:
    first = opened(forget_after_s=0.05)
    for n in range(3):
        first.append(event(n))
    assert first.acknowledge(2) == 3
    wait_for(lambda: stored(path) == [], PATIENCE_S, what="the acknowledged events forgotten")
    first.close()

    second = opened()
    seq = second.append(event(3))

    assert second.acknowledged == 2
    assert seq == 3
    assert [(e["seq"], e["prev_seq"]) for e in stored(path)] == [(3, 2)]


def test_the_legacy_ceiling_seeds_a_new_outbox_only(opened: Open, path: Path, tmp_path: Path) -> None:
    legacy = tmp_path / "event-seq"
    legacy.write_text("1042\n")  # the older EventSequence's ceiling: every number below it may have been used

    first = opened(legacy_sequence=legacy)
    seqs = [first.append(event(n)) for n in range(2)]
    first.close()
    legacy.write_text("5000\n")
    second = opened(legacy_sequence=legacy)

    assert seqs == [1042, 1043]
    assert stored(path)[0]["prev_seq"] is None  # nothing kept before it
    assert second.next_seq == 1044  # an outbox that holds events ignores the file


@pytest.mark.parametrize("content", ["not a number\n", "-3\n", None], ids=["text", "negative", "directory"])
def test_an_unreadable_legacy_ceiling_is_refused(path: Path, tmp_path: Path, content: str | None) -> None:
    legacy = tmp_path / "event-seq"
    if content is None:
        legacy.mkdir()
    else:
        legacy.write_text(content)

    with pytest.raises(StoredStateError, match="event-seq"):
        Outbox(path, legacy_sequence=legacy)


def test_a_refusing_payload_builder_consumes_no_number(opened: Open, path: Path) -> None:
    outbox = opened()

    def invalid(seq: int, prev: int | None) -> bytes:
        raise ValueError("not an event")

    with pytest.raises(ValueError, match="not an event"):
        outbox.append(invalid)
    seq = outbox.append(event(1))

    assert seq == 0
    assert [(e["seq"], e["prev_seq"]) for e in stored(path)] == [(0, None)]
    assert outbox.waiting == 1


# ---- durability -------------------------------------------------------------------------------------

_APPENDER = """
import sys
from pathlib import Path
from device.outbox import Outbox

outbox = Outbox(Path(sys.argv[1]), durable=True)
n = 0
while True:
    seq = outbox.append(lambda seq, prev: b'{"seq": %d, "prev_seq": null, "n": %d}' % (seq, n))
    print(seq, flush=True)
    n += 1
"""


def test_a_durable_append_is_on_disk_when_it_returns_even_if_the_process_is_killed(path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", _APPENDER, str(path)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        returned = [int(child.stdout.readline()) for _ in range(20)]  # append() had returned for each
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(PATIENCE_S)

    on_disk = stored_seqs(path)
    reopened = Outbox(path)
    try:
        assert returned == list(range(20))
        assert set(returned) <= set(on_disk)
        assert on_disk == list(range(len(on_disk)))  # no hole, whatever the kill interrupted
        assert reopened.next_seq == on_disk[-1] + 1
    finally:
        reopened.close()


def test_a_durable_append_returns_only_after_its_commit_and_concurrent_ones_share_it(
    opened: Open, path: Path
) -> None:
    # Prepare: nothing can commit while another connection holds the write lock
    commits: list[int] = []
    outbox = opened(on_committed=lambda: commits.append(1))
    returned: dict[int, int] = {}
    emitters = [
        threading.Thread(target=lambda n=n: returned.__setitem__(n, outbox.append(event(n)))) for n in range(12)
    ]

    # Execute: twelve emitters at once
    with write_lock_held(path):
        for emitter in emitters:
            emitter.start()
        wait_for(lambda: outbox.waiting == 12, PATIENCE_S, what="twelve events staged")
        blocked = [e.is_alive() for e in emitters]
    for emitter in emitters:
        emitter.join(PATIENCE_S)

    # Assert: none returned before the commit, all did after it, in a transaction or two (one may have started
    # with the first event alone before the lock stopped it), not twelve
    assert all(blocked)
    assert sorted(returned.values()) == list(range(12))
    assert stored_seqs(path) == list(range(12))
    assert 1 <= len(commits) <= 2


def test_a_fast_append_does_not_wait_for_its_commit(opened: Open, path: Path) -> None:
    commits: list[int] = []
    outbox = opened(durable=False, commit_window_s=0.05, on_committed=lambda: commits.append(1))

    with write_lock_held(path):  # a durable append would wait here for as long as the lock is held
        seqs = [outbox.append(event(n)) for n in range(10)]
        before = stored_seqs(path)
    # committed, and told so (the callback follows the commit: on a busy machine the rows show first)
    wait_for(lambda: stored_seqs(path) == list(range(10)) and commits, PATIENCE_S, what="the window's events committed")

    assert seqs == list(range(10))
    assert before == []
    assert 1 <= len(commits) <= 2  # the window's events share a transaction


def test_fast_mode_commits_each_window_without_being_asked(opened: Open, path: Path) -> None:
    outbox = opened(durable=False, commit_window_s=0.05)

    outbox.append(event(0))
    wait_for(lambda: stored_seqs(path) == [0], PATIENCE_S, what="the event committed")
    outbox.append(event(1))

    wait_for(lambda: stored_seqs(path) == [0, 1], PATIENCE_S, what="the next window's event committed")


def test_close_commits_what_is_staged(opened: Open, path: Path) -> None:
    outbox = opened(durable=False, commit_window_s=0.5)
    for n in range(3):
        outbox.append(event(n))

    outbox.close()

    assert stored_seqs(path) == [0, 1, 2]
    with pytest.raises(NotRunning):
        outbox.append(event(3))


# ---- bounds -----------------------------------------------------------------------------------------


def test_a_full_outbox_refuses_by_count_and_stores_nothing(opened: Open, path: Path) -> None:
    outbox = opened(max_events=3)
    for n in range(3):
        outbox.append(event(n))

    with pytest.raises(OutboxFull):
        outbox.append(event(3))
    refused_next = outbox.next_seq
    outbox.acknowledge(0)
    seq = outbox.append(event(4))

    assert refused_next == 3
    assert seq == 3  # no number was lost to the refusal: no hole for the edge
    assert [(e["seq"], e["prev_seq"], e["n"]) for e in stored(path)][-1] == (3, 2, 4)
    assert 3 not in [e["n"] for e in stored(path)]


def test_a_full_outbox_refuses_by_bytes_and_stores_nothing(opened: Open, path: Path) -> None:
    two = len(event(0, pad=200)(0, None)) + len(event(1, pad=200)(1, 0))
    outbox = opened(max_bytes=two)  # exactly the first two events' bytes
    outbox.append(event(0, pad=200))
    outbox.append(event(1, pad=200))

    with pytest.raises(OutboxFull):
        outbox.append(event(2, pad=200))

    assert stored_seqs(path) == [0, 1]
    assert outbox.next_seq == 2
    assert outbox.waiting == 2


# ---- acknowledgements and the send cursor -----------------------------------------------------------


def test_acknowledged_events_are_forgotten(opened: Open, path: Path) -> None:
    outbox = opened(forget_after_s=0.05)
    for n in range(5):
        outbox.append(event(n))

    done = outbox.acknowledge(2)

    assert done == 3
    assert outbox.acknowledged == 2
    assert outbox.waiting == 2
    wait_for(lambda: stored_seqs(path) == [3, 4], PATIENCE_S, what="events 0-2 gone from the file")
    assert outbox.acknowledge(1) == 0  # old news


def test_an_acknowledgement_beyond_what_is_committed_is_clamped(opened: Open, path: Path) -> None:
    outbox = opened()
    for n in range(3):
        outbox.append(event(n))

    done = outbox.acknowledge(10)
    later = outbox.append(event(3))

    assert done == 3
    assert outbox.acknowledged == 2
    assert later == 3
    assert seqs_of(outbox.sendable(True)) == [3]  # the clamp swallowed nothing that came after


def test_only_committed_events_are_sendable(opened: Open, path: Path) -> None:
    outbox = opened(durable=False, commit_window_s=0.05)

    with write_lock_held(path):
        outbox.append(event(0))
        outbox.append(event(1))
        before = outbox.sendable(True)

    assert before == []
    rows = wait_for(lambda: outbox.sendable(True), PATIENCE_S, what="committed events to send")
    assert isinstance(rows, list) and seqs_of(rows) == [0, 1]


def test_sendable_hands_out_committed_events_in_order_within_the_window(opened: Open, path: Path) -> None:
    outbox = opened(window=3)
    for n in range(5):
        outbox.append(event(n))

    offline = outbox.sendable(False)
    first = outbox.sendable(True)
    full = outbox.sendable(True)
    outbox.acknowledge(0)
    after_one = outbox.sendable(True)
    outbox.acknowledge(3)
    after_more = outbox.sendable(True)
    outbox.acknowledge(4)
    nothing_left = outbox.sendable(True)

    assert offline == []
    assert seqs_of(first) == [0, 1, 2]
    assert [json.loads(payload)["n"] for _, payload in first] == [0, 1, 2]  # the stored bytes, unchanged
    assert full == []  # three in flight: the window is full
    assert seqs_of(after_one) == [3]
    assert seqs_of(after_more) == [4]
    assert nothing_left == []
    assert outbox.waiting == 0


def test_rewind_and_a_resend_request_send_again_from_the_first_unacknowledged(opened: Open) -> None:
    outbox = opened()
    for n in range(4):
        outbox.append(event(n))
    assert seqs_of(outbox.sendable(True)) == [0, 1, 2, 3]
    outbox.acknowledge(0)

    outbox.rewind()
    after_rewind = outbox.sendable(True)
    outbox.acknowledge(1, resend=True)
    after_resend = outbox.sendable(True)
    outbox.acknowledge(None, resend=True)  # an edge that has stored none of them yet
    after_none = outbox.sendable(True)

    assert seqs_of(after_rewind) == [1, 2, 3]
    assert seqs_of(after_resend) == [2, 3]
    assert seqs_of(after_none) == [2, 3]


def test_no_acknowledgement_in_time_sends_the_newest_event_again_and_the_rest_when_the_edge_asks(opened: Open) -> None:
    outbox = opened(ack_timeout_s=0.1, ack_timeout_cap_s=0.2)
    for n in range(3):
        outbox.append(event(n))
    assert seqs_of(outbox.sendable(True)) == [0, 1, 2]
    outbox.acknowledge(0)

    # no acknowledgement in time: the newest event sent goes again, alone (a probe behind the others)
    probe = wait_for(lambda: outbox.sendable(True), PATIENCE_S, what="the probe")
    assert isinstance(probe, list) and seqs_of(probe) == [2]
    assert outbox.sendable(True) == []  # nothing more until the edge answers, or the next timeout
    # an edge that lost 1 and 2 sees a hole before the probe and asks for a resend: all of them go again
    outbox.acknowledge(0, resend=True)
    assert seqs_of(outbox.sendable(True)) == [1, 2]
    outbox.acknowledge(2)
    assert outbox.waiting == 0


def test_an_edge_that_has_the_events_answers_the_probe_and_nothing_is_sent_twice(opened: Open) -> None:
    outbox = opened(ack_timeout_s=0.1, ack_timeout_cap_s=0.2)
    for n in range(4):
        outbox.append(event(n))
    assert seqs_of(outbox.sendable(True)) == [0, 1, 2, 3]

    probe = wait_for(lambda: outbox.sendable(True), PATIENCE_S, what="the probe")
    outbox.acknowledge(3)  # the duplicate's answer: everything is stored

    assert isinstance(probe, list) and seqs_of(probe) == [3]
    assert outbox.waiting == 0 and outbox.sendable(True) == []
