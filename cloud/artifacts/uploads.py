"""Chunked, resumable uploads of artefacts (``/artifacts/uploads``; the wire side in :mod:`interfaces.uploads`).

A session is a row (``cloud.tables.ArtifactUpload``: the declared artefact, its size, SHA-256 and chunk size,
when it expires); its bytes are one file ``<root>/<upload id>/data`` beside the blob store, never in the database,
each chunk at its offset (``index * chunk_size``). A chunk is written in place while it is hashed, and only once its
length and SHA-256 check and its bytes are on disk (``fdatasync``) does its receipt ``<index>.done`` appear (holding
its SHA-256; linked into place, so two writers of one chunk cannot both win, on one hub or several on a shared
disk). Writers of one chunk take no lock (a request cut mid-way may hang on until its connection times out; its
retry must not wait for it): a retry of the same bytes writes the same bytes, and should two writers of other bytes
overlap, the commit's whole SHA-256 finds it and the chunks are sent again. A chunk sent again while its receipt exists is only hashed, never written:
204 for the same bytes, 409 for others. What the hub holds is what the receipts list, so a session resumes after a
restart of the hub. A commit reads the data file once through SHA-256 and, when it matches, renames it into the blob
store (no copy; a copy through a blob writer where the store is elsewhere) and stores and signs the artefact with
:func:`cloud.artifacts.records.create_artifact`, as ``POST /artifacts`` does. Expired sessions (and directories whose row is gone) are removed by :func:`purge_expired`,
which runs when a session is created and in the hub's housekeeping loop.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy import select
from sqlmodel import Session, col

from cloud.artifacts.blobs import CHUNK, BlobStore, FileBlobStore, _fsync_dir
from cloud.artifacts.records import create_artifact, ensure_absent
from cloud.errors import Conflict, NotFound, ValidationFailed
from cloud.filemodes import private_dir
from cloud.signing import SigningKey
from cloud.tables import Artifact, ArtifactUpload
from interfaces.deployments import ArtifactCreate, ArtifactFormat, ArtifactKind
from interfaces.ids import is_id, new_id
from interfaces.uploads import MAX_CHUNKS, UploadCreate, UploadSession, chunk_count, chunk_length

log = logging.getLogger("aisynergy.hub.uploads")

_CHUNK_FILE = re.compile(r"^(0|[1-9][0-9]{0,9})\.done$")
DATA_FILE = "data"
_STAGING_PREFIX = ".staging-"
_COMMITTING: set[str] = set()
_COMMITTING_LOCK = threading.Lock()


def _utc(value: datetime) -> datetime:
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class UploadArea:
    """The chunks of every session, one directory per session under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = private_dir(root)

    def dir(self, upload_id: str) -> Path:
        return self.root / upload_id

    def chunk(self, upload_id: str, index: int) -> Path:
        """The receipt of chunk ``index`` (its SHA-256): the chunk's bytes are in :meth:`data`, at its offset."""
        return self.dir(upload_id) / f"{index}.done"

    def data(self, upload_id: str) -> Path:
        return self.dir(upload_id) / DATA_FILE


    def received(self, upload_id: str) -> list[int]:
        """Indexes of the chunks held, ascending."""
        try:
            names = os.listdir(self.dir(upload_id))
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for m in map(_CHUNK_FILE.match, names) if m is not None)

    def remove(self, upload_id: str) -> None:
        shutil.rmtree(self.dir(upload_id), ignore_errors=True)

    def sessions(self) -> list[str]:
        return [p.name for p in self.root.iterdir() if p.is_dir()]


def upload_to_wire(row: ArtifactUpload, area: UploadArea) -> UploadSession:
    return UploadSession(
        id=row.id, kind=ArtifactKind(row.kind), name=row.name, version=row.version, format=ArtifactFormat(row.format),
        size=row.size, sha256=row.sha256, chunk_size=row.chunk_size, chunk_count=chunk_count(row.size, row.chunk_size),
        received=area.received(row.id), created_at=_utc(row.created_at), expires_at=_utc(row.expires_at),
    )  # fmt: skip


def purge_expired(session: Session, area: UploadArea, now: datetime | None = None) -> int:
    """Remove expired sessions with their chunks, and chunk directories whose session is gone; how many sessions."""
    now = now or datetime.now(UTC)
    expired = list(session.execute(select(ArtifactUpload).where(ArtifactUpload.expires_at <= now)).scalars())  # type: ignore[arg-type]
    for row in expired:
        session.delete(row)
    session.commit()
    for row in expired:
        area.remove(row.id)
        log.info("upload %s of %s %s expired; its chunks are removed", row.id, row.name, row.version)
    names = area.sessions()
    if names:
        kept = set(session.execute(select(col(ArtifactUpload.id)).where(col(ArtifactUpload.id).in_(names))).scalars())
        for name in names:
            if name not in kept:
                area.remove(name)
    return len(expired)


def create_upload(session: Session, area: UploadArea, body: UploadCreate, chunk_size: int, ttl_s: int, max_bytes: int) -> ArtifactUpload:
    """A new session for ``body`` (422 for a ``size`` above ``max_bytes``: the request itself is small, its field is
    out of the hub's range; 409 ``artifact_exists`` when the artefact is stored)."""
    limit = min(max_bytes, MAX_CHUNKS * chunk_size)
    if body.size > limit:
        raise ValidationFailed(
            f"artefacts are limited to {limit} bytes (max_artifact_bytes {max_bytes}, at most {MAX_CHUNKS} chunks of {chunk_size} bytes)",
            errors=[{"loc": ["body", "size"], "msg": f"at most {limit}", "type": "less_than_equal"}],
        )  # fmt: skip
    ensure_absent(session, _identity(body))
    purge_expired(session, area)
    now = datetime.now(UTC).replace(microsecond=0)
    row = ArtifactUpload(
        id=new_id("upl"), kind=body.kind.value, name=body.name, version=body.version, format=body.format.value, size=body.size,
        sha256=body.sha256, chunk_size=chunk_size, created_at=now, expires_at=now + timedelta(seconds=ttl_s),
    )  # fmt: skip
    session.add(row)
    session.commit()
    private_dir(area.dir(row.id))
    log.info("upload %s started: %s %s %s, %d bytes in %d chunks", row.id, row.kind, row.name, row.version, row.size, chunk_count(row.size, chunk_size))
    return row


def _identity(row: UploadCreate | ArtifactUpload) -> ArtifactCreate:
    return ArtifactCreate(kind=ArtifactKind(row.kind), name=row.name, version=row.version, format=ArtifactFormat(row.format))


def get_upload(session: Session, area: UploadArea, upload_id: str) -> ArtifactUpload:
    """The live session (404 when unknown, or expired: then it is removed)."""
    row = session.get(ArtifactUpload, upload_id) if is_id(upload_id) else None
    if row is None:
        raise NotFound(f"upload {upload_id} does not exist (aborted, committed or expired)")
    if _utc(row.expires_at) <= datetime.now(UTC):
        session.delete(row)
        session.commit()
        area.remove(upload_id)
        raise NotFound(f"upload {upload_id} expired at {_utc(row.expires_at).isoformat()}; start a new one")
    return row


def abort_upload(session: Session, area: UploadArea, upload_id: str) -> None:
    row = get_upload(session, area, upload_id)
    session.delete(row)
    session.commit()
    area.remove(upload_id)
    log.info("upload %s aborted", upload_id)


# --- chunks ----------------------------------------------------------------------------------------


def expected_length(row: ArtifactUpload, index: int) -> int:
    """The exact length of chunk ``index`` (422 when the session has no such chunk)."""
    count = chunk_count(row.size, row.chunk_size)
    if index >= count:
        raise ValidationFailed(
            f"upload {row.id} has chunks 0 to {count - 1}, not {index}",
            errors=[{"loc": ["path", "index"], "msg": f"at most {count - 1}", "type": "less_than_equal"}],
        )  # fmt: skip
    return chunk_length(row.size, row.chunk_size, index)


class ChunkStaging:
    """One chunk being received: written in place into the session's data file and hashed on the way (a chunk already
    held is only hashed, to answer 204 or 409)."""

    def __init__(self, area: UploadArea, upload_id: str, index: int, length: int, sha256: str, offset: int) -> None:
        self.area, self.upload_id, self.index, self.length, self.sha256, self.offset = area, upload_id, index, length, sha256, offset
        self.size = 0
        self._hash = hashlib.sha256()
        self._data: int | None = None
        try:
            self._held = self._receipt()
            if self._held is None:
                if not area.dir(upload_id).is_dir():
                    raise FileNotFoundError(upload_id)
                self._data = os.open(area.data(upload_id), os.O_WRONLY | os.O_CREAT, 0o600)
        except FileNotFoundError:
            self.discard()
            raise NotFound(f"upload {upload_id} does not exist (aborted, committed or expired)") from None
        except BaseException:
            self.discard()
            raise

    def _receipt(self) -> str | None:
        try:
            return self.area.chunk(self.upload_id, self.index).read_text().strip()
        except FileNotFoundError:
            return None

    def write_all(self, pieces: list[bytes]) -> None:
        for data in pieces:
            if self.size + len(data) > self.length:
                raise self._wrong_length(f"more than {self.length} bytes")
            if self._data is not None and self.area.chunk(self.upload_id, self.index).exists():
                self._held = self._receipt()  # another request stored it meanwhile: its bytes stay as they are
                os.close(self._data)
                self._data = None
            if self._data is not None:
                view = memoryview(data)
                while view:
                    written = os.pwrite(self._data, view, self.offset + self.size)
                    view = view[written:]
                    self.size += written
            else:
                self.size += len(data)
            self._hash.update(data)

    def _wrong_length(self, what: str) -> ValidationFailed:
        return ValidationFailed(
            f"chunk {self.index} of upload {self.upload_id} has exactly {self.length} bytes; this one has {what}",
            errors=[{"loc": ["body"], "msg": f"exactly {self.length} bytes", "type": "chunk_length"}],
        )  # fmt: skip

    def finish(self) -> bool:
        """Check and keep the chunk: True when stored now, False when the same chunk was stored already (409 when
        another one was; 422 for a wrong length or SHA-256: no receipt, the bytes written count for nothing)."""
        if self.size != self.length:
            raise self._wrong_length(f"{self.size}")
        digest = self._hash.hexdigest()
        if digest != self.sha256:
            raise ValidationFailed(
                f"chunk {self.index} of upload {self.upload_id} has SHA-256 {digest}, not the {self.sha256} its header names",
                errors=[{"loc": ["header", "X-Chunk-SHA256"], "msg": "does not match the bytes", "type": "digest_mismatch"}],
            )  # fmt: skip
        if self._held is not None:
            if self._held != digest:
                raise Conflict(f"chunk {self.index} of upload {self.upload_id} is held with SHA-256 {self._held}, not {digest}", sha256=self._held)
            return False
        assert self._data is not None
        os.fdatasync(self._data)
        final = self.area.chunk(self.upload_id, self.index)
        fd, staged = tempfile.mkstemp(dir=self.area.dir(self.upload_id), prefix=_STAGING_PREFIX)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(digest)
                f.flush()
                os.fsync(f.fileno())
            os.link(staged, final)  # atomic, and refuses to replace a receipt that is there
        except FileExistsError:  # another hub on a shared disk won
            held = final.read_text().strip()
            if held != digest:
                raise Conflict(f"chunk {self.index} of upload {self.upload_id} is held with SHA-256 {held}, not {digest}", sha256=held) from None
            return False
        finally:
            os.unlink(staged)
        _fsync_dir(final.parent)
        return True

    def discard(self) -> None:
        if self._data is not None:
            os.close(self._data)
            self._data = None


# --- commit ----------------------------------------------------------------------------------------


def _store(session: Session, signing: SigningKey, blobs: BlobStore, row: ArtifactUpload, data: Path) -> Artifact:
    """The checked data file as the artefact: renamed into a file blob store, else copied through a blob writer."""
    if isinstance(blobs, FileBlobStore) and os.stat(data).st_dev == os.stat(blobs.root).st_dev:  # a rename, not a copy
        return create_artifact(session, signing, blobs, _identity(row), blobs.adopt(data, row.sha256, row.size))
    with blobs.writer() as writer, data.open("rb") as f:
        while piece := f.read(CHUNK):
            writer.write(piece)
        return create_artifact(session, signing, blobs, _identity(row), writer)


@contextmanager
def _one_commit(upload_id: str) -> Iterator[None]:
    with _COMMITTING_LOCK:
        if upload_id in _COMMITTING:
            raise Conflict(f"upload {upload_id} is being committed already")
        _COMMITTING.add(upload_id)
    try:
        yield
    finally:
        with _COMMITTING_LOCK:
            _COMMITTING.discard(upload_id)


def commit_upload(session: Session, signing: SigningKey, blobs: BlobStore, area: UploadArea, upload_id: str) -> Artifact:
    """Join the chunks into a blob, check the declared SHA-256 and store the signed artefact; the session and its
    chunks are removed. 422 when chunks are missing (the session unchanged) or the whole SHA-256 differs (the
    session is kept, its chunks dropped: send them again)."""
    with _one_commit(upload_id):
        row = get_upload(session, area, upload_id)
        count = chunk_count(row.size, row.chunk_size)
        missing = sorted(set(range(count)) - set(area.received(upload_id)))
        if missing:
            raise ValidationFailed(
                f"upload {upload_id} lacks {len(missing)} of its {count} chunks (first missing: {missing[0]})",
                errors=[{"loc": ["chunks"], "msg": f"missing {missing[:32]}", "type": "missing"}],
            )  # fmt: skip
        data = area.data(upload_id)
        with data.open("rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        if digest != row.sha256 or data.stat().st_size != row.size:
            for index in range(count):
                area.chunk(upload_id, index).unlink(missing_ok=True)
            raise ValidationFailed(
                f"the chunks of upload {upload_id} join to SHA-256 {digest}, not the declared {row.sha256}; "
                "its chunks are dropped: send them again",
                errors=[{"loc": ["body", "sha256"], "msg": "does not match the joined chunks", "type": "digest_mismatch"}],
            )  # fmt: skip
        artifact = _store(session, signing, blobs, row, data)
        session.delete(row)
        session.commit()
        area.remove(upload_id)
        log.info("upload %s committed as artifact %s", upload_id, artifact.id)
        return artifact
