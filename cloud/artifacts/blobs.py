"""The bytes of the artefacts: a content-addressed blob store (DESIGN §4.2). Every blob lives under its SHA-256, so
artefacts with the same bytes share one. :class:`FileBlobStore` keeps blobs on the local disk; an object store can
replace it behind the same :class:`BlobStore` protocol."""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import BinaryIO, Protocol

CHUNK = 1024 * 1024
SHA256 = re.compile(r"^[0-9a-f]{64}$")


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
    if not SHA256.match(sha256):
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


class _AdoptedBlob:
    def __init__(self, store: FileBlobStore, path: Path, sha256: str, size: int) -> None:
        self._store, self._path, self.sha256, self.size = store, path, sha256, size

    def write(self, data: bytes) -> None:
        raise TypeError("an adopted blob is written already")

    def commit(self) -> tuple[str, int]:
        final = self._store._file(self.sha256)
        final.parent.mkdir(exist_ok=True)
        os.chmod(self._path, 0o644)
        os.replace(self._path, final)  # same bytes under the same name: replacing an existing blob is harmless
        _fsync_dir(final.parent)
        return self.sha256, self.size


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
        return SHA256.match(sha256) is not None and self._file(sha256).is_file()

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

    def adopt(self, path: Path, sha256: str, size: int) -> _AdoptedBlob:
        """A writer whose ``commit`` moves the file ``path`` (its content already hashed to ``sha256``, fsynced) into
        the store by a rename: no copy. ``OSError`` (another filesystem) from ``commit`` leaves ``path`` as it was."""
        return _AdoptedBlob(self, Path(path), _check_sha(sha256), size)

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
