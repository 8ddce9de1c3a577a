"""Orders and reports over MQTT: a worker's ``WorkerOrder`` in its target's desired document, and what the worker
sends back on ``events`` (state, logs, metrics, outputs, federated updates)."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import Field, TypeAdapter, model_validator

from interfaces.algorithms import AlgorithmManifest
from interfaces.deployments import ArtifactName, Sha256, SignedManifest, Version
from interfaces.strict import JsonObject, BY_VALUE, INT64_MAX, AwareTimestamp, Timestamp, WireModel
from interfaces.tasks.specs import (
    MAX_FL_UPDATE_BYTES,
    MAX_SPLIT_CUTS,
    BatchInferenceSpec,
    FederatedTrainingSpec,
    IncrementalTrainingSpec,
    InferenceSpec,
    SplitInferenceSpec,
    TensorName,
    TrainingSpec,
)
from interfaces.tasks.states import (
    MAX_CHUNK_OUTPUT_BYTES,
    MAX_HEAD_BYTES,
    MAX_TRAINING_STEPS,
    ChunkIndex,
    Id,
    MetricName,
    PublicKey,
    TaskType,
    WorkerState,
)

# --- orders and reports over MQTT ------------------------------------------------------------------


class WorkerAction(StrEnum):
    RUN = "run"
    PAUSE = "pause"  # finish the item in hand, then wait (keep reporting)


class InputRef(WireModel):
    """An artefact the worker fetches like an update (a dataset; a training body): signed manifest, path, download token."""

    artifact_id: Id
    signed_manifest: SignedManifest
    path: str = Field(min_length=1, max_length=512)
    token: str = Field(min_length=1, max_length=2048)


class TrainingOrder(WireModel):
    """What an ``incremental_training`` worker needs beyond its spec (per device: the budget's ``max_steps``)."""

    body: InputRef = Field(description="the frozen body: a signed ONNX model artefact, the model's inputs -> feature")
    base_sha256: Sha256 = Field(description="the installed model the body was cut from")
    feature: str = Field(min_length=1, max_length=256, description="the body's output, the last dense layer's input")
    head: str = Field(min_length=1, max_length=MAX_HEAD_BYTES * 4 // 3 + 4, description="base64 safetensors: weight [features, classes], bias [classes]")
    max_steps: int = Field(ge=0, le=MAX_TRAINING_STEPS, description="the most DP-SGD steps this worker may take (its privacy reservation)")
    sample_rate: float = Field(gt=0, le=1, description="Poisson sampling rate q the accountant assumed")


class SplitPart(WireModel):
    """One cut of a ``split_inference`` order: the head (a device's order) or the tail (an edge's) cut there."""

    cut: TensorName
    head: InputRef | None = Field(default=None, description="device orders: the model's inputs -> the cut tensor (a signed ONNX artefact)")
    tail: InputRef | None = Field(default=None, description="edge orders: the cut tensor -> the model's outputs")


class SplitOrder(WireModel):
    """What a ``split_inference`` worker needs beyond its spec: the parts the hub cut, as signed artefacts."""

    base_sha256: Sha256 = Field(description="the whole model the parts were cut from (the device runs it for device-only and fallbacks)")
    input: TensorName = Field(description="the model's one input (what crosses for edge-only)")
    parts: list[SplitPart] = Field(default_factory=list, max_length=MAX_SPLIT_CUTS)
    whole: InputRef | None = Field(default=None, description="edge orders: the whole model, for edge-only")


class FlOrder(WireModel):
    """What a ``federated_training`` worker needs beyond its spec: the round in progress and its global layer."""

    round: int = Field(ge=1, le=INT64_MAX, description="the round in progress (1-based)")
    attempt: int = Field(default=1, ge=1, le=INT64_MAX, description="a round short of k at its timeout runs again as the next attempt")
    deadline_at: AwareTimestamp = Field(description="updates for this round attempt must reach the hub by then")
    weights: InputRef = Field(description="the round's global model: a signed safetensors artefact (last layer: weight [features, classes], bias [classes]; whole model: the algorithm's named tensors)")
    body: InputRef | None = Field(default=None, description="last layer: the frozen body, a signed ONNX artefact, the model's inputs -> feature")
    base_sha256: Sha256 | None = Field(default=None, description="last layer: the installed model the body was cut from")
    feature: str | None = Field(default=None, min_length=1, max_length=256, description="last layer: the body's output the layer reads")
    run: AlgorithmRun | None = Field(default=None, description="whole model: this participant's algorithm (package, limits) and the grant to upload its update of this round attempt")
    participant: Id | None = Field(default=None, description="whole model: this participant's id (a node's or a device's), the contributor its update names")
    config: JsonObject | None = Field(default=None, description="whole model: the configuration this participant's algorithm runs with (its variant's, else the task's)")
    sample_rate: float | None = Field(default=None, gt=0, le=1, description="dp: the Poisson sampling rate q the hub accounted for this device")
    via_edge: bool = Field(description="send the update to the edge's aggregator on fl (hierarchical), else as an event to the hub (flat)")
    participants: list[Id] = Field(
        default_factory=list, max_length=10_000, description="aggregators: the devices under this node taking part in this round (whole model: "
        "their files reach the edge's intake, and the aggregator uploads their weighted mean with the grant of its run)",
    )  # fmt: skip
    secure: bool = Field(default=False, description="secure aggregation: send the layer scaled by n / total_examples, fixed-point, masked (interfaces.secagg)")
    peers: dict[Id, PublicKey] = Field(
        default_factory=dict, max_length=10_000, description="secure: every participant's X25519 public key (base64), to derive the pair seeds",
    )  # fmt: skip
    total_examples: int | None = Field(default=None, ge=1, le=INT64_MAX, description="secure: the participants' examples in all (the scale of each layer)")
    weight: int | None = Field(
        default=None, ge=1, le=INT64_MAX, description="secure, whole model: the examples this participant's parameters count for (its update's share is weight / total_examples)",
    )  # fmt: skip
    reveal: list[Id] = Field(default_factory=list, max_length=10_000, description="secure: participants that dropped after masking; survivors reveal their pair seeds with them")


FL_UPDATE_PREFIX = "fl-update"
"""A whole-model participant's update of a round attempt is the model ``<prefix>.<task>.<participant>`` (:func:`fl_update_identity`)."""
FL_UPDATES_PATH = "/fl/updates"
"""Hierarchical whole-model rounds: the route of a device's edge (under the API prefix) that takes the device's update
(``PUT``, the round's publish grant as the bearer credential) for the edge's aggregator (``edge.fl.UpdateIntake``)."""


def fl_update_identity(task_id: str, participant: str, round: int, attempt: int) -> tuple[str, str]:
    """The (name, version) of the model artefact a whole-model participant (a device, a site, or an edge's
    aggregator) uploads as its update of a round attempt."""
    return f"{FL_UPDATE_PREFIX}.{task_id}.{participant}"[:128], f"{round}.{attempt}"


PARAMETERS_SUFFIX = "-parameters"
"""A ``training`` task publishes its parameters (safetensors) as the model ``<output name><PARAMETERS_SUFFIX>``."""


class PublishGrant(WireModel):
    """What a ``training`` worker may publish: the model artefacts ``names`` at ``version``, through the chunked upload
    API with ``token`` (a hub-signed grant, ``interfaces.uploads.PublishClaims``) instead of an operator's token."""

    token: str = Field(min_length=1, max_length=4096)
    names: list[ArtifactName] = Field(min_length=1, max_length=2, description="the ONNX export's name, then the parameters'")
    version: Version
    expires_at: AwareTimestamp


class AlgorithmRun(WireModel):
    """What a ``training`` worker needs beyond its spec: the signed package, the limits resolved from the spec and the
    manifest, the cards reserved for it, and the grant to publish its result."""

    package: InputRef = Field(description="the algorithm: a signed artefact of kind algorithm, format zip")
    manifest: AlgorithmManifest = Field(description="the package's manifest as the hub read it (the site checks the package carries the same)")
    initial: InputRef | None = Field(default=None, description="the parameters to start from: a signed model artefact (safetensors)")
    cpu_cores: float = Field(gt=0, le=1024)
    memory_bytes: int = Field(ge=1 << 20, le=INT64_MAX)
    timeout_s: float | None = Field(default=None, gt=0, le=30 * 86400)
    accelerators: list[Annotated[int, Field(ge=0, le=1023)]] = Field(default_factory=list, max_length=64, description="indices of the cards reserved for this worker (CUDA_VISIBLE_DEVICES)")
    publish: PublishGrant


EVALUATED_GLOBAL = "global"
"""The label of the published global model in a cross-site evaluation (the others: the participant whose last local
model it is)."""
EvaluationLabel = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")]


class FlEvaluationOrder(WireModel):
    """A whole-model task's cross-site evaluation, after its last round (``round`` None), or the check of the global
    model after round ``round`` (``evaluate_every``): every model named here scored on this site's own data by its
    algorithm's ``evaluate``."""

    round: int | None = Field(default=None, ge=1, le=10_000, description="the round whose global model is checked; None: the cross-site evaluation at the end")

    models: dict[EvaluationLabel, InputRef] = Field(min_length=1, max_length=1_000, description="label (global, or a participant's id) -> the model's parameters (signed safetensors)")
    run: AlgorithmRun = Field(description="this participant's algorithm, as in the rounds")
    config: JsonObject | None = Field(default=None, description="the configuration its algorithm runs with (its variant's, else the task's)")
    deadline_at: AwareTimestamp = Field(description="scores must reach the hub by then")


class FlExportOrder(WireModel):
    """A whole-model task's published parameters to export as ONNX with this participant's algorithm (when it has
    ``export``): upload the model with the grant of ``run`` and report it (``TASK_TRAINED_EVENT``)."""

    parameters: InputRef = Field(description="the published parameters (signed safetensors)")
    run: AlgorithmRun = Field(description="this participant's algorithm; its publish grant names the ONNX model")
    config: JsonObject | None = None
    deadline_at: AwareTimestamp


class FlScore(WireModel):
    """What a site's ``evaluate`` said of one model."""

    loss: float | None = Field(default=None, description="None when it was not finite")
    num_examples: int = Field(ge=0, le=INT64_MAX)
    metrics: dict[MetricName, float] = Field(default_factory=dict, max_length=64)


class FlEvaluation(WireModel):
    """``data`` of an ``FL_EVALUATION_EVENT``: a site's scores of the models of its evaluation order."""

    task_id: Id
    worker_id: Id
    round: int | None = Field(default=None, ge=1, le=10_000, description="the evaluation order's round (None: the cross-site evaluation at the end)")
    scores: dict[EvaluationLabel, FlScore] = Field(min_length=1, max_length=1_000)


class _Order(WireModel):
    """What every worker order holds; each task type's variant adds its ``type``, its ``spec`` and its kind's part."""

    worker_id: Id
    task_id: Id
    role: str = Field(default="worker", max_length=32)
    action: Annotated[WorkerAction, BY_VALUE] = WorkerAction.RUN
    attempt: int = Field(default=1, ge=1, le=INT64_MAX)
    heartbeat_s: float = Field(default=5, gt=0, le=3600)
    inputs: InputRef | None = None
    items: int | None = Field(default=None, ge=0, le=INT64_MAX, description="sharded: number of inputs in the dataset")
    chunk_size: int | None = Field(default=None, ge=1, le=INT64_MAX)
    chunks: list[Annotated[tuple[ChunkIndex, ChunkIndex], BY_VALUE]] = Field(default_factory=list, max_length=4096, description="sharded: ranges [first, end) of chunk indices this worker owns; may grow")

    def input_refs(self) -> list[InputRef]:
        """Every artefact this order makes the worker fetch (the worker host keeps their files, no others)."""
        return [self.inputs] if self.inputs is not None else []

    def chunk_indices(self) -> list[int]:
        return [i for first, end in self.chunks for i in range(first, end)]

    def chunk_bounds(self, index: int) -> tuple[int, int]:
        """Item range [start, end) of chunk ``index``."""
        assert self.chunk_size is not None and self.items is not None
        return index * self.chunk_size, min((index + 1) * self.chunk_size, self.items)


class InferenceOrder(_Order):
    """An ``inference`` worker: serve the model until stopped or ``duration_s``."""

    type: Literal[TaskType.INFERENCE]
    spec: InferenceSpec


class BatchInferenceOrder(_Order):
    """A ``batch_inference`` worker: the dataset (``inputs``) and the chunks of it this worker owns."""

    type: Literal[TaskType.BATCH_INFERENCE]
    spec: BatchInferenceSpec


class SplitInferenceOrder(_Order):
    """A ``split_inference`` worker: a device's head or its edge's tail, with the parts the hub cut."""

    type: Literal[TaskType.SPLIT_INFERENCE]
    spec: SplitInferenceSpec
    split: SplitOrder | None = Field(default=None, description="the parts of the model this worker runs")

    def input_refs(self) -> list[InputRef]:
        refs = super().input_refs()
        if self.split is not None:
            refs += [r for p in self.split.parts for r in (p.head, p.tail) if r is not None]
            refs += [self.split.whole] if self.split.whole is not None else []
        return refs


class IncrementalTrainingOrder(_Order):
    """An ``incremental_training`` worker: the body, the layer to train and the step limit."""

    type: Literal[TaskType.INCREMENTAL_TRAINING]
    spec: IncrementalTrainingSpec
    training: TrainingOrder | None = Field(default=None, description="the body, the layer to train and the step limit")

    def input_refs(self) -> list[InputRef]:
        return super().input_refs() + ([self.training.body] if self.training is not None else [])


class FederatedTrainingOrder(_Order):
    """A ``federated_training`` worker (a device's, or its edge's ``aggregator``): the round in progress."""

    type: Literal[TaskType.FEDERATED_TRAINING]
    spec: FederatedTrainingSpec
    fl: FlOrder | None = Field(default=None, description="the round in progress")
    evaluation: FlEvaluationOrder | None = Field(default=None, description="whole model, after the last round: the cross-site evaluation")
    export: FlExportOrder | None = Field(default=None, description="whole model, after the last round: export the published model as ONNX")

    def input_refs(self) -> list[InputRef]:
        refs = super().input_refs()
        if self.evaluation is not None:
            refs += [*self.evaluation.models.values(), self.evaluation.run.package]
        if self.export is not None:
            refs += [self.export.parameters, self.export.run.package]
        if self.fl is None:
            return refs
        return refs + [ref for ref in (self.fl.weights, self.fl.body, self.fl.run.package if self.fl.run else None) if ref is not None]


class TrainingTaskOrder(_Order):
    """A ``training`` worker: the algorithm to run on this site's datasets and where its result goes."""

    type: Literal[TaskType.TRAINING]
    spec: TrainingSpec
    run: AlgorithmRun | None = Field(default=None, description="the package, the resolved limits and the publish grant")

    def input_refs(self) -> list[InputRef]:
        if self.run is None:
            return super().input_refs()
        return super().input_refs() + [self.run.package] + ([self.run.initial] if self.run.initial is not None else [])


WorkerOrder = Annotated[
    InferenceOrder | BatchInferenceOrder | SplitInferenceOrder | IncrementalTrainingOrder | FederatedTrainingOrder | TrainingTaskOrder,
    Field(discriminator="type"),
]
"""One entry of ``DesiredBody.tasks``: run this worker (withdrawn: stop it). One variant per task type, told apart
by ``type``: its ``spec`` is that type's, and it carries that type's part (``split``, ``training``, ``fl``)."""
ORDER_VARIANTS: dict[TaskType, type[_Order]] = {
    TaskType.INFERENCE: InferenceOrder, TaskType.BATCH_INFERENCE: BatchInferenceOrder, TaskType.SPLIT_INFERENCE: SplitInferenceOrder,
    TaskType.INCREMENTAL_TRAINING: IncrementalTrainingOrder, TaskType.FEDERATED_TRAINING: FederatedTrainingOrder, TaskType.TRAINING: TrainingTaskOrder,
}  # fmt: skip
ORDER_ADAPTER: TypeAdapter[WorkerOrder] = TypeAdapter(WorkerOrder)
"""Validates one order (a stored one, or one built from parts) into its type's variant."""


def worker_order(**fields: object) -> WorkerOrder:
    """The order of ``fields`` as its type's variant (``type`` picks it; the spec is validated as that type's)."""
    return ORDER_ADAPTER.validate_python(fields)


class WorkerReport(WireModel):
    """``data`` of a ``TASK_WORKER_EVENT``: the worker's state (RUNNING is also its heartbeat)."""

    worker_id: Id
    task_id: Id
    state: Literal[WorkerState.RUNNING, WorkerState.SUCCEEDED, WorkerState.FAILED, WorkerState.REJECTED]
    detail: str = Field(default="", max_length=2048)
    paused: bool = False
    items_done: int | None = Field(default=None, ge=0, le=INT64_MAX, description="inputs this worker finished (this run)")


class LogLine(WireModel):
    ts: Timestamp
    level: Literal["debug", "info", "warning", "error"] = "info"
    text: str = Field(max_length=4096)


class WorkerLog(WireModel):
    """``data`` of a ``TASK_LOG_EVENT``: a worker's log lines in order (the hub keeps each once)."""

    worker_id: Id
    task_id: Id
    lines: list[LogLine] = Field(min_length=1, max_length=200)


class WorkerMetrics(WireModel):
    """``data`` of a ``TASK_METRICS_EVENT``: one sample of a worker's numbers (counts, rates, latencies)."""

    worker_id: Id
    task_id: Id
    ts: Timestamp
    values: dict[Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-z][a-z0-9_]*$")], float] = Field(max_length=64)


class WorkerOutput(WireModel):
    """``data`` of a ``TASK_OUTPUT_EVENT``: one chunk's outputs. ``data`` is base64 of a safetensors frame, one tensor per model output,
    first axis = the chunk's inputs in order. The hub keeps the first copy from the chunk's owner."""

    worker_id: Id
    task_id: Id
    chunk: int = Field(ge=0, le=INT64_MAX)
    items: int = Field(ge=1, le=INT64_MAX)
    data: str = Field(min_length=1, max_length=MAX_CHUNK_OUTPUT_BYTES * 4 // 3 + 4)


class FlUpdate(WireModel):
    """``data`` of an ``FL_UPDATE_EVENT`` (and the payload of a device's ``fl`` message to its edge's aggregator): the
    layer trained in one round attempt by ``contributors`` (one device, or an edge's devices combined: their
    sample-weighted mean), on ``num_examples`` examples in all."""

    task_id: Id
    worker_id: Id = Field(description="the reporting worker: the device's, or the edge aggregator's")
    round: int = Field(ge=1, le=INT64_MAX)
    attempt: int = Field(ge=1, le=INT64_MAX)
    contributors: list[Id] = Field(min_length=1, max_length=10_000, description="the devices whose training is in it")
    num_examples: int = Field(ge=1, le=INT64_MAX)
    data: str | None = Field(default=None, min_length=1, max_length=MAX_FL_UPDATE_BYTES * 4 // 3 + 4, description="last layer: base64 safetensors, weight [features, classes], bias [classes]")
    parameters: Id | None = Field(
        default=None, description="whole model: the model artefact (safetensors) the participant uploaded with its round grant (a device of a hierarchical "
        "task, on fl to its edge's aggregator: the id the edge's intake answered for its file)",
    )  # fmt: skip
    metrics: dict[MetricName, float] = Field(default_factory=dict, max_length=64, description="sample-weighted means over the contributors: loss, accuracy (on their own data)")
    masked: bool = Field(default=False, description="secure aggregation: weight and bias are uint32 masked encodings (an edge's: their sum)")

    @model_validator(mode="after")
    def _one_payload(self) -> FlUpdate:
        if (self.data is None) == (self.parameters is None):
            raise ValueError("an update carries either data (a last layer, inline) or parameters (a whole model, uploaded)")
        return self


class FlKey(WireModel):
    """``data`` of an ``FL_KEY_EVENT``: the X25519 public key a device's worker masks its updates with."""

    task_id: Id
    worker_id: Id
    public_key: PublicKey


class FlReveal(WireModel):
    """``data`` of an ``FL_REVEAL_EVENT``: a survivor's pair seeds with the participants that dropped after masking."""

    task_id: Id
    worker_id: Id
    round: int = Field(ge=1, le=INT64_MAX)
    attempt: int = Field(ge=1, le=INT64_MAX)
    seeds: dict[Id, Annotated[str, Field(min_length=44, max_length=44)]] = Field(max_length=10_000, description="dropped participant -> base64 of the 32-byte pair seed")


class TrainedModel(WireModel):
    """``data`` of a ``TASK_TRAINED_EVENT``: a ``training`` worker's result, sent once the artefacts it published are
    stored (the hub checks they are the granted names and version before it keeps the result)."""

    task_id: Id
    worker_id: Id
    parameters: Id = Field(description="the model artefact of the trained parameters (safetensors)")
    onnx: Id | None = Field(default=None, description="the model artefact of the ONNX export, when the algorithm exports")
    steps: int = Field(ge=1, le=MAX_TRAINING_STEPS)
    resumed_from: int = Field(ge=0, le=MAX_TRAINING_STEPS, description="the checkpoint's step the last run started from (0: from the start)")
    num_examples: int = Field(ge=0, le=INT64_MAX, description="examples evaluate() scored")
    loss: float
    metrics: dict[MetricName, float] = Field(default_factory=dict, max_length=64, description="what evaluate() reported (accuracy, ...)")


KindReport = WorkerOutput | FlUpdate | FlKey | FlReveal | FlEvaluation | TrainedModel
"""What a worker sends that its task's kind takes (``TaskKind.accept``): a chunk's outputs, a trained layer, a
round's update, a key, a survivor's seeds, a trained model."""
TaskReportData = WorkerReport | WorkerLog | WorkerMetrics | KindReport
"""The ``data`` of every task event (``TASK_EVENTS``), read as its type's model."""
