"""Trained layers coming back from devices, and the model versions the hub publishes from them (DESIGN §5, §8.2).

* :func:`accept` (in the ingest's transaction, for a ``task.output`` of an ``incremental_training`` worker):
  the frame is kept once (``TrainingResult``) when it comes from the worker's own device while the worker is
  active, is chunk 0, holds float32 ``weight`` and ``bias`` of the plan's shapes with finite numbers, and
  claims between 1 and the worker's reserved steps. Anything else is refused and counted.
* :func:`publish` (on the scheduler's tick, so on one hub replica): each kept layer becomes a new ONNX model,
  the task's model with the last layer's initializers replaced (and ``aisynergy.*`` metadata: base version,
  task, device, dataset, steps, ε), stored like any upload (content-addressed, signed: ``create_artifact``)
  under ``output.name`` (default: the model's name) and ``output.version`` (default: the next free patch
  version after the trained one). It can then be rolled out with a deployment. A failure is recorded and
  tried again on the next ticks, ``MAX_ATTEMPTS`` times in all; the task does not SUCCEED before its layers
  are published or given up (:func:`unpublished`).
"""

from __future__ import annotations

import base64
import logging
from datetime import UTC, datetime
from typing import Any

import numpy as np
from sqlalchemy import select, update
from sqlalchemy.engine import Engine
from sqlmodel import Session

from cloud.incremental import accounting, surgery
from cloud.incremental.task import reservation
from cloud.tables import Artifact, PrivacySpendRow, Task, TaskWorker, TrainingPlan, TrainingResult
from cloud.tasks.lifecycle import hub_log
from interfaces.deployments import ArtifactCreate, ArtifactFormat, ArtifactKind, parse_version
from interfaces.tasks import WORKER_ACTIVE, IncrementalTrainingSpec, TrainingOutput, WorkerOutput, WorkerState

log = logging.getLogger("aisynergy.hub.training")
MAX_ATTEMPTS = 5


def accept(session: Session, task: Task, worker: TaskWorker, data: WorkerOutput, at: datetime) -> tuple[str, bool]:
    """Keep a worker's trained layer; returns (outcome, wake the scheduler)."""
    if session.get(TrainingResult, worker.id) is not None:
        return "duplicate", False
    if WorkerState(worker.state) not in WORKER_ACTIVE:
        return "not_owner", False
    if data.chunk != 0:
        return "unknown_chunk", False
    plan = session.get(TrainingPlan, task.id)
    spend = reservation(session, task.id, worker.target_id, worker.id)
    if plan is None or spend is None:
        return "unknown", False
    layer = surgery.DenseLayer.from_json(plan.layer)
    try:
        frame = base64.b64decode(data.data, validate=True)
        weight, bias = _layer(frame)
        if weight.shape != (layer.features, layer.classes) or bias.shape != (layer.classes,):
            raise ValueError(f"weight {list(weight.shape)} and bias {list(bias.shape)}; [{layer.features}, {layer.classes}] and [{layer.classes}] expected")
        if not (np.isfinite(weight).all() and np.isfinite(bias).all()):
            raise ValueError("the layer holds non-finite numbers")
        if data.items > spend.steps:
            raise ValueError(f"it claims {data.items} steps; the worker was allowed {spend.steps}")
    except Exception as exc:  # noqa: BLE001 - binascii, ValueError and safetensors' own errors alike
        log.warning("refused the trained layer of task %s from %s: %s", task.id, worker.id, exc)
        hub_log(session, task.id, f"refused the trained layer from {worker.target_id}: {exc}", "warning", at, worker.id, worker.target_id)
        return "malformed", False
    session.add(TrainingResult(worker_id=worker.id, task_id=task.id, device_id=worker.target_id, steps=data.items, data=frame, created_at=at))
    hub_log(session, task.id, f"received the layer {worker.target_id} trained in {data.items} steps", at=at, worker_id=worker.id, target_id=worker.target_id)
    return "applied", True


def _layer(frame: bytes) -> tuple[np.ndarray, np.ndarray]:
    from safetensors.numpy import load

    tensors = load(frame)
    if set(tensors) != {"weight", "bias"}:
        raise ValueError(f"the frame holds {sorted(tensors)}, not weight and bias")
    weight, bias = tensors["weight"], tensors["bias"]
    if weight.dtype != np.float32 or bias.dtype != np.float32:
        raise ValueError("weight and bias must be float32")
    return weight, bias


def unpublished(session: Session, task_id: str) -> bool:
    """Whether a kept layer of the task still waits to be published (and will be tried again)."""
    return session.execute(
        select(TrainingResult.worker_id).where(TrainingResult.task_id == task_id, TrainingResult.artifact_id.is_(None), TrainingResult.attempts < MAX_ATTEMPTS).limit(1)  # type: ignore[union-attr]
    ).first() is not None  # fmt: skip


def publish(engine: Engine, signing: Any, blobs: Any) -> int:
    """Publish every kept layer not published yet; returns how many were."""
    with Session(engine) as session:
        waiting = list(session.execute(
            select(TrainingResult.worker_id).where(TrainingResult.artifact_id.is_(None), TrainingResult.attempts < MAX_ATTEMPTS).order_by(TrainingResult.created_at)  # type: ignore[union-attr]
        ).scalars())  # fmt: skip
    done = 0
    for worker_id in waiting:
        try:
            _publish_one(engine, signing, blobs, worker_id)
            done += 1
        except Exception as exc:  # noqa: BLE001 - recorded on the row, tried again on the next tick
            log.exception("publishing the layer of worker %s failed", worker_id)
            with Session(engine) as session:
                row = session.get(TrainingResult, worker_id)
                if row is not None:
                    row.attempts += 1
                    row.error = f"{type(exc).__name__}: {exc}"[:2048]
                    session.add(row)
                    if row.attempts >= MAX_ATTEMPTS:
                        hub_log(session, row.task_id, f"gave up publishing the layer of {row.device_id}: {row.error}", "error", worker_id=worker_id, target_id=row.device_id)
                    session.commit()
    return done


def _publish_one(engine: Engine, signing: Any, blobs: Any, worker_id: str) -> Artifact:
    with Session(engine, expire_on_commit=False) as session:
        result = session.get(TrainingResult, worker_id)
        assert result is not None
        task, plan = session.get(Task, result.task_id), session.get(TrainingPlan, result.task_id)
        base = session.get(Artifact, plan.model_artifact_id) if plan is not None else None
        if task is None or plan is None or base is None:
            raise LookupError(f"task {result.task_id}, its plan or its model artefact is gone")
        spec = IncrementalTrainingSpec.model_validate(task.spec)
        layer = surgery.DenseLayer.from_json(plan.layer)
        weight, bias = _layer(result.data)
        spend = session.execute(select(PrivacySpendRow).where(PrivacySpendRow.worker_id == worker_id).order_by(PrivacySpendRow.id.desc()).limit(1)).scalars().first()  # type: ignore[union-attr]
        metadata = {
            "aisynergy.trained_from": f"{base.name} {base.version}", "aisynergy.task": task.id, "aisynergy.device": result.device_id,
            "aisynergy.dataset": spec.dataset, "aisynergy.dp_steps": str(result.steps),
        }  # fmt: skip
        if spend is not None:
            run = accounting.Run(spend.sample_rate, spend.noise_multiplier, result.steps)
            metadata |= {"aisynergy.dp_epsilon": f"{accounting.run_epsilon(run, spend.delta):.6g}", "aisynergy.dp_delta": f"{spend.delta:g}",
                         "aisynergy.dp_noise_multiplier": f"{spend.noise_multiplier:g}", "aisynergy.dp_sample_rate": f"{spend.sample_rate:.6g}"}  # fmt: skip
        artifact = publish_layer(session, signing, blobs, base, layer, weight, bias, metadata, spec.output)
        session.execute(update(TrainingResult).where(TrainingResult.worker_id == worker_id).values(artifact_id=artifact.id, published_at=datetime.now(UTC), error=""))  # type: ignore[arg-type]
        hub_log(session, task.id, f"published model {artifact.name} {artifact.version} ({artifact.id}) trained on {result.device_id} in {result.steps} steps",
                worker_id=worker_id, target_id=result.device_id)  # fmt: skip
        session.commit()
        log.info("task %s: published %s %s (%s) from %s", task.id, artifact.name, artifact.version, artifact.id, result.device_id)
        return artifact


def publish_layer(
    session: Session, signing: Any, blobs: Any, base: Artifact, layer: surgery.DenseLayer, weight: np.ndarray, bias: np.ndarray, metadata: dict[str, str],
    output: TrainingOutput,
) -> Artifact:  # fmt: skip
    """``base`` with its last dense layer replaced, stored (signed, content-addressed; ``create_artifact`` commits) as
    ``output.name`` (default: the base's name) ``output.version`` (default: the next free patch version)."""
    from cloud.artifacts import create_artifact, find_by_identity, read_blob
    from cloud.errors import Conflict

    data = surgery.with_layer(surgery.load(read_blob(blobs, base.sha256)), layer, weight, bias, metadata).SerializeToString()
    name = output.name or base.name
    versions = [output.version] if output.version else next_free_versions(session, name, base.version)
    for version in versions:
        if find_by_identity(session, ArtifactKind.MODEL.value, name, version) is not None:
            continue
        with blobs.writer() as writer:
            writer.write(data)
            try:
                return create_artifact(session, signing, blobs, ArtifactCreate(kind=ArtifactKind.MODEL, name=name, version=version, format=ArtifactFormat.ONNX), writer)
            except Conflict:
                continue
    raise RuntimeError(f"no free version of {name} to publish as ({versions[:1]} taken)")


def next_free_versions(session: Session, name: str, base: str, tries: int = 1000) -> list[str]:
    """Patch versions after ``base`` (1.0.0 -> 1.0.1, 1.0.2, ...; 1.2 -> 1.2.1; 1.0.0.4 -> 1.0.0.5) that are not taken."""
    parse_version(base)  # ValueError for a malformed one
    core = [int(p) for p in base.partition("-")[0].split(".")]
    core += [0] * (3 - len(core))
    taken = set(session.execute(select(Artifact.version).where(Artifact.kind == ArtifactKind.MODEL.value, Artifact.name == name)).scalars())
    out = []
    for k in range(1, tries + 1):
        version = ".".join(str(p) for p in [*core[:-1], core[-1] + k])
        if version not in taken:
            out.append(version)
            if len(out) >= 5:
                break
    return out
