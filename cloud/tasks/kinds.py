"""The kinds with no hub-side state of their own: ``inference`` (a service on every placed target) and
``batch_inference`` (a dataset split in chunks over the placed targets; its outputs are the chunks')."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from cloud.errors import BadRequest
from cloud.tasks.kind import HubParts, TaskKind
from cloud.tasks.lifecycle import accept_output, create_chunks, dataset_rows
from interfaces.deployments import ArtifactKind
from interfaces.tasks import BatchInferenceSpec, TaskType, WorkerOutput

if TYPE_CHECKING:
    from datetime import datetime

    from pydantic import BaseModel
    from sqlmodel import Session

    from cloud.tables import Task, TaskWorker
    from interfaces.tasks import KindReport, Placement


class Inference(TaskKind):
    type: ClassVar[TaskType] = TaskType.INFERENCE


class BatchInference(TaskKind):
    """Admission reads the dataset's first axis now (npy or safetensors header) and makes the chunks."""

    type: ClassVar[TaskType] = TaskType.BATCH_INFERENCE

    def admit(self, session: Session, task: Task, spec: BaseModel, placement: Placement, hub: HubParts) -> BaseModel:
        from cloud.artifacts import get_artifact

        assert isinstance(spec, BatchInferenceSpec)
        artifact = get_artifact(session, spec.inputs, lock=True)
        if artifact.kind != ArtifactKind.DATASET.value:
            raise BadRequest(f"artefact {artifact.id} is a {artifact.kind}, not a dataset", status=422)
        try:
            rows = dataset_rows(hub.blobs.path(artifact.sha256), artifact.format, spec.input_name)
        except (OSError, ValueError, TypeError) as exc:
            raise BadRequest(f"cannot read dataset {artifact.id}: {exc}", status=422) from None
        if rows == 0:
            raise BadRequest(f"dataset {artifact.id} has no rows", status=422)
        create_chunks(session, task, rows, spec.chunk_size)
        return spec

    def accept(self, session: Session, task: Task, worker: TaskWorker, target_kind: str, target_id: str, data: KindReport, at: datetime) -> tuple[str, bool]:
        """A ``WorkerOutput`` is one chunk's outputs, kept once (:func:`cloud.tasks.lifecycle.accept_output`)."""
        if isinstance(data, WorkerOutput):
            return accept_output(session, task, worker, data, at)
        return super().accept(session, task, worker, target_kind, target_id, data, at)


INFERENCE = Inference()
BATCH_INFERENCE = BatchInference()
