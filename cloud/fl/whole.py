"""Whole-model federated rounds with users' algorithms (``federated_training`` with ``algorithm``; DESIGN §5, seeds/000).

The rounds themselves (open, k of n, deadlines, retries, stale updates, one vote per participant, restart-resume)
are :mod:`cloud.fl.rounds`'; this module is what differs when the model is a user's algorithm's named tensors:

* **Admission** (:func:`admit`): the task's algorithm and each variant's are artefacts of this hub, each
  configuration satisfies its algorithm's ``config_schema`` (422 naming the paths); ``initial_parameters`` is a
  safetensors model whose header gives the model every update must match: its tensor names, dtypes and shapes
  (floating point only). The output identity is pinned as a ``training`` task's (``<name>-parameters`` at
  ``output.version``). The plan (:class:`WholePlan`, in ``fl_plans.layer``) keeps the tensors and the algorithms;
  the first round starts from the initial parameters' artefact itself.
* **Placement** (:func:`candidates`): every site (or device) of the placement that has the frameworks of the
  algorithm it would run (the first variant whose selector its labels match, else the task's); the others are
  left out, the reason in the task's wait.
* **Orders** (:func:`run_for`): the package and limits of the participant's algorithm and a publish grant for
  exactly one model, its update of the round attempt in progress: ``fl-update.<task>.<target>`` at version
  ``<round>.<attempt>`` (:func:`interfaces.tasks.fl_update_identity`).
* **Updates**: an ``fl.update`` names the artefact; the ingest keeps it when the artefact is that identity
  (:func:`identity_wrong`), and before a round closes every update kept is read through (:func:`vet`): its tensors
  must be the plan's names and shapes, floating point, with finite values (read one tensor at a time); one that is
  not is dropped, with the reason in the task's log.
* **Fusion** (:func:`fuse`): the strategy runs tensor by tensor over the stored files
  (``interfaces.aggregation.Strategy.aggregate_stream``): one tensor of each update is read at a time, never a
  whole model in memory, and the result is written to the blob store as it is computed; a server optimiser's
  moments live in a tensor file of their own. The artefact of the next round's parameters (or, after the last
  round, the published ``<name>-parameters``) is recorded by :func:`store` in the hub's tick, on its own
  transaction; the fused updates' artefacts are deleted then (:func:`sweep`, in a tick after something became
  sweepable in this process, and at least every :data:`SWEEP_EVERY_S`: not a scan of every kept update each tick).
* **Checks of the global model** (``evaluate_every``; :func:`check_due`, :func:`checked`): every N rounds and after the
  last, before anything else happens, every running participant scores the global model the next round would start
  from (an ``FlEvaluationOrder`` with that ``round``); the participants' accuracy weighted by their examples is kept
  (``WholePlan.scored``) and the best round's artefact is spared by :func:`_retire`. After the last round its
  parameters are recorded as a round artefact first, scored, and the best round's are published (:func:`_publish_best`:
  the same blob under the output's identity).
* **Secure aggregation**: each participant counts for the examples of its latest update (:func:`counted`; 1 before
  its first), fixed as a round attempt opens (:func:`secure_weights`); its upload is its parameters times its share,
  masked (uint32 tensors under the model's names, ``interfaces.secagg.masked_misfit``), and the strategy fuses one
  update: the contributors' weighted mean, read tensor by tensor from the sum of the masked files with the masks of
  the participants that dropped removed (``interfaces.secagg.MaskedSum``).
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import select, update
from sqlmodel import Session

from cloud.convert import utc
from cloud.errors import BadRequest, Conflict
from cloud.tables import Artifact, Device, FlPlan, FlUpdateRow, Node, Task, TaskWorker, TrainingManifest
from interfaces.algorithms import AlgorithmManifest
from interfaces.compression import FLOATS
from interfaces.deployments import ArtifactCreate, ArtifactFormat, ArtifactKind, TargetKind
from interfaces.tasks import FL_UPDATE_PREFIX, PARAMETERS_SUFFIX, AlgorithmRun, FederatedTrainingSpec, PublishGrant, fl_update_identity
from interfaces.tensorfile import TensorFile, TensorFileError, TensorInfo, TensorWriter
from interfaces.uploads import PublishClaims

log = logging.getLogger("aisynergy.hub.fl")

UPDATE_PREFIX = FL_UPDATE_PREFIX
GRANT_TTL_S = 7 * 86400
REFUSED = -1
"""``fl_updates.used_in`` of an update that did not fit the model when read through (never fused)"""
COPY_BYTES = 4 << 20


class PlanAlgorithm(BaseModel):
    model_config = ConfigDict(extra="forbid")

    artifact_id: str
    manifest: dict[str, Any]
    selector: str | None = None
    config: dict[str, Any] = Field(default_factory=dict)


class PlanTensor(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dtype: str
    shape: list[int]


class PendingBlob(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sha256: str
    size: int


class EvaluationPhase(BaseModel):
    """A cross-site evaluation in progress (or done): the models, who scores them, by when, and the scores so far."""

    model_config = ConfigDict(extra="forbid")

    models: dict[str, str] = Field(description="label (global, or a participant's id) -> the model's artefact")
    evaluators: list[str]
    deadline_at: datetime
    scores: dict[str, dict[str, dict[str, Any]]] = Field(default_factory=dict, description="evaluator -> label -> FlScore as JSON")
    done: bool = False
    round: int | None = Field(default=None, description="evaluate_every: the round whose global model this check scores; None: the evaluation at the end")


class ExportPhase(BaseModel):
    """The ONNX export of the published model (a task with ``then_deploy``) and the deployment of it."""

    model_config = ConfigDict(extra="forbid")

    exporter: str | None = Field(description="the participant asked to export; None: none was running")
    deadline_at: datetime
    onnx_artifact_id: str | None = None
    done: bool = False
    deployment_id: str | None = None
    why_not: str | None = Field(default=None, description="why nothing was deployed")


class WholePlan(BaseModel):
    """What a whole-model plan keeps beside the rounds (``fl_plans.layer`` as ``{"whole": ...}``)."""

    model_config = ConfigDict(extra="forbid")

    tensors: dict[str, PlanTensor]
    algorithms: list[PlanAlgorithm] = Field(min_length=1, description="the task's first, then its variants'")
    pending: PendingBlob | None = Field(default=None, description="the fused parameters stored as a blob, not yet an artefact")
    state_sha256: str | None = Field(default=None, description="the blob of the strategy's arrays (a server optimiser's moments)")
    retired: list[str] = Field(default_factory=list, description="blobs of earlier strategy arrays, deleted once the plan moved on")
    examples: dict[str, int] = Field(default_factory=dict, description="secure: each participant's examples, as its latest update counted them")
    weights: dict[str, int] = Field(default_factory=dict, description="secure: what each participant of the attempt in progress counts for")
    evaluation: EvaluationPhase | None = None
    check: EvaluationPhase | None = Field(default=None, description="evaluate_every: the latest check of a round's global model")
    scored: list[dict[str, Any]] = Field(default_factory=list, description="evaluate_every: each check's RoundScore as JSON")
    best: int | None = Field(default=None, description="evaluate_every: the round whose global model scored best so far")
    superseded: list[str] = Field(default_factory=list, description="round artefacts kept as the best, then beaten: deleted by the next store")
    publish_from: str | None = Field(default=None, description="evaluate_every, after the last check: the artefact of the best round's parameters to publish")
    export: ExportPhase | None = None

    @classmethod
    def of(cls, plan: FlPlan) -> WholePlan:
        return cls.model_validate(plan.layer["whole"])

    def put(self, plan: FlPlan) -> None:
        plan.layer = {"whole": self.model_dump(mode="json")}

    def infos(self) -> dict[str, TensorInfo]:
        return {name: TensorInfo(t.dtype, tuple(t.shape)) for name, t in self.tensors.items()}


def is_whole(plan: FlPlan) -> bool:
    return isinstance(plan.layer, dict) and "whole" in plan.layer


def own_blobs(plan_row: FlPlan) -> list[str]:
    """The blobs the plan holds outside artefacts: the strategy's arrays (and earlier ones), fused parameters pending."""
    plan = WholePlan.of(plan_row)
    return [*([plan.state_sha256] if plan.state_sha256 else []), *plan.retired, *([plan.pending.sha256] if plan.pending else [])]


def secure_weights(plan_row: FlPlan, participants: list[str]) -> int:
    """Secure aggregation, as a round attempt opens: what each participant's masked parameters count for (the examples
    of its latest update; 1 before its first, so a first round is an unweighted mean), kept in the plan; their total."""
    plan = WholePlan.of(plan_row)
    plan.weights = {d: plan.examples.get(d, 1) for d in participants}
    plan.put(plan_row)
    return sum(plan.weights.values())


def counted(plan_row: FlPlan, target_id: str, num_examples: int) -> None:
    """Secure aggregation: the examples ``target_id``'s update counted, its weight in the rounds it masks next."""
    plan = WholePlan.of(plan_row)
    plan.examples[target_id] = num_examples
    plan.put(plan_row)


# --- admission -------------------------------------------------------------------------------------


def admit(session: Session, task: Task, spec: FederatedTrainingSpec, blobs: Any) -> FederatedTrainingSpec:
    """Check the algorithms, their configurations and the initial parameters; pin the output; add the plan."""
    from cloud.artifacts import find_by_identity, get_artifact
    from cloud.training.kind import check_config, pin_output, read_manifest

    assert spec.algorithm is not None and spec.initial_parameters is not None
    algorithms = []
    for ref, config, selector in [(spec.algorithm, spec.config, None), *((v.algorithm, v.config if v.config is not None else spec.config, v.selector) for v in spec.variants)]:
        found = find_by_identity(session, ArtifactKind.ALGORITHM.value, ref.name, ref.version)
        if found is None:
            raise BadRequest(f"algorithm {ref.name} {ref.version} is not an artefact of this hub; upload it first (aisynergy algorithm upload)", status=422)
        manifest = read_manifest(blobs, found)
        check_config(manifest, dict(config))
        if selector is not None:
            _selector(selector)
        algorithms.append(PlanAlgorithm(artifact_id=found.id, manifest=manifest.model_dump(mode="json"), selector=selector, config=dict(config)))
    initial = get_artifact(session, spec.initial_parameters)
    if initial.kind != ArtifactKind.MODEL.value or initial.format != ArtifactFormat.SAFETENSORS.value:
        raise BadRequest(f"initial_parameters {initial.id} is a {initial.kind} in {initial.format}; it must be a model in safetensors", status=422)
    try:
        with _local(blobs, initial.sha256) as path, TensorFile(path) as tensors:
            infos = tensors.infos()
    except TensorFileError as exc:
        raise BadRequest(f"initial_parameters {initial.id} is no safetensors file: {exc}", status=422) from None
    if not infos:
        raise BadRequest(f"initial_parameters {initial.id} holds no tensor", status=422)
    odd = sorted(name for name, info in infos.items() if info.dtype not in FLOATS)
    if odd:
        raise BadRequest(f"initial_parameters {initial.id}: only floating-point tensors aggregate; {', '.join(odd[:5])} are not", status=422)
    output = pin_output(session, spec)
    assert output.name is not None and output.version is not None
    session.add(TrainingManifest(task_id=task.id, algorithm_id=algorithms[0].artifact_id, manifest=algorithms[0].manifest, output_name=output.name,
                                 output_version=output.version))  # fmt: skip
    plan = FlPlan(task_id=task.id, model_artifact_id=algorithms[0].artifact_id, body_artifact_id=initial.id, layer={}, weights=b"", weights_artifact_id=initial.id)
    WholePlan(tensors={n: PlanTensor(dtype=i.dtype, shape=list(i.shape)) for n, i in infos.items()}, algorithms=algorithms).put(plan)
    session.add(plan)
    return spec.model_copy(update={"output": output})


def _selector(text: str) -> Any:
    from interfaces.selectors import SelectorError, parse_selector

    try:
        return parse_selector(text)
    except SelectorError as exc:
        raise BadRequest(f"variant selector {text!r}: {exc}", status=422) from None


def labels_of(session: Session, kind: str, target_id: str) -> dict[str, str]:
    row = session.get(Device, target_id) if kind == TargetKind.DEVICE.value else session.get(Node, target_id)
    return dict(row.labels or {}) if row is not None else {}


def algorithm_for(plan: WholePlan, labels: dict[str, str]) -> PlanAlgorithm:
    """The algorithm a participant with ``labels`` runs: the first variant whose selector matches, else the task's."""
    from interfaces.selectors import matches, parse_selector

    for variant in plan.algorithms[1:]:
        if variant.selector is not None and matches(parse_selector(variant.selector), labels):
            return variant
    return plan.algorithms[0]


def candidates(session: Session, task: Task, found: Any) -> Any:
    """Every candidate with the frameworks of the algorithm it would run (the others, and why, in the wait)."""
    from cloud.placement import Candidates
    from cloud.training.kind import missing_frameworks

    plan_row = session.get(FlPlan, task.id)
    if plan_row is None or not found.eligible:
        return found
    plan = WholePlan.of(plan_row)
    eligible, lacking = [], []
    for candidate in found.eligible:
        chosen = algorithm_for(plan, labels_of(session, candidate.kind.value, candidate.id))
        manifest = AlgorithmManifest.model_validate(chosen.manifest)
        missing = missing_frameworks(manifest, candidate.resources)
        if missing:
            lacking.append(f"{candidate.id} lacks {', '.join(missing)} for {manifest.name} {manifest.version}")
        else:
            eligible.append(candidate)
    why = "" if eligible else (found.why_not or "no participant qualifies") + ("; " + "; ".join(lacking[:5]) if lacking else "")
    return Candidates(eligible, why)


# --- orders ----------------------------------------------------------------------------------------


def run_for(session: Session, task: Task, plan_row: FlPlan, worker: TaskWorker, signing: Any, deadline: datetime | None = None,
            grant: tuple[str, str] | None = None) -> tuple[AlgorithmRun, dict[str, Any]]:  # fmt: skip
    """The participant's algorithm, its limits and the grant for its update of the round attempt in progress (``deadline``:
    another than the round's, the last phases'; ``grant``: another model, name and version), and the configuration it
    runs with."""
    from cloud.artifacts import task_input

    spec = FederatedTrainingSpec.model_validate(task.spec)
    plan = WholePlan.of(plan_row)
    chosen = algorithm_for(plan, labels_of(session, worker.target_kind, worker.target_id))
    manifest = AlgorithmManifest.model_validate(chosen.manifest)
    name, version = grant or fl_update_identity(task.id, worker.target_id, plan_row.round, max(1, plan_row.attempt))
    deadline = deadline or plan_row.deadline_at
    expires = int(deadline.timestamp() if deadline is not None else time.time()) + GRANT_TTL_S  # one token per round attempt: the order stays the same
    claims = PublishClaims(task_id=task.id, worker_id=worker.id, target_id=worker.target_id, names=[name], version=version, exp=expires)
    return AlgorithmRun(
        package=task_input(session, chosen.artifact_id, worker.target_id, signing, "algorithm"), manifest=manifest,
        cpu_cores=spec.limits.cpu_cores or manifest.resources.cpu_cores, memory_bytes=spec.limits.memory_bytes or manifest.resources.memory_bytes,
        timeout_s=spec.limits.timeout_s, accelerators=[],
        publish=PublishGrant(token=signing.issue_publish_token(claims), names=[name], version=version, expires_at=datetime.fromtimestamp(expires, UTC)),
    ), dict(chosen.config)  # fmt: skip


# --- updates ---------------------------------------------------------------------------------------


def identity_wrong(session: Session, task_id: str, target_id: str, artifact_id: str, round: int, attempt: int) -> str | None:
    """Why ``artifact_id`` is not this participant's update of (round, attempt); None when it is."""
    artifact = session.get(Artifact, artifact_id)
    if artifact is None:
        return f"artefact {artifact_id} is not stored"
    name, version = fl_update_identity(task_id, target_id, round, attempt)
    if (artifact.kind, artifact.name, artifact.version, artifact.format) != (ArtifactKind.MODEL.value, name, version, ArtifactFormat.SAFETENSORS.value):
        return f"artefact {artifact_id} is the {artifact.kind} {artifact.name} {artifact.version} ({artifact.format}), not the update {name} {version} (safetensors)"
    return None


def misfit(blobs: Any, plan: WholePlan, artifact: Artifact, spec: FederatedTrainingSpec) -> str | None:
    """Why the update's file is not an update of the plan's model as the task's compression encodes it (names, dtypes,
    shapes, finite values, indices in range: ``interfaces.compression.misfit``); None when it is."""
    from interfaces import compression, secagg

    try:
        with _local(blobs, artifact.sha256) as path, TensorFile(path) as tensors:
            if spec.secure_aggregation:
                return secagg.masked_misfit(tensors, plan.infos())
            return compression.misfit(spec.compression, tensors, plan.infos(), spec.topk_fraction)
    except TensorFileError as exc:
        return f"not a safetensors file: {exc}"


def vet(session: Session, blobs: Any, task: Task, plan_row: FlPlan, at: datetime) -> int:
    """Read through every update of the task not read yet; drop those that do not fit (logged). How many were dropped."""
    from cloud.tasks.lifecycle import hub_log

    plan = WholePlan.of(plan_row)
    spec = FederatedTrainingSpec.model_validate(task.spec)
    dropped = 0
    rows = session.execute(select(FlUpdateRow).where(FlUpdateRow.task_id == task.id, FlUpdateRow.vetted.is_(False), FlUpdateRow.used_in.is_(None))).scalars()  # type: ignore[attr-defined,union-attr,arg-type]
    for row in list(rows):
        artifact = session.get(Artifact, row.artifact_id) if row.artifact_id else None
        why = "its artefact is gone" if artifact is None else misfit(blobs, plan, artifact, spec)
        if why is None:
            row.vetted = True
            session.add(row)
            continue
        hub_log(session, task.id, f"refused the round {row.round} update of worker {row.worker_id}: {why}", "warning", at, row.worker_id)
        row.used_in, row.vetted = REFUSED, True  # never fused; its artefact goes with the next sweep
        session.add(row)
        dropped += 1
        sweep_due(session)
    session.flush()
    return dropped


def vet_waiting(session: Session, blobs: Any, at: datetime) -> int:
    """:func:`vet` every active whole-model task that holds updates not read yet, each on its own transaction
    (committed); how many updates were dropped."""
    from interfaces.tasks import TASK_ACTIVE

    waiting = session.execute(
        select(FlUpdateRow.task_id).join(Task, Task.id == FlUpdateRow.task_id).where(  # type: ignore[arg-type,call-overload]
            FlUpdateRow.vetted.is_(False), FlUpdateRow.used_in.is_(None), Task.state.in_([s.value for s in TASK_ACTIVE])  # type: ignore[attr-defined,union-attr]
        ).distinct()
    ).scalars().all()  # fmt: skip
    dropped = 0
    for task_id in waiting:
        task, plan_row = session.get(Task, task_id), session.get(FlPlan, task_id)
        if task is not None and plan_row is not None and is_whole(plan_row):
            dropped += vet(session, blobs, task, plan_row, at)
            session.commit()
    return dropped


# --- fusion ----------------------------------------------------------------------------------------


@contextmanager
def _local(blobs: Any, sha256: str) -> Iterator[Path]:
    """A local file of the blob ``sha256`` (the store's own, or a temporary copy)."""
    path = blobs.path(sha256)
    if path is not None:
        yield Path(path)
        return
    fd, tmp = tempfile.mkstemp(prefix="fl-blob-")
    try:
        with os.fdopen(fd, "wb") as out, blobs.open(sha256) as content:
            shutil.copyfileobj(content, out, COPY_BYTES)
        yield Path(tmp)
    finally:
        os.unlink(tmp)


def _put_file(blobs: Any, path: Path) -> PendingBlob:
    with blobs.writer() as writer, path.open("rb") as content:
        while block := content.read(COPY_BYTES):
            writer.write(block)
        sha256, size = writer.commit()
    return PendingBlob(sha256=sha256, size=size)


def fuse(session: Session, blobs: Any, plan_row: FlPlan, strategy: Any, fresh: list[tuple[FlUpdateRow, int]], task_id: str, compression: str = "none",
         dropped: dict[str, dict[str, bytes]] | None = None, dp: Any = None) -> dict[str, float]:  # fmt: skip
    """Aggregate the updates (each row with the weight it counts at; encoded as ``compression`` says) into the next
    global parameters, stored as a pending blob of the plan, and the strategy's arrays as another; the bytes moved,
    for the round's metrics. ``dropped`` (secure aggregation: the updates are masked; dropped participant -> the
    survivors' seeds with it): the strategy sees one update, the contributors' weighted mean
    (``interfaces.secagg.MaskedSum``), at the weight of all of them. ``dp`` (the task's ``FlPrivacy``): one update
    too, the clipped deltas' mean with noise (``interfaces.dpfedavg.NoisedMean``)."""
    from contextlib import ExitStack

    from interfaces.aggregation import StreamUpdate
    from interfaces.compression import Decoded
    from interfaces.secagg import MaskedSum

    plan = WholePlan.of(plan_row)
    stored = {r.artifact_id: session.get(Artifact, r.artifact_id) for r, _ in fresh if r.artifact_id is not None}
    base = session.get(Artifact, plan_row.weights_artifact_id) if plan_row.weights_artifact_id else None
    if base is None:
        raise LookupError(f"task {task_id}: the round's global parameters are gone")
    infos = plan.infos()
    state_infos = strategy.state_infos(infos)
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="fl-fuse-") as scratch:
        def opened(sha256: str) -> TensorFile:
            return stack.enter_context(TensorFile(stack.enter_context(_local(blobs, sha256))))

        global_ = opened(base.sha256)
        updates = []
        for row, weight in fresh:
            artifact = stored.get(row.artifact_id) if row.artifact_id is not None else None
            if artifact is None:
                raise LookupError(f"task {task_id}: the update {row.artifact_id} of worker {row.worker_id} is gone")
            source = opened(artifact.sha256)
            updates.append(StreamUpdate(source if compression == "none" else Decoded(compression, source, global_), weight, dict(row.metrics), row.worker_id))
        if dropped is not None and updates:  # masked: only their sum means anything
            weights = [plan.weights.get(c, 1) for row, _ in fresh for c in row.contributors]
            mean = MaskedSum([u.tensors for u in updates], infos, dropped, (plan_row.total_examples or sum(weights)) / sum(weights))
            updates = [StreamUpdate(mean, sum(weights), {}, "the secure sum")]
        if dp is not None and updates:
            from interfaces.dpfedavg import NoisedMean

            noised = NoisedMean(global_, [u.tensors for u in updates], dp.clip_norm, dp.noise_multiplier)
            updates = [StreamUpdate(noised, len(updates), {}, "the noised mean")]
        state_in = opened(plan.state_sha256) if plan.state_sha256 and state_infos else None
        out_path, state_path = Path(scratch) / "global.safetensors", Path(scratch) / "state.safetensors"
        with TensorWriter(out_path, infos) as out, TensorWriter(state_path, state_infos) as state_out:
            strategy.aggregate_stream(global_, updates, out.write, state_in, state_out.write)
        plan.pending = _put_file(blobs, out_path)
        if plan.state_sha256:
            plan.retired.append(plan.state_sha256)
        plan.state_sha256 = _put_file(blobs, state_path).sha256 if state_infos else None
    plan.put(plan_row)
    bytes_up = float(sum(a.size for a in stored.values() if a is not None))
    return {"bytes_up": bytes_up, "bytes_down": float(base.size) * len(fresh), "model_bytes": float(plan.pending.size)}


# --- artefacts (the hub's tick, own transactions) -----------------------------------------------------


class _StoredBlob:
    """A blob writer over bytes already in the store (``create_artifact`` then records and signs them)."""

    def __init__(self, blob: PendingBlob) -> None:
        self.blob = blob

    def write(self, data: bytes) -> None:
        raise RuntimeError("the blob is stored already")

    def commit(self) -> tuple[str, int]:
        return self.blob.sha256, self.blob.size


def store(session: Session, signing: Any, blobs: Any, task: Task, plan_row: FlPlan, spec: FederatedTrainingSpec) -> Artifact | None:
    """The pending fused parameters as a signed artefact: the next round's (``<algorithm>.fl`` ``<version>-<task>.r<round>``),
    or after the last round the published ``<output>-parameters``; None when nothing is pending. Commits."""
    from cloud.artifacts import create_artifact, find_by_identity

    plan = WholePlan.of(plan_row)
    if plan.pending is None and plan.publish_from is not None and plan_row.round > spec.rounds and plan_row.published_artifact_id is None:
        return _publish_best(session, signing, blobs, task, plan_row, spec, plan.publish_from)
    if plan.pending is None:
        return None
    if plan_row.round > spec.rounds and spec.evaluate_every is None:
        assert spec.output.name is not None and spec.output.version is not None
        name, version = spec.output.name + PARAMETERS_SUFFIX, spec.output.version
    else:
        assert spec.algorithm is not None
        name = f"{spec.algorithm.name[:100]}.fl"
        version = f"{spec.algorithm.version.partition('-')[0]}-{task.id.rpartition('-')[2]}.r{plan_row.round}"
    existing = find_by_identity(session, ArtifactKind.MODEL.value, name, version)
    if existing is None:
        try:
            existing = create_artifact(session, signing, blobs, ArtifactCreate(kind=ArtifactKind.MODEL, name=name, version=version, format=ArtifactFormat.SAFETENSORS),
                                       _StoredBlob(plan.pending))  # type: ignore[arg-type]  # fmt: skip
        except Conflict:
            existing = find_by_identity(session, ArtifactKind.MODEL.value, name, version)
            if existing is None:
                raise
    if existing.sha256 != plan.pending.sha256:
        raise Conflict(f"model {name} {version} is stored with other bytes than the fused parameters of task {task.id}")
    plan.pending, retired, plan.retired = None, list(plan.retired), []
    superseded, plan.superseded = list(plan.superseded), []
    row = session.get(FlPlan, task.id)
    assert row is not None
    plan.put(row)
    if row.round > spec.rounds and spec.evaluate_every is None:
        row.published_artifact_id = existing.id
    else:
        row.weights_artifact_id = existing.id
    session.add(row)
    session.commit()
    _retire(session, blobs, task, spec, row.round, retired, keep=_best_artifact(plan), superseded=superseded)
    return existing


def _publish_best(session: Session, signing: Any, blobs: Any, task: Task, plan_row: FlPlan, spec: FederatedTrainingSpec, source_id: str) -> Artifact:
    """``evaluate_every``: the best round's parameters (a round artefact of this task) published as ``<output>-parameters``
    (the same blob under the task's output identity). Commits."""
    from cloud.artifacts import create_artifact, find_by_identity

    source = session.get(Artifact, source_id)
    if source is None:
        raise LookupError(f"task {task.id}: the best round's parameters ({source_id}) are gone")
    assert spec.output.name is not None and spec.output.version is not None
    name, version = spec.output.name + PARAMETERS_SUFFIX, spec.output.version
    existing = find_by_identity(session, ArtifactKind.MODEL.value, name, version)
    if existing is None:
        try:
            existing = create_artifact(session, signing, blobs, ArtifactCreate(kind=ArtifactKind.MODEL, name=name, version=version, format=ArtifactFormat.SAFETENSORS),
                                       _StoredBlob(PendingBlob(sha256=source.sha256, size=source.size)))  # type: ignore[arg-type]  # fmt: skip
        except Conflict:
            existing = find_by_identity(session, ArtifactKind.MODEL.value, name, version)
            if existing is None:
                raise
    if existing.sha256 != source.sha256:
        raise Conflict(f"model {name} {version} is stored with other bytes than the best round's parameters of task {task.id}")
    row = session.get(FlPlan, task.id)
    assert row is not None
    row.published_artifact_id = existing.id
    session.add(row)
    session.commit()
    return existing


def _retire(session: Session, blobs: Any, task: Task, spec: FederatedTrainingSpec, round: int, retired: list[str], keep: str | None = None,
            superseded: list[str] | None = None) -> None:  # fmt: skip
    """Delete what the plan moved past: the strategy's earlier arrays, the global parameters of two rounds ago (the
    round before stays for a participant still fetching it; the first round's are the task's initial parameters), but
    ``keep`` (the best round's, ``evaluate_every``), and ``superseded`` (round artefacts once kept as the best)."""
    from cloud.artifacts import delete_artifact, find_by_identity
    from cloud.artifacts.records import find_by_sha256, is_delta_blob

    for sha256 in retired:
        if find_by_sha256(session, sha256) is None and not is_delta_blob(session, sha256):
            blobs.delete(sha256)
    if spec.algorithm is None:
        return
    old = None if round - 2 < 2 else find_by_identity(session, ArtifactKind.MODEL.value, f"{spec.algorithm.name[:100]}.fl",
                                                      f"{spec.algorithm.version.partition('-')[0]}-{task.id.rpartition('-')[2]}.r{round - 2}")  # fmt: skip
    row = session.get(FlPlan, task.id)
    current = {a for a in (keep, row.weights_artifact_id if row is not None else None) if a}
    for artifact_id in dict.fromkeys([*(superseded or []), *([old.id] if old is not None else [])]):
        if artifact_id in current or session.get(Artifact, artifact_id) is None:
            continue
        try:
            delete_artifact(session, blobs, artifact_id, checked=False)
        except Exception:  # noqa: BLE001 - an operator may delete it later
            session.rollback()
            log.warning("task %s: the global parameters %s stay: they could not be deleted", task.id, artifact_id, exc_info=True)


SWEEP_EVERY_S = 60.0
"""Without a reason to sweep (a round closed, an update refused, an attempt run again, a task deleted, in this
process), the sweep runs at most this often: what another replica or a restart left is still found."""
_swept: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()
_due: weakref.WeakSet[Any] = weakref.WeakSet()


def sweep_due(session: Session) -> None:
    """Something became sweepable in this database (the next tick sweeps, not only the periodic one)."""
    bind = session.get_bind()
    _due.add(getattr(bind, "engine", bind))


def sweep_if_due(session: Session, blobs: Any) -> int | None:
    """:func:`sweep` when something became sweepable here or :data:`SWEEP_EVERY_S` passed since the last one (the
    first tick of a process sweeps); None when it did not run."""
    bind = session.get_bind()
    engine = getattr(bind, "engine", bind)
    now = time.monotonic()
    if engine not in _due and now - _swept.get(engine, -math.inf) < SWEEP_EVERY_S:
        return None
    _due.discard(engine)
    _swept[engine] = now
    return sweep(session, blobs)


def sweep(session: Session, blobs: Any) -> int:
    """Delete the update artefacts no longer needed; how many. Each participant's latest fused update stays while the
    task is kept (its last local model); an older fused one, a refused one, one of an attempt that was run again, and
    every update of a deleted task go.
    Commits after each."""
    from cloud.artifacts import delete_artifact

    rows = list(session.execute(select(FlUpdateRow).where(FlUpdateRow.artifact_id.is_not(None), FlUpdateRow.used_in.is_not(None))).scalars())  # type: ignore[union-attr,arg-type]
    latest: dict[tuple[str, str], tuple[int, int, int]] = {}
    for row in rows:
        if row.used_in != REFUSED:
            key = (row.task_id, ",".join(sorted(row.contributors)))
            latest[key] = max(latest.get(key, (0, 0, 0)), (row.round, row.attempt, row.id or 0))
    doomed = [r.artifact_id for r in rows if r.artifact_id and (r.used_in == REFUSED or latest.get((r.task_id, ",".join(sorted(r.contributors)))) != (r.round, r.attempt, r.id or 0))]
    at = {r.task_id: (r.round, r.attempt) for r in session.execute(select(FlPlan.task_id, FlPlan.round, FlPlan.attempt)).all()}  # type: ignore[call-overload]
    tasks = set(at)
    waiting = session.execute(select(FlUpdateRow).where(FlUpdateRow.artifact_id.is_not(None), FlUpdateRow.used_in.is_(None), FlUpdateRow.stale.is_(False))).scalars()  # type: ignore[union-attr,arg-type,attr-defined]
    doomed += [r.artifact_id for r in waiting if r.artifact_id and r.task_id in at and (r.round, r.attempt) < at[r.task_id]]  # an attempt run again: never counts
    orphans = session.execute(select(Artifact.id, Artifact.name).where(Artifact.name.startswith(UPDATE_PREFIX + "."))).all()  # type: ignore[attr-defined,call-overload]
    doomed += [o.id for o in orphans if o.name.split(".")[1:2] and o.name.split(".")[1] not in tasks]
    removed = 0
    for artifact_id in doomed[:500]:
        session.execute(update(FlUpdateRow).where(FlUpdateRow.artifact_id == artifact_id).values(artifact_id=None))  # type: ignore[arg-type]
        try:
            if session.get(Artifact, artifact_id) is not None:
                delete_artifact(session, blobs, artifact_id)
            session.commit()
            removed += 1
        except Exception:  # noqa: BLE001 - tried again on the next tick
            session.rollback()
            log.exception("deleting the federated update %s failed", artifact_id)
    return removed


def last_updates(session: Session, task_id: str) -> dict[str, str]:
    """Each participant's latest fused update of the task: participant -> artefact id (its last local model)."""
    rows = session.execute(select(FlUpdateRow).where(FlUpdateRow.task_id == task_id, FlUpdateRow.artifact_id.is_not(None), FlUpdateRow.used_in.is_not(None),  # type: ignore[union-attr,arg-type]
                                                     FlUpdateRow.used_in != REFUSED).order_by(FlUpdateRow.round, FlUpdateRow.attempt, FlUpdateRow.id)).scalars()  # type: ignore[arg-type]  # fmt: skip
    return {",".join(sorted(r.contributors)): r.artifact_id for r in rows if r.artifact_id}


# --- cross-site evaluation -------------------------------------------------------------------------


def evaluated(session: Session, task: Task, plan_row: FlPlan, spec: FederatedTrainingSpec, running: list[str], at: datetime, driver: Any) -> str:
    """After the last round (the model published), with ``cross_evaluation``: open the evaluation (every running
    participant scores the published model and, but with compression or secure aggregation, every participant's last
    local model), wait for the scores until every evaluator sent them or its deadline passed: "opened", "waiting",
    "done"."""
    from cloud.tasks.lifecycle import hub_log
    from interfaces.tasks import EVALUATED_GLOBAL

    plan = WholePlan.of(plan_row)
    phase = plan.evaluation
    if phase is None:
        assert plan_row.published_artifact_id is not None
        models = {EVALUATED_GLOBAL: plan_row.published_artifact_id}
        if spec.compression == "none" and not spec.secure_aggregation:
            models |= {p: a for p, a in sorted(last_updates(session, task.id).items()) if "," not in p}
        phase = plan.evaluation = EvaluationPhase(models=models, evaluators=sorted(running), deadline_at=at + timedelta(seconds=spec.round_timeout_s))
        plan.put(plan_row)
        session.add(plan_row)
        session.flush()
        driver.put_orders()
        hub_log(session, task.id, f"cross-site evaluation open: {len(phase.evaluators)} participants score {len(models)} models, deadline in {spec.round_timeout_s:g} s", at=at)
        driver.wait(f"cross-site evaluation: 0 of {len(phase.evaluators)} participants scored")
        return "opened"
    if phase.done:
        return "done"
    deadline = utc(phase.deadline_at) or at
    if not phase.evaluators or set(phase.scores) >= set(phase.evaluators) or at >= deadline:
        phase.done = True
        plan.put(plan_row)
        session.add(plan_row)
        hub_log(session, task.id, f"cross-site evaluation done: {len(phase.scores)} of {len(phase.evaluators)} participants scored the {len(phase.models)} models", at=at)
        return "done"
    driver.wait(f"cross-site evaluation: {len(phase.scores)} of {len(phase.evaluators)} participants scored")
    return "waiting"


def check_due(plan_row: FlPlan, spec: FederatedTrainingSpec) -> int | None:
    """``evaluate_every``: the round whose global model is checked before anything else happens (the one the next
    round starts from, every ``evaluate_every`` rounds; after the last round, the last one), None when none is."""
    if not spec.whole or spec.evaluate_every is None or plan_row.attempt != 0 or plan_row.weights_artifact_id is None or plan_row.published_artifact_id:
        return None
    done = plan_row.round - 1
    if done < 1 or (done % spec.evaluate_every and plan_row.round <= spec.rounds):
        return None
    plan = WholePlan.of(plan_row)
    return None if any(r["round"] == done for r in plan.scored) else done


def checked(session: Session, task: Task, plan_row: FlPlan, spec: FederatedTrainingSpec, round: int, running: list[str], at: datetime, driver: Any) -> str:
    """Check round ``round``'s global model (the plan's round artefact now): every running participant scores it on its
    own data; once all did, or at the deadline, the score is recorded and the best round moves to it when it is at
    least as good (after the last round, the best one's artefact is marked for publishing): "opened", "waiting",
    "done"."""
    from cloud.tasks.lifecycle import hub_log
    from interfaces.tasks import EVALUATED_GLOBAL

    plan = WholePlan.of(plan_row)
    phase = plan.check
    assert plan_row.weights_artifact_id is not None
    if phase is None or phase.round != round:
        phase = plan.check = EvaluationPhase(models={EVALUATED_GLOBAL: plan_row.weights_artifact_id}, evaluators=sorted(running), round=round,
                                             deadline_at=at + timedelta(seconds=spec.round_timeout_s))  # fmt: skip
        _put(session, plan_row, plan)
        driver.put_orders()
        hub_log(session, task.id, f"round {round}: {len(phase.evaluators)} participants score its global model, deadline in {spec.round_timeout_s:g} s", at=at)
        driver.wait(f"round {round}'s global model: 0 of {len(phase.evaluators)} participants scored")
        return "opened"
    if phase.evaluators and set(phase.scores) < set(phase.evaluators) and at < (utc(phase.deadline_at) or at):
        driver.wait(f"round {round}'s global model: {len(phase.scores)} of {len(phase.evaluators)} participants scored")
        return "waiting"
    phase.done = True
    metric, value = _global_score(phase)
    plan.scored.append({"round": round, "metric": metric, "value": value, "evaluators": len(phase.scores), "artifact_id": phase.models[EVALUATED_GLOBAL]})
    best = next((r for r in plan.scored if r["round"] == plan.best), None)
    better = value is not None and (best is None or best["value"] is None or best["metric"] != metric
                                    or (value >= best["value"] if metric == "accuracy" else value <= best["value"]))  # fmt: skip
    if better:
        if best is not None and best["artifact_id"] != phase.models[EVALUATED_GLOBAL]:
            plan.superseded.append(best["artifact_id"])
        plan.best = round
    shown = "nobody scored it" if value is None else f"{metric} {value:.4f} on {len(phase.scores)} participants"
    hub_log(session, task.id, f"round {round}'s global model: {shown}" + (" (the best so far)" if better else f" (round {plan.best} stays the best)" if plan.best else ""), at=at)
    if plan_row.round > spec.rounds:  # the last check: publish the best round's model (the last one when none scored)
        chosen = next((r for r in plan.scored if r["round"] == plan.best), None)
        plan.publish_from = chosen["artifact_id"] if chosen is not None else plan_row.weights_artifact_id
        plan.best = chosen["round"] if chosen is not None else round
        plan_row.weights_artifact_id = None  # the hub's prepare publishes it now
        hub_log(session, task.id, f"publishing round {plan.best}'s global model, the best of the {len(plan.scored)} checked", at=at)
    _put(session, plan_row, plan)
    driver.put_orders()
    return "done"


def _put(session: Session, plan_row: FlPlan, plan: WholePlan) -> None:
    plan.put(plan_row)
    session.add(plan_row)
    session.flush()


def _global_score(phase: EvaluationPhase) -> tuple[str, float | None]:
    """The participants' scores of the global model weighted by their examples: accuracy when every one reported it,
    else the loss (None: nobody scored it)."""
    from interfaces.tasks import EVALUATED_GLOBAL

    rows = [scores[EVALUATED_GLOBAL] for scores in phase.scores.values() if EVALUATED_GLOBAL in scores]
    weight = lambda r: max(1, int(r.get("num_examples") or 0))  # noqa: E731
    if rows and all("accuracy" in (r.get("metrics") or {}) for r in rows):
        return "accuracy", sum(weight(r) * float(r["metrics"]["accuracy"]) for r in rows) / sum(weight(r) for r in rows)
    losses = [r for r in rows if r.get("loss") is not None]
    if losses:
        return "loss", sum(weight(r) * float(r["loss"]) for r in losses) / sum(weight(r) for r in losses)
    return ("accuracy" if rows else "loss"), None


def _best_artifact(plan: WholePlan) -> str | None:
    return next((r["artifact_id"] for r in plan.scored if r["round"] == plan.best), None)


def round_scores(plan_row: FlPlan) -> tuple[list[Any], int | None]:
    """``evaluate_every``: every check as a ``RoundScore``, and the round published (or the best so far)."""
    from interfaces.tasks import RoundScore

    if not is_whole(plan_row):
        return [], None
    plan = WholePlan.of(plan_row)
    return [RoundScore.model_validate(r) for r in plan.scored], plan.best


def _reporters_plan(session: Session, task: Task, kind: str, target_id: str, worker_id: str) -> FlPlan | None:
    """The task's whole-model plan, locked, when ``worker_id`` is the task's worker on that target; else None."""
    plan_row = session.get(FlPlan, task.id, with_for_update=True)
    worker = session.get(TaskWorker, worker_id)
    if plan_row is None or not is_whole(plan_row) or worker is None or worker.task_id != task.id or (worker.target_kind, worker.target_id) != (kind, target_id):
        return None
    return plan_row


def accept_evaluation(session: Session, task: Task, kind: str, target_id: str, data: Any) -> str:
    """A participant's scores of the evaluation's models: accepted once, from an evaluator's worker, for those models."""
    plan_row = _reporters_plan(session, task, kind, target_id, data.worker_id)
    if plan_row is None:
        return "refused"
    plan = WholePlan.of(plan_row)
    phase = plan.evaluation if data.round is None else plan.check
    if phase is None or phase.round != data.round or target_id not in phase.evaluators or not set(data.scores) <= set(phase.models):
        return "refused"
    if phase.done:
        return "late"
    if target_id in phase.scores:
        return "duplicate"
    phase.scores[target_id] = {label: score.model_dump(mode="json") for label, score in data.scores.items()}
    if set(phase.scores) >= set(phase.evaluators):
        phase.deadline_at = min(utc(phase.deadline_at) or datetime.now(UTC), datetime.now(UTC))
    plan.put(plan_row)
    session.add(plan_row)
    return "accepted"


def evaluation_order(session: Session, task: Task, plan_row: FlPlan, worker: TaskWorker, signing: Any) -> Any:
    """The worker's part of the evaluation in progress (None when there is none, it is done, or it scored already)."""
    from cloud.artifacts import task_input
    from interfaces.tasks import FlEvaluationOrder

    plan = WholePlan.of(plan_row) if is_whole(plan_row) else None
    phase = None if plan is None else plan.check if plan.check is not None and not plan.check.done else plan.evaluation
    if phase is None or phase.done or worker.target_id not in phase.evaluators or worker.target_id in phase.scores:
        return None
    deadline = utc(phase.deadline_at) or phase.deadline_at
    run, config = run_for(session, task, plan_row, worker, signing, deadline)
    what = f"task {task.id}'s cross-site evaluation" if phase.round is None else f"task {task.id}'s check of round {phase.round}"
    models = {label: task_input(session, artifact_id, worker.target_id, signing, what) for label, artifact_id in phase.models.items()}
    return FlEvaluationOrder(models=models, run=run, config=config, deadline_at=deadline, round=phase.round)


def matrix(plan_row: FlPlan) -> list[Any]:
    """The evaluation's scores as ``CrossScore`` rows (evaluator, then model)."""
    from interfaces.tasks import CrossScore

    phase = WholePlan.of(plan_row).evaluation if is_whole(plan_row) else None
    if phase is None:
        return []
    return [CrossScore(evaluator=evaluator, model=label, loss=score.get("loss"), num_examples=int(score.get("num_examples", 0)), metrics=dict(score.get("metrics", {})))
            for evaluator, scores in sorted(phase.scores.items()) for label, score in sorted(scores.items())]  # fmt: skip


# --- the ONNX export and its deployment (then_deploy) ---------------------------------------------------


def exported(session: Session, task: Task, plan_row: FlPlan, spec: FederatedTrainingSpec, running: list[str], at: datetime, driver: Any) -> str:
    """With ``then_deploy``, after the model is published: ask one running participant to export it as ONNX with its
    algorithm, and wait for the export until its deadline: "opened", "waiting", "done"."""
    from cloud.tasks.lifecycle import hub_log

    plan = WholePlan.of(plan_row)
    phase = plan.export
    if phase is None:
        exporter = sorted(running)[0] if running else None
        phase = plan.export = ExportPhase(exporter=exporter, deadline_at=at + timedelta(seconds=spec.round_timeout_s))
        if exporter is None:
            phase.done, phase.why_not = True, "no participant was running to export the model as ONNX"
        plan.put(plan_row)
        session.add(plan_row)
        session.flush()
        if exporter is None:
            hub_log(session, task.id, f"not deployed: {phase.why_not}", "warning", at=at)
            return "done"
        driver.put_orders()
        hub_log(session, task.id, f"{exporter} exports the published model as ONNX (deadline in {spec.round_timeout_s:g} s)", at=at)
        driver.wait(f"{exporter} exports the published model as ONNX")
        return "opened"
    if phase.done:
        return "done"
    if at >= (utc(phase.deadline_at) or phase.deadline_at):
        phase.done, phase.why_not = True, f"{phase.exporter} did not export the model by the deadline"
        plan.put(plan_row)
        session.add(plan_row)
        hub_log(session, task.id, f"not deployed: {phase.why_not}", "warning", at=at)
        return "done"
    driver.wait(f"{phase.exporter} exports the published model as ONNX")
    return "waiting"


def export_order(session: Session, task: Task, plan_row: FlPlan, worker: TaskWorker, signing: Any) -> Any:
    """The exporter's order part (None for everyone else, or once the export is done)."""
    from cloud.artifacts import task_input
    from interfaces.tasks import FlExportOrder

    phase = WholePlan.of(plan_row).export if is_whole(plan_row) else None
    if phase is None or phase.done or worker.target_id != phase.exporter or plan_row.published_artifact_id is None:
        return None
    spec = FederatedTrainingSpec.model_validate(task.spec)
    assert spec.output.name is not None and spec.output.version is not None
    deadline = (utc(phase.deadline_at) or phase.deadline_at)
    run, config = run_for(session, task, plan_row, worker, signing, deadline, grant=(spec.output.name, spec.output.version))
    parameters = task_input(session, plan_row.published_artifact_id, worker.target_id, signing, f"task {task.id}'s published")
    return FlExportOrder(parameters=parameters, run=run, config=config, deadline_at=deadline)


def accept_export(session: Session, task: Task, kind: str, target_id: str, data: Any) -> str:
    """The exporter's ONNX model (or none: its algorithm does not export): the granted name and version, in ONNX."""
    from cloud.tasks.lifecycle import hub_log

    plan_row = _reporters_plan(session, task, kind, target_id, data.worker_id)
    if plan_row is None:
        return "refused"
    plan = WholePlan.of(plan_row)
    phase = plan.export
    if phase is None or phase.exporter != target_id or data.parameters != plan_row.published_artifact_id:
        return "refused"
    if phase.done:
        return "late"
    spec = FederatedTrainingSpec.model_validate(task.spec)
    if data.onnx is None:
        phase.why_not = f"{spec.algorithm.name if spec.algorithm else 'the algorithm'} of {target_id} has no export"
    else:
        artifact = session.get(Artifact, data.onnx)
        wanted = (ArtifactKind.MODEL.value, spec.output.name, spec.output.version, ArtifactFormat.ONNX.value)
        if artifact is None or (artifact.kind, artifact.name, artifact.version, artifact.format) != wanted:
            hub_log(session, task.id, f"refused the ONNX export of {target_id}: artefact {data.onnx} is not the model {spec.output.name} {spec.output.version} in ONNX", "warning")
            return "refused"
        phase.onnx_artifact_id = artifact.id
    phase.done = True
    plan.put(plan_row)
    session.add(plan_row)
    hub_log(session, task.id, f"exported as ONNX: {phase.onnx_artifact_id}" if phase.onnx_artifact_id else f"not deployed: {phase.why_not}", "info" if phase.onnx_artifact_id else "warning")
    return "accepted"


def deploy_waiting(session: Session, at: datetime) -> int:
    """Start the ``then_deploy`` deployment of each active task whose ONNX export is in and not deployed yet (the hub's
    tick, own transactions: creating a deployment commits); how many were started. A deployment named after the task
    that exists already (started before a restart) is the task's."""
    from cloud.errors import ApiError
    from cloud.services import deployments
    from cloud.tables import Deployment
    from cloud.tasks.lifecycle import hub_log
    from interfaces.deployments import DeploymentCreate
    from interfaces.tasks import TASK_ACTIVE

    waiting = session.execute(
        select(FlPlan.task_id).join(Task, Task.id == FlPlan.task_id).where(  # type: ignore[arg-type,call-overload]
            Task.state.in_([s.value for s in TASK_ACTIVE]), FlPlan.published_artifact_id.is_not(None)  # type: ignore[attr-defined,union-attr]
        )
    ).scalars().all()  # fmt: skip
    started = 0
    for task_id in waiting:
        task, plan_row = session.get(Task, task_id), session.get(FlPlan, task_id)
        if task is None or plan_row is None or not is_whole(plan_row):
            continue
        spec = FederatedTrainingSpec.model_validate(task.spec)
        phase = WholePlan.of(plan_row).export
        then = spec.then_deploy
        if then is None or phase is None or phase.onnx_artifact_id is None or phase.deployment_id is not None or phase.why_not is not None:
            continue
        name = f"{task.id} {spec.output.name} {spec.output.version}"[:128]
        body = DeploymentCreate(artifact_id=phase.onnx_artifact_id, target=then.target, strategy=then.strategy, max_failure_percent=then.max_failure_percent,
                                failure_policy=then.failure_policy, timeout_s=then.timeout_s, name=name)  # fmt: skip
        why, deployment_id = None, session.execute(select(Deployment.id).where(Deployment.name == name)).scalars().first()  # type: ignore[arg-type,call-overload]
        if deployment_id is None:
            try:
                deployment_id = deployments.create(session, body).id  # commits
            except ApiError as exc:
                session.rollback()
                why = f"the deployment was refused: {exc}"
        plan_row = session.get(FlPlan, task_id, with_for_update=True)
        if plan_row is None:
            continue
        plan = WholePlan.of(plan_row)
        assert plan.export is not None
        plan.export.deployment_id, plan.export.why_not = deployment_id, why
        plan.put(plan_row)
        session.add(plan_row)
        if why is None:
            hub_log(session, task_id, f"deployment {deployment_id} of {spec.output.name} {spec.output.version} (ONNX {plan.export.onnx_artifact_id}) started: {then.strategy.type}", at=at)
            started += 1
        else:
            hub_log(session, task_id, f"not deployed: {why}", "warning", at=at)
        session.commit()
    return started


def deployment_of(plan_row: FlPlan) -> tuple[str | None, str | None]:
    """The ONNX export's artefact and the deployment the task started (either may be None)."""
    phase = WholePlan.of(plan_row).export if is_whole(plan_row) else None
    return (phase.onnx_artifact_id, phase.deployment_id) if phase is not None else (None, None)
