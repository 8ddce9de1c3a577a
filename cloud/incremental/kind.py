"""The ``incremental_training`` kind (DESIGN §5): the hooks of :class:`~cloud.tasks.kind.TaskKind` over
``cloud.incremental.task`` (admission, reservations, orders) and ``cloud.incremental.results`` (trained layers,
published as model versions)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar

from sqlalchemy import select

from cloud.incremental import results
from cloud.incremental import task as training
from cloud.tables import PrivacySpendRow, TrainingResult
from cloud.tasks.kind import HubParts, TaskKind
from interfaces.tasks import TASK_FINAL, IncrementalTrainingSpec, TaskOutputs, TaskState, TaskType, WorkerOutput

if TYPE_CHECKING:
    from pydantic import BaseModel
    from sqlalchemy.engine import Engine
    from sqlmodel import Session

    from cloud.placement import Candidates
    from cloud.tables import Task, TaskWorker
    from interfaces.tasks import KindReport, Placement, WorkerOrder, WorkerState


class IncrementalTraining(TaskKind):
    type: ClassVar[TaskType] = TaskType.INCREMENTAL_TRAINING

    def admit(self, session: Session, task: Task, spec: BaseModel, placement: Placement, hub: HubParts) -> BaseModel:
        assert isinstance(spec, IncrementalTrainingSpec)
        return training.admit(session, task, spec, placement, hub.blobs, hub.signing)

    def readmit(self, session: Session, task: Task, at: datetime) -> None:
        training.readmit(session, task, at)

    def order(self, session: Session, task: Task, worker: TaskWorker, signing: Any, order: WorkerOrder) -> WorkerOrder:
        return order.model_copy(update={"training": training.training_order(session, task, worker, signing)})

    def candidates(self, session: Session, task: Task, found: Candidates) -> Candidates:
        """Only the devices holding an unbound privacy reservation of the task."""
        return training.only_reserved(session, task.id, found)

    def worker_ended(self, session: Session, task: Task, worker: TaskWorker, state: WorkerState, at: datetime) -> None:
        training.worker_ended(session, task, worker, state, at)

    def task_ended(self, session: Session, task: Task, at: datetime) -> None:
        training.task_ended(session, task, at)

    def success_refused(self, session: Session, task: Task, worker: TaskWorker) -> str | None:
        return "reported SUCCEEDED but its trained layer never arrived" if session.get(TrainingResult, worker.id) is None else None

    def success_held(self, session: Session, task: Task) -> str | None:
        return "publishing the trained models" if results.unpublished(session, task.id) else None

    def accept(self, session: Session, task: Task, worker: TaskWorker, target_kind: str, target_id: str, data: KindReport, at: datetime) -> tuple[str, bool]:
        """A worker's output is its trained layer (``cloud.incremental.results.accept``)."""
        if isinstance(data, WorkerOutput):
            return results.accept(session, task, worker, data, at)
        return "refused", False

    def outputs(self, session: Session, task: Task, outputs: TaskOutputs) -> TaskOutputs:
        """The published model versions and what each run spent; complete once final and all are published."""
        from cloud.incremental.budgets import spend_to_wire

        kept = list(session.execute(select(TrainingResult).where(TrainingResult.task_id == task.id).order_by(TrainingResult.created_at)).scalars())
        artifacts = [r.artifact_id for r in kept if r.artifact_id]
        spends = session.execute(select(PrivacySpendRow).where(PrivacySpendRow.task_id == task.id).order_by(PrivacySpendRow.id)).scalars()  # type: ignore[arg-type]
        complete = TaskState(task.state) in TASK_FINAL and bool(artifacts) and not results.unpublished(session, task.id)
        return outputs.model_copy(update={"artifacts": artifacts, "privacy": [spend_to_wire(r) for r in spends], "complete": complete})

    def forget(self, session: Session, task_id: str) -> None:
        training.forget(session, task_id)

    def prepare(self, engine: Engine, signing: Any, blobs: Any) -> Mapping[str, int]:
        """Publish the trained layers that came back as new model versions."""
        return {"models_published": results.publish(engine, signing, blobs)}


KIND = IncrementalTraining()
