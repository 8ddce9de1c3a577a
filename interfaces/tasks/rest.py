"""The REST models of task run management: a task's creation (one variant per type), its public view, workers,
logs, metrics and outputs."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, TypeAdapter, model_validator

from interfaces.deployments import TargetKind
from interfaces.privacy import PrivacySpend
from interfaces.strict import BY_VALUE, JsonObject
from interfaces.tasks.specs import (
    AcceleratorRequest,
    BatchInferenceSpec,
    FederatedTrainingSpec,
    IncrementalTrainingSpec,
    InferenceSpec,
    Placement,
    RetryPolicy,
    SplitInferenceSpec,
    TrainingSpec,
    _In,
)
from interfaces.tasks.states import TaskState, TaskType, WorkerState

# --- REST ------------------------------------------------------------------------------------------


class TaskCreate(_In):
    name: str = Field(default="", max_length=128)
    type: Annotated[TaskType, BY_VALUE]
    spec: JsonObject = Field(description="the type's spec (InferenceSpec, BatchInferenceSpec, ...); its workers' orders carry it on MQTT")
    placement: Placement = Field(default_factory=Placement)
    timeout_s: int | None = Field(default=None, ge=1, le=30 * 86400, description="running time (paused time excluded) before TIMED_OUT; none: no limit")
    worker_timeout_s: float = Field(default=30, ge=1, le=86400, description="a worker silent this long is TIMED_OUT and its work rescheduled")
    heartbeat_s: float = Field(default=5, ge=0.2, le=3600, description="how often a worker reports while it runs")
    retry: RetryPolicy = Field(default_factory=RetryPolicy)
    start: bool = Field(default=True, description="false: the task is held in PENDING until POST /tasks/{id}/start")

    @model_validator(mode="after")
    def _check(self) -> TaskCreate:
        if self.heartbeat_s >= self.worker_timeout_s:
            raise ValueError("heartbeat_s must be below worker_timeout_s")
        return self


class InferenceTaskCreate(TaskCreate):
    type: Literal[TaskType.INFERENCE]
    spec: InferenceSpec  # type: ignore[assignment]


class BatchInferenceTaskCreate(TaskCreate):
    type: Literal[TaskType.BATCH_INFERENCE]
    spec: BatchInferenceSpec  # type: ignore[assignment]


class SplitInferenceTaskCreate(TaskCreate):
    type: Literal[TaskType.SPLIT_INFERENCE]
    spec: SplitInferenceSpec  # type: ignore[assignment]


class IncrementalTrainingTaskCreate(TaskCreate):
    type: Literal[TaskType.INCREMENTAL_TRAINING]
    spec: IncrementalTrainingSpec  # type: ignore[assignment]


class FederatedTrainingTaskCreate(TaskCreate):
    type: Literal[TaskType.FEDERATED_TRAINING]
    spec: FederatedTrainingSpec  # type: ignore[assignment]


class TrainingTaskCreate(TaskCreate):
    type: Literal[TaskType.TRAINING]
    spec: TrainingSpec  # type: ignore[assignment]


TaskCreateBody = Annotated[
    InferenceTaskCreate | BatchInferenceTaskCreate | SplitInferenceTaskCreate | IncrementalTrainingTaskCreate | FederatedTrainingTaskCreate
    | TrainingTaskCreate,
    Field(discriminator="type"),
]
"""``POST /tasks``: a :class:`TaskCreate` whose ``spec`` is its type's (one variant per type, told apart by
``type``), so the OpenAPI shows each type's fields and a client can generate code from it."""
TASK_CREATE_VARIANTS: dict[TaskType, type[TaskCreate]] = {
    TaskType.INFERENCE: InferenceTaskCreate, TaskType.BATCH_INFERENCE: BatchInferenceTaskCreate, TaskType.SPLIT_INFERENCE: SplitInferenceTaskCreate,
    TaskType.INCREMENTAL_TRAINING: IncrementalTrainingTaskCreate, TaskType.FEDERATED_TRAINING: FederatedTrainingTaskCreate,
    TaskType.TRAINING: TrainingTaskCreate,
}  # fmt: skip


class TaskProgress(BaseModel):
    items_total: int | None = Field(default=None, description="sharded types: inputs in all")
    items_done: int | None = None
    chunks_total: int | None = None
    chunks_done: int | None = None
    workers: dict[WorkerState, int] = Field(default_factory=dict)


class TaskTransition(BaseModel):
    from_state: str | None
    to_state: str
    at: datetime
    reason: str = ""


class TaskPublic(BaseModel):
    id: str
    name: str
    type: TaskType
    spec: dict[str, Any]
    placement: Placement
    timeout_s: int | None
    worker_timeout_s: float
    heartbeat_s: float
    retry: RetryPolicy
    state: TaskState
    reason: str = ""
    held: bool = Field(description="created with start=false and not started yet")
    attempt: int = Field(description="1, then one more per retry of the whole task")
    progress: TaskProgress
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None = Field(description="first worker RUNNING")
    finished_at: datetime | None
    deadline_at: datetime | None


class TaskDetail(TaskPublic):
    history: list[TaskTransition] = Field(default_factory=list)


# one variant of each per type, told apart by ``type``: its ``spec`` is that type's (what the REST answers carry)
class InferenceTask(TaskPublic):
    type: Literal[TaskType.INFERENCE]
    spec: InferenceSpec  # type: ignore[assignment]


class BatchInferenceTask(TaskPublic):
    type: Literal[TaskType.BATCH_INFERENCE]
    spec: BatchInferenceSpec  # type: ignore[assignment]


class SplitInferenceTask(TaskPublic):
    type: Literal[TaskType.SPLIT_INFERENCE]
    spec: SplitInferenceSpec  # type: ignore[assignment]


class IncrementalTrainingTask(TaskPublic):
    type: Literal[TaskType.INCREMENTAL_TRAINING]
    spec: IncrementalTrainingSpec  # type: ignore[assignment]


class FederatedTrainingTask(TaskPublic):
    type: Literal[TaskType.FEDERATED_TRAINING]
    spec: FederatedTrainingSpec  # type: ignore[assignment]


class TrainingTask(TaskPublic):
    type: Literal[TaskType.TRAINING]
    spec: TrainingSpec  # type: ignore[assignment]


class InferenceTaskDetail(InferenceTask, TaskDetail): ...


class BatchInferenceTaskDetail(BatchInferenceTask, TaskDetail): ...


class SplitInferenceTaskDetail(SplitInferenceTask, TaskDetail): ...


class IncrementalTrainingTaskDetail(IncrementalTrainingTask, TaskDetail): ...


class FederatedTrainingTaskDetail(FederatedTrainingTask, TaskDetail): ...


class TrainingTaskDetail(TrainingTask, TaskDetail): ...


TaskPublicBody = Annotated[
    InferenceTask | BatchInferenceTask | SplitInferenceTask | IncrementalTrainingTask | FederatedTrainingTask | TrainingTask, Field(discriminator="type")
]
"""A task as the REST API answers it (lists, actions): :class:`TaskPublic` with its type's spec."""
TaskDetailBody = Annotated[
    InferenceTaskDetail | BatchInferenceTaskDetail | SplitInferenceTaskDetail | IncrementalTrainingTaskDetail | FederatedTrainingTaskDetail
    | TrainingTaskDetail,
    Field(discriminator="type"),
]
"""``GET /tasks/{id}`` and ``POST /tasks``: :class:`TaskDetail` with its type's spec."""
TASK_PUBLIC: TypeAdapter[TaskPublicBody] = TypeAdapter(TaskPublicBody)
TASK_DETAIL: TypeAdapter[TaskDetailBody] = TypeAdapter(TaskDetailBody)


class WorkerPublic(BaseModel):
    id: str
    task_id: str
    target_kind: TargetKind
    target_id: str
    role: str
    state: WorkerState
    attempt: int
    items_assigned: int | None
    items_done: int | None
    accelerators: list[AcceleratorRequest] = Field(default_factory=list, description="reserved on the target while the worker is active")
    detail: str
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    last_report_at: datetime | None
    history: list[TaskTransition] = Field(default_factory=list)


class TaskLogLine(BaseModel):
    id: int = Field(description="increases in the order the hub stored the lines; the SSE event id")
    task_id: str
    worker_id: str | None = Field(description="none: a line of the hub's scheduler about this task")
    target_id: str | None
    ts: datetime
    level: Literal["debug", "info", "warning", "error"]
    text: str


class MetricSample(BaseModel):
    worker_id: str
    target_id: str
    ts: datetime
    values: dict[str, float]


class TaskMetrics(BaseModel):
    task_id: str
    totals: dict[str, float] = Field(description="sums over the workers' latest samples (rates and counts)")
    workers: dict[str, MetricSample] = Field(description="each worker's latest sample")
    series: list[MetricSample] = Field(default_factory=list, description="samples in order (GET ?series=true, newest last)")


class TrainedSummary(BaseModel):
    worker_id: str
    target_id: str
    parameters: str = Field(description="id of the parameters' model artefact (safetensors)")
    onnx: str | None = Field(description="id of the ONNX export's model artefact")
    steps: int
    resumed_from: int
    num_examples: int
    loss: float
    metrics: dict[str, float]


class CrossScore(BaseModel):
    evaluator: str = Field(description="the participant whose own data scored the model")
    model: str = Field(description="global (the published model), or the participant whose last local model it is")
    loss: float | None
    num_examples: int
    metrics: dict[str, float]


class RoundScore(BaseModel):
    round: int = Field(description="the round whose global model was scored (evaluate_every)")
    metric: str = Field(description="accuracy (higher is better), or loss (lower) when a participant reported no accuracy")
    value: float | None = Field(description="the participants' scores weighted by their examples; None: nobody scored it by the deadline")
    evaluators: int
    artifact_id: str = Field(description="the global model's parameters")


class TensorInfo(BaseModel):
    name: str
    dtype: str
    shape: list[int]


class TaskOutputs(BaseModel):
    task_id: str
    state: TaskState
    complete: bool = Field(description="every input has its output")
    items_total: int | None
    items_done: int | None
    tensors: list[TensorInfo] = Field(default_factory=list, description="sharded types: the gathered outputs (rows in input order)")
    content_url: str | None = Field(default=None, description="GET it for the gathered outputs as one safetensors file")
    artifacts: list[str] = Field(default_factory=list, description="ids of artefacts the task produced (models)")
    privacy: list[PrivacySpend] = Field(default_factory=list, description="incremental_training: what each worker run spent of its device's budget")
    trained: list[TrainedSummary] = Field(default_factory=list, description="training: what each site's run reported (its evaluation) and published")
    evaluation: list[CrossScore] = Field(default_factory=list, description="federated_training with cross_evaluation: every participant's score of every model (the cross-site matrix)")
    rounds_scored: list[RoundScore] = Field(default_factory=list, description="federated_training with evaluate_every: each check of the global model")
    best_round: int | None = Field(default=None, description="federated_training with evaluate_every: the round whose model was published")
    deployments: list[str] = Field(default_factory=list, description="federated_training with then_deploy: the deployment of the ONNX export it started (GET /deployments/{id})")
