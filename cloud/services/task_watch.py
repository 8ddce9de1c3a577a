"""Wake-ups for the task log streams (``GET /tasks/{id}/logs`` as Server-Sent Events).

A commit that adds a task's log lines, or changes the task or one of its workers, wakes the streams of that task in
this process at once (:func:`touched` marks what a transaction changed; rows added through the ORM are marked on
their own). Streams also read the database every ``sse_poll_s``, for what other hub replicas commit.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from cloud.tables import Task, TaskLog, TaskWorker

_CHANGED = "aisynergy.tasks_changed"


class Waiter:
    """One stream's wake-up: set from any thread, awaited on its event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.event = asyncio.Event()

    def wake(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self.event.set)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    async def wait(self, timeout_s: float) -> bool:
        """True when woken before ``timeout_s``; clears the wake-up either way."""
        try:
            await asyncio.wait_for(self.event.wait(), timeout_s)
            return True
        except TimeoutError:
            return False
        finally:
            self.event.clear()


class TaskWatch:
    """The streams waiting on each task of one database."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: dict[str, set[Waiter]] = {}

    def subscribe(self, task_id: str) -> Waiter:
        waiter = Waiter(asyncio.get_running_loop())
        with self._lock:
            self._waiters.setdefault(task_id, set()).add(waiter)
        return waiter

    def unsubscribe(self, task_id: str, waiter: Waiter) -> None:
        with self._lock:
            waiters = self._waiters.get(task_id)
            if waiters is not None:
                waiters.discard(waiter)
                if not waiters:
                    del self._waiters[task_id]

    def notify(self, task_ids: set[str]) -> None:
        with self._lock:
            woken = [w for task_id in task_ids for w in self._waiters.get(task_id, ())]
        for waiter in woken:
            waiter.wake()

    def waiting(self, task_id: str) -> int:
        with self._lock:
            return len(self._waiters.get(task_id, ()))


_watches: weakref.WeakKeyDictionary[Engine, TaskWatch] = weakref.WeakKeyDictionary()
_watches_lock = threading.Lock()


def watch(engine: Engine) -> TaskWatch:
    """The watch of ``engine``'s database in this process."""
    with _watches_lock:
        found = _watches.get(engine)
        if found is None:
            found = _watches[engine] = TaskWatch()
        return found


def touched(session: Session, task_id: str) -> None:
    """``task_id`` changed in this transaction in a way the ORM does not see (a bulk insert of its log lines)."""
    session.info.setdefault(_CHANGED, set()).add(task_id)


@event.listens_for(Session, "before_flush")
def _mark(session: Session, _context: Any, _instances: Any) -> None:
    for row in (*session.new, *session.dirty):
        if isinstance(row, TaskLog | TaskWorker):
            touched(session, row.task_id)
        elif isinstance(row, Task):
            touched(session, row.id)


@event.listens_for(Session, "after_commit")
def _notify(session: Session) -> None:
    changed = session.info.pop(_CHANGED, None)
    if not changed:
        return
    try:
        bind = session.get_bind()
    except Exception:  # noqa: BLE001 - a session bound to no engine has no streams to wake
        return
    if isinstance(bind, Engine):
        with _watches_lock:
            found = _watches.get(bind)
        if found is not None:
            found.notify(changed)


@event.listens_for(Session, "after_rollback")
def _forget(session: Session) -> None:
    session.info.pop(_CHANGED, None)
