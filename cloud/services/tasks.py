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
* **Orders.** A worker's ``WorkerOrder`` sits in its target's ``tasks`` list (one per worker id) and the
  target's ``tasks_version`` goes up on every change, so the bridge republishes its desired document.
* **incremental_training** adds its own rules (``cloud.incremental.task``): admission against the devices'
  privacy budgets at creation and retry (409 ``privacy_budget_exceeded``), the ``training`` part of the
  orders, settling a worker's reservation when it ends and releasing the rest when the task does; its
  outputs are the published model versions and what each run spent.
* **federated_training** (``cloud.fl``): the model cut and the plan stored at creation, rounds opened and
  closed by the scheduler, updates kept by ``cloud.fl.rounds.accept``; the output is the published model.
* **split_inference** (``cloud.split_inference``): the model is cut at creation (its heads and tails stored
  as signed artefacts), devices run ``head`` workers, their edge nodes ``tail`` workers, both with the
  ``split`` part of their orders.
"""

from __future__ import annotations

import base64
import logging
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError
from sqlalchemy import delete, func, select
from sqlmodel import Session

from cloud.convert import utc
from cloud.errors import BadRequest, Conflict, NotFound, ValidationFailed
from cloud.services.paging import parse_selector_or_400
from cloud.tables import (
    Device, Node, Task, TaskChunk, TaskLog, TaskMetric, TaskTransitionRow, TaskWorker, WorkerTransitionRow,
)  # fmt: skip
from interfaces.deployments import ArtifactFormat, ArtifactKind, TargetKind
from interfaces.errors import ErrorCode
from interfaces.ids import is_id, new_id
from interfaces.lifecycle import AdminState, NodeState
from interfaces.tasks import (
    TASK_ACTIVE, TASK_FINAL, TASK_TRANSITIONS, TASK_TYPES, WORKER_ACTIVE, BatchInferenceSpec, IllegalTaskTransition, IncrementalTrainingSpec, MetricSample, SplitInferenceSpec, FederatedTrainingSpec,
    Placement, RetryPolicy, TaskAction, TaskCreate, TaskDetail, TaskLogLine, TaskMetrics, TaskOutputs, TaskProgress, TaskPublic, TaskState,
    TaskTransition, TaskType, TaskTypeInfo, TensorInfo, WorkerAction, WorkerOrder, WorkerPublic, WorkerState, worker_path,
)  # fmt: skip

log = logging.getLogger("aisynergy.hub.tasks")
_T, _W = TaskState, WorkerState
PENDING, ASSIGNED, DONE = "PENDING", "ASSIGNED", "DONE"  # chunk states


def now() -> datetime:
    return datetime.now(UTC)


def type_info(task: Task) -> TaskTypeInfo:
    return TASK_TYPES[TaskType(task.type)]


def spec_of(task: Task) -> Any:
    model = type_info(task).spec
    assert model is not None
    return model.model_validate(task.spec)


def placement_of(task: Task) -> Placement:
    return Placement.model_validate(task.placement)


def retry_of(task: Task) -> RetryPolicy:
    return RetryPolicy.model_validate(task.retry)


def target_table(kind: TargetKind | str) -> Any:
    return Device if TargetKind(kind) is TargetKind.DEVICE else Node


# --- state moves and the hub's own log lines -------------------------------------------------------


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
        if task is not None and task.type == TaskType.INCREMENTAL_TRAINING.value:
            from cloud.incremental.task import worker_ended

            worker_ended(session, task, worker, target, at)


def hub_log(session: Session, task_id: str, text: str, level: str = "info", at: datetime | None = None,
            worker_id: str | None = None, target_id: str | None = None) -> None:  # fmt: skip
    session.add(TaskLog(task_id=task_id, worker_id=worker_id, target_id=target_id, ts=at or now(), level=level, text=f"[hub] {text}"[:4096]))


# --- orders ----------------------------------------------------------------------------------------


def put_worker_order(session: Session, kind: TargetKind | str, target_id: str, order: WorkerOrder) -> bool:
    """Make ``order`` the target's order for its worker id; False if the target is gone."""
    row = session.get(target_table(kind), target_id, with_for_update=True)
    if row is None or row.state == NodeState.DELETED.value:
        return False
    doc = order.model_dump(mode="json")
    row.tasks = [o for o in row.tasks if o.get("worker_id") != order.worker_id] + [doc]
    row.tasks_version += 1
    session.add(row)
    return True


def withdraw_worker_order(session: Session, kind: TargetKind | str, target_id: str, worker_id: str) -> bool:
    row = session.get(target_table(kind), target_id, with_for_update=True)
    if row is None:
        return False
    kept = [o for o in row.tasks if o.get("worker_id") != worker_id]
    if len(kept) == len(row.tasks):
        return False
    row.tasks = kept
    row.tasks_version += 1
    session.add(row)
    return True


def set_order_action(session: Session, worker: TaskWorker, action: WorkerAction) -> bool:
    row = session.get(target_table(worker.target_kind), worker.target_id, with_for_update=True)
    if row is None:
        return False
    changed = False
    tasks = []
    for o in row.tasks:
        if o.get("worker_id") == worker.id and o.get("action") != action.value:
            o = {**o, "action": action.value}
            changed = True
        tasks.append(o)
    if changed:
        row.tasks = tasks
        row.tasks_version += 1
        session.add(row)
    return changed


def owned_chunks(session: Session, worker_id: str) -> list[int]:
    return list(session.execute(select(TaskChunk.index).where(TaskChunk.worker_id == worker_id).order_by(TaskChunk.index)).scalars())


def build_order(session: Session, task: Task, worker: TaskWorker, signing: Any) -> WorkerOrder:
    """The order for ``worker`` as things stand (a sharded worker's chunks are read from the database)."""
    from cloud.artifacts import task_input
    from cloud.placement import ranges

    inputs = chunks = None
    if type_info(task).placement == "shards":
        inputs = task_input(session, spec_of(task).inputs, worker.target_id, signing, "inputs")
        chunks = ranges(owned_chunks(session, worker.id))
    training = split = fl = None
    if task.type == TaskType.INCREMENTAL_TRAINING.value:
        from cloud.incremental.task import training_order

        training = training_order(session, task, worker, signing)
    elif task.type == TaskType.SPLIT_INFERENCE.value:
        from cloud.split_inference import split_order

        split = split_order(session, task, worker, signing)
    elif task.type == TaskType.FEDERATED_TRAINING.value:
        from cloud.fl.task import fl_order

        fl = fl_order(session, task, worker, signing)
    paused = TaskState(task.state) is _T.PAUSED
    return WorkerOrder(
        worker_id=worker.id, task_id=task.id, type=TaskType(task.type), role=worker.role, action=WorkerAction.PAUSE if paused else WorkerAction.RUN,
        attempt=worker.attempt, spec=task.spec, heartbeat_s=task.heartbeat_s, inputs=inputs, items=task.items_total, chunk_size=task.chunk_size,
        chunks=chunks or [], training=training, split=split, fl=fl,
    )  # fmt: skip


def end_workers(session: Session, task: Task, running_to: WorkerState, reason: str, at: datetime) -> bool:
    """Take every active worker of ``task`` out (RUNNING ones to ``running_to``, QUEUED ones CANCELED) and
    withdraw their orders; True if an order changed."""
    changed = False
    for worker in active_workers(session, task.id):
        target = running_to if worker.state == _W.RUNNING.value else _W.CANCELED
        move_worker(session, worker, target, reason, at)
        changed |= withdraw_worker_order(session, worker.target_kind, worker.target_id, worker.id)
    return changed


def active_workers(session: Session, task_id: str) -> list[TaskWorker]:
    return list(session.execute(
        select(TaskWorker).where(TaskWorker.task_id == task_id, TaskWorker.state.in_([s.value for s in WORKER_ACTIVE])).order_by(TaskWorker.id)  # type: ignore[attr-defined]
    ).scalars())  # fmt: skip


def finish(session: Session, task: Task, state: TaskState, reason: str, at: datetime) -> bool:
    """End ``task`` in ``state``; RUNNING workers SUCCEED when the task did, else they are CANCELED."""
    move_task(session, task, state, reason, at)
    changed = end_workers(session, task, _W.SUCCEEDED if state is _T.SUCCEEDED else _W.CANCELED, f"task {state.value}: {reason}", at)
    if task.type == TaskType.INCREMENTAL_TRAINING.value:
        from cloud.incremental.task import task_ended

        task_ended(session, task, at)
    elif task.type == TaskType.FEDERATED_TRAINING.value:
        from cloud.fl.task import task_ended as fl_ended

        fl_ended(session, task, at)
    return changed


# --- creation --------------------------------------------------------------------------------------


def dataset_rows(path: Path, fmt: str, tensor: str | None) -> int:
    """The length of a dataset's first axis, read from its header only."""
    if fmt == ArtifactFormat.NPY.value:
        import numpy as np

        with path.open("rb") as f:
            version = np.lib.format.read_magic(f)
            reader = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, _fortran, dtype = reader(f)
        if dtype.hasobject:
            raise ValueError("the array holds Python objects; only plain numeric arrays are accepted")
    elif fmt == ArtifactFormat.SAFETENSORS.value:
        from safetensors import safe_open

        with safe_open(str(path), framework="numpy") as f:
            names = list(f.keys())
            name = tensor if tensor is not None else (names[0] if len(names) == 1 else None)
            if name is None or name not in names:
                raise ValueError(f"say which tensor to read (input_name): the file holds {sorted(names)[:20]}")
            shape = f.get_slice(name).get_shape()
    else:
        raise ValueError(f"a dataset must be npy or safetensors, not {fmt}")
    if not shape:
        raise ValueError("a dataset must have a first axis (one row per input)")
    return int(shape[0])


def _validated_spec(body: TaskCreate, info: TaskTypeInfo) -> BaseModel:
    assert info.spec is not None
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
    if isinstance(spec, BatchInferenceSpec):
        from cloud.artifacts import get_artifact

        artifact = get_artifact(session, spec.inputs, lock=True)
        if artifact.kind != ArtifactKind.DATASET.value:
            raise BadRequest(f"artefact {artifact.id} is a {artifact.kind}, not a dataset", status=422)
        path = blobs.path(artifact.sha256)
        try:
            rows = dataset_rows(path, artifact.format, spec.input_name)
        except (OSError, ValueError, TypeError) as exc:
            raise BadRequest(f"cannot read dataset {artifact.id}: {exc}", status=422) from None
        if rows == 0:
            raise BadRequest(f"dataset {artifact.id} has no rows", status=422)
        task.items_total, task.chunk_size = rows, spec.chunk_size
        task.chunks_total = -(-rows // spec.chunk_size)
        session.add(task)
        session.flush()
        session.execute(TaskChunk.__table__.insert(), [{"task_id": task.id, "index": i, "state": PENDING, "attempts": 0, "last_error": ""} for i in range(task.chunks_total)])  # type: ignore[attr-defined]
    elif isinstance(spec, IncrementalTrainingSpec):
        from cloud.incremental.task import admit

        task.spec = admit(session, task, spec, body.placement, blobs, signing).model_dump(mode="json", exclude_none=True)
    elif isinstance(spec, FederatedTrainingSpec):
        from cloud.fl.task import admit as admit_fl

        task.spec = admit_fl(session, task, spec, body.placement, blobs, signing).model_dump(mode="json", exclude_none=True)
    elif isinstance(spec, SplitInferenceSpec):
        from cloud.split_inference import admit as admit_split

        task.spec = admit_split(session, task, spec, body.placement, blobs, signing).model_dump(mode="json", exclude_none=True)
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
        if task.type == TaskType.INCREMENTAL_TRAINING.value:
            from cloud.incremental.task import readmit

            readmit(session, task, at)
        elif task.type == TaskType.FEDERATED_TRAINING.value:
            from cloud.fl.task import readmit as readmit_fl

            readmit_fl(session, task, at)
        task.attempt += 1
        task.deadline_at = task.finished_at = task.paused_at = task.not_before = None
        task.scheduled_at = None
        session.execute(
            TaskChunk.__table__.update().where(TaskChunk.task_id == task.id, TaskChunk.state != DONE)  # type: ignore[attr-defined]
            .values(state=PENDING, worker_id=None, attempts=0, not_before=None)
        )  # fmt: skip
        move_task(session, task, _T.PENDING, f"retry {task.attempt - 1} requested by a user", at)
    session.add(task)
    session.commit()
    return task, orders


def delete_task(session: Session, task_id: str) -> None:
    task = get(session, task_id, lock=True)
    if TaskState(task.state) in TASK_ACTIVE:
        raise Conflict(f"task {task.id} is {task.state}: cancel it first", code=ErrorCode.ILLEGAL_TRANSITION, current_state=task.state)
    worker_ids = select(TaskWorker.id).where(TaskWorker.task_id == task.id)
    session.execute(delete(WorkerTransitionRow).where(WorkerTransitionRow.worker_id.in_(worker_ids)))  # type: ignore[attr-defined]
    for table in (TaskWorker, TaskChunk, TaskLog, TaskMetric, TaskTransitionRow):
        session.execute(delete(table).where(table.task_id == task.id))  # type: ignore[attr-defined]
    if task.type == TaskType.INCREMENTAL_TRAINING.value:
        from cloud.incremental.task import forget

        forget(session, task.id)
    elif task.type == TaskType.SPLIT_INFERENCE.value:
        from cloud.split_inference import forget as forget_split

        forget_split(session, task.id)
    elif task.type == TaskType.FEDERATED_TRAINING.value:
        from cloud.fl.task import forget as forget_fl

        forget_fl(session, task.id)
    session.delete(task)
    session.commit()


# --- wire ------------------------------------------------------------------------------------------


def items_done(task: Task, session: Session) -> int | None:
    if task.items_total is None or task.chunk_size is None or task.chunks_total is None:
        return None
    done = task.chunks_done * task.chunk_size
    last = task.chunks_total - 1
    if done and session.execute(select(TaskChunk.state).where(TaskChunk.task_id == task.id, TaskChunk.index == last)).scalar() == DONE:
        done -= task.chunks_total * task.chunk_size - task.items_total
    return done


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


def to_wire(session: Session, rows: list[Task]) -> list[TaskPublic]:
    counts = worker_counts(session, [t.id for t in rows])
    return [
        TaskPublic(
            id=t.id, name=t.name, type=TaskType(t.type), spec=t.spec, placement=placement_of(t), timeout_s=t.timeout_s,
            worker_timeout_s=t.worker_timeout_s, heartbeat_s=t.heartbeat_s, retry=retry_of(t), state=TaskState(t.state), reason=t.reason,
            held=t.held, attempt=t.attempt, progress=progress(session, t, counts.get(t.id, {})), created_at=utc(t.created_at),
            updated_at=utc(t.updated_at), started_at=utc(t.started_at), finished_at=utc(t.finished_at), deadline_at=utc(t.deadline_at),
        )  # fmt: skip
        for t in rows
    ]


def detail(session: Session, task: Task) -> TaskDetail:
    history = session.execute(select(TaskTransitionRow).where(TaskTransitionRow.task_id == task.id).order_by(TaskTransitionRow.id)).scalars()
    return TaskDetail(
        **to_wire(session, [task])[0].model_dump(),
        history=[TaskTransition(from_state=h.from_state, to_state=h.to_state, at=utc(h.at), reason=h.reason) for h in history],
    )


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
    if series:
        query = select(TaskMetric).where(TaskMetric.task_id == task.id)
        if worker_id:
            query = query.where(TaskMetric.worker_id == worker_id)
        rows = list(session.execute(query.order_by(TaskMetric.id.desc()).limit(limit)).scalars())  # type: ignore[union-attr]
        samples = [_sample(m) for m in reversed(rows)]
    workers = {w: _sample(m) for w, m in latest.items() if worker_id is None or w == worker_id}
    return TaskMetrics(task_id=task.id, totals=dict(totals), workers=workers, series=samples)


def _sample(m: TaskMetric) -> MetricSample:
    return MetricSample(worker_id=m.worker_id, target_id=m.target_id, ts=utc(m.ts), values=m.values)  # type: ignore[arg-type]


# --- outputs ---------------------------------------------------------------------------------------


def decode_chunk(data: bytes) -> dict[str, Any]:
    from safetensors.numpy import load

    return load(data)


def outputs(session: Session, task_id: str) -> TaskOutputs:
    task = get(session, task_id)
    complete = task.chunks_total is not None and task.chunks_done == task.chunks_total
    tensors: list[TensorInfo] = []
    if task.chunks_total:
        first = session.execute(select(TaskChunk.data).where(TaskChunk.task_id == task.id, TaskChunk.state == DONE).order_by(TaskChunk.index).limit(1)).scalar()
        if first is not None:
            tensors = [TensorInfo(name=k, dtype=str(v.dtype), shape=[task.items_total or 0, *v.shape[1:]]) for k, v in sorted(decode_chunk(first).items())]
    artifacts, privacy = [], []
    if task.type == TaskType.INCREMENTAL_TRAINING.value:
        from cloud.incremental.budgets import spend_to_wire
        from cloud.incremental.results import unpublished
        from cloud.tables import PrivacySpendRow, TrainingResult

        results = list(session.execute(select(TrainingResult).where(TrainingResult.task_id == task.id).order_by(TrainingResult.created_at)).scalars())
        artifacts = [r.artifact_id for r in results if r.artifact_id]
        spends = session.execute(select(PrivacySpendRow).where(PrivacySpendRow.task_id == task.id).order_by(PrivacySpendRow.id)).scalars()  # type: ignore[arg-type]
        privacy = [spend_to_wire(r) for r in spends]
        complete = TaskState(task.state) in TASK_FINAL and bool(artifacts) and not unpublished(session, task.id)
    elif task.type == TaskType.FEDERATED_TRAINING.value:
        from cloud.tables import FlPlan

        from cloud.incremental.budgets import spend_to_wire
        from cloud.tables import PrivacySpendRow

        plan = session.get(FlPlan, task.id)
        artifacts = [plan.published_artifact_id] if plan is not None and plan.published_artifact_id else []
        complete = bool(artifacts)
        privacy = [spend_to_wire(r) for r in session.execute(select(PrivacySpendRow).where(PrivacySpendRow.task_id == task.id).order_by(PrivacySpendRow.id)).scalars()]  # type: ignore[arg-type]
    return TaskOutputs(
        task_id=task.id, state=TaskState(task.state), complete=complete, items_total=task.items_total, items_done=items_done(task, session),
        tensors=tensors, content_url=f"/tasks/{task.id}/outputs/content" if task.chunks_total else None, artifacts=artifacts, privacy=privacy,
    )  # fmt: skip


def gather(session: Session, task_id: str) -> bytes:
    """Every chunk's outputs concatenated in input order, as one safetensors file (409 while incomplete)."""
    import numpy as np
    from safetensors.numpy import save

    task = get(session, task_id)
    if task.chunks_total is None:
        raise Conflict(f"a {task.type} task has no gathered outputs")
    if task.chunks_done != task.chunks_total:
        raise Conflict(f"outputs are incomplete: {task.chunks_done} of {task.chunks_total} chunks done", current_state=task.state)
    parts: dict[str, list[Any]] = defaultdict(list)
    for (data,) in session.execute(select(TaskChunk.data).where(TaskChunk.task_id == task.id).order_by(TaskChunk.index)).all():
        for name, value in decode_chunk(data).items():
            parts[name].append(value)
    metadata = {"task_id": task.id, "items": str(task.items_total)}
    return save({name: np.ascontiguousarray(np.concatenate(values)) for name, values in parts.items()}, metadata=metadata)


def encode_chunk(tensors: dict[str, Any]) -> str:
    """What a worker sends: base64 of a safetensors frame (used by tests and tools)."""
    from safetensors.numpy import save

    return base64.b64encode(save(tensors)).decode()

