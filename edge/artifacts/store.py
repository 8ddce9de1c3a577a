"""The blobs on disk: content-addressed files under ``<data dir>/artifacts/``, pinned while served, checked before
they are served (their SHA-256 against their name, once per change of the file), and kept within a size budget by
dropping the least recently used. A miss is fetched once however many requests ask at the same time."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, NamedTuple

from edge.artifacts.answers import Answer, Refused, problem
from interfaces.errors import ErrorCode

log = logging.getLogger("aisynergy.edge.artifacts")

DEFAULT_BUDGET_BYTES = 2 * 1024**3
HASH_CHUNK = 1024 * 1024
PART_SUFFIX = ".part"
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}  # fmt: skip


def parse_size(text: str) -> int:
    """``2GiB``, ``500M``, ``1048576`` -> bytes; ValueError otherwise."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size (e.g. 2GiB, 500MB, 1048576)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


@dataclass
class _Download:
    done: threading.Event = field(default_factory=threading.Event)
    failure: Answer | None = None


class Stamp(NamedTuple):
    """What a blob's file looked like when its bytes last verified; any write or rename changes it."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int


def stamp_of(stat: os.stat_result) -> Stamp:
    return Stamp(stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)


@dataclass
class Blob:
    """A cached blob, open and pinned (not evicted) until :meth:`release`; ``verified``: its bytes are known good."""

    sha256: str
    size: int
    handle: BinaryIO
    _unpin: Callable[[str], None]
    stamp: Stamp
    verified: bool = False

    def release(self) -> None:
        self.handle.close()
        self._unpin(self.sha256)


class BlobStore:
    """The content-addressed blobs in ``root`` within ``budget_bytes``; see the package docstring. Thread-safe.

    ``writing`` holds the names of the ``.part`` files being written (never evicted); whoever writes one adds and
    discards its name."""

    def __init__(self, root: Path, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        if budget_bytes < 0:
            raise ValueError(f"the artefact cache budget {budget_bytes} is negative")
        self.root = Path(root)
        self.budget_bytes = budget_bytes
        self.hits = 0
        self.integrity_checks = 0  # full SHA-256 reads of cached blobs
        self.corrupt_dropped = 0  # cached blobs that failed their check and were dropped
        self.pins: Counter[str] = Counter()
        self.writing: set[str] = set()
        self._lock = threading.Lock()
        self._downloads: dict[str, _Download] = {}
        self._verified: dict[str, Stamp] = {}  # blob -> its stamp when its bytes last verified
        self._checks: dict[str, threading.Lock] = {}  # blob -> held while it is hashed, so once for all who ask
        (self.root / "deltas").mkdir(parents=True, exist_ok=True)

    def blob_path(self, sha256: str) -> Path:
        return self.root / sha256

    def contains(self, sha256: str) -> bool:
        return self.blob_path(sha256).is_file()

    def usage(self) -> int:
        """Bytes held: blobs and partial downloads."""
        return sum(p.stat().st_size for p in self.root.iterdir() if p.is_file())

    def acquire(self, key: str, lookup: Callable[[], str | None], fetch: Callable[[], str]) -> Blob:
        """Look the blob up, pin and check it; on a miss or a bad blob, download it once however many ask at
        the same time."""
        for _ in range(4):  # a blob dropped as corrupt, or evicted between its download and our look-up, is fetched again
            with self._lock:
                sha = lookup()
                blob = self._open(sha) if sha is not None else None
                if blob is None:
                    download = self._downloads.get(key)
                    owner = download is None
                    if download is None:
                        download = self._downloads[key] = _Download()
            if blob is not None:
                if self._intact(blob):
                    with self._lock:
                        self.hits += 1
                    return blob
                continue
            if not owner:
                download.done.wait()
                if download.failure is not None:
                    raise Refused(download.failure)
                continue
            try:
                sha = fetch()
            except Refused as exc:
                download.failure = exc.answer
                raise
            except Exception as exc:
                log.exception("downloading %s failed", key)
                download.failure = problem(500, ErrorCode.INTERNAL, "Internal error", f"{type(exc).__name__}: {exc}")
                raise Refused(download.failure) from exc
            finally:
                with self._lock:
                    del self._downloads[key]
                download.done.set()
            with self._lock:  # insert pinned it for us
                blob = self._open(sha, pinned=True)
            if blob is not None and self._intact(blob):
                return blob
        raise Refused(problem(503, ErrorCode.HUB_UNREACHABLE, "The artefact cannot be kept in the cache", key))

    def _open(self, sha256: str, pinned: bool = False) -> Blob | None:
        """Under ``_lock``: open and pin a cached blob. One whose file is as it was when it last verified is
        ``verified`` and marked used (its mtime); any other is checked by :meth:`_intact` first."""
        path = self.blob_path(sha256)
        try:
            handle = path.open("rb")
        except OSError:
            if pinned:
                self._unpin_locked(sha256)
            return None
        if not pinned:
            self.pins[sha256] += 1
        stamp = stamp_of(os.fstat(handle.fileno()))
        blob = Blob(sha256, stamp.size, handle, self.unpin, stamp)  # type: ignore[arg-type]
        if self._verified.get(sha256) == stamp:
            blob.verified = True
            self._touch(blob)
        return blob

    def _touch(self, blob: Blob) -> None:
        """Under ``_lock``: mark a verified blob used (its mtime, set on the open file) and move its record along."""
        now = time.time_ns()
        try:
            os.utime(blob.handle.fileno() if os.utime in os.supports_fd else self.blob_path(blob.sha256), ns=(now, now))
            self._verified[blob.sha256] = stamp_of(os.fstat(blob.handle.fileno()))
        except OSError:
            pass  # not touched: the record still holds, the LRU order is a little off

    def _intact(self, blob: Blob) -> bool:
        """The blob's bytes are the ones its name promises (verified before, or hashed now, once however many
        ask); ``False``: it was dropped as corrupt, or another request dropped or replaced it meanwhile, and
        is released: look it up again."""
        if blob.verified:
            return True
        with self._lock:
            check = self._checks.setdefault(blob.sha256, threading.Lock())
        with check:
            intact = self._check(blob)
        if not intact:
            blob.release()
        return intact

    def _check(self, blob: Blob) -> bool:
        """Under the blob's check lock: the size against the record, else the SHA-256; drop a bad blob."""
        sha = blob.sha256
        with self._lock:
            if not self._current(blob):
                return False
            stamp = stamp_of(os.fstat(blob.handle.fileno()))
            recorded = self._verified.get(sha)
            if recorded == stamp:  # checked by another request while this one waited
                blob.verified = True
                return True
        if recorded is not None and recorded.size != stamp.size:
            fault: str | None = f"it holds {stamp.size} bytes, {recorded.size} when it was verified"
        else:
            fault = self._digest_fault(blob)
        with self._lock:
            if fault is None:
                blob.verified = True
                if self._current(blob) and stamp_of(os.fstat(blob.handle.fileno())) == stamp:  # nothing wrote it while it was read
                    self._touch(blob)
                return True
            self.corrupt_dropped += 1
            self._verified.pop(sha, None)
            if self._current(blob):
                self.blob_path(sha).unlink(missing_ok=True)
        log.error("cached blob %s is corrupt (%s): dropped; fetching it again from the hub", sha, fault)
        return False

    def _digest_fault(self, blob: Blob) -> str | None:
        """Hash the open file (the inode that will be served); what is wrong with it, or ``None``."""
        with self._lock:
            self.integrity_checks += 1
        digest, offset, fd = hashlib.sha256(), 0, blob.handle.fileno()
        started = time.monotonic()
        try:
            while chunk := os.pread(fd, HASH_CHUNK, offset):
                digest.update(chunk)
                offset += len(chunk)
        except OSError as exc:
            return f"unreadable after {offset} bytes: {exc}"
        if digest.hexdigest() != blob.sha256:
            return f"its {offset} bytes have SHA-256 {digest.hexdigest()}"
        log.info("verified cached blob %s (%s bytes) in %.2f s", blob.sha256, offset, time.monotonic() - started)
        return None

    def _current(self, blob: Blob) -> bool:
        """Under ``_lock``: the cache still names this open file (not dropped, evicted or replaced)."""
        try:
            stat = self.blob_path(blob.sha256).stat()
        except OSError:
            return False
        return (stat.st_dev, stat.st_ino) == (blob.stamp.dev, blob.stamp.ino)

    def unpin(self, sha256: str) -> None:
        with self._lock:
            self._unpin_locked(sha256)

    def _unpin_locked(self, sha256: str) -> None:
        self.pins[sha256] -= 1
        if self.pins[sha256] <= 0:
            del self.pins[sha256]

    def insert(self, part: Path, sha256: str) -> str:
        """Move a verified part into the cache, pinned for the caller, then keep the budget."""
        with self._lock:
            target = self.blob_path(sha256)
            part.replace(target)
            self._verified[sha256] = stamp_of(target.stat())  # hashed as it arrived: no second read
            self.writing.discard(part.name)
            self.pins[sha256] += 1
            self._evict()
        log.info("cached %s (%s bytes)", sha256, target.stat().st_size)
        return sha256

    def _evict(self) -> None:
        """Under ``_lock``: drop least recently used files until the budget holds (never pinned or written ones)."""
        total, candidates = 0, []
        for path in self.root.iterdir():
            try:
                stat = path.stat()
            except OSError:
                continue
            if not path.is_file():
                continue
            total += stat.st_size
            busy = path.name in self.writing if path.name.endswith(PART_SUFFIX) else self.pins[path.name] > 0
            if not busy:
                candidates.append((stat.st_mtime_ns, path, stat.st_size))
        candidates.sort()
        for _, path, size in candidates:
            if total <= self.budget_bytes:
                break
            path.unlink(missing_ok=True)
            self._verified.pop(path.name, None)
            self._checks.pop(path.name, None)
            total -= size
            log.info("evicted %s (%s bytes) to keep the cache within %s bytes", path.name, size, self.budget_bytes)
        if total > self.budget_bytes:
            log.warning("the artefact cache holds %s bytes, over its budget of %s: the rest is in use", total, self.budget_bytes)
