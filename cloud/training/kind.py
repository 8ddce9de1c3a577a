"""The ``training`` kind (issue 18): a user's algorithm (an ``algorithm`` artefact) trained on one site's datasets (a
site: an edge node, or a device, as the placement's ``target`` says).

* Admission: the algorithm is an artefact of this hub and its manifest is read from the stored package; the
  configuration, with the schema's defaults filled in, must satisfy the manifest's ``config_schema`` (422 naming each
  failing path); initial parameters, when given, are a safetensors model artefact; the output identity is pinned:
  ``output.name`` (default: the algorithm's name) at ``output.version`` (default: the first of the algorithm's
  version and its next patch versions that is free for both the ONNX export and ``<name>-parameters``).
* Placement: sites (edge nodes, or devices) whose reported ``resources.frameworks`` satisfy every PEP 440 specifier the manifest
  declares; a site without one is left out and the task waits in PENDING saying which framework each lacks. One
  site trains: the one with the most free compute.
* The order: the package (and initial parameters) as signed inputs, the limits (the spec's, else the manifest's
  resources), the indices of the cards reserved for the worker, and a publish grant for the two output artefacts.
* Results: the site publishes through the chunked upload API with the grant, then reports a ``TrainedModel``; it is
  kept once it names the granted artefacts, and a SUCCEEDED report without it counts as FAILED.
"""

from __future__ import annotations

import time
import zipfile
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import ValidationError
from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError
from sqlmodel import col

from cloud.errors import BadRequest, Conflict, ValidationFailed
from cloud.tables import Artifact, Device, Node, TrainedModelRow, TrainingManifest
from cloud.tasks.kind import HubParts, TaskKind
from interfaces.algorithms import MANIFEST_NAME, AlgorithmManifest, with_defaults
from interfaces.deployments import ArtifactFormat, ArtifactKind, TargetKind
from interfaces.resources import Resources
from interfaces.tasks import (
    PARAMETERS_SUFFIX, TASK_FINAL, TASK_TRAINED_EVENT, AcceleratorRequest, AlgorithmRun, FederatedTrainingSpec, PublishGrant, TaskOutputs, TaskState, TaskType,
    TrainedModel, TrainedSummary, TrainingOutput, TrainingSpec, TrainingTaskOrder,
)  # fmt: skip
from interfaces.uploads import PublishClaims

if TYPE_CHECKING:
    from pydantic import BaseModel
    from sqlmodel import Session

    from cloud.placement import Candidates
    from cloud.tables import Task, TaskWorker
    from interfaces.tasks import KindReport, Placement, WorkerOrder

GRANT_TTL_S = 7 * 86400
"""A publish grant lasts this long from the order that carries it (each new order carries a new one)."""


def algorithm_of(session: Session, spec: TrainingSpec) -> Artifact:
    """The stored package ``spec.algorithm`` names (a 422 when there is none)."""
    from cloud.artifacts import find_by_identity

    found = find_by_identity(session, ArtifactKind.ALGORITHM.value, spec.algorithm.name, spec.algorithm.version)
    if found is None:
        raise BadRequest(f"algorithm {spec.algorithm.name} {spec.algorithm.version} is not an artefact of this hub; upload it first (aisynergy algorithm upload)", status=422)
    return found


def read_manifest(blobs: Any, artifact: Artifact) -> AlgorithmManifest:
    """The manifest inside a stored package (checked when it was stored)."""
    with blobs.open(artifact.sha256) as content, zipfile.ZipFile(content) as archive:
        return AlgorithmManifest.model_validate_json(archive.read(MANIFEST_NAME))


def admitted(session: Session, task: Task) -> tuple[str, AlgorithmManifest]:
    """The package id and manifest the task was admitted with."""
    row = session.get(TrainingManifest, task.id)
    if row is None:
        raise LookupError(f"task {task.id} has no admitted algorithm")
    return row.algorithm_id, AlgorithmManifest.model_validate(row.manifest)


def check_config(manifest: AlgorithmManifest, config: dict[str, Any]) -> None:
    """A 422 naming each path of ``config`` (with the schema's defaults) that fails the manifest's ``config_schema``."""
    import jsonschema_rs

    try:
        validator = jsonschema_rs.Draft202012Validator(manifest.config_schema)
    except (jsonschema_rs.ValidationError, ValueError) as exc:
        raise BadRequest(f"algorithm {manifest.name} {manifest.version} has a config_schema that does not compile: {exc}", status=422) from None
    errors = [
        {"loc": ["body", "spec", "config", *[str(p) for p in e.instance_path]], "msg": e.message, "type": "config_schema"}
        for e in validator.iter_errors(with_defaults(manifest, config))
    ]  # fmt: skip
    if errors:
        raise ValidationFailed(
            f"the configuration does not satisfy the config_schema of {manifest.name} {manifest.version}: "
            + "; ".join(f"{'/'.join(e['loc'][3:]) or 'config'}: {e['msg']}" for e in errors[:5]),
            errors=errors[:20],
        )  # fmt: skip


def _free(session: Session, name: str, version: str) -> bool:
    taken = select(Artifact).where(col(Artifact.kind) == ArtifactKind.MODEL.value, col(Artifact.version) == version, col(Artifact.name).in_([name, name + PARAMETERS_SUFFIX]))
    pinned = select(TrainingManifest).where(col(TrainingManifest.output_name) == name, col(TrainingManifest.output_version) == version)
    return session.execute(taken).first() is None and session.execute(pinned).first() is None


def pin_output(session: Session, spec: TrainingSpec | FederatedTrainingSpec) -> TrainingOutput:
    """The output identity, free for both artefacts: a 409 for a taken explicit version (a training task's, or a
    whole-model federated one's)."""
    from cloud.incremental.results import next_free_versions

    if spec.algorithm is None:
        raise ValueError("only a task with an algorithm has an output to pin")
    name = spec.output.name or spec.algorithm.name
    if len(name) + len(PARAMETERS_SUFFIX) > 128:
        raise BadRequest(f"the output name {name!r} leaves no room for {PARAMETERS_SUFFIX!r} (at most {128 - len(PARAMETERS_SUFFIX)} characters)", status=422)
    if spec.output.version is not None:
        if not _free(session, name, spec.output.version):
            raise Conflict(f"model {name} {spec.output.version} (or {name}{PARAMETERS_SUFFIX}) is stored already or another task's output; name another output version")
        return TrainingOutput(name=name, version=spec.output.version)
    for version in [spec.algorithm.version, *next_free_versions(session, name, spec.algorithm.version)]:
        if _free(session, name, version):
            return TrainingOutput(name=name, version=version)
    raise Conflict(f"no free version of {name} after {spec.algorithm.version}; name the output version")


def missing_frameworks(manifest: AlgorithmManifest, resources: Resources | None) -> list[str]:
    """What a site lacks of the manifest's frameworks (empty: it has them all)."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet
    from packaging.version import InvalidVersion, Version

    have = resources.frameworks if resources is not None else {}
    lacking = []
    for name, specifier in sorted(manifest.frameworks.items()):
        installed = have.get(name) or have.get(name.lower().replace("_", "-"))
        if installed is None:
            lacking.append(f"{name} {specifier}".strip() + " (not installed)")
            continue
        try:
            ok = SpecifierSet(specifier).contains(Version(installed), prereleases=True) if specifier else True
        except (InvalidSpecifier, InvalidVersion):
            ok = False
        if not ok:
            lacking.append(f"{name} {specifier} (it has {installed})")
    return lacking


def card_indices(resources: Resources | None, mine: list[dict[str, Any]], others: list[list[dict[str, Any]]]) -> list[int]:
    """Indices (in the order the site lists its cards, each entry ``count`` cards) of the cards a worker's reservation
    ``mine`` holds, after the reservations of the site's other active workers took theirs."""
    from cloud.placement import card_order

    if resources is None:
        return []
    cards: list[tuple[int, Any]] = []
    for acc in resources.accelerators:
        cards.extend((len(cards) + i, acc) for i in range(acc.count))
    taken: set[int] = set()

    def take(reservations: list[dict[str, Any]]) -> list[int]:
        got: list[int] = []
        for reservation in reservations:
            try:
                req = AcceleratorRequest.model_validate(reservation)
            except ValidationError:
                continue
            free = [i for i, _ in card_order(cards, req) if i not in taken][: req.count]
            taken.update(free)
            got.extend(free)
        return got

    for reservations in others:
        take(reservations)
    return sorted(take(mine))


class Training(TaskKind):
    type: ClassVar[TaskType] = TaskType.TRAINING
    events: ClassVar[frozenset[str]] = frozenset({TASK_TRAINED_EVENT})

    def admit(self, session: Session, task: Task, spec: BaseModel, placement: Placement, hub: HubParts) -> BaseModel:
        from cloud.artifacts import get_artifact

        assert isinstance(spec, TrainingSpec)
        algorithm = algorithm_of(session, spec)
        manifest = read_manifest(hub.blobs, algorithm)
        check_config(manifest, spec.config)
        if spec.initial_parameters is not None:
            initial = get_artifact(session, spec.initial_parameters)
            if initial.kind != ArtifactKind.MODEL.value or initial.format != ArtifactFormat.SAFETENSORS.value:
                raise BadRequest(f"initial_parameters {initial.id} is a {initial.kind} in {initial.format}; it must be a model in safetensors", status=422)
        if spec.checkpoint_every > spec.steps:
            raise BadRequest(f"checkpoint_every ({spec.checkpoint_every}) is above steps ({spec.steps})", status=422)
        output = pin_output(session, spec)
        assert output.name is not None and output.version is not None
        session.add(TrainingManifest(task_id=task.id, algorithm_id=algorithm.id, manifest=manifest.model_dump(mode="json"), output_name=output.name,
                                     output_version=output.version))  # fmt: skip
        try:
            session.flush()  # another task pinned the same output meanwhile: the unique constraint says so now
        except IntegrityError:
            session.rollback()
            raise Conflict(f"another task took the output {output.name} {output.version} at the same moment; create this one again") from None
        return spec.model_copy(update={"output": output})

    def candidates(self, session: Session, task: Task, found: Candidates) -> Candidates:
        """Sites with every framework the algorithm declares; of them, the one with the most free compute."""
        from cloud.placement import Candidates

        _, manifest = admitted(session, task)
        eligible, lacking = [], []
        for candidate in found.eligible:
            missing = missing_frameworks(manifest, candidate.resources)
            if missing:
                lacking.append(f"{candidate.id} lacks {', '.join(missing)}")
            else:
                eligible.append(candidate)
        if not eligible:
            why = found.why_not if not lacking else f"no site has what algorithm {manifest.name} {manifest.version} needs: " + "; ".join(lacking[:5])
            return Candidates([], why)
        return Candidates([min(eligible, key=lambda c: (-c.weight, c.id))])

    def order(self, session: Session, task: Task, worker: TaskWorker, signing: Any, order: WorkerOrder) -> WorkerOrder:
        from cloud.artifacts import task_input
        from cloud.tasks.lifecycle import active_workers, spec_of

        assert isinstance(order, TrainingTaskOrder)
        spec = spec_of(task)
        algorithm_id, manifest = admitted(session, task)
        name, version = spec.output.name, spec.output.version
        assert name is not None and version is not None  # pinned at admission
        target: Device | Node | None = session.get(Device, worker.target_id) if worker.target_kind == TargetKind.DEVICE.value else session.get(Node, worker.target_id)
        resources = Resources.model_validate(target.resources) if target is not None and target.resources else None
        others = [w.accelerators for w in active_workers(session, task.id) if w.target_id == worker.target_id and w.id != worker.id]
        expires = int(time.time()) + GRANT_TTL_S
        claims = PublishClaims(task_id=task.id, worker_id=worker.id, target_id=worker.target_id, names=[name, name + PARAMETERS_SUFFIX], version=version, exp=expires)
        run = AlgorithmRun(
            package=task_input(session, algorithm_id, worker.target_id, signing, "algorithm"), manifest=manifest,
            initial=task_input(session, spec.initial_parameters, worker.target_id, signing, "initial parameters") if spec.initial_parameters else None,
            cpu_cores=spec.limits.cpu_cores or manifest.resources.cpu_cores, memory_bytes=spec.limits.memory_bytes or manifest.resources.memory_bytes,
            timeout_s=spec.limits.timeout_s, accelerators=card_indices(resources, worker.accelerators, others),
            publish=PublishGrant(token=signing.issue_publish_token(claims), names=claims.names, version=version, expires_at=datetime.fromtimestamp(expires, UTC)),
        )  # fmt: skip
        return order.model_copy(update={"run": run})

    def success_refused(self, session: Session, task: Task, worker: TaskWorker) -> str | None:
        return "reported SUCCEEDED but its trained model never arrived" if session.get(TrainedModelRow, worker.id) is None else None

    def accept(self, session: Session, task: Task, worker: TaskWorker, target_kind: str, target_id: str, data: KindReport, at: datetime) -> tuple[str, bool]:
        """A ``TrainedModel`` naming the granted artefacts, stored, is kept once."""
        from cloud.tasks.lifecycle import hub_log, spec_of

        if not isinstance(data, TrainedModel):
            return "refused", False
        if session.get(TrainedModelRow, worker.id) is not None:
            return "duplicate", False
        spec = spec_of(task)
        wrong = _wrong_artifact(session, data.parameters, f"{spec.output.name}{PARAMETERS_SUFFIX}", spec.output.version, ArtifactFormat.SAFETENSORS)
        if wrong is None and data.onnx is not None:
            wrong = _wrong_artifact(session, data.onnx, spec.output.name, spec.output.version, ArtifactFormat.ONNX)
        if wrong is not None:
            hub_log(session, task.id, f"the trained model of worker {worker.id} is refused: {wrong}", "warning", at, worker_id=worker.id, target_id=target_id)
            return "refused", False
        session.add(TrainedModelRow(
            worker_id=worker.id, task_id=task.id, node_id=target_id, parameters_id=data.parameters, onnx_id=data.onnx, steps=data.steps,
            resumed_from=data.resumed_from, num_examples=data.num_examples, loss=data.loss, metrics=dict(data.metrics), created_at=at,
        ))  # fmt: skip
        shown = ", ".join(f"{k} {v:.4g}" for k, v in sorted(data.metrics.items()))
        hub_log(session, task.id, f"trained {data.steps} steps on {target_id} (resumed from {data.resumed_from}): loss {data.loss:.4g}"
                + (f", {shown}" if shown else ""), at=at, worker_id=worker.id, target_id=target_id)  # fmt: skip
        return "kept", True

    def outputs(self, session: Session, task: Task, outputs: TaskOutputs) -> TaskOutputs:
        rows = list(session.execute(select(TrainedModelRow).where(TrainedModelRow.task_id == task.id).order_by(TrainedModelRow.created_at)).scalars())  # type: ignore[arg-type]
        artifacts = [a for r in rows for a in (r.onnx_id, r.parameters_id) if a]
        trained = [
            TrainedSummary(worker_id=r.worker_id, target_id=r.node_id, parameters=r.parameters_id, onnx=r.onnx_id, steps=r.steps, resumed_from=r.resumed_from,
                           num_examples=r.num_examples, loss=r.loss, metrics=r.metrics)
            for r in rows
        ]  # fmt: skip
        complete = TaskState(task.state) in TASK_FINAL and bool(rows)
        return outputs.model_copy(update={"artifacts": artifacts, "trained": trained, "complete": complete})

    def forget(self, session: Session, task_id: str) -> None:
        session.execute(delete(TrainedModelRow).where(TrainedModelRow.task_id == task_id))  # type: ignore[arg-type]
        session.execute(delete(TrainingManifest).where(TrainingManifest.task_id == task_id))  # type: ignore[arg-type]


def _wrong_artifact(session: Session, artifact_id: str, name: str | None, version: str | None, fmt: ArtifactFormat) -> str | None:
    artifact = session.get(Artifact, artifact_id)
    if artifact is None:
        return f"artefact {artifact_id} is not stored"
    if (artifact.kind, artifact.name, artifact.version, artifact.format) != (ArtifactKind.MODEL.value, name, version, fmt.value):
        return f"artefact {artifact_id} is the {artifact.kind} {artifact.name} {artifact.version} ({artifact.format}), not the model {name} {version} ({fmt.value})"
    return None


KIND = Training()
