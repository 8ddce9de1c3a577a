"""Worker orders (DESIGN §4.3): a worker's ``WorkerOrder`` sits in its target's ``tasks`` list (one per worker
id), and the target's ``tasks_version`` goes up on every change, so the bridge republishes its desired document."""

from __future__ import annotations

from typing import Any

from sqlmodel import Session

from cloud.tables import Task, TaskWorker
from cloud.tasks.chunks import owned_chunks
from cloud.tasks.kind import kind_of
from cloud.tasks.rows import spec_of, target_table, type_info
from interfaces.deployments import TargetKind
from interfaces.lifecycle import NodeState
from interfaces.tasks import TaskState, TaskType, WorkerAction, WorkerOrder, worker_order


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
