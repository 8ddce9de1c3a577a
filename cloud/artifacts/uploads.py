"""Chunked, resumable uploads of artefacts (``/artifacts/uploads``; the wire side in :mod:`interfaces.uploads`).

A session is a row (``cloud.tables.ArtifactUpload``: the declared artefact, its size, chunk size and, when the client
declared it at the start, its SHA-256; when it expires); its bytes are one file ``<root>/<upload id>/data`` beside the
blob store, never in the database, each chunk at its offset (``index * chunk_size``). A chunk is written in place
while it is hashed, and only once its length and SHA-256 check does its receipt ``<index>.done`` appear (holding its
SHA-256; linked into place, so two writers of one chunk cannot both win, on one hub or several on a shared disk). A
chunk sent again while its receipt exists is only hashed, never written: 204 for the same bytes, 409 for others.
What the hub holds is what the receipts list, so a session resumes after a restart of the hub.

The whole SHA-256 is computed as the chunks arrive: once a chunk's receipt appears, a follower thread
(:class:`_Follower`) carries the session's running hash (:class:`_Chain`) on through every chunk held from where it
ends, reading their bytes back while they are still in the page cache, and writes the data file back to disk; a
commit then hashes only what the chain lacks (every byte after a restart of the hub, or when another replica served
the chunks). Writers of one chunk take no lock (a request cut mid-way may hang on until its connection times out;
its retry must not wait for it), so a chunk is followed only once no other writer of it may still write: each writer
leaves a mark ``<index>.w-<random>`` while it may write (``done`` when it wrote bytes beside another writer), and a
chunk with a mark not ``done`` is left for later; the bytes followed are those in the file, so any mixture of two
writers' bytes is found by the whole SHA-256 at commit (and the chunks are sent again). A commit holds the data file
exclusively (``flock``; writers hold it shared while they write), so a writer still hanging on cannot touch the file
once it becomes a blob. Chunks are not synced one by one: the follower and the commit sync the data file. A crash of
the machine may leave a receipt whose bytes never reached the disk; the chain does not survive a restart, so that
commit reads the whole file and refuses it (the chunks are sent again).

A commit checks the whole SHA-256 (declared at the start, or in the commit itself) and, when it matches, renames the
data file into the blob store (no copy; a copy through a blob writer where the store is elsewhere) and stores and
signs the artefact with :func:`cloud.artifacts.records.create_artifact`, as ``POST /artifacts`` does. Expired
sessions (and directories whose row is gone) are removed by :func:`purge_expired`, which runs when a session is
created and in the hub's housekeeping loop.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import re
import shutil
import secrets
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy import select
from sqlmodel import Session, col

from cloud.artifacts.blobs import CHUNK, BlobStore, FileBlobStore
from cloud.artifacts.records import create_artifact, ensure_absent
from cloud.errors import Conflict, NotFound, PayloadTooLarge, ValidationFailed
from cloud.filemodes import private_dir
from cloud.signing import SigningKey
from cloud.tables import Artifact, ArtifactUpload
from interfaces.deployments import ArtifactCreate, ArtifactFormat, ArtifactKind
from interfaces.ids import is_id, new_id
from interfaces.uploads import MAX_CHUNKS, UploadCreate, UploadSession, chunk_count, chunk_length

log = logging.getLogger("aisynergy.hub.uploads")

_CHUNK_FILE = re.compile(r"^(0|[1-9][0-9]{0,9})\.done$")
_RECEIPT = re.compile(r"^[0-9a-f]{64}$")
_MARK_DONE = b"done"
DATA_FILE = "data"
_STAGING_PREFIX = ".staging-"
_COMMITTING: set[str] = set()
_COMMITTING_LOCK = threading.Lock()


def _utc(value: datetime) -> datetime:
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class _Chain:
    """The running SHA-256 of a session's data file from its start up to ``offset``, as far as its chunks are held (and
    settled: see :func:`_settled`); ``lock`` is held by whoever carries it on."""

    def __init__(self, chunk_size: int, size: int) -> None:
        self.hash = hashlib.sha256()
        self.offset = 0
        self.chunk_size, self.size = chunk_size, size
        self.lock = threading.Lock()


class _Follower:
    """Follows the sessions whose chunks arrive, in a thread of its own: carries each one's chain on through the chunks
    held (their bytes read back while they are still in the page cache) and writes the data file back to disk
    (``fdatasync``), so that a commit finds little left to hash or to sync. A chunk is stored the moment its receipt
    appears; nothing here is on the request's path."""

    def __init__(self) -> None:
        self._pending: dict[tuple[Path, str], UploadArea] = {}
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None

    def follow(self, area: UploadArea, upload_id: str) -> None:
        with self._wake:
            self._pending[(area.root, upload_id)] = area
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="upload-follower", daemon=True)
                self._thread.start()
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                if not self._wake.wait_for(lambda: bool(self._pending), timeout=60):
                    self._thread = None
                    return
                (_, upload_id), area = next(iter(self._pending.items()))
                del self._pending[(area.root, upload_id)]
            try:
                fd = os.open(area.data(upload_id), os.O_RDONLY)
            except OSError:
                continue  # committed or removed meanwhile
            try:
                chain = area.existing_chain(upload_id)
                if chain is not None:
                    with chain.lock:
                        _carry_on(area, upload_id, chain, fd, settled_only=True)
                os.fdatasync(fd)
            except OSError as exc:
                log.warning("could not follow upload %s ahead of its commit: %s", upload_id, exc)
            finally:
                os.close(fd)


def _settled(area: UploadArea, upload_id: str, index: int) -> bool:
    """Chunk ``index`` is held and no writer of it may still write (each of its marks says ``done``): its bytes in the
    data file are final."""
    if not area.chunk(upload_id, index).exists():
        return False
    for name in area.marks(upload_id, index):
        try:
            if (area.dir(upload_id) / name).read_bytes() != _MARK_DONE:
                return False
        except FileNotFoundError:
            pass  # removed: it wrote nothing
    return True


def _carry_on(area: UploadArea, upload_id: str, chain: _Chain, fd: int, settled_only: bool) -> int:
    """Carry ``chain`` on through the data file (``fd``): chunk by chunk while they are settled, or (a commit, which
    holds the file) to its end. The caller holds ``chain.lock``; returns the bytes read."""
    read = 0
    while chain.offset < chain.size:
        index = chain.offset // chain.chunk_size
        if settled_only and not _settled(area, upload_id, index):
            break
        end = min(chain.offset + chain.chunk_size, chain.size) if settled_only else chain.size
        while chain.offset < end:
            piece = os.pread(fd, min(CHUNK * 2, end - chain.offset), chain.offset)
            if not piece:
                raise OSError(errno.EIO, f"the data file of upload {upload_id} ends at {chain.offset} of {chain.size} bytes")
            chain.hash.update(piece)
            chain.offset += len(piece)
            read += len(piece)
    return read


_FOLLOWER = _Follower()
_CHAINS: dict[Path, _Chain] = {}
_CHAINS_LOCK = threading.Lock()


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

    def marks(self, upload_id: str, index: int) -> set[str]:
        """The names of the writer marks of chunk ``index`` (see the module's text)."""
        prefix = f"{index}.w-"
        return {name for name in os.listdir(self.dir(upload_id)) if name.startswith(prefix)}

    def chain(self, upload_id: str, chunk_size: int, size: int) -> _Chain:
        """This process's running hash of the session (a new one, from offset 0, when it has none)."""
        with _CHAINS_LOCK:
            return _CHAINS.setdefault(self.dir(upload_id), _Chain(chunk_size, size))

    def existing_chain(self, upload_id: str) -> _Chain | None:
        with _CHAINS_LOCK:
            return _CHAINS.get(self.dir(upload_id))

    def drop_chain(self, upload_id: str) -> None:
        with _CHAINS_LOCK:
            _CHAINS.pop(self.dir(upload_id), None)

    def received(self, upload_id: str) -> list[int]:
        """Indexes of the chunks held, ascending."""
        try:
            names = os.listdir(self.dir(upload_id))
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for m in map(_CHUNK_FILE.match, names) if m is not None)

    def remove(self, upload_id: str) -> None:
        self.drop_chain(upload_id)
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
    os.close(os.open(area.data(row.id), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    log.info("upload %s started: %s %s %s, %d bytes in %d chunks", row.id, row.kind, row.name, row.version, row.size, chunk_count(row.size, chunk_size))
    return row


def _allocate(fd: int, offset: int, length: int) -> None:
    """The blocks of one chunk's range allocated before it is written (its writes then only fill them; a full disk
    says so before the bytes are taken): only what a client sends is ever allocated."""
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # a file system that cannot allocate ahead
            return
        raise PayloadTooLarge(f"the hub has no room for {length} more bytes now ({exc.strerror})") from exc


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
    held is only hashed, to answer 204 or 409). Its writer's mark (see the module's text) lives as long as it may write;
    once stored, the session's follower carries the whole SHA-256 on through it."""

    def __init__(self, area: UploadArea, upload_id: str, index: int, length: int, sha256: str, chunk_size: int, size: int) -> None:
        self.area, self.upload_id, self.index, self.length, self.sha256 = area, upload_id, index, length, sha256
        self.chunk_size, self.total, self.offset = chunk_size, size, index * chunk_size
        self.size = 0
        self._written = 0
        self._hash = hashlib.sha256()
        self._data: int | None = None
        self._mark: Path | None = None
        self._stored = False
        self._stopped = False
        try:
            if not area.dir(upload_id).is_dir():
                raise FileNotFoundError(upload_id)
            # The mark comes first, the receipt is read after it: a writer that finds no receipt has a mark others see.
            self._mark = area.dir(upload_id) / f"{index}.w-{secrets.token_hex(8)}"
            os.close(os.open(self._mark, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            self._held = self._receipt()
            if self._held is None:
                self._data = os.open(area.data(upload_id), os.O_WRONLY | os.O_CREAT, 0o600)
                _allocate(self._data, self.offset, length)
            else:
                self._drop_mark()
        except FileNotFoundError:
            self.discard()
            raise NotFound(f"upload {upload_id} does not exist (aborted, committed or expired)") from None
        except BaseException:
            self.discard()
            raise

    def _receipt(self) -> str | None:
        """The SHA-256 in the chunk's receipt; None when there is none (or one a crash left empty: it is removed)."""
        path = self.area.chunk(self.upload_id, self.index)
        try:
            held = path.read_text().strip()
        except FileNotFoundError:
            return None
        if _RECEIPT.match(held) is None:
            path.unlink(missing_ok=True)
            return None
        return held

    def _overlapped(self) -> bool:
        """Another writer of this chunk is there (its mark), or has stored it."""
        assert self._mark is not None
        try:
            return bool(self.area.marks(self.upload_id, self.index) - {self._mark.name}) or self.area.chunk(self.upload_id, self.index).exists()
        except FileNotFoundError:  # the session is gone
            return False

    def _drop_mark(self) -> None:
        if self._mark is not None:
            self._mark.unlink(missing_ok=True)
            self._mark = None

    def write_all(self, pieces: list[bytes]) -> None:
        """Write and hash a batch of the chunk's bytes, joined first: one write and one hash update per batch (each
        lets go of the GIL once, rather than once per piece the server read)."""
        data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        if not data:
            return
        if self.size + len(data) > self.length:
            raise self._wrong_length(f"more than {self.length} bytes")
        if self._data is not None:
            fcntl.flock(self._data, fcntl.LOCK_SH)  # a commit holds it exclusively while the file becomes a blob
            try:
                if self._may_write():
                    view = memoryview(data)
                    while view:
                        written = os.pwrite(self._data, view, self.offset + self.size + (len(data) - len(view)))
                        view = view[written:]
                    self._written += len(data)
                else:
                    self._held = self._receipt()  # another request stored it meanwhile (or the session ended): its bytes stay as they are
                    self._stopped = True
            finally:
                fcntl.flock(self._data, fcntl.LOCK_UN)
            if self._stopped:
                os.close(self._data)
                self._data = None
        self.size += len(data)
        self._hash.update(data)

    def _may_write(self) -> bool:
        """No receipt for the chunk yet, and the session's data file is still the one this writer has open."""
        if self.area.chunk(self.upload_id, self.index).exists():
            return False
        try:
            return os.stat(self.area.data(self.upload_id)).st_ino == os.fstat(self._data).st_ino  # type: ignore[arg-type]
        except FileNotFoundError:
            return False

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
        if self._data is None:
            raise NotFound(f"upload {self.upload_id} ended while chunk {self.index} was being sent")
        final = self.area.chunk(self.upload_id, self.index)
        fd, staged = tempfile.mkstemp(dir=self.area.dir(self.upload_id), prefix=_STAGING_PREFIX)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(digest)
            os.link(staged, final)  # atomic, and refuses to replace a receipt that is there
        except FileExistsError:  # another writer won
            held = final.read_text().strip()
            if held != digest:
                raise Conflict(f"chunk {self.index} of upload {self.upload_id} is held with SHA-256 {held}, not {digest}", sha256=held) from None
            return False
        finally:
            os.unlink(staged)
        self._stored = True
        self.discard()  # this writer is done: its mark goes before the follower looks
        self.area.chain(self.upload_id, self.chunk_size, self.total)
        _FOLLOWER.follow(self.area, self.upload_id)
        return True

    def discard(self) -> None:
        """Close the chunk's file. A writer that wrote bytes and did not store its chunk leaves its mark, ``done``, when
        another writer of the chunk is there or was (its mark, or the receipt): its bytes may be after theirs. Alone,
        it leaves nothing: whoever writes the chunk next writes all of it after these bytes."""
        if self._data is not None:
            os.close(self._data)
            self._data = None
        if self._mark is not None:
            if self._written and not self._stored and self._overlapped():
                with suppress(FileNotFoundError):
                    self._mark.write_bytes(_MARK_DONE)
                self._mark = None
            else:
                self._drop_mark()


# --- commit ----------------------------------------------------------------------------------------


def _store(session: Session, signing: SigningKey, blobs: BlobStore, row: ArtifactUpload, data: Path, sha256: str) -> Artifact:
    """The checked data file as the artefact: renamed into a file blob store, else copied through a blob writer."""
    if isinstance(blobs, FileBlobStore) and os.stat(data).st_dev == os.stat(blobs.root).st_dev:  # a rename, not a copy
        return create_artifact(session, signing, blobs, _identity(row), blobs.adopt(data, sha256, row.size))
    with blobs.writer() as writer, data.open("rb") as f:
        while piece := f.read(CHUNK):
            writer.write(piece)
        return create_artifact(session, signing, blobs, _identity(row), writer)


def expected_sha256(row: ArtifactUpload, declared: str | None) -> str:
    """The SHA-256 the joined chunks must have: declared when the session started, or in the commit (both: the
    same one), else 422."""
    if row.sha256 is not None and declared is not None and declared != row.sha256:
        raise ValidationFailed(
            f"upload {row.id} was started with SHA-256 {row.sha256}; the commit declares {declared}",
            errors=[{"loc": ["body", "sha256"], "msg": f"the session's is {row.sha256}", "type": "digest_mismatch"}],
        )  # fmt: skip
    expected = row.sha256 or declared
    if expected is None:
        raise ValidationFailed(
            f"upload {row.id} was started without the artefact's SHA-256: declare it in the commit",
            errors=[{"loc": ["body", "sha256"], "msg": "required: the session has none", "type": "missing"}],
        )  # fmt: skip
    return expected


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


def commit_upload(session: Session, signing: SigningKey, blobs: BlobStore, area: UploadArea, upload_id: str, sha256: str | None = None) -> Artifact:
    """Check the joined chunks against the SHA-256 declared at the start or here (``sha256``) and store the signed
    artefact; the session and its chunks are removed. 422 when chunks are missing or no SHA-256 was declared (the
    session unchanged), or when the whole SHA-256 differs (the session is kept, its chunks dropped: send them again)."""
    with _one_commit(upload_id):
        row = get_upload(session, area, upload_id)
        expected = expected_sha256(row, sha256)
        count = chunk_count(row.size, row.chunk_size)
        missing = sorted(set(range(count)) - set(area.received(upload_id)))
        if missing:
            raise ValidationFailed(
                f"upload {upload_id} lacks {len(missing)} of its {count} chunks (first missing: {missing[0]})",
                errors=[{"loc": ["chunks"], "msg": f"missing {missing[:32]}", "type": "missing"}],
            )  # fmt: skip
        data = area.data(upload_id)
        fd = os.open(data, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # writers still in flight stop: the file becomes a blob under this lock
            chain = area.chain(upload_id, row.chunk_size, row.size)
            with chain.lock:
                read = _carry_on(area, upload_id, chain, fd, settled_only=False)
                digest = chain.hash.hexdigest()
            if digest != expected or os.fstat(fd).st_size != row.size:
                area.drop_chain(upload_id)
                for index in range(count):
                    area.chunk(upload_id, index).unlink(missing_ok=True)
                raise ValidationFailed(
                    f"the chunks of upload {upload_id} join to SHA-256 {digest}, not the declared {expected}; "
                    "its chunks are dropped: send them again",
                    errors=[{"loc": ["body", "sha256"], "msg": "does not match the joined chunks", "type": "digest_mismatch"}],
                )  # fmt: skip
            os.fdatasync(fd)
            artifact = _store(session, signing, blobs, row, data, expected)
        finally:
            os.close(fd)
        session.delete(row)
        session.commit()
        area.remove(upload_id)
        log.info("upload %s committed as artifact %s (%d of its %d bytes read again to hash them)", upload_id, artifact.id, read, row.size)
        return artifact
