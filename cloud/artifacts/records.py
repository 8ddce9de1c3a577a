"""The artefacts in the database (DESIGN §4.2): each row (``cloud.tables.Artifact``) holds the manifest fields and
the hub's Ed25519 signature over them; its bytes are a blob (:mod:`cloud.artifacts.blobs`). Here: rows to wire
models, upload and delete, the in-use rule, and the artefacts tasks read or derive."""

from __future__ import annotations

import hashlib
import logging
import threading
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from sqlalchemy import func, or_, select
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session

from cloud.artifacts.blobs import BlobStore, BlobWriter
from cloud.errors import Conflict, NotFound
from cloud.services.paging import page
from cloud.signing import SigningKey
from cloud.tables import (
    Artifact,
    ArtifactDelta,
    Deployment,
    Execution,
    FlPlan,
    SplitPartRow,
    SplitPlan,
    Task,
    TrainingManifest,
    TrainingPlan,
)
from interfaces import API_PREFIX
from interfaces.deployments import (
    DEPLOYMENT_FINAL,
    IN_FLIGHT,
    ArtifactCreate,
    ArtifactFormat,
    ArtifactKind,
    ArtifactManifest,
    ArtifactPublic,
    DeploymentState,
    ExecutionState,
    InstalledArtifact,
    SignedManifest,
)  # fmt: skip
from interfaces.errors import ErrorCode
from interfaces.ids import is_id, new_id

if TYPE_CHECKING:
    from interfaces.tasks import InputRef

log = logging.getLogger("aisynergy.hub.artifacts")

# Within one hub process, "store a blob and record who uses it" and "forget a user and delete the blob if no
# one else uses it" do not interleave (a blob is never deleted under an upload that just reused it).
_REFS = threading.Lock()


def _utc(value: datetime) -> datetime:
    """SQLite hands back naive datetimes, PostgreSQL the session's zone: the manifest is always UTC."""
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def content_path(artifact_id: str) -> str:
    """GET path of an artefact's bytes, relative to the API base (``DeploymentOrder.path``)."""
    return f"/artifacts/{artifact_id}/content"


def delta_path(artifact_id: str, base_sha256: str) -> str:
    """GET path of the patch from ``base_sha256`` to the artefact, relative to the API base (``DeltaOffer.path``)."""
    return f"/artifacts/{artifact_id}/delta?from={base_sha256}"


def get_artifact(session: Session, artifact_id: str, lock: bool = False) -> Artifact:
    """The artefact row (404 when missing). ``lock``: hold its row lock to the end of the transaction
    (PostgreSQL ``FOR UPDATE``; SQLite serialises writers anyway), so that a deletion and a new deployment
    of the same artefact on two hub replicas cannot both pass their checks."""
    row = session.get(Artifact, artifact_id, with_for_update=lock) if is_id(artifact_id) else None
    if row is None:
        raise NotFound(f"artifact {artifact_id} does not exist")
    return row


def artifact_manifest(row: Artifact) -> ArtifactManifest:
    return ArtifactManifest(
        name=row.name, version=row.version, kind=ArtifactKind(row.kind), format=ArtifactFormat(row.format),
        sha256=row.sha256, size=row.size, created_at=_utc(row.created_at),
    )  # fmt: skip


def signed_manifest(row: Artifact, signing: SigningKey | None = None) -> SignedManifest:
    """The stored manifest and signature; with ``signing``, the key transitions that lead to its key (a target
    that pins a key the hub has rotated away from follows them)."""
    transitions = signing.transitions_to(row.key_id) if signing is not None else []
    return SignedManifest(manifest=artifact_manifest(row), signature=row.signature, key_id=row.key_id, key_transitions=transitions)


def artifact_to_wire(row: Artifact) -> ArtifactPublic:
    return ArtifactPublic(
        id=row.id, name=row.name, version=row.version, kind=ArtifactKind(row.kind), format=ArtifactFormat(row.format),
        sha256=row.sha256, size=row.size, created_at=_utc(row.created_at), signed_manifest=signed_manifest(row),
        content_url=API_PREFIX + content_path(row.id),
    )  # fmt: skip


def installed_of(row: Artifact) -> InstalledArtifact:
    return InstalledArtifact(name=row.name, version=row.version, sha256=row.sha256, artifact_id=row.id)


def find_by_sha256(session: Session, sha256: str, kind: str | None = None) -> Artifact | None:
    """The oldest artefact with these bytes (of this kind), or None."""
    query = select(Artifact).where(Artifact.sha256 == sha256)
    if kind is not None:
        query = query.where(Artifact.kind == kind)
    return session.execute(query.order_by(Artifact.id).limit(1)).scalars().first()  # type: ignore[arg-type]


def find_by_identity(session: Session, kind: str, name: str, version: str) -> Artifact | None:
    query = select(Artifact).where(Artifact.kind == kind, Artifact.name == name, Artifact.version == version)
    return session.execute(query).scalars().first()


def list_artifacts(session: Session, kind: ArtifactKind | None, name: str | None, limit: int, cursor: str | None) -> tuple[list[Artifact], str | None]:
    query = select(Artifact)
    if kind is not None:
        query = query.where(Artifact.kind == kind.value)
    if name is not None:
        query = query.where(Artifact.name == name)
    return page(session, query, Artifact.id, limit, cursor)


# --- upload and delete -----------------------------------------------------------------------------


def _exists_conflict(existing: Artifact) -> Conflict:
    return Conflict(
        f"{existing.kind} {existing.name} {existing.version} already exists as {existing.id}",
        code=ErrorCode.ARTIFACT_EXISTS, artifact_id=existing.id, sha256=existing.sha256,
    )  # fmt: skip


def ensure_absent(session: Session, body: ArtifactCreate) -> None:
    """409 ``artifact_exists`` when (kind, name, version) is taken (checked again when the upload is stored)."""
    existing = find_by_identity(session, body.kind.value, body.name, body.version)
    if existing is not None:
        raise _exists_conflict(existing)


def create_artifact(session: Session, signing: SigningKey, blobs: BlobStore, body: ArtifactCreate, writer: BlobWriter) -> Artifact:
    """Commit the uploaded bytes in ``writer`` to the store and record the signed artefact.

    409 ``artifact_exists`` when (kind, name, version) is taken; then nothing new is stored.
    """
    sync = getattr(writer, "sync", None)
    if sync is not None:
        sync()
    with _REFS:
        ensure_absent(session, body)
        sha256, size = writer.commit()
        if body.kind is ArtifactKind.ALGORITHM:
            _check_algorithm(session, blobs, body, sha256)
        row = Artifact(
            id=new_id("art"), kind=body.kind.value, name=body.name, version=body.version, format=body.format.value,
            sha256=sha256, size=size, created_at=datetime.now(UTC).replace(microsecond=0), signature="", key_id="",
        )  # fmt: skip
        signed = signing.sign_manifest(artifact_manifest(row))
        row.signature, row.key_id = signed.signature, signed.key_id
        session.add(row)
        try:
            session.commit()
        except IntegrityError:
            session.rollback()
            if find_by_sha256(session, sha256) is None and not is_delta_blob(session, sha256):
                blobs.delete(sha256)
            existing = find_by_identity(session, body.kind.value, body.name, body.version)
            if existing is None:
                raise
            raise _exists_conflict(existing) from None
    log.info("stored artifact %s: %s %s %s (%d bytes, sha256 %s)", row.id, row.kind, row.name, row.version, size, sha256)
    return row


def _check_algorithm(session: Session, blobs: BlobStore, body: ArtifactCreate, sha256: str) -> None:
    """A package the hub refuses (:mod:`cloud.artifacts.algorithms`) leaves no blob behind, unless others use it."""
    from cloud.artifacts.algorithms import check_algorithm_package

    try:
        with blobs.open(sha256) as content:
            check_algorithm_package(body, content)
    except Exception:
        if find_by_sha256(session, sha256) is None and not is_delta_blob(session, sha256):
            blobs.delete(sha256)
        raise


TASK_TOKEN_TTL_S = 7 * 86400
"""Download tokens in task orders (datasets, cut models, round weights) last this long."""


def task_input(session: Session, artifact_id: str, target_id: str, signing: SigningKey, what: str = "input") -> InputRef:
    """An artefact a task's worker on ``target_id`` fetches: its signed manifest, path and a download token bound to
    that target (``LookupError`` naming ``what`` when the artefact is gone)."""
    from interfaces.tasks import InputRef

    artifact = session.get(Artifact, artifact_id)
    if artifact is None:
        raise LookupError(f"the {what} artefact {artifact_id} is gone")
    token = signing.issue_download_token(artifact.id, artifact.sha256, target_id, ttl_s=TASK_TOKEN_TTL_S)
    return InputRef(artifact_id=artifact.id, signed_manifest=signed_manifest(artifact, signing), path=f"/artifacts/{artifact.id}/content", token=token)


def onnx_model_artifact(session: Session, name: str, version: str, purpose: str) -> Artifact:
    """The stored ONNX model artefact ``name`` ``version`` that ``purpose`` needs; a 422 when there is none or it is another format."""
    from cloud.errors import BadRequest

    model = find_by_identity(session, ArtifactKind.MODEL.value, name, version)
    if model is None:
        raise BadRequest(f"model {name} {version} is not an artefact of this hub; upload it first", status=422)
    if model.format != ArtifactFormat.ONNX.value:
        raise BadRequest(f"model {model.name} {model.version} is {model.format}; {purpose} cuts ONNX models", status=422)
    return model


def store_derived_model(session: Session, signing: SigningKey, blobs: BlobStore, name: str, version: str, data: bytes) -> Artifact:
    """An ONNX model the hub cut from another (a training body, a split head or tail) as the model artefact
    ``name`` ``version``, reused when stored already; a different cut under that identity gets the version
    ``<version>-cut.<sha>``. Stored in a transaction of its own (``create_artifact`` commits)."""
    sha = hashlib.sha256(data).hexdigest()
    with Session(session.get_bind(), expire_on_commit=False) as own:
        existing = find_by_identity(own, ArtifactKind.MODEL.value, name, version)
        if existing is not None and existing.sha256 != sha:
            version = f"{version}{'.' if '-' in version else '-'}cut.{sha[:12]}"
            if len(version) > 64:
                version = f"0-cut.{sha[:16]}"
            existing = find_by_identity(own, ArtifactKind.MODEL.value, name, version)
        if existing is None:
            same = find_by_sha256(own, sha, ArtifactKind.MODEL.value)
            existing = same if same is not None and same.name == name else None
        if existing is not None:
            return existing
        body = ArtifactCreate(kind=ArtifactKind.MODEL, name=name, version=version, format=ArtifactFormat.ONNX)
        with blobs.writer() as writer:
            writer.write(data)
            try:
                return create_artifact(own, signing, blobs, body, writer)
            except Conflict:  # another admission stored it meanwhile
                stored = find_by_identity(own, ArtifactKind.MODEL.value, name, version)
                if stored is None:
                    raise
                return stored


def artifact_in_use(session: Session, artifact_id: str) -> str | None:
    """Why the artefact may not be deleted, or None. It is in use while

    * a deployment of it is not final (PENDING, RUNNING, PAUSED);
    * an execution of a deployment of it is in flight (QUEUED ... INSTALLING), ACTIVE or ROLLING_BACK;
    * an ACTIVE execution (of any deployment) recorded it as ``previous``, the version a rollback
      reinstalls: by ``artifact_id``, or by ``sha256`` when no other artefact of that kind has the bytes;
    * a task (any state: a finished one can be retried) reads it as its inputs (delete the task first);
    * an incremental_training task (any state) trains that model or sends that body to its devices;
    * a split_inference task (any state) was cut from that model or sends that head or tail;
    * a federated_training task (any state) trains that model, sends that body or one of its rounds' global layers;
    * a training or whole-model federated_training task (any state) runs that algorithm (its own, or a variant's).
    """
    row = session.get(Artifact, artifact_id)
    if row is None:
        return None
    if row.kind == ArtifactKind.ALGORITHM.value:
        runs = session.execute(select(TrainingManifest.task_id).where(TrainingManifest.algorithm_id == artifact_id).order_by(TrainingManifest.task_id).limit(1)).first()  # type: ignore[call-overload]
        if runs is None:
            plans = session.execute(select(FlPlan.task_id, FlPlan.layer)).all()  # type: ignore[call-overload]
            runs = next((p for p in plans if isinstance(p.layer, dict) and any(a.get("artifact_id") == artifact_id for a in p.layer.get("whole", {}).get("algorithms", []))), None)
        if runs is not None:
            return f"task {runs[0]} runs it (delete the task first)"
    if row.kind == ArtifactKind.DATASET.value:
        spec = Task.__table__.c.spec  # type: ignore[attr-defined]
        task = session.execute(
            select(Task.id, Task.state).where(or_(spec["inputs"].as_string() == artifact_id, spec["eval_inputs"].as_string() == artifact_id)).order_by(Task.id).limit(1)
        ).first()  # fmt: skip
        if task is not None:
            return f"task {task.id} ({task.state}) reads it as its inputs or its held-out set"
    if row.kind == ArtifactKind.MODEL.value:
        plan = session.execute(
            select(TrainingPlan.task_id).where(or_(TrainingPlan.model_artifact_id == artifact_id, TrainingPlan.body_artifact_id == artifact_id)).order_by(TrainingPlan.task_id).limit(1)
        ).first()  # fmt: skip
        if plan is not None:
            return f"incremental_training task {plan.task_id} trains with it (delete the task first)"
        split = session.execute(
            select(SplitPlan.task_id).where(SplitPlan.model_artifact_id == artifact_id).union(
                select(SplitPartRow.task_id).where(or_(SplitPartRow.head_artifact_id == artifact_id, SplitPartRow.tail_artifact_id == artifact_id))
            ).limit(1)
        ).first()  # fmt: skip
        if split is not None:
            return f"split_inference task {split[0]} runs it or a part cut from it (delete the task first)"
        fl = session.execute(
            select(FlPlan.task_id).where(or_(FlPlan.model_artifact_id == artifact_id, FlPlan.body_artifact_id == artifact_id, FlPlan.weights_artifact_id == artifact_id)).limit(1)
        ).first()  # fmt: skip
        if fl is None and row.name.endswith(".fl") and "-" in row.version:  # a round's global layer: <version>-<task ulid>.r<round>
            owner = f"task-{row.version.split('-', 1)[1].split('.r', 1)[0]}"
            fl = session.execute(select(FlPlan.task_id).where(FlPlan.task_id == owner)).first()
        if fl is not None:
            return f"federated_training task {fl[0]} trains it or sends it to its devices (delete the task first)"
    live = [s.value for s in DeploymentState if s not in DEPLOYMENT_FINAL]
    deployment = session.execute(
        select(Deployment).where(Deployment.artifact_id == artifact_id, Deployment.state.in_(live)).order_by(Deployment.id).limit(1)  # type: ignore[attr-defined]
    ).scalars().first()
    if deployment is not None:
        return f"deployment {deployment.id} of it is {deployment.state}"
    busy = [s.value for s in IN_FLIGHT | {ExecutionState.ACTIVE, ExecutionState.ROLLING_BACK}]
    execution = session.execute(
        select(Execution)
        .join(Deployment, Deployment.id == Execution.deployment_id)  # type: ignore[arg-type]
        .where(Deployment.artifact_id == artifact_id, Execution.state.in_(busy))  # type: ignore[attr-defined]
        .order_by(Execution.id)
        .limit(1)
    ).scalars().first()
    if execution is not None:
        return f"execution {execution.id} of it on {execution.target_kind} {execution.target_id} is {execution.state}"
    previous = Execution.__table__.c.previous  # type: ignore[attr-defined]
    by_id = select(Execution).where(Execution.state == ExecutionState.ACTIVE.value, previous["artifact_id"].as_string() == artifact_id)
    holder = session.execute(by_id.order_by(Execution.id).limit(1)).scalars().first()
    if holder is None:
        shared = session.execute(
            select(func.count()).select_from(Artifact).where(Artifact.sha256 == row.sha256, Artifact.kind == row.kind, Artifact.id != row.id)
        ).scalar_one()
        if not shared:
            by_sha = select(Execution).where(Execution.state == ExecutionState.ACTIVE.value, previous["sha256"].as_string() == row.sha256)
            holder = session.execute(by_sha.order_by(Execution.id).limit(1)).scalars().first()
    if holder is not None:
        return f"it is the rollback target of ACTIVE execution {holder.id} on {holder.target_kind} {holder.target_id}"
    return None


def is_delta_blob(session: Session, sha256: str) -> bool:
    return session.execute(select(ArtifactDelta.id).where(ArtifactDelta.sha256 == sha256).limit(1)).first() is not None


def delete_artifact(session: Session, blobs: BlobStore, artifact_id: str, checked: bool = True) -> None:
    """Delete the artefact (409 ``artifact_in_use`` with the reason), and its blob when no other artefact has
    the same bytes (with the deltas from and to those bytes). ``checked=False``: the hub retires an artefact of a
    task's own that the task no longer reads (a whole model's global parameters of an earlier round)."""
    with _REFS:
        row = get_artifact(session, artifact_id, lock=True)
        reason = artifact_in_use(session, artifact_id) if checked else None
        if reason is not None:
            raise Conflict(f"artifact {artifact_id} is in use: {reason}", code=ErrorCode.ARTIFACT_IN_USE, reason=reason)
        sha256 = row.sha256
        session.delete(row)
        session.flush()
        orphans: list[str] = []
        if find_by_sha256(session, sha256) is None:
            deltas = session.execute(
                select(ArtifactDelta).where((ArtifactDelta.base_sha256 == sha256) | (ArtifactDelta.target_sha256 == sha256))
            ).scalars().all()
            for delta in deltas:
                session.delete(delta)
            session.flush()
            orphans = [sha256] + [d.sha256 for d in deltas]
            orphans = [s for s in dict.fromkeys(orphans) if find_by_sha256(session, s) is None and not is_delta_blob(session, s)]
        session.commit()
        for sha in orphans:
            blobs.delete(sha)
    log.info("deleted artifact %s (%s blobs removed)", artifact_id, len(orphans))
