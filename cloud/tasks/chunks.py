"""The chunk lifecycle of a sharded task (``placement == "shards"``, DESIGN §4.3).

A sharded task's inputs are split at creation into chunks of ``chunk_size`` rows (:func:`create_chunks`), each
``PENDING``. The scheduler gives pending chunks past their back-off to workers (:func:`assign`: ``ASSIGNED``,
with the worker's id); a worker that ends badly gives its unfinished ones back (:func:`release_chunks`: one more
attempt, a back-off from the task's ``RetryPolicy``); a chunk's outputs are kept once, from the worker it is
assigned to while that worker is active (:func:`accept_output`: ``DONE``). The task's outputs are every chunk's,
in input order (:func:`gather`).
"""

from __future__ import annotations

import base64
import logging
from collections import defaultdict
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlmodel import Session

from cloud.convert import utc
from cloud.tables import Task, TaskChunk, TaskWorker
from cloud.tasks.rows import retry_of
from interfaces.deployments import ArtifactFormat
from interfaces.tasks import WORKER_ACTIVE, WorkerOutput, WorkerState

log = logging.getLogger("aisynergy.hub.tasks")
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
