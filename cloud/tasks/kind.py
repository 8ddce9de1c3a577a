"""What a task kind adds to the generic task, worker and chunk lifecycle, and the registry of kinds.

The generic code (``cloud.services.tasks`` for the REST operations, ``cloud.scheduler`` for placement and
health, ``cloud.services.task_reports`` for the workers' reports) has no branch on the task type: where a kind
has rules of its own it calls the kind's hook here. :class:`TaskKind` gives every hook a default that does
nothing, so a kind overrides only what it needs. ``KINDS`` names, for each :class:`~interfaces.tasks.TaskType`,
the ``module:attribute`` of its kind object; a kind's module is imported the first time the hub needs it
(:func:`kind_of`), the way ``device.tasks.programs`` finds a worker program.

The contract, hook by hook (``session``: the transaction the caller commits; nothing here commits):

* ``admit(session, task, spec, placement, hub)``: at creation, after the spec validated; check and store
  what the kind needs (chunks, plans, reservations), raise a ``cloud.errors`` error to refuse; returns the
  spec to keep (e.g. with a model version pinned). ``readmit``: the same at a retry.
* ``order(session, task, worker, signing, order)``: the worker's order with the kind's part filled in.
* ``worker_role(task)``: the role of a worker placed from the task's placement; ``companion_roles(task)``:
  (device role, node role) when the devices' workers need a companion worker on their edge node.
* ``candidates(session, task, found)``: the placement's candidates, narrowed by the kind's own rules.
* ``worker_ended`` / ``task_ended``: settle what the kind holds for a worker or the task.
* ``success_refused(session, task, worker)``: why a worker's SUCCEEDED report counts as FAILED (or None);
  ``success_held(session, task)``: why the task may not SUCCEED yet (or None).
* ``accept(session, task, worker, target_kind, target_id, data, at)``: an output or update a worker sent
  (a ``WorkerOutput``, or one of the kind's ``events``); returns (outcome counted as ``task_<kind>_<outcome>``,
  whether the scheduler should look now).
* ``outputs(session, task, outputs)``: the task's ``TaskOutputs`` with the kind's artefacts and spends.
* ``forget(session, task_id)``: drop the kind's rows of a deleted task.
* ``prepare(engine, signing, blobs)``: once a tick, outside any task's transaction (storing or publishing
  models); returns scheduler counters to add. ``due_ids(session, at)``: tasks of the kind with something due;
  ``is_due(active, node_of)``: the same for one task from its active workers. ``tick(session, task, at, driver)``:
  once per drive of an active, placed, unpaused task (a federated round), through ``driver``.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from interfaces.tasks import TaskOutputs, TaskState, TaskType

if TYPE_CHECKING:
    from pydantic import BaseModel
    from sqlalchemy.engine import Engine
    from sqlmodel import Session

    from cloud.placement import Candidates
    from cloud.tables import Task, TaskWorker
    from interfaces.tasks import KindReport, Placement, WorkerOrder, WorkerState


@dataclass(frozen=True)
class HubParts:
    """What a kind may need at admission besides the database: the blob store and the signing key."""

    blobs: Any = None
    signing: Any = None


class Driver(Protocol):
    """The scheduler's side of a kind's ``tick``: what the kind may ask of it for the task being driven."""

    @property
    def blobs(self) -> Any:
        """The hub's artefact blob store (None in a scheduler without one)."""

    def put_orders(self) -> bool:
        """Rewrite every active worker's order; True if one changed."""

    def finish(self, state: TaskState, reason: str) -> None:
        """End the task in ``state``."""

    def wait(self, reason: str) -> None:
        """Keep the task as it is, saying why (logged once per reason)."""


@dataclass
class Ticked:
    """What a kind's ``tick`` did."""

    orders: bool = False
    changed: bool = False
    closed: bool = False
    """a round closed: the scheduler prepares and drives the task again in the same tick"""


class ActiveWorker(Protocol):
    """An active worker as the scheduler's ``due`` reads it (a row of its query)."""

    role: str
    target_id: str


class TaskKind:
    """A task kind with every hook a no-op; subclass and override (module docstring)."""

    type: ClassVar[TaskType]
    events: ClassVar[frozenset[str]] = frozenset()
    """event types, besides ``task.output``, whose data the kind's ``accept`` takes"""
    node_roles: ClassVar[frozenset[str]] = frozenset()
    """roles of companion workers on edge nodes: the task's end does not wait for them"""

    # --- admission ---------------------------------------------------------------------------------
    def admit(self, session: Session, task: Task, spec: BaseModel, placement: Placement, hub: HubParts) -> BaseModel:
        return spec

    def readmit(self, session: Session, task: Task, at: datetime) -> None:
        return None

    # --- orders and placement ----------------------------------------------------------------------
    def order(self, session: Session, task: Task, worker: TaskWorker, signing: Any, order: WorkerOrder) -> WorkerOrder:
        return order

    def worker_role(self, task: Task) -> str:
        return "worker"

    def companion_roles(self, task: Task) -> tuple[str, str] | None:
        return None

    def candidates(self, session: Session, task: Task, found: Candidates) -> Candidates:
        return found

    # --- ends --------------------------------------------------------------------------------------
    def worker_ended(self, session: Session, task: Task, worker: TaskWorker, state: WorkerState, at: datetime) -> None:
        return None

    def task_ended(self, session: Session, task: Task, at: datetime) -> None:
        return None

    def success_refused(self, session: Session, task: Task, worker: TaskWorker) -> str | None:
        return None

    def success_held(self, session: Session, task: Task) -> str | None:
        return None

    # --- what workers send -------------------------------------------------------------------------
    def accept(self, session: Session, task: Task, worker: TaskWorker, target_kind: str, target_id: str, data: KindReport, at: datetime) -> tuple[str, bool]:
        """Take what a worker sent beyond its state, logs and metrics: (the outcome counted, whether the scheduler
        should look at the task now). By default nothing is taken: a kind with outputs says what they are (a batch
        task's chunks, :func:`cloud.tasks.lifecycle.accept_output`; a trained layer; a round's update)."""
        return "refused", False

    def outputs(self, session: Session, task: Task, outputs: TaskOutputs) -> TaskOutputs:
        return outputs

    def forget(self, session: Session, task_id: str) -> None:
        return None

    def blobs_of(self, session: Session, task_id: str) -> list[str]:
        """Blobs of the task's own that no artefact records (a server optimiser's state): deleted with the task."""
        return []

    # --- the scheduler's tick ----------------------------------------------------------------------
    def prepare(self, engine: Engine, signing: Any, blobs: Any) -> Mapping[str, int]:
        return {}

    def due_ids(self, session: Session, at: datetime) -> set[str]:
        return set()

    def is_due(self, active: Iterable[ActiveWorker], node_of: Mapping[str, str]) -> bool:
        return False

    def tick(self, session: Session, task: Task, at: datetime, driver: Driver) -> Ticked:
        return Ticked()


KINDS: dict[TaskType, str] = {
    TaskType.INFERENCE: "cloud.tasks.kinds:INFERENCE",
    TaskType.BATCH_INFERENCE: "cloud.tasks.kinds:BATCH_INFERENCE",
    TaskType.SPLIT_INFERENCE: "cloud.split_inference:KIND",
    TaskType.INCREMENTAL_TRAINING: "cloud.incremental.kind:KIND",
    TaskType.FEDERATED_TRAINING: "cloud.fl.kind:KIND",
    TaskType.TRAINING: "cloud.training.kind:KIND",
}
"""type -> ``module:attribute`` of its :class:`TaskKind`"""

_loaded: dict[TaskType, TaskKind] = {}


def kind_of(task_type: TaskType | str) -> TaskKind:
    """The kind of a task type (or of a stored task's ``type``); ``KeyError`` for a type without one."""
    t = TaskType(task_type)
    kind = _loaded.get(t)
    if kind is None:
        module, _, name = KINDS[t].partition(":")
        kind = getattr(importlib.import_module(module), name)
        if not isinstance(kind, TaskKind) or kind.type is not t:
            raise TypeError(f"{KINDS[t]} is not the TaskKind of {t.value}")
        _loaded[t] = kind
    return kind


def all_kinds() -> list[TaskKind]:
    return [kind_of(t) for t in KINDS]


def node_roles() -> frozenset[str]:
    """Every kind's companion roles on edge nodes."""
    return frozenset().union(*(k.node_roles for k in all_kinds()))
