"""Tasks and their workers (DESIGN §4.3): creation, actions, orders, wire models, logs, metrics, outputs.

Rules:

* **Creation** (``create``). The type must be runnable (``TASK_TYPES[type].spec`` is not None; else 422)
  and the spec must validate into its model (422 with the errors). Named target ids must exist (422) and
  not be on a LOCKED node (409 ``target_locked``). A ``batch_inference`` task's inputs must be a stored
  artefact of kind ``dataset`` whose first axis is read now (npy header or safetensors header); its
  chunks (``chunk_size`` rows each) are created with the task. The task starts PENDING (``held`` when
  created with ``start=false``); the scheduler (cloud/scheduler.py) places it.
* **Actions** (``act``): ``start`` (a held PENDING task), ``pause`` (SCHEDULED or RUNNING; worker orders
  say pause), ``resume`` (PAUSED; the deadline moves by the time spent paused), ``stop`` (any active state:
  a service type SUCCEEDS, a finite one is CANCELED), ``cancel`` (any active state), ``retry`` (FAILED,
  CANCELED or TIMED_OUT: back to PENDING, attempt + 1, finished chunks kept). Ending a task ends its active
  workers and withdraws their orders. An action the state refuses is a 409 ``illegal_transition`` with
  ``current_state``. ``DELETE`` removes a final task with everything it recorded (409 while active).
* **Orders** (``cloud.tasks.lifecycle``). A worker's ``WorkerOrder`` sits in its target's ``tasks`` list (one per
  worker id) and the target's ``tasks_version`` goes up on every change, so the bridge republishes its desired
  document.
* **Kinds.** What a type adds is its kind's (``cloud.tasks.kind``; this module has no branch on the type): its
  admission at creation and retry, its part of the orders, its outputs, what it forgets with the task.
  ``batch_inference`` reads its dataset and makes its chunks (``cloud.tasks.kinds``); ``incremental_training``
  admits against the devices' privacy budgets (409 ``privacy_budget_exceeded``; ``cloud.incremental``), and its
  outputs are the published model versions and what each run spent; ``federated_training`` stores the cut model
  and its plan (``cloud.fl``), and its output is the published model; ``split_inference`` cuts the model into
  signed heads and tails (``cloud.split_inference``).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

from pydantic import BaseModel, ValidationError
from sqlalchemy import delete, func, select
from sqlmodel import Session

from cloud.convert import utc
from cloud.errors import BadRequest, Conflict, NotFound, ValidationFailed
from cloud.services.paging import parse_selector_or_400
from cloud.tables import Device, Node, Task, TaskChunk, TaskMetric, TaskLog, TaskTransitionRow, TaskWorker, WorkerTransitionRow
from cloud.tasks.lifecycle import active_workers, finish, first_chunk, gather as gather_chunks, hub_log, items_done, move_task, now, placement_of, retry_of, retry_unfinished, set_order_action, target_table, type_info
from cloud.tasks.kind import HubParts, kind_of
from interfaces.deployments import TargetKind
from interfaces.errors import ErrorCode
from interfaces.ids import is_id, new_id
from interfaces.lifecycle import AdminState, NodeState
from interfaces.tasks import (
    TASK_ACTIVE, TASK_DETAIL, TASK_PUBLIC, TASK_TYPES, MetricSample, Placement, TaskAction, TaskCreate, TaskLogLine, TaskMetrics, TaskOutputs, TaskProgress,
    TaskDetailBody, TaskPublicBody, TaskState, TaskTransition, TaskType, TaskTypeInfo, TensorInfo, WorkerAction, WorkerPublic, WorkerState,
)  # fmt: skip

log = logging.getLogger("aisynergy.hub.tasks")
_T, _W = TaskState, WorkerState


def _validated_spec(body: TaskCreate, info: TaskTypeInfo) -> BaseModel:
    """The spec as its type's model: the REST body's variant holds it validated already (``TaskCreateBody``)."""
    assert info.spec is not None
    if isinstance(body.spec, info.spec):
        return body.spec
    try:
        return info.spec.model_validate(body.spec)
    except ValidationError as exc:
        errors = [{"loc": ["body", "spec", *e["loc"]], "msg": e["msg"], "type": e["type"]} for e in exc.errors()]
        raise ValidationFailed(f"the spec is not a valid {info.spec.__name__}", errors=errors) from None


def _check_targets(session: Session, placement: Placement) -> None:
    if placement.selector:
        parse_selector_or_400(placement.selector)
    if placement.ids is None:
        return
    table = target_table(placement.target)
    rows = {r.id: r for r in session.execute(select(table).where(table.id.in_(placement.ids), table.state != NodeState.DELETED.value)).scalars()}
    unknown = [i for i in placement.ids if i not in rows]
    if unknown:
        raise BadRequest(f"unknown targets: {', '.join(unknown[:20])}", status=422, unknown_ids=unknown)
    node_of = {r.id: (r.node_id if table is Device else r.id) for r in rows.values()}
    locked_nodes = set(session.execute(
        select(Node.id).where(Node.id.in_(set(node_of.values())), Node.admin_state == AdminState.LOCKED.value)  # type: ignore[attr-defined]
    ).scalars())  # fmt: skip
    locked = [i for i in placement.ids if node_of[i] in locked_nodes]
    if locked:
        raise Conflict(f"targets on a LOCKED node: {', '.join(locked[:20])}", code=ErrorCode.TARGET_LOCKED, locked_ids=locked)


def create(session: Session, body: TaskCreate, blobs: Any, signing: Any = None) -> Task:
    info = TASK_TYPES[body.type]
    if info.spec is None:
        raise BadRequest(f"task type {body.type.value} is not available on this hub (runnable: {', '.join(t.value for t, i in TASK_TYPES.items() if i.spec)})", status=422)
    if body.placement.target not in info.targets:
        raise BadRequest(f"task type {body.type.value} does not run on {body.placement.target.value}s", status=422)
    spec = _validated_spec(body, info)
    _check_targets(session, body.placement)
    at = now()
    task = Task(
        id=new_id("task"), name=body.name, type=body.type.value, spec=spec.model_dump(mode="json", exclude_none=True),
        placement=body.placement.model_dump(mode="json", exclude_none=True), timeout_s=body.timeout_s, worker_timeout_s=body.worker_timeout_s,
        heartbeat_s=body.heartbeat_s, retry=body.retry.model_dump(mode="json"), state=_T.PENDING.value, held=not body.start,
        created_at=at, updated_at=at,
    )  # fmt: skip
    task.spec = kind_of(body.type).admit(session, task, spec, body.placement, HubParts(blobs, signing)).model_dump(mode="json", exclude_none=True)
    session.add(task)
    session.add(TaskTransitionRow(task_id=task.id, from_state=None, to_state=_T.PENDING.value, at=at, reason="created" + (" (held)" if task.held else "")))
    hub_log(session, task.id, f"created {task.type} task" + (f" over {task.items_total} inputs in {task.chunks_total} chunks" if task.items_total else "") + (" (held until started)" if task.held else ""), at=at)
    session.commit()
    log.info("task %s (%s) created", task.id, task.type)
    return task


# --- actions ---------------------------------------------------------------------------------------


def get(session: Session, task_id: str, lock: bool = False) -> Task:
    task = session.get(Task, task_id, with_for_update=lock) if is_id(task_id) else None
    if task is None:
        raise NotFound(f"task {task_id} does not exist")
    return task


def _illegal(task: Task, action: TaskAction, why: str = "") -> Conflict:
    return Conflict(f"cannot {action.value} a task that is {task.state}{why}", code=ErrorCode.ILLEGAL_TRANSITION, current_state=task.state)


def act(session: Session, task_id: str, action: TaskAction) -> tuple[Task, bool]:
    """Apply ``action``; returns the task and whether any target's orders changed."""
    task = get(session, task_id, lock=True)
    state, at = TaskState(task.state), now()
    orders = False
    if action is TaskAction.START:
        if state is not _T.PENDING or not task.held:
            raise _illegal(task, action, " (only a task created with start=false and not started yet)" if state is _T.PENDING else "")
        task.held = False
        task.updated_at = at
        hub_log(session, task.id, "started by a user", at=at)
    elif action is TaskAction.PAUSE:
        if state not in (_T.SCHEDULED, _T.RUNNING):
            raise _illegal(task, action)
        move_task(session, task, _T.PAUSED, "paused by a user", at)
        task.paused_at = at
        for worker in active_workers(session, task.id):
            orders |= set_order_action(session, worker, WorkerAction.PAUSE)
    elif action is TaskAction.RESUME:
        if state is not _T.PAUSED:
            raise _illegal(task, action)
        paused_at, deadline = utc(task.paused_at), utc(task.deadline_at)
        if paused_at is not None and deadline is not None:
            task.deadline_at = deadline + (at - paused_at)
        task.paused_at = None
        move_task(session, task, _T.RUNNING if task.started_at else _T.SCHEDULED, "resumed by a user", at)
        for worker in active_workers(session, task.id):
            orders |= set_order_action(session, worker, WorkerAction.RUN)
    elif action in (TaskAction.STOP, TaskAction.CANCEL):
        if state not in TASK_ACTIVE:
            raise _illegal(task, action)
        if action is TaskAction.STOP:
            orders = finish(session, task, _T.SUCCEEDED if type_info(task).service else _T.CANCELED, "stopped by a user", at)
        else:
            orders = finish(session, task, _T.CANCELED, "canceled by a user", at)
    elif action is TaskAction.RETRY:
        if state not in (_T.FAILED, _T.CANCELED, _T.TIMED_OUT):
            raise _illegal(task, action)
        kind_of(task.type).readmit(session, task, at)
        task.attempt += 1
        task.deadline_at = task.finished_at = task.paused_at = task.not_before = None
        task.scheduled_at = None
        retry_unfinished(session, task)
        move_task(session, task, _T.PENDING, f"retry {task.attempt - 1} requested by a user", at)
    session.add(task)
    session.commit()
    return task, orders


def delete_task(session: Session, task_id: str, blobs: Any = None) -> None:
    """Remove a finished task and what it alone holds (``blobs``: the store of the blobs its kind keeps outside artefacts)."""
    task = get(session, task_id, lock=True)
    if TaskState(task.state) in TASK_ACTIVE:
        raise Conflict(f"task {task.id} is {task.state}: cancel it first", code=ErrorCode.ILLEGAL_TRANSITION, current_state=task.state)
    worker_ids = select(TaskWorker.id).where(TaskWorker.task_id == task.id)
    session.execute(delete(WorkerTransitionRow).where(WorkerTransitionRow.worker_id.in_(worker_ids)))  # type: ignore[attr-defined]
    for table in (TaskWorker, TaskChunk, TaskLog, TaskMetric, TaskTransitionRow):
        session.execute(delete(table).where(table.task_id == task.id))  # type: ignore[attr-defined]
    kind = kind_of(task.type)
    own = kind.blobs_of(session, task.id)
    kind.forget(session, task.id)
    session.delete(task)
    session.commit()
    if blobs is not None:
        from cloud.artifacts.records import find_by_sha256, is_delta_blob

        for sha256 in own:
            if find_by_sha256(session, sha256) is None and not is_delta_blob(session, sha256):
                blobs.delete(sha256)


# --- wire ------------------------------------------------------------------------------------------


def worker_counts(session: Session, task_ids: list[str]) -> dict[str, dict[WorkerState, int]]:
    out: dict[str, dict[WorkerState, int]] = defaultdict(dict)
    if task_ids:
        for task_id, state, n in session.execute(
            select(TaskWorker.task_id, TaskWorker.state, func.count()).where(TaskWorker.task_id.in_(task_ids)).group_by(TaskWorker.task_id, TaskWorker.state)  # type: ignore[attr-defined]
        ).all():  # fmt: skip
            out[task_id][WorkerState(state)] = n
    return out


def progress(session: Session, task: Task, counts: dict[WorkerState, int] | None = None) -> TaskProgress:
    sharded = task.chunks_total is not None
    return TaskProgress(
        items_total=task.items_total, items_done=items_done(task, session), chunks_total=task.chunks_total,
        chunks_done=task.chunks_done if sharded else None, workers=counts if counts is not None else worker_counts(session, [task.id]).get(task.id, {}),
    )  # fmt: skip


def to_wire(session: Session, rows: list[Task]) -> list[TaskPublicBody]:
    """The tasks as the REST API answers them, each its type's variant (its spec that type's)."""
    counts = worker_counts(session, [t.id for t in rows])
    return [
        TASK_PUBLIC.validate_python(dict(
            id=t.id, name=t.name, type=TaskType(t.type), spec=t.spec, placement=placement_of(t), timeout_s=t.timeout_s,
            worker_timeout_s=t.worker_timeout_s, heartbeat_s=t.heartbeat_s, retry=retry_of(t), state=TaskState(t.state), reason=t.reason,
            held=t.held, attempt=t.attempt, progress=progress(session, t, counts.get(t.id, {})), created_at=utc(t.created_at),
            updated_at=utc(t.updated_at), started_at=utc(t.started_at), finished_at=utc(t.finished_at), deadline_at=utc(t.deadline_at),
        ))  # fmt: skip
        for t in rows
    ]


def detail(session: Session, task: Task) -> TaskDetailBody:
    history = session.execute(select(TaskTransitionRow).where(TaskTransitionRow.task_id == task.id).order_by(TaskTransitionRow.id)).scalars()
    return TASK_DETAIL.validate_python({
        **dict(to_wire(session, [task])[0]),
        "history": [TaskTransition(from_state=h.from_state, to_state=h.to_state, at=utc(h.at), reason=h.reason) for h in history],
    })


def list_tasks(session: Session, state: TaskState | None, type_: TaskType | None, limit: int, cursor: str | None) -> tuple[list[Task], str | None]:
    from cloud.services.paging import page

    query = select(Task)
    if state is not None:
        query = query.where(Task.state == state.value)
    if type_ is not None:
        query = query.where(Task.type == type_.value)
    return page(session, query, Task.id, limit, cursor)


def workers(session: Session, task_id: str) -> list[WorkerPublic]:
    task = get(session, task_id)
    rows = list(session.execute(select(TaskWorker).where(TaskWorker.task_id == task.id).order_by(TaskWorker.created_at, TaskWorker.id)).scalars())
    history: dict[str, list[TaskTransition]] = defaultdict(list)
    if rows:
        for h in session.execute(
            select(WorkerTransitionRow).where(WorkerTransitionRow.worker_id.in_([w.id for w in rows])).order_by(WorkerTransitionRow.id)  # type: ignore[attr-defined]
        ).scalars():  # fmt: skip
            history[h.worker_id].append(TaskTransition(from_state=h.from_state, to_state=h.to_state, at=utc(h.at), reason=h.reason))
    assigned: dict[str, int] = {}
    if task.chunk_size is not None and rows:
        for worker_id, n in session.execute(
            select(TaskChunk.worker_id, func.count()).where(TaskChunk.task_id == task.id, TaskChunk.worker_id.is_not(None)).group_by(TaskChunk.worker_id)  # type: ignore[union-attr]
        ).all():  # fmt: skip
            assigned[worker_id] = n * task.chunk_size
    return [
        WorkerPublic(
            id=w.id, task_id=w.task_id, target_kind=TargetKind(w.target_kind), target_id=w.target_id, role=w.role, state=WorkerState(w.state),
            attempt=w.attempt, items_assigned=assigned.get(w.id, 0 if task.chunk_size else None) if task.chunk_size else None, items_done=w.items_done,
            accelerators=w.accelerators, detail=w.detail, created_at=utc(w.created_at), started_at=utc(w.started_at), finished_at=utc(w.finished_at),
            last_report_at=utc(w.last_report_at), history=history.get(w.id, []),
        )  # fmt: skip
        for w in rows
    ]


def log_lines(session: Session, task_id: str, after: int, limit: int) -> list[TaskLogLine]:
    rows = session.execute(select(TaskLog).where(TaskLog.task_id == task_id, TaskLog.id > after).order_by(TaskLog.id).limit(limit)).scalars()  # type: ignore[operator]
    return [
        TaskLogLine(id=r.id, task_id=r.task_id, worker_id=r.worker_id, target_id=r.target_id, ts=utc(r.ts), level=r.level, text=r.text)  # type: ignore[arg-type]
        for r in rows
    ]


def metrics(session: Session, task_id: str, series: bool, worker_id: str | None, limit: int = 1000) -> TaskMetrics:
    task = get(session, task_id)
    latest_ids = select(func.max(TaskMetric.id)).where(TaskMetric.task_id == task.id).group_by(TaskMetric.worker_id)
    latest = {m.worker_id: m for m in session.execute(select(TaskMetric).where(TaskMetric.id.in_(latest_ids))).scalars()}  # type: ignore[union-attr]
    totals: dict[str, float] = defaultdict(float)
    for m in latest.values():
        for k, v in m.values.items():
            totals[k] += float(v)
    samples: list[MetricSample] = []
    if series:  # no sample newer than the latest ones read above: the two views agree
        newest = max((m.id for m in latest.values() if m.id is not None), default=0)
        query = select(TaskMetric).where(TaskMetric.task_id == task.id, TaskMetric.id <= newest)  # type: ignore[arg-type,operator]
        if worker_id:
            query = query.where(TaskMetric.worker_id == worker_id)
        rows = list(session.execute(query.order_by(TaskMetric.id.desc()).limit(limit)).scalars())  # type: ignore[union-attr]
        samples = [_sample(m) for m in reversed(rows)]
    workers = {w: _sample(m) for w, m in latest.items() if worker_id is None or w == worker_id}
    return TaskMetrics(task_id=task.id, totals=dict(totals), workers=workers, series=samples)


def _sample(m: TaskMetric) -> MetricSample:
    return MetricSample(worker_id=m.worker_id, target_id=m.target_id, ts=utc(m.ts), values=m.values)  # type: ignore[arg-type]


# --- outputs ---------------------------------------------------------------------------------------


def outputs(session: Session, task_id: str) -> TaskOutputs:
    """A sharded task's gathered tensors (complete when every chunk is done); what else a kind outputs is its own
    (``TaskKind.outputs``: published models, privacy spent)."""
    task = get(session, task_id)
    complete = task.chunks_total is not None and task.chunks_done == task.chunks_total
    tensors: list[TensorInfo] = []
    if task.chunks_total:
        first = first_chunk(session, task)
        if first is not None:
            tensors = [TensorInfo(name=k, dtype=str(v.dtype), shape=[task.items_total or 0, *v.shape[1:]]) for k, v in sorted(first.items())]
    gathered = TaskOutputs(
        task_id=task.id, state=TaskState(task.state), complete=complete, items_total=task.items_total, items_done=items_done(task, session),
        tensors=tensors, content_url=f"/tasks/{task.id}/outputs/content" if task.chunks_total else None, artifacts=[], privacy=[],
    )  # fmt: skip
    return kind_of(task.type).outputs(session, task, gathered)


def gather(session: Session, task_id: str) -> bytes:
    """Every chunk's outputs concatenated in input order, as one safetensors file (409 while incomplete)."""
    task = get(session, task_id)
    if task.chunks_total is None:
        raise Conflict(f"a {task.type} task has no gathered outputs")
    if task.chunks_done != task.chunks_total:
        raise Conflict(f"outputs are incomplete: {task.chunks_done} of {task.chunks_total} chunks done", current_state=task.state)
    return gather_chunks(session, task)
