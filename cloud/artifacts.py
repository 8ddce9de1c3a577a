"""Artefacts (DESIGN §4.2): a content-addressed blob store, signed manifests, binary deltas, the in-use rule.

The bytes of every artefact live in a :class:`BlobStore` under their SHA-256 (artefacts with the same bytes
share one blob); the database row (``cloud.tables.Artifact``) holds the manifest fields and the hub's Ed25519
signature over them. Binary deltas (bsdiff4 patches from one stored artefact to another) are blobs too,
recorded once per (base, target) pair in ``ArtifactDelta``.

:class:`FileBlobStore` keeps blobs on the local disk; an object store can replace it behind the same protocol.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Protocol

import bsdiff4
from sqlalchemy import func, or_, select
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session

from cloud.errors import Conflict, NotFound
from cloud.services.paging import page
from cloud.signing import SigningKey
from cloud.tables import Artifact, ArtifactDelta, Deployment, Execution, FlPlan, SplitPartRow, SplitPlan, Task, TrainingPlan
from interfaces import API_PREFIX
from interfaces.deployments import (
    DEPLOYMENT_FINAL, IN_FLIGHT, ArtifactCreate, ArtifactFormat, ArtifactKind, ArtifactManifest, ArtifactPublic, DeltaOffer,
    DeploymentState, ExecutionState, InstalledArtifact, SignedManifest,
)  # fmt: skip
from interfaces.errors import ErrorCode
from interfaces.ids import is_id, new_id

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from interfaces.tasks import InputRef

log = logging.getLogger("aisynergy.hub.artifacts")

CHUNK = 1024 * 1024
MAX_DELTA_INPUT_BYTES = 64 * 1024 * 1024
"""bsdiff4 holds both versions in memory (and several times that while it works): no deltas above this size."""
MAX_CONCURRENT_DELTAS = 2
"""bsdiff4 runs per process at most this many times at once (each holds a CPU and up to ~10x its inputs in memory)."""
DELTA_RETRY_AFTER_S = 10
_SHA256 = re.compile(r"^[0-9a-f]{64}$")

# Within one hub process, "store a blob and record who uses it" and "forget a user and delete the blob if no
# one else uses it" do not interleave (a blob is never deleted under an upload that just reused it).
_REFS = threading.Lock()
_DELTA_LOCKS: dict[tuple[str, str], threading.Lock] = {}
_DELTA_LOCKS_GUARD = threading.Lock()
_DELTA_SLOTS = threading.BoundedSemaphore(MAX_CONCURRENT_DELTAS)
_COMPUTED: dict[tuple[str, str], tuple[str, int]] = {}
_COMPUTED_KEPT = 256


class DeltaBusy(Exception):
    """Every delta slot is computing: the caller asked not to wait (a download request: it may retry, or fetch
    the full artefact)."""


# --- blob store ------------------------------------------------------------------------------------


class BlobWriter(Protocol):
    def write(self, data: bytes) -> None: ...

    def commit(self) -> tuple[str, int]:
        """Store what was written under its SHA-256; returns (sha256, size). Not committed: nothing is stored."""
        ...


class BlobStore(Protocol):
    """Content-addressed bytes, keyed by lower-case hex SHA-256."""

    def exists(self, sha256: str) -> bool: ...

    def path(self, sha256: str) -> Path | None:
        """The local file, when the store has one (for Range responses), else None."""
        ...

    def open(self, sha256: str) -> BinaryIO: ...

    def size(self, sha256: str) -> int: ...

    def writer(self) -> AbstractContextManager[BlobWriter]: ...

    def put_bytes(self, data: bytes) -> tuple[str, int]: ...

    def delete(self, sha256: str) -> None: ...


def _check_sha(sha256: str) -> str:
    if not _SHA256.match(sha256):
        raise ValueError(f"not a SHA-256: {sha256!r}")
    return sha256


class _FileBlobWriter:
    def __init__(self, store: FileBlobStore) -> None:
        self._store = store
        fd, self._tmp = tempfile.mkstemp(dir=store.tmp_dir, prefix="upload-")
        self._file = os.fdopen(fd, "wb")
        self._hash = hashlib.sha256()
        self.size = 0
        self.committed = False

    def write(self, data: bytes) -> None:
        self._file.write(data)
        self._hash.update(data)
        self.size += len(data)

    def sync(self) -> None:
        """Flush the bytes to disk (the slow part of ``commit``, done before any lock is taken)."""
        self._file.flush()
        os.fsync(self._file.fileno())

    def commit(self) -> tuple[str, int]:
        self.sync()
        self._file.close()
        sha256 = self._hash.hexdigest()
        final = self._store._file(sha256)
        final.parent.mkdir(exist_ok=True)
        os.chmod(self._tmp, 0o644)
        os.replace(self._tmp, final)  # same bytes under the same name: replacing an existing blob is harmless
        _fsync_dir(final.parent)
        self.committed = True
        return sha256, self.size

    def abandon(self) -> None:
        if not self._file.closed:
            self._file.close()
        if not self.committed:
            with _suppress_missing():
                os.unlink(self._tmp)


class FileBlobStore:
    """Blobs as files ``root/ab/cdef...``; written to a temporary file under ``root/.tmp``, fsynced, then renamed."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.tmp_dir = root / ".tmp"
        self.tmp_dir.mkdir(parents=True, exist_ok=True)

    def _file(self, sha256: str) -> Path:
        _check_sha(sha256)
        return self.root / sha256[:2] / sha256[2:]

    def exists(self, sha256: str) -> bool:
        return _SHA256.match(sha256) is not None and self._file(sha256).is_file()

    def path(self, sha256: str) -> Path | None:
        return self._file(sha256) if self.exists(sha256) else None

    def open(self, sha256: str) -> BinaryIO:
        return self._file(sha256).open("rb")

    def size(self, sha256: str) -> int:
        return self._file(sha256).stat().st_size

    @contextmanager
    def writer(self) -> Iterator[BlobWriter]:
        writer = _FileBlobWriter(self)
        try:
            yield writer
        finally:
            writer.abandon()

    def put_bytes(self, data: bytes) -> tuple[str, int]:
        with self.writer() as writer:
            writer.write(data)
            return writer.commit()

    def delete(self, sha256: str) -> None:
        with _suppress_missing():
            self._file(sha256).unlink()

    def temporary_files(self) -> list[Path]:
        """Uploads in progress (or left by a crash)."""
        return sorted(self.tmp_dir.iterdir())


@contextmanager
def _suppress_missing() -> Iterator[None]:
    try:
        yield
    except FileNotFoundError:
        pass


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_blob(blobs: BlobStore, sha256: str) -> bytes:
    with blobs.open(sha256) as f:
        return f.read()


# --- rows and wire models --------------------------------------------------------------------------


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
            if find_by_sha256(session, sha256) is None and not _is_delta_blob(session, sha256):
                blobs.delete(sha256)
            existing = find_by_identity(session, body.kind.value, body.name, body.version)
            if existing is None:
                raise
            raise _exists_conflict(existing) from None
    log.info("stored artifact %s: %s %s %s (%d bytes, sha256 %s)", row.id, row.kind, row.name, row.version, size, sha256)
    return row


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
    * a federated_training task (any state) trains that model, sends that body or one of its rounds' global layers.
    """
    row = session.get(Artifact, artifact_id)
    if row is None:
        return None
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


def _is_delta_blob(session: Session, sha256: str) -> bool:
    return session.execute(select(ArtifactDelta.id).where(ArtifactDelta.sha256 == sha256).limit(1)).first() is not None


def delete_artifact(session: Session, blobs: BlobStore, artifact_id: str) -> None:
    """Delete the artefact (409 ``artifact_in_use`` with the reason), and its blob when no other artefact has
    the same bytes (with the deltas from and to those bytes)."""
    with _REFS:
        row = get_artifact(session, artifact_id, lock=True)
        reason = artifact_in_use(session, artifact_id)
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
            orphans = [s for s in dict.fromkeys(orphans) if find_by_sha256(session, s) is None and not _is_delta_blob(session, s)]
        session.commit()
        for sha in orphans:
            blobs.delete(sha)
    log.info("deleted artifact %s (%s blobs removed)", artifact_id, len(orphans))


# --- binary deltas ---------------------------------------------------------------------------------


def _delta_lock(base_sha256: str, target_sha256: str) -> threading.Lock:
    with _DELTA_LOCKS_GUARD:
        return _DELTA_LOCKS.setdefault((base_sha256, target_sha256), threading.Lock())


def _offer(row: ArtifactDelta, target: Artifact, blobs: BlobStore) -> DeltaOffer | None:
    if row.size >= target.size or not blobs.exists(row.sha256):
        return None
    return DeltaOffer(base_sha256=row.base_sha256, sha256=row.sha256, size=row.size, path=delta_path(target.id, row.base_sha256))


def _recorded(session: Session, base_sha256: str, target_sha256: str) -> ArtifactDelta | None:
    query = select(ArtifactDelta).where(ArtifactDelta.base_sha256 == base_sha256, ArtifactDelta.target_sha256 == target_sha256)
    return session.execute(query).scalars().first()


def offer_delta(session: Session, blobs: BlobStore, base_sha256: str, target: Artifact, wait: bool = True) -> DeltaOffer | None:
    """A bsdiff4 patch from the bytes ``base_sha256`` (what the target runs) to ``target``, or None when the
    base is not stored, either side is larger than ``MAX_DELTA_INPUT_BYTES``, or the patch is not smaller than
    the full artefact.

    The patch is computed once per (base, target) pair and recorded as an ``ArtifactDelta`` row (also when it
    is not worth it, so it is not computed again); the row is added in a savepoint of ``session`` and becomes
    durable when the caller commits. Concurrent callers compute it at most once per process and never record
    two rows for a pair (the unique constraint decides; the loser's patch blob, if different, is removed).
    At most ``MAX_CONCURRENT_DELTAS`` patches are computed at once: a caller that finds every slot busy waits
    for one, or with ``wait=False`` gets :class:`DeltaBusy` (a recorded patch never waits).
    """
    if not _SHA256.match(base_sha256) or base_sha256 == target.sha256:
        return None
    row = _recorded(session, base_sha256, target.sha256)
    if row is not None and (row.size >= target.size or blobs.exists(row.sha256)):
        return _offer(row, target, blobs)
    if not blobs.exists(base_sha256) or not blobs.exists(target.sha256):
        return None
    if max(blobs.size(base_sha256), target.size) > MAX_DELTA_INPUT_BYTES:
        return None
    pair = (base_sha256, target.sha256)
    with _delta_lock(*pair):
        row = _recorded(session, base_sha256, target.sha256)
        if row is not None and (row.size >= target.size or blobs.exists(row.sha256)):
            return _offer(row, target, blobs)
        computed = _computed(pair, target, blobs)
        if computed is None:
            if not _DELTA_SLOTS.acquire(blocking=wait):
                raise DeltaBusy(f"{MAX_CONCURRENT_DELTAS} deltas are being computed")
            try:
                patch = bsdiff4.diff(read_blob(blobs, base_sha256), read_blob(blobs, target.sha256))
            finally:
                _DELTA_SLOTS.release()
            computed = blobs.put_bytes(patch) if len(patch) < target.size else (hashlib.sha256(patch).hexdigest(), len(patch))
            with _DELTA_LOCKS_GUARD:
                _COMPUTED[pair] = computed
                while len(_COMPUTED) > _COMPUTED_KEPT:
                    _COMPUTED.pop(next(iter(_COMPUTED)))
    # Recorded outside the pair's lock: a caller whose transaction already writes (the rollout's, on SQLite) may
    # wait here for the pair; it takes the patch from _COMPUTED instead of waiting for this transaction.
    sha256, size = computed
    worth_it = size < target.size
    if row is not None:  # recorded, but its blob was lost: it is back now
        row.sha256, row.size = sha256, size
        session.add(row)
        return _offer(row, target, blobs)
    fresh = ArtifactDelta(base_sha256=base_sha256, target_sha256=target.sha256, sha256=sha256, size=size, created_at=datetime.now(UTC))
    try:
        with session.begin_nested():
            session.add(fresh)
    except IntegrityError:
        winner = _recorded(session, base_sha256, target.sha256)
        if winner is None:
            raise
        if worth_it and winner.sha256 != sha256 and find_by_sha256(session, sha256) is None and not _is_delta_blob(session, sha256):
            blobs.delete(sha256)
        return _offer(winner, target, blobs)
    log.info("delta %s -> %s: %d bytes (full %d)%s", base_sha256[:12], target.sha256[:12], size, target.size, "" if worth_it else ", not offered")
    return _offer(fresh, target, blobs)


def _computed(pair: tuple[str, str], target: Artifact, blobs: BlobStore) -> tuple[str, int] | None:
    """The patch this process computed for ``pair`` lately (its SHA-256 and size), if its blob is still here."""
    with _DELTA_LOCKS_GUARD:
        computed = _COMPUTED.get(pair)
    if computed is None or (computed[1] < target.size and not blobs.exists(computed[0])):
        return None
    return computed


def prepare_deltas(engine: Engine, blobs: BlobStore, artifact_id: str, bases: list[str]) -> int:
    """Compute and record the deltas to ``artifact_id`` from each of ``bases`` (the versions a deployment's targets
    run) ahead of their downloads, one at a time; how many are offered. Errors are logged: a delta is an
    optimisation, the full artefact always works."""
    offered = 0
    for base in dict.fromkeys(bases):
        try:
            with Session(engine, expire_on_commit=False) as session:
                target = session.get(Artifact, artifact_id)
                if target is None:
                    return offered
                offered += offer_delta(session, blobs, base, target) is not None
                session.commit()
        except Exception:  # noqa: BLE001 - see above
            log.exception("no delta from %s to artefact %s", base[:12], artifact_id)
    return offered


def prepare_deltas_in_background(engine: Engine, blobs: BlobStore, artifact_id: str, bases: list[str]) -> threading.Thread | None:
    """:func:`prepare_deltas` in a daemon thread (never in a request); None when there is nothing to compute."""
    bases = [b for b in dict.fromkeys(bases) if _SHA256.match(b)]
    if not bases:
        return None
    thread = threading.Thread(target=prepare_deltas, args=(engine, blobs, artifact_id, bases), name=f"deltas-{artifact_id}", daemon=True)
    thread.start()
    return thread
