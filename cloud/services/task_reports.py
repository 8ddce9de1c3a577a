"""What task workers report on ``events`` (DESIGN §4.3), applied in the ingest's transaction.

Every report names its worker; it counts only from the target that worker runs on (a device cannot
speak for another's worker). In arrival order:

* ``task.worker`` (``WorkerReport``): RUNNING moves a QUEUED worker to RUNNING (and the task from
  SCHEDULED to RUNNING) and refreshes ``last_report_at`` (the worker's heartbeat); SUCCEEDED, FAILED and
  REJECTED end it. A FAILED or REJECTED worker's unfinished chunks go back to PENDING with one more attempt
  and a back-off (``RetryPolicy.delay``); the scheduler gives them to another worker. A report for a worker
  that already ended is late news and ignored.
* ``task.log`` lines and ``task.metrics`` samples are kept once each (by event id and line number).
* ``task.output`` and the updates of a kind (``fl.update``, ``fl.key``, ``fl.reveal``) are the kind's to keep or
  refuse (``TaskKind.accept``; a kind that takes none refuses them). A batch task's ``task.output`` is a chunk's outputs (``cloud.tasks.lifecycle``), kept
  if the chunk is ASSIGNED to that worker and the worker is still active; the frame must be safetensors whose
  tensors all have the chunk's row count first. Any other copy (a duplicate, a late one from a worker that was
  declared LOST) is refused and counted: no input is ever stored with two outputs. An ``incremental_training``
  worker's output is its trained layer (``cloud.incremental.results.accept``), and its SUCCEEDED report without
  one counts as FAILED (``TaskKind.success_refused``); a federated round's update, a device's key and a
  survivor's seeds are ``cloud.fl.rounds``'.

Returns outcome counts (``task_<kind>_<outcome>``) and whether the scheduler should look now.
"""

from __future__ import annotations

import logging
from collections import Counter
from datetime import datetime
from typing import Any

from pydantic import ValidationError
from sqlalchemy import insert, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlmodel import Session

from cloud.services import task_watch
from cloud.tables import Task, TaskLog, TaskMetric, TaskWorker
from cloud.tasks.lifecycle import hub_log, move_task, move_worker, release_chunks
from cloud.tasks.kind import kind_of
from interfaces.messages import Envelope, EventBody, ExecutionEvent, acted_event
from interfaces.tasks import (
    WORKER_ACTIVE,
    TaskReportData,
    TaskState,
    WorkerLog,
    WorkerMetrics,
    WorkerReport,
    WorkerState,
)

log = logging.getLogger("aisynergy.hub.tasks")
Report = tuple[str, str, Envelope[EventBody], datetime]  # target kind, target id, the event, when the hub received it


def apply(session: Session, reports: list[Report]) -> tuple[Counter[str], bool]:
    counts: Counter[str] = Counter()
    parsed: list[tuple[str, str, Envelope[EventBody], datetime, TaskReportData]] = []
    for kind, target_id, message, at in reports:
        try:
            event = acted_event(message.body)
            if event is None or isinstance(event, ExecutionEvent):
                raise KeyError(f"{message.body.type} is not a task event")
            parsed.append((kind, target_id, message, at, event.data))
        except (KeyError, ValidationError) as exc:
            counts[f"task_{message.body.type.split('.')[-1]}_malformed"] += 1
            log.warning("malformed %s report %s from %s: %s", message.body.type, message.id, target_id, str(exc).splitlines()[0])
    if not parsed:
        return counts, False
    ids = {p[4].worker_id for p in parsed}
    workers = {w.id: w for w in session.execute(select(TaskWorker).where(TaskWorker.id.in_(ids))).scalars()}  # type: ignore[attr-defined]
    tasks: dict[str, Task] = {}
    poke = False
    for kind, target_id, message, at, data in parsed:
        name = message.body.type.split(".")[-1]
        worker = workers.get(data.worker_id)
        if worker is None or worker.task_id != data.task_id:
            counts[f"task_{name}_unknown"] += 1
            continue
        if worker.target_id != target_id or worker.target_kind != kind:
            counts[f"task_{name}_wrong_target"] += 1
            log.warning("%s %s claims worker %s of %s; refused", kind, target_id, worker.id, worker.target_id)
            continue
        task = tasks.get(worker.task_id)
        if task is None:
            task = tasks[worker.task_id] = session.get(Task, worker.task_id, with_for_update=True)  # type: ignore[assignment]
            if task is None:
                counts[f"task_{name}_unknown"] += 1
                continue
        if isinstance(data, WorkerReport):
            outcome, wake = _report(session, task, worker, data, at)
        elif isinstance(data, WorkerLog):
            outcome, wake = _log(session, task, worker, message, data), False
        elif isinstance(data, WorkerMetrics):
            outcome, wake = _metrics(session, task, worker, message, data, at), False
        else:  # an output or an update: the kind's (a chunk's outputs, a trained layer, a round's update, ...)
            outcome, wake = kind_of(task.type).accept(session, task, worker, kind, target_id, data, at)
        poke |= wake
        counts[f"task_{name}_{outcome}"] += 1
    return counts, poke


def _report(session: Session, task: Task, worker: TaskWorker, data: WorkerReport, at: datetime) -> tuple[str, bool]:
    state = WorkerState(worker.state)
    if state not in WORKER_ACTIVE:
        return "late", False
    worker.last_report_at = at
    worker.updated_at = at
    worker.paused = data.paused
    if data.items_done is not None:
        worker.items_done = data.items_done
    session.add(worker)
    if data.state is WorkerState.RUNNING:
        if state is WorkerState.QUEUED:
            move_worker(session, worker, WorkerState.RUNNING, data.detail or "started", at)
            hub_log(session, task.id, f"worker {worker.id} RUNNING on {worker.target_id}", at=at, worker_id=worker.id, target_id=worker.target_id)
        if task.started_at is None and task.state in (TaskState.SCHEDULED.value, TaskState.PAUSED.value):
            task.started_at = at  # a resumed task goes back to RUNNING, not SCHEDULED
        if task.state == TaskState.SCHEDULED.value:
            move_task(session, task, TaskState.RUNNING, "a worker is running", at)
        return "applied", False
    detail = data.detail or data.state.value.lower()
    ended = data.state
    if ended is WorkerState.SUCCEEDED and (refused := kind_of(task.type).success_refused(session, task, worker)) is not None:
        ended, detail = WorkerState.FAILED, refused
    move_worker(session, worker, ended, detail, at)
    level = "info" if ended is WorkerState.SUCCEEDED else "error"
    hub_log(session, task.id, f"worker {worker.id} on {worker.target_id} {ended.value}: {detail}", level, at, worker.id, worker.target_id)
    if ended is not WorkerState.SUCCEEDED:
        release_chunks(session, task, worker, f"{ended.value} on {worker.target_id}: {detail}", at)
    return "applied", True


def _insert_ignoring_duplicates(session: Session, table: Any, rows: list[dict[str, Any]], keys: list[str]) -> int:
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        stmt = postgresql.insert(table).on_conflict_do_nothing(index_elements=keys)
    elif dialect == "sqlite":
        stmt = sqlite.insert(table).on_conflict_do_nothing(index_elements=keys)
    else:  # pragma: no cover - the two supported databases are above
        stmt = insert(table)
    return int(session.connection().execute(stmt, rows).rowcount or 0)


def _log(session: Session, task: Task, worker: TaskWorker, message: Envelope[EventBody], data: WorkerLog) -> str:
    rows = [
        {"task_id": task.id, "worker_id": worker.id, "target_id": worker.target_id, "message_id": message.id, "line": i, "ts": line.ts,
         "level": line.level, "text": line.text}
        for i, line in enumerate(data.lines)
    ]  # fmt: skip
    task_watch.touched(session, task.id)
    return "applied" if _insert_ignoring_duplicates(session, TaskLog, rows, ["message_id", "line"]) else "duplicate"


def _metrics(session: Session, task: Task, worker: TaskWorker, message: Envelope[EventBody], data: WorkerMetrics, at: datetime) -> str:
    row = {"task_id": task.id, "worker_id": worker.id, "target_id": worker.target_id, "message_id": message.id, "ts": data.ts, "values": data.values}
    if WorkerState(worker.state) in WORKER_ACTIVE:
        worker.last_report_at = at
        session.add(worker)
    return "applied" if _insert_ignoring_duplicates(session, TaskMetric, [row], ["message_id"]) else "duplicate"
