"""The task and worker lifecycle (DESIGN §4.3): their legal moves, and ending them.

A task moves only along ``interfaces.tasks.TASK_TRANSITIONS`` (:func:`move_task`; anything else is
``IllegalTaskTransition``), a worker along ``worker_path`` (:func:`move_worker`), and every move is a
transition row. A worker that leaves the active states, and a task that ends (:func:`finish`), are told to its
kind (``worker_ended``, ``task_ended``). Chunks, the third lifecycle, are :mod:`cloud.tasks.chunks`.
"""

from __future__ import annotations

import logging
from datetime import datetime

from sqlalchemy import select
from sqlmodel import Session

from cloud.tables import Task, TaskTransitionRow, TaskWorker, WorkerTransitionRow
from cloud.tasks.kind import kind_of
from cloud.tasks.orders import withdraw_worker_order
from cloud.tasks.rows import hub_log
from interfaces.tasks import TASK_FINAL, TASK_TRANSITIONS, WORKER_ACTIVE, IllegalTaskTransition, TaskState, WorkerState, worker_path

log = logging.getLogger("aisynergy.hub.tasks")
_T, _W = TaskState, WorkerState


def move_task(session: Session, task: Task, target: TaskState, reason: str, at: datetime) -> None:
    current = TaskState(task.state)
    if current == target:
        return
    if target not in TASK_TRANSITIONS[current]:
        raise IllegalTaskTransition(current, target)
    session.add(TaskTransitionRow(task_id=task.id, from_state=current.value, to_state=target.value, at=at, reason=reason))
    task.state = target.value
    task.reason = reason
    task.updated_at = at
    if target in TASK_FINAL:
        task.finished_at = at
    session.add(task)
    hub_log(session, task.id, f"task {current.value} -> {target.value}" + (f": {reason}" if reason else ""), "error" if target in (_T.FAILED, _T.TIMED_OUT) else "info", at)
    log.info("task %s: %s -> %s %s", task.id, current.value, target.value, reason)


def move_worker(session: Session, worker: TaskWorker, target: WorkerState, reason: str, at: datetime) -> None:
    for step in worker_path(WorkerState(worker.state), target):
        session.add(WorkerTransitionRow(worker_id=worker.id, from_state=worker.state, to_state=step.value, at=at, reason=reason))
        worker.state = step.value
        if step is _W.RUNNING and worker.started_at is None:
            worker.started_at = at
    if target not in WORKER_ACTIVE:
        worker.finished_at = at
    worker.detail = reason[:2048]
    worker.updated_at = at
    session.add(worker)
    if target not in WORKER_ACTIVE:
        task = session.get(Task, worker.task_id)
        if task is not None:
            kind_of(task.type).worker_ended(session, task, worker, target, at)


def active_workers(session: Session, task_id: str) -> list[TaskWorker]:
    return list(session.execute(
        select(TaskWorker).where(TaskWorker.task_id == task_id, TaskWorker.state.in_([s.value for s in WORKER_ACTIVE])).order_by(TaskWorker.id)  # type: ignore[attr-defined]
    ).scalars())  # fmt: skip


def end_workers(session: Session, task: Task, running_to: WorkerState, reason: str, at: datetime) -> bool:
    """Take every active worker of ``task`` out (RUNNING ones to ``running_to``, QUEUED ones CANCELED) and
    withdraw their orders; True if an order changed."""
    changed = False
    for worker in active_workers(session, task.id):
        target = running_to if worker.state == _W.RUNNING.value else _W.CANCELED
        move_worker(session, worker, target, reason, at)
        changed |= withdraw_worker_order(session, worker.target_kind, worker.target_id, worker.id)
    return changed


def finish(session: Session, task: Task, state: TaskState, reason: str, at: datetime) -> bool:
    """End ``task`` in ``state``; RUNNING workers SUCCEED when the task did, else they are CANCELED."""
    move_task(session, task, state, reason, at)
    changed = end_workers(session, task, _W.SUCCEEDED if state is _T.SUCCEEDED else _W.CANCELED, f"task {state.value}: {reason}", at)
    kind_of(task.type).task_ended(session, task, at)
    return changed
