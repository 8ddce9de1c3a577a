"""The spec of each task type (what ``POST /tasks`` takes and every worker's order carries), where its workers run
(``Placement``), its retries, and ``TASK_TYPES``: the registry of the types."""

from __future__ import annotations

import builtins
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from interfaces.deployments import AllAtOnce, ArtifactName, DeploymentTarget, FailurePolicy, Strategy, TargetKind, Version
from interfaces.privacy import DatasetName, Delta, Epsilon
from interfaces.resources import AcceleratorType
from interfaces.strict import BY_VALUE, INT64_MAX, JsonObject
from interfaces.tasks.states import MAX_TRAINING_STEPS, Id, TaskType
from interfaces.text import NoNul


class _In(NoNul):
    """Base of the REST models: no coercion (JSON as sent: ``0`` is no boolean, ``"3"`` no number); an enum field
    is ``BY_VALUE``, so that Python code and stored documents may give its value."""

    model_config = ConfigDict(extra="forbid", strict=True)


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


class AlgorithmRef(_In):
    """An ``algorithm`` artefact (a package built by ``aisynergy algorithm build``) stored on this hub."""

    name: ArtifactName
    version: Version


MAX_TRAINING_DATASETS = 16


class AlgorithmLimits(_In):
    """What each worker of the algorithm may use; a field left out takes the manifest's ``resources``."""

    cpu_cores: float | None = Field(default=None, gt=0, le=1024, description="a CPU quota in cores (cgroup cpu.cfs_quota_us, or nice where cgroups are not allowed)")
    memory_bytes: int | None = Field(default=None, ge=64 << 20, le=INT64_MAX, description="a memory limit (cgroup memory.limit_in_bytes, or RLIMIT_AS)")
    timeout_s: float | None = Field(default=None, gt=0, le=30 * 86400, description="wall-clock limit of one run of the worker (it is killed at it)")


class FlPrivacy(_In):
    """Last layer: DP-SGD on every participant (per-example clipping to ``clip_norm``, Gaussian noise ``noise_multiplier *
    clip_norm``, Poisson sampling at ``batch_size / rows``); each device's privacy budget for the dataset must afford all
    its rounds (``rounds * local_steps`` steps). Whole model: client-level DP-FedAvg (``interfaces.dpfedavg``: each
    participant's update clipped to ``clip_norm``, noise ``noise_multiplier * clip_norm`` added to their sum, every
    contributor counted the same); each device's budget for each of the task's datasets must afford ``rounds`` steps
    at sample rate 1. Both: checked at creation (409 ``privacy_budget_exceeded``); at the end each device is charged
    for the round attempts it took part in."""

    clip_norm: float = Field(default=1.0, gt=0, le=1e6)
    noise_multiplier: float = Field(default=1.0, gt=0, le=1000)
    delta: Delta | None = Field(default=None, description="δ of the task's own ε (default: the device budget's δ)")
    epsilon: Epsilon | None = Field(default=None, description="the most this task may spend on each device (at delta)")


class FlVariant(_In):
    """Another algorithm for some participants of a whole-model task (another framework training the same network):
    a participant whose labels match ``selector`` runs it (the first variant that matches), the others the task's
    ``algorithm``. Its parameters must carry the same names and shapes (the hub aggregates by name)."""

    selector: str = Field(min_length=1, max_length=4096, description="label selector of the participants that run this algorithm")
    algorithm: AlgorithmRef
    config: JsonObject | None = Field(default=None, description="its configuration (checked against its config_schema); none: the task's")


class ThenDeploy(_In):
    """A deployment of a whole-model task's ONNX export, started by the hub once the task's model is published
    (``DeploymentCreate`` without the artefact)."""

    target: DeploymentTarget
    strategy: Strategy = Field(default_factory=AllAtOnce)
    max_failure_percent: float = Field(default=0, ge=0, le=100)
    failure_policy: Annotated[FailurePolicy, BY_VALUE] = FailurePolicy.HALT
    timeout_s: int = Field(default=600, ge=1, le=7 * 24 * 3600, description="per target, from its release to ACTIVE")


LAYER_ONLY = ("local_steps", "batch_size", "learning_rate", "layer", "eval_inputs")
"""Fields of the last-layer mode that a whole-model task (``algorithm``) does not take."""


class FederatedTrainingSpec(_In):
    """Train a model across participants without their data leaving them (seeds/000: several parties, fusion
    strategies, reset of timed-out local training), in one of two modes.

    **Last layer** (``model``): the last dense layer of an installed ONNX model on devices. Each round every
    participant starts from the round's global layer, takes ``local_steps`` SGD steps on its own ``dataset`` (on the
    features of the frozen body, as ``incremental_training``), and sends the trained layer back inline.

    **Whole model** (``algorithm``): every parameter of a user's algorithm (an ``algorithm`` artefact, as ``training``
    runs) on sites (edge nodes, ``placement.target: node``) or capable devices. Each round every participant runs the
    algorithm from the round's global parameters (a signed safetensors artefact) for ``local_fits`` calls of its
    ``fit`` on its own ``datasets`` and uploads its parameters through the chunked upload API; the hub aggregates them
    tensor by tensor, by name.

    Either way the round closes when every participant answered, or at ``round_timeout_s`` with at least
    ``min_participants`` (k of n), and the strategy fuses what arrived into the next global model. ``hierarchical``
    (the last layer's default; a whole model's when asked, on devices): each edge node combines its devices' updates
    first (decomposable strategies: their sample-weighted mean) and sends one; ``flat``: every participant's update
    goes to the hub. After ``rounds`` rounds the hub publishes the model."""

    model: ModelRef | None = Field(default=None, description="last layer: the installed model whose last dense layer is trained; a missing version is resolved (and pinned) at creation")
    dataset: DatasetName | None = Field(default=None, description="last layer: the name of a dataset each device keeps (it never leaves it)")
    algorithm: AlgorithmRef | None = Field(default=None, description="whole model: the algorithm every participant runs (but those a variant names)")
    variants: list[FlVariant] = Field(default_factory=list, max_length=8, description="whole model: other algorithms for the participants their selectors match")
    datasets: dict[Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z][A-Za-z0-9_]*$")], DatasetName] = Field(
        default_factory=dict, max_length=MAX_TRAINING_DATASETS,
        description="whole model: the algorithm's dataset names -> the names of datasets each participant keeps (their data never leaves them)",
    )  # fmt: skip
    config: JsonObject = Field(default_factory=dict, description="whole model: the algorithm's configuration, checked against its config_schema at creation")
    initial_parameters: Id | None = Field(default=None, description="whole model (required): a model artefact (safetensors: the algorithm's named tensors) the first round starts from")
    local_fits: int = Field(default=1, ge=1, le=MAX_TRAINING_STEPS, description="whole model: fit calls per participant per round")
    limits: AlgorithmLimits = Field(default_factory=AlgorithmLimits, description="whole model: what each participant's worker may use")
    compression: Literal["none", "fp16", "int8", "topk"] = Field(
        default="none", description="whole model: how updates travel (interfaces.compression): fp16; int8 deltas with a per-tensor scale; topk deltas "
        "(topk_fraction of each tensor's coordinates); int8 and topk keep their error feedback on the participant",
    )  # fmt: skip
    topk_fraction: float = Field(default=0.1, gt=0, le=1, description="whole model, topk: the share of each tensor's coordinates an update carries")
    rounds: int = Field(ge=1, le=10_000)
    local_steps: int = Field(default=20, ge=1, le=100_000, description="SGD steps per participant per round")
    batch_size: int = Field(default=32, ge=1, le=65536)
    learning_rate: float = Field(default=0.1, gt=0, le=1000)
    strategy: Literal["fedavg", "fedprox", "fedadam", "median", "trimmed_mean"] = "fedavg"
    strategy_params: dict[Annotated[str, Field(min_length=1, max_length=16)], float] = Field(default_factory=dict, max_length=8, description="fedprox: mu; fedadam: eta, beta_1, beta_2, tau; trimmed_mean: beta")
    topology: Literal["hierarchical", "flat"] | None = Field(
        default=None, description="default: hierarchical for a last layer, flat for a whole model; a hierarchical whole model (devices only; fedavg, fedprox "
        "or fedadam, compression none, no dp, secure aggregation, async or stale updates): each device hands its update to its edge, which uploads their "
        "weighted mean",
    )  # fmt: skip
    min_participants: int = Field(default=1, ge=1, le=10_000, description="k: a round closes at its timeout with at least this many updates")
    round_timeout_s: float = Field(default=60, ge=0.5, le=86400)
    sync: Literal["fixed", "adaptive", "async"] = Field(
        default="fixed", description="adaptive: each round's deadline is 3x the slowest of the last 5 rounds every participant finished (at least "
        "1 s, at most round_timeout_s), so a dead participant costs little once the pace is known; async (whole models): the hub folds every "
        "buffer_size arriving updates into a new global model (FedBuff), a late one at weight n / sqrt(1 + staleness), so a slow site never holds a round",
    )  # fmt: skip
    buffer_size: int | None = Field(default=None, ge=1, le=10_000, description="async: how many updates make a fold (default: min_participants)")
    max_round_attempts: int = Field(default=3, ge=1, le=100, description="a round short of k at its timeout runs again; after this many tries the task FAILS")
    late_updates: Literal["drop", "stale"] = Field(default="drop", description="an update for a closed round: dropped, or fused into the next round at weight / (1 + staleness)")
    max_staleness: int = Field(default=2, ge=1, le=100, description="stale: updates older than this many rounds are dropped")
    layer: str | None = Field(default=None, min_length=1, max_length=256, description="the tensor feeding the last dense layer (default: found)")
    dp: FlPrivacy | None = Field(default=None, description="differential privacy (last layer: DP-SGD on each device; whole model: DP-FedAvg), accounted against each device's budget")
    secure_aggregation: bool = Field(
        default=False, description="pairwise additive masking: the hub (and an edge) sees only the sum of the participants' layers (whole models: parameters); fedavg, fedprox, fedadam",
    )  # fmt: skip
    eval_inputs: Id | None = Field(
        default=None, description="a dataset artefact (safetensors: x, and integer labels y) the hub scores each round's global model on (held out at the cloud)",
    )  # fmt: skip
    cross_evaluation: bool = Field(
        default=False, description="whole model: after the last round every participant scores the published model and every participant's last local model "
        "(compression none, no secure aggregation) on its own data with its algorithm's evaluate; the matrix is a task output",
    )  # fmt: skip
    evaluate_every: int | None = Field(
        default=None, ge=1, le=10_000, description="whole model: every this many rounds, and after the last, every participant scores the global model on its "
        "own data (its algorithm's evaluate); the round whose model scored best (accuracy, else loss, weighted by examples) is the one published",
    )  # fmt: skip
    then_deploy: ThenDeploy | None = Field(
        default=None, description="whole model: once published, its ONNX export (a participant's algorithm exports it) goes to these targets, as a deployment the hub starts",
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
        if (self.model is None) == (self.algorithm is None):
            raise ValueError("give either model (its last layer is trained) or algorithm (the whole model is trained)")
        if self.buffer_size is not None and self.sync != "async":
            raise ValueError("buffer_size is for sync async")
        if self.model is not None:
            if self.sync == "async":
                raise ValueError("async rounds are for whole models (algorithm) in this version")
            if self.dataset is None:
                raise ValueError("a last-layer task names the dataset each device keeps")
            whole = self._not_default(("variants", "datasets", "config", "initial_parameters", "local_fits", "limits", "compression", "topk_fraction", "cross_evaluation", "evaluate_every", "then_deploy"))
            if whole:
                raise ValueError(f"{', '.join(whole)}: whole-model fields; a last-layer task (model) does not take them")
            return self
        layer = self._not_default(("dataset", *LAYER_ONLY))
        if layer:
            raise ValueError(f"{', '.join(layer)}: last-layer fields; a whole-model task (algorithm) does not take them (datasets, local_fits, config)")
        if self.initial_parameters is None:
            raise ValueError("a whole-model task starts from initial_parameters: a model artefact of the algorithm's named tensors (aisynergy algorithm run writes them)")
        if self.topology == "hierarchical":  # devices -> their edge's aggregator (the weighted mean of their files) -> the hub
            for what, why in (("secure_aggregation", self.secure_aggregation), ("dp", self.dp is not None), ("sync async", self.sync == "async"),
                              ("late_updates stale", self.late_updates == "stale"), (f"compression {self.compression}", self.compression != "none"),
                              (f"strategy {self.strategy}", self.strategy in ("median", "trimmed_mean"))):  # fmt: skip
                if why:
                    raise ValueError(f"hierarchical whole-model rounds (each edge sends its devices' weighted mean) do not go with {what}")
        if self.dp is not None:  # client-level DP-FedAvg (interfaces.dpfedavg)
            for what, why in (("secure_aggregation", self.secure_aggregation), ("sync async", self.sync == "async"), ("late_updates stale", self.late_updates == "stale"),
                              (f"strategy {self.strategy}", self.strategy in ("median", "trimmed_mean"))):  # fmt: skip
                if why:
                    raise ValueError(f"dp on whole models (DP-FedAvg: each round's clipped updates averaged, with noise) does not go with {what}")
            if not self.datasets:
                raise ValueError("dp charges each participant's privacy budget of the datasets it trains on: name them (datasets)")
        if self.secure_aggregation and self.compression != "none":
            raise ValueError(f"secure aggregation masks the full-precision parameters: compression none, not {self.compression}")
        if self.secure_aggregation and self.sync == "async":
            raise ValueError("secure aggregation cannot fold an update of an earlier round (its masks cancel only within its round): sync fixed or adaptive")
        return self

    def _not_default(self, names: tuple[str, ...]) -> list[str]:
        """Those of ``names`` set to something else than their default (a stored spec holds every default)."""
        fields = type(self).model_fields
        return [n for n in names if getattr(self, n) != fields[n].get_default(call_default_factory=True)]

    @property
    def whole(self) -> bool:
        """Whether the task trains a whole model with an algorithm (else an installed model's last layer)."""
        return self.algorithm is not None


class TrainingSpec(_In):
    """Train (or fine-tune) a model with a user's algorithm on one site's own data (seeds/000: a user's algorithm,
    packaged, started by the site's agent). The site fetches the signed package, runs it in a limited process of its
    own (``fit`` ``steps`` times, a checkpoint every ``checkpoint_every`` steps, then ``evaluate`` and ``export``),
    resumes from its last checkpoint after a restart, and publishes the trained parameters (safetensors) and the
    ONNX export as signed model artefacts ``output.name`` ``output.version`` (the ONNX) and
    ``<name>-parameters`` (the parameters). ``config`` must validate against the algorithm's ``config_schema``."""

    algorithm: AlgorithmRef
    datasets: dict[Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z][A-Za-z0-9_]*$")], DatasetName] = Field(
        default_factory=dict, max_length=MAX_TRAINING_DATASETS,
        description="the algorithm's dataset names -> the names of datasets the site keeps (edge --dataset NAME=PATH); their data never leaves it",
    )  # fmt: skip
    config: JsonObject = Field(default_factory=dict, description="the algorithm's configuration, checked against its config_schema at creation")
    initial_parameters: Id | None = Field(default=None, description="a model artefact (safetensors: the algorithm's named tensors) to start from; none: the algorithm's own")
    steps: int = Field(ge=1, le=MAX_TRAINING_STEPS, description="fit calls (rounds of the algorithm's own local training)")
    checkpoint_every: int = Field(default=1, ge=1, le=MAX_TRAINING_STEPS, description="steps between two checkpoints kept on the site")
    limits: AlgorithmLimits = Field(default_factory=AlgorithmLimits)
    output: TrainingOutput = Field(default_factory=TrainingOutput, description="default name: the algorithm's; default version: the first of the algorithm's version and its next patch versions that is free for both artefacts (pinned at creation)")


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
        TaskType.FEDERATED_TRAINING, FederatedTrainingSpec, "each", "reschedule", service=False,
    ),
    TaskType.TRAINING: TaskTypeInfo(TaskType.TRAINING, TrainingSpec, "each", "reschedule", service=False),
}
