"""Task and worker states, their legal moves, the task types, the event types and the limits every part shares."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import Field

from interfaces.strict import INT64_MAX

TASK_WORKER_EVENT = "task.worker"
"""``EventBody.type`` of a worker's state report (also its heartbeat); ``data`` is a ``WorkerReport``."""
TASK_LOG_EVENT = "task.log"
"""``EventBody.type`` of a worker's log lines; ``data`` is a ``WorkerLog``."""
TASK_METRICS_EVENT = "task.metrics"
"""``EventBody.type`` of a worker's metrics sample; ``data`` is a ``WorkerMetrics``."""
TASK_OUTPUT_EVENT = "task.output"
"""``EventBody.type`` of one finished chunk of outputs; ``data`` is a ``WorkerOutput``."""
FL_UPDATE_EVENT = "fl.update"
"""``EventBody.type`` of a federated update (a device's, or an edge aggregator's combined one); ``data`` is an ``FlUpdate``."""
FL_KEY_EVENT = "fl.key"
"""``EventBody.type`` of a device's key for secure aggregation (its X25519 public key); ``data`` is an ``FlKey``."""
FL_REVEAL_EVENT = "fl.reveal"
"""``EventBody.type`` of a survivor's pair seeds with participants that dropped after masking; ``data`` is an ``FlReveal``."""
FL_EVALUATION_EVENT = "fl.evaluation"
"""``EventBody.type`` of a site's scores in a whole-model task's cross-site evaluation; ``data`` is an ``FlEvaluation``."""
TASK_TRAINED_EVENT = "task.trained"
"""``EventBody.type`` of a ``training`` worker's result (the model artefacts it published); ``data`` is a ``TrainedModel``."""
TASK_EVENTS = frozenset({
    TASK_WORKER_EVENT, TASK_LOG_EVENT, TASK_METRICS_EVENT, TASK_OUTPUT_EVENT, FL_UPDATE_EVENT, FL_KEY_EVENT, FL_REVEAL_EVENT, FL_EVALUATION_EVENT, TASK_TRAINED_EVENT,
})  # fmt: skip

MAX_WORKERS_PER_TARGET = 64
"""Worker orders one desired document carries (``DesiredBody.tasks``): a target running this many takes no more."""
MAX_CHUNK_OUTPUT_BYTES = 180 * 1024
"""Largest safetensors frame one ``WorkerOutput`` carries (base64 and the envelope must fit in one 256 KiB MQTT message)."""
MAX_HEAD_BYTES = 64 * 1024
"""Largest trainable layer (safetensors frame) an ``incremental_training`` order carries inline."""
MAX_TRAINING_STEPS = 1_000_000

Id = Annotated[str, Field(min_length=1, max_length=64)]
ChunkIndex = Annotated[int, Field(ge=0, le=INT64_MAX)]
MetricName = Annotated[str, Field(min_length=1, max_length=64)]
PublicKey = Annotated[str, Field(min_length=44, max_length=44, description="base64 of the 32-byte X25519 public key")]

# --- states ----------------------------------------------------------------------------------------


class TaskType(StrEnum):
    INFERENCE = "inference"
    SPLIT_INFERENCE = "split_inference"
    INCREMENTAL_TRAINING = "incremental_training"
    FEDERATED_TRAINING = "federated_training"
    BATCH_INFERENCE = "batch_inference"
    TRAINING = "training"


class TaskState(StrEnum):
    PENDING = "PENDING"
    SCHEDULED = "SCHEDULED"
    RUNNING = "RUNNING"
    PAUSED = "PAUSED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELED = "CANCELED"
    TIMED_OUT = "TIMED_OUT"


_T = TaskState
_TASK_ENDS = frozenset({_T.SUCCEEDED, _T.FAILED, _T.CANCELED, _T.TIMED_OUT})
TASK_TRANSITIONS: dict[TaskState, frozenset[TaskState]] = {
    _T.PENDING: frozenset({_T.SCHEDULED}) | _TASK_ENDS,
    _T.SCHEDULED: frozenset({_T.RUNNING, _T.PAUSED}) | _TASK_ENDS,
    _T.RUNNING: frozenset({_T.PAUSED}) | _TASK_ENDS,
    _T.PAUSED: frozenset({_T.RUNNING, _T.SCHEDULED}) | _TASK_ENDS,
    _T.SUCCEEDED: frozenset(),
    _T.FAILED: frozenset({_T.PENDING}),
    _T.CANCELED: frozenset({_T.PENDING}),
    _T.TIMED_OUT: frozenset({_T.PENDING}),
}
TASK_FINAL = _TASK_ENDS
TASK_ACTIVE = frozenset({_T.PENDING, _T.SCHEDULED, _T.RUNNING, _T.PAUSED})


class TaskAction(StrEnum):
    START = "start"  # a task created with start=false (held in PENDING) may be scheduled
    STOP = "stop"  # end it now: a service type SUCCEEDS, a finite one is CANCELED; outputs so far are kept
    PAUSE = "pause"
    RESUME = "resume"
    CANCEL = "cancel"
    RETRY = "retry"  # FAILED, CANCELED or TIMED_OUT: back to PENDING; finished work is kept


class WorkerState(StrEnum):
    QUEUED = "QUEUED"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    TIMED_OUT = "TIMED_OUT"
    REJECTED = "REJECTED"
    LOST = "LOST"
    CANCELED = "CANCELED"


_W = WorkerState
_WORKER_ENDS = frozenset({_W.SUCCEEDED, _W.FAILED, _W.TIMED_OUT, _W.REJECTED, _W.LOST, _W.CANCELED})
WORKER_TRANSITIONS: dict[WorkerState, frozenset[WorkerState]] = {
    _W.QUEUED: frozenset({_W.RUNNING}) | (_WORKER_ENDS - {_W.SUCCEEDED}),
    _W.RUNNING: _WORKER_ENDS,
    **{s: frozenset() for s in _WORKER_ENDS},
}
WORKER_FINAL = _WORKER_ENDS
WORKER_ACTIVE = frozenset({_W.QUEUED, _W.RUNNING})
WORKER_FAILURES = frozenset({_W.FAILED, _W.TIMED_OUT, _W.REJECTED, _W.LOST})


class IllegalTaskTransition(ValueError):
    def __init__(self, current: StrEnum, target: StrEnum, what: str = "task") -> None:
        super().__init__(f"{what} cannot go from {current} to {target}")
        self.current = current
        self.target = target


def worker_path(current: WorkerState, target: WorkerState) -> list[WorkerState]:
    """The legal steps from ``current`` to ``target`` (SUCCEEDED after QUEUED fills in RUNNING), or raise."""
    if current == target:
        return []
    if target in WORKER_TRANSITIONS[current]:
        return [target]
    if current is _W.QUEUED and target is _W.SUCCEEDED:
        return [_W.RUNNING, _W.SUCCEEDED]
    raise IllegalTaskTransition(current, target, "worker")
