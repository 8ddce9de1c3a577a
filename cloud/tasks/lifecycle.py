"""The task, worker and chunk lifecycles (DESIGN §4.3), and the orders that carry them to the targets.

* **Rows**: reading a stored task (its spec, placement, retries, type), and the hub's own lines in its log.
* **Moves**: a task moves only along ``interfaces.tasks.TASK_TRANSITIONS`` (:func:`move_task`; anything else is
  ``IllegalTaskTransition``), a worker along ``worker_path`` (:func:`move_worker`), and every move is a transition
  row. A worker that leaves the active states, and a task that ends (:func:`finish`), are told to its kind
  (``worker_ended``, ``task_ended``).
* **Orders**: a worker's ``WorkerOrder`` sits in its target's ``tasks`` list (one per worker id), and the target's
  ``tasks_version`` goes up on every change, so the bridge republishes its desired document (:func:`build_order`,
  :func:`put_worker_order`, :func:`withdraw_worker_order`).
* **Chunks** of a sharded task (``placement == "shards"``): its inputs are split at creation into chunks of
  ``chunk_size`` rows (:func:`create_chunks`), each ``PENDING``. The scheduler gives pending chunks past their
  back-off to workers (:func:`assign`: ``ASSIGNED``, with the worker's id); a worker that ends badly gives its
  unfinished ones back (:func:`release_chunks`: one more attempt, a back-off from the task's ``RetryPolicy``); a
  chunk's outputs are kept once, from the worker it is assigned to while that worker is active
  (:func:`accept_output`: ``DONE``). The task's outputs are every chunk's, in input order (:func:`gather`).
"""

from __future__ import annotations

import base64
import logging
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlmodel import Session

from cloud.convert import utc
from cloud.tables import Device, Node, Task, TaskChunk, TaskLog, TaskTransitionRow, TaskWorker, WorkerTransitionRow
from cloud.tasks.kind import kind_of
from interfaces.deployments import ArtifactFormat, TargetKind
from interfaces.lifecycle import NodeState
from interfaces.tasks import (
    TASK_FINAL,
    TASK_TRANSITIONS,
    TASK_TYPES,
    WORKER_ACTIVE,
    IllegalTaskTransition,
    Placement,
    RetryPolicy,
    TaskState,
    TaskType,
    TaskTypeInfo,
    WorkerAction,
    WorkerOrder,
    WorkerOutput,
    WorkerState,
    worker_order,
    worker_path,
)

log = logging.getLogger("aisynergy.hub.tasks")


# --- rows ----------------------------------------------------------------------------------------------------------


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


def hub_log(session: Session, task_id: str, text: str, level: str = "info", at: datetime | None = None,
            worker_id: str | None = None, target_id: str | None = None) -> None:  # fmt: skip
    session.add(TaskLog(task_id=task_id, worker_id=worker_id, target_id=target_id, ts=at or now(), level=level, text=f"[hub] {text}"[:4096]))


# --- moves ---------------------------------------------------------------------------------------------------------


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


# --- orders --------------------------------------------------------------------------------------------------------


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


def build_order(session: Session, task: Task, worker: TaskWorker, signing: Any) -> WorkerOrder:
    """The order for ``worker`` as things stand (a sharded worker's chunks are read from the database), with its
    kind's part (``TaskKind.order``)."""
    from cloud.artifacts import task_input
    from cloud.placement import ranges

    inputs = chunks = None
    if type_info(task).placement == "shards":
        inputs = task_input(session, spec_of(task).inputs, worker.target_id, signing, "inputs")
        chunks = ranges(owned_chunks(session, worker.id))
    paused = TaskState(task.state) is TaskState.PAUSED
    order = worker_order(
        worker_id=worker.id, task_id=task.id, type=TaskType(task.type), role=worker.role, action=WorkerAction.PAUSE if paused else WorkerAction.RUN,
        attempt=worker.attempt, spec=task.spec, heartbeat_s=task.heartbeat_s, inputs=inputs, items=task.items_total, chunk_size=task.chunk_size,
        chunks=chunks or [],
    )  # fmt: skip
    return kind_of(task.type).order(session, task, worker, signing, order)


# --- chunks --------------------------------------------------------------------------------------------------------


PENDING, ASSIGNED, DONE = "PENDING", "ASSIGNED", "DONE"  # chunk states


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


def create_chunks(session: Session, task: Task, rows: int, chunk_size: int) -> None:
    """Split ``rows`` inputs into PENDING chunks of ``chunk_size`` (the task row is flushed first)."""
    task.items_total, task.chunk_size = rows, chunk_size
    task.chunks_total = -(-rows // chunk_size)
    session.add(task)
    session.flush()
    session.execute(TaskChunk.__table__.insert(), [{"task_id": task.id, "index": i, "state": PENDING, "attempts": 0, "last_error": ""} for i in range(task.chunks_total)])  # type: ignore[attr-defined]


def owned_chunks(session: Session, worker_id: str) -> list[int]:
    return list(session.execute(select(TaskChunk.index).where(TaskChunk.worker_id == worker_id).order_by(TaskChunk.index)).scalars())


def pending_chunks(session: Session, task: Task, at: datetime) -> list[int]:
    """The task's PENDING chunks past their back-off, in input order."""
    rows = session.execute(
        select(TaskChunk.index, TaskChunk.not_before).where(TaskChunk.task_id == task.id, TaskChunk.state == PENDING).order_by(TaskChunk.index)
    ).all()  # fmt: skip
    return [i for i, not_before in rows if not_before is None or utc(not_before) <= at]


def assign(session: Session, task: Task, worker: TaskWorker, chunks: list[int]) -> None:
    if not chunks:
        return
    session.execute(
        TaskChunk.__table__.update().where(TaskChunk.task_id == task.id, TaskChunk.index.in_(chunks), TaskChunk.state == PENDING)  # type: ignore[attr-defined]
        .values(state=ASSIGNED, worker_id=worker.id)
    )  # fmt: skip


def release_chunks(session: Session, task: Task, worker: TaskWorker, why: str, at: datetime) -> int:
    """Give a worker's unfinished chunks back (one more attempt each, after the back-off); returns how many."""
    policy = retry_of(task)
    chunks = list(session.execute(
        select(TaskChunk).where(TaskChunk.task_id == task.id, TaskChunk.worker_id == worker.id, TaskChunk.state == ASSIGNED).with_for_update()
    ).scalars())  # fmt: skip
    for chunk in chunks:
        chunk.attempts += 1
        chunk.state, chunk.worker_id = PENDING, None
        chunk.not_before = at + timedelta(seconds=policy.delay(chunk.attempts + 1))
        chunk.last_error = why[:2048]
        session.add(chunk)
    return len(chunks)


def retry_unfinished(session: Session, task: Task) -> None:
    """A retried task: every chunk not DONE is PENDING again, with its attempts reset."""
    session.execute(
        TaskChunk.__table__.update().where(TaskChunk.task_id == task.id, TaskChunk.state != DONE)  # type: ignore[attr-defined]
        .values(state=PENDING, worker_id=None, attempts=0, not_before=None)
    )  # fmt: skip


def accept_output(session: Session, task: Task, worker: TaskWorker, data: WorkerOutput, at: datetime) -> tuple[str, bool]:
    """Keep a chunk's outputs if the chunk is ASSIGNED to this active worker and the frame is safetensors whose
    tensors all have the chunk's rows first; returns (outcome, whether every chunk is done now)."""
    chunk = session.get(TaskChunk, (task.id, data.chunk), with_for_update=True)
    if chunk is None:
        return "unknown_chunk", False
    if chunk.state == DONE:
        return "duplicate", False
    if chunk.worker_id != worker.id or chunk.state != ASSIGNED or WorkerState(worker.state) not in WORKER_ACTIVE:
        return "not_owner", False
    assert task.chunk_size is not None and task.items_total is not None
    rows = min(task.chunk_size, task.items_total - data.chunk * task.chunk_size)
    try:
        frame = base64.b64decode(data.data, validate=True)
        tensors = decode_chunk(frame)
        if not tensors or data.items != rows or any(not v.shape or v.shape[0] != rows for v in tensors.values()):
            raise ValueError(f"expected {rows} rows in every tensor, got {({k: list(v.shape) for k, v in tensors.items()})}")
    except Exception as exc:  # noqa: BLE001 - binascii, ValueError and safetensors' own error types alike
        log.warning("refused the output of chunk %s of task %s from %s: %s", data.chunk, task.id, worker.id, exc)
        return "malformed", False
    chunk.state, chunk.data, chunk.done_at = DONE, frame, at
    session.add(chunk)
    task.chunks_done += 1
    session.add(task)
    return "applied", task.chunks_done == task.chunks_total


def items_done(task: Task, session: Session) -> int | None:
    if task.items_total is None or task.chunk_size is None or task.chunks_total is None:
        return None
    done = task.chunks_done * task.chunk_size
    last = task.chunks_total - 1
    if done and session.execute(select(TaskChunk.state).where(TaskChunk.task_id == task.id, TaskChunk.index == last)).scalar() == DONE:
        done -= task.chunks_total * task.chunk_size - task.items_total
    return done


def decode_chunk(data: bytes) -> dict[str, Any]:
    from safetensors.numpy import load

    return load(data)


def encode_chunk(tensors: dict[str, Any]) -> str:
    """What a worker sends: base64 of a safetensors frame (used by tests and tools)."""
    from safetensors.numpy import save

    return base64.b64encode(save(tensors)).decode()


def first_chunk(session: Session, task: Task) -> dict[str, Any] | None:
    """The outputs of the first chunk done (what every chunk's tensors look like), or None."""
    first = session.execute(select(TaskChunk.data).where(TaskChunk.task_id == task.id, TaskChunk.state == DONE).order_by(TaskChunk.index).limit(1)).scalar()
    return decode_chunk(first) if first is not None else None


def gather(session: Session, task: Task) -> bytes:
    """Every chunk's outputs concatenated in input order, as one safetensors file (the caller checks all are done)."""
    import numpy as np
    from safetensors.numpy import save

    parts: dict[str, list[Any]] = defaultdict(list)
    for (data,) in session.execute(select(TaskChunk.data).where(TaskChunk.task_id == task.id).order_by(TaskChunk.index)).all():
        for name, value in decode_chunk(data).items():
            parts[name].append(value)
    metadata = {"task_id": task.id, "items": str(task.items_total)}
    return save({name: np.ascontiguousarray(np.concatenate(values)) for name, values in parts.items()}, metadata=metadata)
