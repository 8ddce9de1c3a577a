"""The ``federated_training`` kind (DESIGN §5): the hooks of :class:`~cloud.tasks.kind.TaskKind` over
``cloud.fl.task`` (admission, plan, orders, privacy) and ``cloud.fl.rounds`` (updates, keys, reveals, rounds)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar

from sqlalchemy import select

from cloud.fl import rounds
from cloud.fl import task as fl
from cloud.tables import FlPlan, PrivacySpendRow
from cloud.tasks.kind import Driver, HubParts, TaskKind, Ticked
from interfaces.tasks import (
    FL_AGGREGATOR, FL_EVALUATION_EVENT, FL_KEY_EVENT, FL_REVEAL_EVENT, FL_UPDATE_EVENT, FederatedTrainingSpec, FlEvaluation, FlKey, FlReveal, FlUpdate, TASK_TRAINED_EVENT, TrainedModel, TaskOutputs, TaskType,
)  # fmt: skip

if TYPE_CHECKING:
    from pydantic import BaseModel
    from sqlalchemy.engine import Engine
    from sqlmodel import Session

    from cloud.placement import Candidates
    from cloud.tables import Task, TaskWorker
    from interfaces.tasks import KindReport, Placement, WorkerOrder


class FederatedTraining(TaskKind):
    type: ClassVar[TaskType] = TaskType.FEDERATED_TRAINING
    events: ClassVar[frozenset[str]] = frozenset({FL_UPDATE_EVENT, FL_KEY_EVENT, FL_REVEAL_EVENT, FL_EVALUATION_EVENT, TASK_TRAINED_EVENT})
    node_roles: ClassVar[frozenset[str]] = frozenset({FL_AGGREGATOR})

    def admit(self, session: Session, task: Task, spec: BaseModel, placement: Placement, hub: HubParts) -> BaseModel:
        assert isinstance(spec, FederatedTrainingSpec)
        return fl.admit(session, task, spec, placement, hub.blobs, hub.signing)

    def readmit(self, session: Session, task: Task, at: datetime) -> None:
        fl.readmit(session, task, at)

    def order(self, session: Session, task: Task, worker: TaskWorker, signing: Any, order: WorkerOrder) -> WorkerOrder:
        from cloud.fl import whole

        plan = session.get(FlPlan, task.id)
        evaluation = whole.evaluation_order(session, task, plan, worker, signing) if plan is not None else None
        export = whole.export_order(session, task, plan, worker, signing) if plan is not None else None
        return order.model_copy(update={"fl": fl.fl_order(session, task, worker, signing), "evaluation": evaluation, "export": export})

    def companion_roles(self, task: Task) -> tuple[str, str] | None:
        """Hierarchical rounds of a decomposable strategy: an aggregator on the edge node of each device."""
        return ("worker", FL_AGGREGATOR) if fl.via_edge(fl.spec_of(task)) else None

    def candidates(self, session: Session, task: Task, found: Candidates) -> Candidates:
        return fl.keeping_dataset(session, task, found)

    def task_ended(self, session: Session, task: Task, at: datetime) -> None:
        fl.task_ended(session, task, at)

    def accept(self, session: Session, task: Task, worker: TaskWorker, target_kind: str, target_id: str, data: KindReport, at: datetime) -> tuple[str, bool]:
        """A round's update, a device's key, a survivor's seeds (``cloud.fl.rounds``); an accepted one wakes the
        scheduler. A chunk output means nothing to a federated task (there are no chunks)."""
        if isinstance(data, FlUpdate):
            outcome = rounds.accept(session, task, target_kind, target_id, data, at)
        elif isinstance(data, FlKey):
            outcome = rounds.accept_key(session, task, target_kind, target_id, data)
        elif isinstance(data, FlReveal):
            outcome = rounds.accept_reveal(session, task, target_kind, target_id, data, at)
        elif isinstance(data, FlEvaluation):
            from cloud.fl import whole

            outcome = whole.accept_evaluation(session, task, target_kind, target_id, data)
        elif isinstance(data, TrainedModel):  # the ONNX export of the published model (then_deploy)
            from cloud.fl import whole

            outcome = whole.accept_export(session, task, target_kind, target_id, data)
        else:
            return super().accept(session, task, worker, target_kind, target_id, data, at)
        return outcome, outcome == "accepted"

    def outputs(self, session: Session, task: Task, outputs: TaskOutputs) -> TaskOutputs:
        """The published model, and what each device's participation spent (a DP task)."""
        from cloud.incremental.budgets import spend_to_wire

        plan = session.get(FlPlan, task.id)
        artifacts = [plan.published_artifact_id] if plan is not None and plan.published_artifact_id else []
        spends = session.execute(select(PrivacySpendRow).where(PrivacySpendRow.task_id == task.id).order_by(PrivacySpendRow.id)).scalars()  # type: ignore[arg-type]
        from cloud.fl import whole

        scores = whole.matrix(plan) if plan is not None else []
        checks, best = whole.round_scores(plan) if plan is not None else ([], None)
        onnx, deployment = whole.deployment_of(plan) if plan is not None else (None, None)
        artifacts += [onnx] if onnx else []
        return outputs.model_copy(update={"artifacts": artifacts, "privacy": [spend_to_wire(r) for r in spends], "complete": bool(artifacts), "evaluation": scores,
                                          "rounds_scored": checks, "best_round": best if plan is not None and plan.published_artifact_id else None,
                                          "deployments": [deployment] if deployment else []})  # fmt: skip

    def forget(self, session: Session, task_id: str) -> None:
        fl.forget(session, task_id)

    def blobs_of(self, session: Session, task_id: str) -> list[str]:
        """A whole-model task's strategy state and fused parameters not yet recorded as an artefact."""
        from cloud.fl import whole

        plan = session.get(FlPlan, task_id)
        return whole.own_blobs(plan) if plan is not None and whole.is_whole(plan) else []

    def prepare(self, engine: Engine, signing: Any, blobs: Any) -> Mapping[str, int]:
        """Store each open round's global layer, and publish the model of a task whose rounds are done."""
        return {"fl_models_stored": rounds.prepare(engine, signing, blobs)}

    def due_ids(self, session: Session, at: datetime) -> set[str]:
        return rounds.round_due(session, at)

    def tick(self, session: Session, task: Task, at: datetime, driver: Driver) -> Ticked:
        """Open, close or retry the round (``cloud.fl.rounds.drive``), on the drive's changes so far."""
        session.flush()
        return rounds.drive(session, task, at, driver, driver.blobs)


KIND = FederatedTraining()
