"""Task run management (DESIGN §4.3, standard §8.3): tasks, workers, orders, worker reports, type registry.

The wire contract between the hub, edges and devices for running AI tasks:

* REST models: ``TaskCreate``, ``TaskPublic``, ``WorkerPublic``, ``TaskLogLine``, ``TaskMetrics``, ``TaskOutputs``.
* Orders (``WorkerOrder``) travel to a target inside its retained ``desired`` document
  (``DesiredBody.tasks``, versioned by ``tasks_version``), so a target that restarts converges on what it
  must run; a withdrawn order means "stop this worker".
* Workers report on ``events``: ``TASK_WORKER_EVENT`` (state and progress, also the worker's heartbeat),
  ``TASK_LOG_EVENT`` (log lines), ``TASK_METRICS_EVENT`` (numbers) and ``TASK_OUTPUT_EVENT`` (one finished
  chunk of a sharded task's outputs, as safetensors bytes). The hub keeps each line, sample and chunk once.
* ``TASK_TYPES`` is the registry: each type's spec model, how it is placed, what happens when a worker is
  lost, and which targets can run it.
* ``incremental_training`` (``IncrementalTrainingSpec``): the hub splits the installed model at the input of
  its last dense layer; the order's ``training`` (``TrainingOrder``) names the frozen body (a signed model
  artefact) and carries the last layer's weights, the sample rate and ``max_steps`` (what the device's
  privacy budget allows, ``interfaces.privacy``). The device trains that layer with DP-SGD on a dataset that
  never leaves it and sends the new weights as its one ``WorkerOutput`` (chunk 0, ``items`` = steps taken).
* ``split_inference`` (``SplitInferenceSpec``): the hub cuts the model into heads and tails (signed artefacts);
  each placed device gets a ``head`` worker, its edge node one ``tail`` worker for the task (the order's
  ``split``, ``SplitOrder``). Requests cross on the ``infer`` channel (``interfaces.topics.DEVICE_INFER``).
  A type whose spec model is ``None`` is known to the contract but not yet runnable (``POST /tasks`` refuses
  it with a 422).

State machines (the transitions below are the only legal moves)::

    task:   PENDING -> SCHEDULED -> RUNNING <-> PAUSED
            PENDING | SCHEDULED | RUNNING | PAUSED -> SUCCEEDED | FAILED | CANCELED | TIMED_OUT
            FAILED | CANCELED | TIMED_OUT -> PENDING            (retry)
    worker: QUEUED -> RUNNING -> SUCCEEDED
            QUEUED | RUNNING -> FAILED | TIMED_OUT | REJECTED | LOST | CANCELED
"""

from __future__ import annotations

import builtins
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from interfaces.deployments import ArtifactName, Sha256, SignedManifest, TargetKind, Version
from interfaces.privacy import DatasetName, Delta, Epsilon, PrivacySpend
from interfaces.resources import AcceleratorType
from interfaces.strict import BY_VALUE, INT64_MAX, AwareTimestamp, JsonObject, Timestamp, WireModel
from interfaces.text import NoNul

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
TASK_EVENTS = frozenset({TASK_WORKER_EVENT, TASK_LOG_EVENT, TASK_METRICS_EVENT, TASK_OUTPUT_EVENT, FL_UPDATE_EVENT, FL_KEY_EVENT, FL_REVEAL_EVENT})

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


class _In(NoNul):
    """Base of the REST models: no coercion (JSON as sent: ``0`` is no boolean, ``"3"`` no number); an enum field
    is ``BY_VALUE``, so that Python code and stored documents may give its value."""

    model_config = ConfigDict(extra="forbid", strict=True)


# --- states ----------------------------------------------------------------------------------------


class TaskType(StrEnum):
    INFERENCE = "inference"
    SPLIT_INFERENCE = "split_inference"
    INCREMENTAL_TRAINING = "incremental_training"
    FEDERATED_TRAINING = "federated_training"
    BATCH_INFERENCE = "batch_inference"


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


# --- specs of the task types ------------------------------------------------------------------------


class ModelRef(_In):
    """A model the target runs, deployed through §8.2 (``installed["model"]`` in its reported document)."""

    name: ArtifactName
    version: Version | None = Field(default=None, description="any version when absent")


class InferenceSpec(_In):
    """Serve a model on every placed target: the worker keeps it loaded, answers ``infer`` commands and
    reports request counts and latencies. Runs for ``duration_s`` (then SUCCEEDS) or until stopped."""

    model: ModelRef
    duration_s: float | None = Field(default=None, gt=0, le=365 * 86400, description="none: until stopped")
    report_interval_s: float = Field(default=10, ge=0.2, le=3600)


class BatchInferenceSpec(_In):
    """Run a model over every row of a dataset artefact (kind ``dataset``, format ``npy`` or
    ``safetensors``), sharded into chunks across the placed targets; outputs are gathered in input order."""

    model: ModelRef
    inputs: Id = Field(description="id of the dataset artefact; its first axis indexes the inputs")
    input_name: str | None = Field(default=None, max_length=128, description="the model input fed (default: its only input); for a safetensors dataset also the tensor read")
    chunk_size: int = Field(default=64, ge=1, le=65536, description="inputs per chunk: the unit of reporting and rescheduling")


class TrainingOutput(_In):
    """The model version an ``incremental_training`` task publishes for each device it trained on."""

    name: ArtifactName | None = Field(default=None, description="default: the trained model's name")
    version: Version | None = Field(
        default=None,
        description="default: the next free patch version after the trained one (1.0.0 -> 1.0.1, or 1.0.2 if taken ...), "
        "one per device; an explicit version needs a placement that resolves to one device",
    )


class IncrementalTrainingSpec(_In):
    """Fine-tune the last dense layer of an installed model on each placed device's own dataset with DP-SGD
    (per-example clipping to ``clip_norm``, Gaussian noise ``noise_multiplier * clip_norm``, Poisson sampling at
    ``batch_size / rows``). The task reserves what it may spend of each device's privacy budget for ``dataset``
    when it is created (409 ``privacy_budget_exceeded`` if a budget cannot afford it); each device stops after
    the order's ``max_steps``. The trained layer comes back to the hub, which publishes the new model version."""

    model: ModelRef = Field(description="the installed model to fine-tune; a missing version is resolved (and pinned) at creation")
    dataset: DatasetName = Field(description="the name of a dataset kept on the device (it never leaves it)")
    epochs: float | None = Field(default=None, gt=0, le=10_000, description="steps = ceil(epochs * rows / batch_size)")
    steps: int | None = Field(default=None, ge=1, le=MAX_TRAINING_STEPS)
    batch_size: int = Field(default=64, ge=1, le=65536, description="expected batch size (Poisson sampling)")
    learning_rate: float = Field(default=0.1, gt=0, le=1000)
    clip_norm: float = Field(default=1.0, gt=0, le=1e6, description="C: each example's gradient is clipped to this L2 norm")
    noise_multiplier: float = Field(default=1.0, gt=0, le=1000, description="σ: Gaussian noise of std σ·C is added to the summed gradients")
    delta: Delta | None = Field(default=None, description="δ of this task's own ε (default: the device budget's δ)")
    epsilon: Epsilon | None = Field(default=None, description="the most this task may spend on each device (at delta); training stops before")
    layer: str | None = Field(default=None, min_length=1, max_length=256, description="the tensor feeding the last dense layer (default: found)")
    output: TrainingOutput = Field(default_factory=TrainingOutput)

    @model_validator(mode="after")
    def _check(self) -> IncrementalTrainingSpec:
        if self.epochs is not None and self.steps is not None:
            raise ValueError("give epochs or steps, not both")
        if self.epochs is None and self.steps is None and self.epsilon is None:
            raise ValueError("give epochs, steps or epsilon (train until the task's epsilon is spent)")
        return self


SPLIT_DEVICE_ONLY = "<device>"
"""A split plan's cut meaning: the whole model on the device, nothing crosses the link."""
SPLIT_EDGE_ONLY = "<edge>"
"""A split plan's cut meaning: the raw input crosses, the whole model runs on the edge."""
SPLIT_HEAD, SPLIT_TAIL = "head", "tail"
"""Worker roles of a ``split_inference`` task: heads on the devices, one tail per edge node serving them."""
MAX_SPLIT_CUTS = 8
TensorName = Annotated[str, Field(min_length=1, max_length=256)]


class SplitInferenceSpec(_In):
    """Serve a model on each placed device split with its edge node: the device runs the head up to a cut
    tensor, the activation crosses on ``infer`` as a safetensors frame (int8 when ``quantize``), the edge runs
    the tail and answers. A planner on the device picks the cut from what it measures (its own part latencies,
    the edge's, the activation size, the link's bandwidth and round trip) and moves it when the link changes.
    When the edge does not answer within ``timeout_ms`` the request runs on the device on the whole model
    (which the device must run) and counts as a fallback; the edge is tried again after ``retry_after_s``.
    Requests arrive the usual way (the ``infer`` command, the application calling the model host). Runs for
    ``duration_s`` (then SUCCEEDS) or until stopped."""

    model: ModelRef = Field(description="the model the devices run (ONNX, one input); a missing version is resolved (and pinned) at creation")
    cuts: list[TensorName] | None = Field(
        default=None, min_length=1, max_length=MAX_SPLIT_CUTS,
        description=f"tensors the planner may cut at (default: the model's candidate cuts, at most {MAX_SPLIT_CUTS} spread over its depth); "
        "device-only and edge-only are always options",
    )  # fmt: skip
    cut: TensorName | None = Field(
        default=None, description=f"pin the plan to this cut (a tensor, {SPLIT_DEVICE_ONLY!r} or {SPLIT_EDGE_ONLY!r}); the planner only measures",
    )  # fmt: skip
    quantize: bool = Field(default=False, description="send activations as int8 (per-tensor scale and zero point): a quarter of the bytes")
    timeout_ms: float = Field(default=1000, gt=0, le=60_000, description="how long the device waits for the edge before it runs the whole model itself")
    retry_after_s: float = Field(default=5, ge=0.05, le=3600, description="after the edge failed to answer, requests stay on the device this long")
    probe_interval_s: float = Field(default=30, ge=0.5, le=86400, description="the link is measured again this often while no request crosses it")
    duration_s: float | None = Field(default=None, gt=0, le=365 * 86400, description="none: until stopped")
    report_interval_s: float = Field(default=10, ge=0.2, le=3600)

    @model_validator(mode="after")
    def _check(self) -> SplitInferenceSpec:
        if self.cut is not None and self.cuts is not None:
            raise ValueError("give cuts (the planner's options) or cut (a pinned plan), not both")
        if self.cuts is not None and len(set(self.cuts)) != len(self.cuts):
            raise ValueError("cuts must not repeat")
        if self.cuts is not None and {SPLIT_DEVICE_ONLY, SPLIT_EDGE_ONLY} & set(self.cuts):
            raise ValueError("cuts name tensors; device-only and edge-only are always options")
        return self


FL_STRATEGIES = ("fedavg", "fedprox", "fedadam", "median", "trimmed_mean")
FL_AGGREGATOR = "aggregator"
"""Worker role of a hierarchical ``federated_training`` task on an edge node (its devices run role ``worker``)."""
MAX_FL_UPDATE_BYTES = 180 * 1024
"""Largest safetensors frame of trained weights one ``FlUpdate`` carries (inline, like a chunk's outputs)."""


class FlPrivacy(_In):
    """DP-SGD on every participant (per-example clipping to ``clip_norm``, Gaussian noise ``noise_multiplier * clip_norm``,
    Poisson sampling at ``batch_size / rows``). Each device's privacy budget for the dataset must afford all its rounds
    (``rounds * local_steps`` steps) at creation (409 ``privacy_budget_exceeded``); at the end each device is charged
    for the round attempts it took part in."""

    clip_norm: float = Field(default=1.0, gt=0, le=1e6)
    noise_multiplier: float = Field(default=1.0, gt=0, le=1000)
    delta: Delta | None = Field(default=None, description="δ of the task's own ε (default: the device budget's δ)")
    epsilon: Epsilon | None = Field(default=None, description="the most this task may spend on each device (at delta)")


class FederatedTrainingSpec(_In):
    """Train the last dense layer of an installed model across devices without their data leaving them (seeds/000:
    several parties, fusion strategies, reset of timed-out local training). Each round every participant starts
    from the round's global layer, takes ``local_steps`` SGD steps on its own ``dataset`` (on the features of the
    frozen body, as ``incremental_training``), and sends the trained layer back; the round closes when every
    participant answered, or at ``round_timeout_s`` with at least ``min_participants`` (k of n), and the strategy
    fuses what arrived into the next global layer. ``hierarchical``: each edge node combines its devices' updates
    first (decomposable strategies) and sends one; ``flat``: every device's update goes to the hub. After
    ``rounds`` rounds the hub publishes the model with the fused layer as a new version."""

    model: ModelRef = Field(description="the installed model whose last dense layer is trained; a missing version is resolved (and pinned) at creation")
    dataset: DatasetName = Field(description="the name of a dataset each device keeps (it never leaves it)")
    rounds: int = Field(ge=1, le=10_000)
    local_steps: int = Field(default=20, ge=1, le=100_000, description="SGD steps per participant per round")
    batch_size: int = Field(default=32, ge=1, le=65536)
    learning_rate: float = Field(default=0.1, gt=0, le=1000)
    strategy: Literal["fedavg", "fedprox", "fedadam", "median", "trimmed_mean"] = "fedavg"
    strategy_params: dict[str, float] = Field(default_factory=dict, description="fedprox: mu; fedadam: eta, beta_1, beta_2, tau; trimmed_mean: beta")
    topology: Literal["hierarchical", "flat"] = "hierarchical"
    min_participants: int = Field(default=1, ge=1, le=10_000, description="k: a round closes at its timeout with at least this many updates")
    round_timeout_s: float = Field(default=60, ge=0.5, le=86400)
    sync: Literal["fixed", "adaptive"] = Field(
        default="fixed", description="adaptive: each round's deadline is 3x the slowest of the last 5 rounds every participant finished (at least "
        "1 s, at most round_timeout_s), so a dead participant costs little once the pace is known",
    )  # fmt: skip
    max_round_attempts: int = Field(default=3, ge=1, le=100, description="a round short of k at its timeout runs again; after this many tries the task FAILS")
    late_updates: Literal["drop", "stale"] = Field(default="drop", description="an update for a closed round: dropped, or fused into the next round at weight / (1 + staleness)")
    max_staleness: int = Field(default=2, ge=1, le=100, description="stale: updates older than this many rounds are dropped")
    layer: str | None = Field(default=None, min_length=1, max_length=256, description="the tensor feeding the last dense layer (default: found)")
    dp: FlPrivacy | None = Field(default=None, description="differentially private local training, accounted against each device's budget")
    secure_aggregation: bool = Field(
        default=False, description="pairwise additive masking: the hub (and an edge) sees only the sum of the participants' layers; fedavg, fedprox, fedadam",
    )  # fmt: skip
    eval_inputs: Id | None = Field(
        default=None, description="a dataset artefact (safetensors: x, and integer labels y) the hub scores each round's global model on (held out at the cloud)",
    )  # fmt: skip
    output: TrainingOutput = Field(default_factory=TrainingOutput)

    @model_validator(mode="after")
    def _check(self) -> FederatedTrainingSpec:
        allowed = {"fedavg": set(), "fedprox": {"mu"}, "fedadam": {"eta", "beta_1", "beta_2", "tau"}, "median": set(), "trimmed_mean": {"beta"}}[self.strategy]
        unknown = set(self.strategy_params) - allowed
        if unknown:
            raise ValueError(f"strategy {self.strategy} takes {sorted(allowed) or 'no parameters'}; unknown: {sorted(unknown)}")
        if self.secure_aggregation and self.strategy in ("median", "trimmed_mean"):
            raise ValueError(f"secure aggregation reveals only the sum of the updates; {self.strategy} needs each of them")
        if self.secure_aggregation and self.late_updates == "stale":
            raise ValueError("secure aggregation cannot fuse a late update (its masks cancel only within its round): use late_updates drop")
        return self


class AcceleratorRequest(_In):
    type: Annotated[AcceleratorType, BY_VALUE]
    count: int = Field(default=1, ge=1, le=1024)
    purpose: Literal["training", "inference"] | None = Field(default=None, description="a card whose purpose is declared must match (or be 'both')")
    min_memory_bytes: int | None = Field(default=None, ge=0, le=INT64_MAX, description="per accelerator")


class Placement(_In):
    """Where workers may run. Targets must be ONLINE, their node (for a device: its edge) UNLOCKED."""

    # the validator's rule in the JSON Schema: not both ids and selector (max_nodes >= min_nodes is not expressible)
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"not": {"required": ["ids", "selector"], "properties": {"ids": {"type": "array"}, "selector": {"type": "string"}}}})

    target: Annotated[TargetKind, BY_VALUE] = TargetKind.DEVICE
    selector: str | None = Field(default=None, max_length=4096, description="label selector; none: every target of the kind")
    ids: list[Id] | None = Field(default=None, min_length=1, max_length=10_000)
    min_nodes: int = Field(default=1, ge=1, le=10_000, description="the task waits in PENDING until this many targets qualify")
    max_nodes: int | None = Field(default=None, ge=1, le=10_000)
    accelerators: list[AcceleratorRequest] = Field(default_factory=list, max_length=8, description="every one must be free on a target (standard 7.3.2)")
    min_memory_bytes: int | None = Field(default=None, ge=0, le=INT64_MAX, description="available memory a target must report")
    capability_weighted: bool = Field(default=True, description="sharded types: a target's share of the inputs follows its free compute (standard 7.2 d 4)")

    @model_validator(mode="after")
    def _check(self) -> Placement:
        if self.ids is not None and self.selector is not None:
            raise ValueError("give at most one of ids or selector")
        if self.ids is not None and len(set(self.ids)) != len(self.ids):
            raise ValueError("ids must not repeat")
        if self.max_nodes is not None and self.max_nodes < self.min_nodes:
            raise ValueError("max_nodes is below min_nodes")
        return self


class RetryPolicy(_In):
    """How often one piece of work (a shard's chunk, a service slot) is tried before the task FAILS."""

    max_attempts: int = Field(default=3, ge=1, le=100)
    backoff_s: float = Field(default=1.0, ge=0, le=3600, description="wait before the 2nd attempt; doubles each time")
    max_backoff_s: float = Field(default=60.0, ge=0, le=86400)

    def delay(self, attempt: int) -> float:
        """Seconds to wait before attempt number ``attempt`` (2, 3, ...)."""
        return float(min(self.max_backoff_s, self.backoff_s * 2 ** max(0, attempt - 2)))


@dataclass(frozen=True)
class TaskTypeInfo:
    """What the scheduler needs to know of a task type."""

    type: TaskType
    spec: builtins.type[BaseModel] | None
    """the spec model; None: not runnable on this version"""
    placement: Literal["each", "shards"]
    """each: one worker per placed target; shards: the inputs are split in chunks over the placed targets"""
    on_lost: Literal["reschedule", "continue"]
    """a worker LOST, TIMED_OUT or FAILED: its work moves to another target, or the task goes on with the rest"""
    service: bool
    """runs until stopped (stop SUCCEEDS it) rather than to completion"""
    targets: frozenset[TargetKind] = frozenset({TargetKind.DEVICE, TargetKind.NODE})


TASK_TYPES: dict[TaskType, TaskTypeInfo] = {
    TaskType.INFERENCE: TaskTypeInfo(TaskType.INFERENCE, InferenceSpec, "each", "reschedule", service=True),
    TaskType.BATCH_INFERENCE: TaskTypeInfo(TaskType.BATCH_INFERENCE, BatchInferenceSpec, "shards", "reschedule", service=False),
    TaskType.SPLIT_INFERENCE: TaskTypeInfo(
        TaskType.SPLIT_INFERENCE, SplitInferenceSpec, "each", "reschedule", service=True, targets=frozenset({TargetKind.DEVICE}),
    ),
    TaskType.INCREMENTAL_TRAINING: TaskTypeInfo(
        TaskType.INCREMENTAL_TRAINING, IncrementalTrainingSpec, "each", "reschedule", service=False, targets=frozenset({TargetKind.DEVICE}),
    ),
    TaskType.FEDERATED_TRAINING: TaskTypeInfo(
        TaskType.FEDERATED_TRAINING, FederatedTrainingSpec, "each", "reschedule", service=False, targets=frozenset({TargetKind.DEVICE}),
    ),
}


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


TaskCreateBody = Annotated[
    InferenceTaskCreate | BatchInferenceTaskCreate | SplitInferenceTaskCreate | IncrementalTrainingTaskCreate | FederatedTrainingTaskCreate,
    Field(discriminator="type"),
]
"""``POST /tasks``: a :class:`TaskCreate` whose ``spec`` is its type's (one variant per type, told apart by
``type``), so the OpenAPI shows each type's fields and a client can generate code from it."""
TASK_CREATE_VARIANTS: dict[TaskType, type[TaskCreate]] = {
    TaskType.INFERENCE: InferenceTaskCreate, TaskType.BATCH_INFERENCE: BatchInferenceTaskCreate, TaskType.SPLIT_INFERENCE: SplitInferenceTaskCreate,
    TaskType.INCREMENTAL_TRAINING: IncrementalTrainingTaskCreate, TaskType.FEDERATED_TRAINING: FederatedTrainingTaskCreate,
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
    weights: InputRef = Field(description="the round's global layer: a signed safetensors artefact (weight [features, classes], bias [classes])")
    body: InputRef = Field(description="the frozen body: a signed ONNX artefact, the model's inputs -> feature")
    base_sha256: Sha256 = Field(description="the installed model the body was cut from")
    feature: str = Field(min_length=1, max_length=256)
    sample_rate: float | None = Field(default=None, gt=0, le=1, description="dp: the Poisson sampling rate q the hub accounted for this device")
    via_edge: bool = Field(description="send the update to the edge's aggregator on fl (hierarchical), else as an event to the hub (flat)")
    participants: list[Id] = Field(default_factory=list, max_length=10_000, description="aggregators: the devices under this node taking part in this round")
    secure: bool = Field(default=False, description="secure aggregation: send the layer scaled by n / total_examples, fixed-point, masked (interfaces.secagg)")
    peers: dict[Id, PublicKey] = Field(
        default_factory=dict, max_length=10_000, description="secure: every participant's X25519 public key (base64), to derive the pair seeds",
    )  # fmt: skip
    total_examples: int | None = Field(default=None, ge=1, le=INT64_MAX, description="secure: the participants' examples in all (the scale of each layer)")
    reveal: list[Id] = Field(default_factory=list, max_length=10_000, description="secure: participants that dropped after masking; survivors reveal their pair seeds with them")


class WorkerOrder(WireModel):
    """One entry of ``DesiredBody.tasks``: run this worker. Withdrawn: stop it."""

    worker_id: Id
    task_id: Id
    type: Annotated[TaskType, BY_VALUE]
    role: str = Field(default="worker", max_length=32)
    action: Annotated[WorkerAction, BY_VALUE] = WorkerAction.RUN
    attempt: int = Field(default=1, ge=1, le=INT64_MAX)
    spec: JsonObject
    heartbeat_s: float = Field(default=5, gt=0, le=3600)
    inputs: InputRef | None = None
    items: int | None = Field(default=None, ge=0, le=INT64_MAX, description="sharded: number of inputs in the dataset")
    chunk_size: int | None = Field(default=None, ge=1, le=INT64_MAX)
    chunks: list[Annotated[tuple[ChunkIndex, ChunkIndex], BY_VALUE]] = Field(default_factory=list, max_length=4096, description="sharded: ranges [first, end) of chunk indices this worker owns; may grow")
    training: TrainingOrder | None = Field(default=None, description="incremental_training: the body, the layer to train and the step limit")
    split: SplitOrder | None = Field(default=None, description="split_inference: the parts of the model this worker runs")
    fl: FlOrder | None = Field(default=None, description="federated_training: the round in progress")

    def input_refs(self) -> list[InputRef]:
        """Every artefact this order makes the worker fetch (the worker host keeps their files, no others)."""
        refs = [self.inputs] if self.inputs is not None else []
        if self.training is not None:
            refs.append(self.training.body)
        if self.split is not None:
            refs += [r for p in self.split.parts for r in (p.head, p.tail) if r is not None]
            refs += [self.split.whole] if self.split.whole is not None else []
        if self.fl is not None:
            refs += [self.fl.weights, self.fl.body]
        return refs

    def chunk_indices(self) -> list[int]:
        return [i for first, end in self.chunks for i in range(first, end)]

    def chunk_bounds(self, index: int) -> tuple[int, int]:
        """Item range [start, end) of chunk ``index``."""
        assert self.chunk_size is not None and self.items is not None
        return index * self.chunk_size, min((index + 1) * self.chunk_size, self.items)


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
    data: str = Field(min_length=1, max_length=MAX_FL_UPDATE_BYTES * 4 // 3 + 4, description="base64 safetensors: weight [features, classes], bias [classes]")
    metrics: dict[MetricName, float] = Field(default_factory=dict, max_length=64, description="sample-weighted means over the contributors: loss, accuracy (on their own data)")
    masked: bool = Field(default=False, description="secure aggregation: weight and bias are uint32 masked encodings (an edge's: their sum)")


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
