"""The edge's artefact cache: devices download their deployments from the edge, which may be all they can reach.

Routes on the device listener (``edge.enrol_proxy``), the very same paths and token as the hub's (DESIGN §4.2)::

    GET|HEAD /api/v1/artifacts/{id}/content              X-Download-Token: <token>
    GET|HEAD /api/v1/artifacts/{id}/delta?from=<sha256>  X-Download-Token: <token>

The token is checked offline against the hub's pinned signing key (401 ``invalid_download_token``); its
``sha256`` names the blob. A cached blob is served from disk (one byte range: 206, 416; ``Accept-Ranges``,
``ETag: "<sha256>"``). A miss is fetched from the hub with the device's token into ``<sha256>.part``,
resumed with ``Range: bytes=<have>-`` after an interruption (a 206 must start there; a 200 starts over),
and moved into the cache only when its SHA-256 is the grant's (a delta's: the hub's ETag, or the order's
offer). Concurrent requests for one blob share one upstream download. The hub's refusals (404 unknown
artefact or delta, 401, 503 ``busy`` with its ``Retry-After``, ...) pass through; the hub unreachable and the
blob not cached: 503 ``hub_unreachable``; the hub sent other bytes than it signed: 502 ``invalid_response``,
nothing kept. A delta is served only from the base the token names (its order's), cached or not: 403 else.

Layout under ``<data dir>/artifacts/``::

    <sha256>                a verified blob (content or delta)
    <sha256>.part           a download in progress or interrupted
    deltas/<base>-<target>  the SHA-256 of the delta from ``base`` to ``target``

Blobs and leftover partial downloads stay within a size budget (default 2 GiB): the least recently used
go first, never one being served or written. A blob's mtime is its LRU stamp, so the order survives a
restart. ``prefetch`` fetches an ordered artefact in the background, so that devices find it here even
when the hub is gone by the time they ask.

Integrity. A cached blob is checked before it is served: its SHA-256 against its name, which is the digest
the hub signed (the token's grant, the manifest's ``sha256``; a delta's: the digest it was verified against
when fetched), and first its size against the size it had when those bytes verified (a device's request
carries the token, not the manifest; the digest fixes the size). A blob that fails (flipped bits, a
truncated or unreadable file) is dropped, counted (``corrupt_dropped``), logged, and fetched again from
the hub: the request that found it waits for that download and gets the good bytes, or, with the hub
unreachable, 503 ``hub_unreachable``, which the device retries. Hashing a large blob on every Range
request would cost a full read each time, so the cache keeps, in memory, the stamp of each blob as last
verified: device, inode, size, mtime_ns and ctime_ns. The full check (``integrity_checks``) runs only
when the stamp differs: once per change of the file, and once per blob after a restart. A download,
hashed before it is moved into the cache, is recorded then (no second read); the LRU touch moves the
record along under the cache's lock. Its limit: a change that keeps the stamp goes
unseen until the edge restarts: bits that rot below the file system, a write within the file system's
timestamp granularity of the last check, or one between that check and the touch (microseconds). The
device still refuses such bytes (SHA-256 + Ed25519), so nothing wrong is installed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import socket
import ssl
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, NamedTuple
from urllib.parse import parse_qs, urlsplit

import httpx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from device.files import write_atomic
from device.ota.verify import TrustedKeys, UnknownSigner, VerificationError, load_public_key, sha256_file, verify_download_token
from device.tls import tls_verify
from interfaces import API_PREFIX
from interfaces.deployments import DELTA_MEDIA_TYPE, DOWNLOAD_TOKEN_HEADER, SHA256_RE, DeploymentOrder, DownloadGrant, KeyTransitions, SignedKeyTransition
from interfaces.errors import ERROR_TYPE_PREFIX, PROBLEM_MEDIA_TYPE, ErrorCode
from interfaces.ranges import RangeNotSatisfiable, parse_byte_range

log = logging.getLogger("aisynergy.edge.artifacts")

DEFAULT_BUDGET_BYTES = 2 * 1024**3
CHUNK = 64 * 1024
HASH_CHUNK = 1024 * 1024
ROUTE = re.compile(rf"^{re.escape(API_PREFIX)}/artifacts/([^/]+)/(content|delta)$")
SIGNING_KEY_PATH = f"{API_PREFIX}/signing-key.pub"
KEY_TRANSITIONS_PATH = f"{API_PREFIX}/signing-key/transitions"
CONTENT_MEDIA_TYPE = "application/octet-stream"
PART_SUFFIX = ".part"
KEY_RETRY_S = 5.0  # after a failed fetch of the signing key, ask the hub again at most this often
_SHA = re.compile(SHA256_RE)
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}  # fmt: skip


def parse_size(text: str) -> int:
    """``2GiB``, ``500M``, ``1048576`` -> bytes; ValueError otherwise."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size (e.g. 2GiB, 500MB, 1048576)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


# ---- answers ------------------------------------------------------------------------------------------


@dataclass
class Answer:
    """What the device listener sends back: status, headers and a body (bytes, or a region of a pinned blob)."""

    status: int
    headers: dict[str, str]
    body: bytes = b""
    blob: _Blob | None = None
    offset: int = 0
    length: int = 0

    def write_body(self, out: BinaryIO, sock: socket.socket | None = None) -> None:
        """Write the body to ``out``; a blob region goes with ``sock.sendfile`` when the socket is given (the
        kernel copies it: a rollout's thousand downloads cost the edge's Python, and its event loop, nothing)."""
        if self.blob is None:
            out.write(self.body)
            return
        handle = self.blob.handle
        if sock is not None and self.length > 0:
            out.flush()
            sent = sock.sendfile(handle, self.offset, self.length)
            if sent != self.length:
                raise OSError(f"blob {self.blob.sha256} is shorter than it was ({sent} of {self.length} bytes sent)")
            return
        handle.seek(self.offset)
        remaining = self.length
        while remaining > 0:
            chunk = handle.read(min(CHUNK, remaining))
            if not chunk:
                raise OSError(f"blob {self.blob.sha256} is shorter than it was")
            out.write(chunk)
            remaining -= len(chunk)

    def release(self) -> None:
        if self.blob is not None:
            self.blob.release()
            self.blob = None


def problem(status: int, code: ErrorCode, title: str, detail: str | None = None) -> Answer:
    document = {"type": ERROR_TYPE_PREFIX + code.value, "title": title, "status": status, "code": code.value, "detail": detail}
    body = json.dumps(document).encode()
    return Answer(status, {"Content-Type": PROBLEM_MEDIA_TYPE, "Content-Length": str(len(body))}, body)


class _Failure(Exception):
    """A download ended with an answer for the device instead of a blob."""

    def __init__(self, answer: Answer) -> None:
        super().__init__(answer.status)
        self.answer = answer


@dataclass
class _Download:
    done: threading.Event = field(default_factory=threading.Event)
    failure: Answer | None = None


class _Stamp(NamedTuple):
    """What a blob's file looked like when its bytes last verified; any write or rename changes it."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int


def _stamp(stat: os.stat_result) -> _Stamp:
    return _Stamp(stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)


@dataclass
class _Blob:
    """A cached blob, open and pinned (not evicted) until :meth:`release`; ``verified``: its bytes are known good."""

    sha256: str
    size: int
    handle: BinaryIO
    _unpin: Callable[[str], None]
    stamp: _Stamp
    verified: bool = False

    def release(self) -> None:
        self.handle.close()
        self._unpin(self.sha256)


# ---- the cache ----------------------------------------------------------------------------------------


class ArtifactCache:
    """Content-addressed artefact cache in ``root``; see the module docstring. Thread-safe."""

    def __init__(
        self,
        root: Path,
        *,
        hub_url: str,
        signing_key: TrustedKeys | Ed25519PublicKey | None = None,
        pin_signing_key: Callable[[str], object] | None = None,
        signing_key_source: Callable[[], TrustedKeys | None] | None = None,
        budget_bytes: int = DEFAULT_BUDGET_BYTES,
        verify: ssl.SSLContext | bool | str = True,
        timeout_s: float = 30.0,
        attempts: int = 5,
        prefetch_workers: int = 2,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if budget_bytes < 0:
            raise ValueError(f"the artefact cache budget {budget_bytes} is negative")
        self.root = Path(root)
        self.hub_url = hub_url.rstrip("/")
        self.budget_bytes = budget_bytes
        self.upstream_requests = 0  # requests sent to the hub for blobs (metrics, tests)
        self.hits = 0
        self.integrity_checks = 0  # full SHA-256 reads of cached blobs
        self.corrupt_dropped = 0  # cached blobs that failed their check and were dropped
        self._key = None if signing_key is None else TrustedKeys.of(signing_key)
        self._pin_key = pin_signing_key
        self._key_source = signing_key_source  # the pinned keys, which the node's updater may have extended
        self._key_lock = threading.Lock()
        self._key_failed_at = -KEY_RETRY_S
        self._caught_up_at = -KEY_RETRY_S
        self._announced: str | None = None  # the key id the hub's retained state names
        self._verify = verify
        self._timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0))
        self._attempts = attempts
        self._transport = transport
        self._lock = threading.Lock()
        self._pins: Counter[str] = Counter()
        self._downloads: dict[str, _Download] = {}
        self._writing: set[str] = set()  # names of .part files being written
        self._verified: dict[str, _Stamp] = {}  # blob -> its stamp when its bytes last verified
        self._checks: dict[str, threading.Lock] = {}  # blob -> held while it is hashed, so once for all who ask
        self._executor = ThreadPoolExecutor(max_workers=prefetch_workers, thread_name_prefix="artifact-prefetch")
        self._closed = False
        (self.root / "deltas").mkdir(parents=True, exist_ok=True)

    # ---- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        """Pin the hub's signing key in the background if the identity has none (an older enrolment)."""
        if self._key is None:
            self._executor.submit(self.ensure_signing_key)

    def close(self) -> None:
        self._closed = True
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ---- the hub's signing key ----------------------------------------------------------------------
    def ensure_signing_key(self) -> TrustedKeys | None:
        """The pinned keys; without one, fetch ``GET /signing-key.pub`` from the hub once and pin it."""
        with self._key_lock:
            if self._key is not None:
                return self._key
            if time.monotonic() - self._key_failed_at < KEY_RETRY_S:
                return None
            url = self.hub_url + SIGNING_KEY_PATH
            try:
                with self._client() as client:
                    response = client.get(url)
                response.raise_for_status()
                key = TrustedKeys([load_public_key(response.content)])
            except (httpx.HTTPError, VerificationError, ValueError) as exc:
                self._key_failed_at = time.monotonic()
                log.warning("no pinned signing key and cannot fetch it from %s: %s", url, exc)
                return None
            self._pin(key)
            self._key = key
            log.warning("the stored identity has no signing key: pinned key %s fetched from %s", key.ids()[0], url)
            return key

    def follow(self, transitions: list[SignedKeyTransition]) -> TrustedKeys | None:
        """Trust the keys ``transitions`` lead to from a pinned key (a device order's manifest after the hub
        rotated its key); :class:`VerificationError` for a forged hand-over."""
        keys = self.ensure_signing_key()
        if keys is None or not transitions:
            return keys
        with self._key_lock:
            keys = self._key or keys
            ahead = keys.following(transitions)
            if ahead is not keys:
                self._key = ahead
                self._pin(ahead)
                log.warning("the hub's signing key is %s now (a transition signed by a pinned key leads to it): pinned", ahead.ids()[0])
            return ahead

    def hub_signing_key(self, announced: str) -> None:
        """The hub announced the key it signs with (its retained state); not one pinned here: fetch the hand-over
        in the background, so the new key is trusted before a device shows a token it signed."""
        self._announced = announced
        keys = self._key
        if keys is not None and keys.get(announced) is None and not self._closed:
            with contextlib.suppress(RuntimeError):  # shut down meanwhile
                self._executor.submit(self._catch_up, keys)

    def _catch_up(self, keys: TrustedKeys) -> TrustedKeys | None:
        """More keys than ``keys``, from the pinned file or, when the hub announced a key not pinned here, from
        its transitions; ``None`` when there are none. A token signed by an unknown key makes no request to the
        hub unless the hub said it signs with a key the edge lacks (and then at most every ``KEY_RETRY_S``)."""
        if self._key_source is not None:
            try:
                pinned = self._key_source()
            except (OSError, ValueError) as exc:
                log.error("cannot read the pinned signing keys: %s", exc)
                pinned = None
            if pinned is not None and set(pinned.ids()) - set(keys.ids()):
                with self._key_lock:
                    self._key = pinned.merged(keys)
                return self._key
        with self._key_lock:
            announced, current = self._announced, self._key or keys
            if announced is None or current.get(announced) is not None:
                return current if current is not keys else None
            if time.monotonic() - self._caught_up_at < KEY_RETRY_S:
                return None
            self._caught_up_at = time.monotonic()
        url = self.hub_url + KEY_TRANSITIONS_PATH
        try:
            with self._client() as client:
                response = client.get(url)
            response.raise_for_status()
            transitions = KeyTransitions.model_validate_json(response.content).transitions
            ahead = self.follow(transitions)
        except (httpx.HTTPError, ValueError) as exc:  # VerificationError and pydantic's ValidationError included
            log.warning("cannot fetch the hub's key transitions from %s: %s", url, exc)
            return None
        return ahead if ahead is not None and ahead is not keys else None

    def verify_token(self, token: str, artifact_id: str) -> DownloadGrant:
        """The grant of a device's token, checked offline with the pinned keys; a token signed by a key the hub
        rotated to since makes the edge follow the hub's transitions first. :class:`VerificationError` else;
        ``LookupError`` when no key is pinned and the hub is unreachable."""
        keys = self.ensure_signing_key()
        if keys is None:
            raise LookupError("no signing key is pinned")
        try:
            return verify_download_token(keys, token, artifact_id)
        except UnknownSigner:
            ahead = self._catch_up(keys)
            if ahead is None:
                raise
            return verify_download_token(ahead, token, artifact_id)

    def _pin(self, keys: TrustedKeys) -> None:
        if self._pin_key is not None:
            try:
                self._pin_key(keys.to_pem())
            except Exception as exc:  # noqa: BLE001 - kept in memory; fetched again after a restart
                log.error("cannot store the hub's signing key: %s", exc)

    # ---- queries ------------------------------------------------------------------------------------
    def blob_path(self, sha256: str) -> Path:
        return self.root / sha256

    def contains(self, sha256: str) -> bool:
        return self.blob_path(sha256).is_file()

    def usage(self) -> int:
        """Bytes held: blobs and partial downloads."""
        return sum(p.stat().st_size for p in self.root.iterdir() if p.is_file())

    # ---- HTTP ---------------------------------------------------------------------------------------
    @staticmethod
    def handles(path: str) -> bool:
        return ROUTE.match(urlsplit(path).path) is not None

    def answer(self, method: str, target: str, headers: Mapping[str, str]) -> Answer:
        """Answer one device request (``target``: path and query). The caller sends the answer, then
        calls its ``release``."""
        split = urlsplit(target)
        match = ROUTE.match(split.path)
        if match is None:
            return problem(404, ErrorCode.NOT_FOUND, "Not found", split.path)
        if method not in ("GET", "HEAD"):
            return problem(405, ErrorCode.METHOD_NOT_ALLOWED, "Method not allowed", method)
        artifact_id, route = match.groups()
        lower = {name.lower(): value for name, value in headers.items()}
        token = lower.get(DOWNLOAD_TOKEN_HEADER.lower(), "")
        try:
            grant = self.verify_token(token, artifact_id)
        except LookupError:
            return problem(503, ErrorCode.HUB_UNREACHABLE, "The hub's signing key is not pinned and the hub cannot be reached")
        except VerificationError as exc:
            log.info("refused a download of %s: %s", artifact_id, exc)
            return problem(401, ErrorCode.INVALID_DOWNLOAD_TOKEN, "Invalid download token", str(exc))
        try:
            if route == "content":
                blob = self.acquire_content(artifact_id, token, grant.sha256)
                media_type = CONTENT_MEDIA_TYPE
            else:
                base = parse_qs(split.query).get("from", [""])[0]
                if not _SHA.match(base):
                    return problem(422, ErrorCode.VALIDATION_FAILED, "Invalid delta base", "from must be a lower-case hex SHA-256")
                if grant.base_sha256 != base:  # as at the hub: a cached patch from other bytes would reveal them
                    log.info("refused a delta to %s from %s: the token names another base", artifact_id, base[:12])
                    return problem(403, ErrorCode.FORBIDDEN, "Forbidden", f"the download token allows no delta from {base}")
                blob = self.acquire_delta(artifact_id, token, base, grant.sha256)
                media_type = DELTA_MEDIA_TYPE
        except _Failure as exc:
            return exc.answer
        return self._serve(blob, lower, media_type)

    def _serve(self, blob: _Blob, headers: Mapping[str, str], media_type: str) -> Answer:
        etag = f'"{blob.sha256}"'
        common = {"Accept-Ranges": "bytes", "ETag": etag}
        wanted = headers.get("range")
        if wanted is not None and headers.get("if-range", etag).strip() != etag:
            wanted = None  # the device holds other bytes: send the whole blob
        try:
            span = parse_byte_range(wanted, blob.size)
        except RangeNotSatisfiable:
            span = False
        except BaseException:  # never leave the blob pinned (it could not be replaced or evicted again)
            blob.release()
            raise
        if span is False:
            blob.release()
            refusal = problem(416, ErrorCode.RANGE_NOT_SATISFIABLE, "Range not satisfiable", f"{wanted} is outside the {blob.size} bytes")
            refusal.headers.update(common, **{"Content-Range": f"bytes */{blob.size}"})
            return refusal
        if span is None:
            return Answer(200, {**common, "Content-Type": media_type, "Content-Length": str(blob.size)}, blob=blob, length=blob.size)
        first, last = span
        length = last - first + 1
        headers_out = {**common, "Content-Type": media_type, "Content-Length": str(length), "Content-Range": f"bytes {first}-{last}/{blob.size}"}
        return Answer(206, headers_out, blob=blob, offset=first, length=length)

    # ---- blobs --------------------------------------------------------------------------------------
    def acquire_content(self, artifact_id: str, token: str, sha256: str) -> _Blob:
        """The artefact's blob, pinned: from the cache, else downloaded from the hub (raises ``_Failure``)."""
        url = f"{self.hub_url}{API_PREFIX}/artifacts/{artifact_id}/content"
        return self._acquire(sha256, lambda: sha256, lambda: self._download(url, token, sha256))

    def acquire_delta(self, artifact_id: str, token: str, base: str, target: str, expected: str | None = None) -> _Blob:
        """The delta from ``base`` to ``target``, pinned; ``expected``: its SHA-256 when known (an order's offer)."""
        index = self.root / "deltas" / f"{base}-{target}"
        url = f"{self.hub_url}{API_PREFIX}/artifacts/{artifact_id}/delta"

        def lookup() -> str | None:
            try:
                return index.read_text().strip() or None
            except OSError:
                return None

        def fetch() -> str:
            sha = self._download(url, token, expected, params={"from": base})
            try:
                write_atomic(index, sha.encode())
            except BaseException:
                self._unpin(sha)
                raise
            return sha

        return self._acquire(f"delta:{base}-{target}", lookup, fetch)

    def _acquire(self, key: str, lookup: Callable[[], str | None], fetch: Callable[[], str]) -> _Blob:
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
                    raise _Failure(download.failure)
                continue
            try:
                sha = fetch()
            except _Failure as exc:
                download.failure = exc.answer
                raise
            except Exception as exc:
                log.exception("downloading %s failed", key)
                download.failure = problem(500, ErrorCode.INTERNAL, "Internal error", f"{type(exc).__name__}: {exc}")
                raise _Failure(download.failure) from exc
            finally:
                with self._lock:
                    del self._downloads[key]
                download.done.set()
            with self._lock:  # _insert pinned it for us
                blob = self._open(sha, pinned=True)
            if blob is not None and self._intact(blob):
                return blob
        raise _Failure(problem(503, ErrorCode.HUB_UNREACHABLE, "The artefact cannot be kept in the cache", key))

    def _open(self, sha256: str, pinned: bool = False) -> _Blob | None:
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
            self._pins[sha256] += 1
        stamp = _stamp(os.fstat(handle.fileno()))
        blob = _Blob(sha256, stamp.size, handle, self._unpin, stamp)  # type: ignore[arg-type]
        if self._verified.get(sha256) == stamp:
            blob.verified = True
            self._touch(blob)
        return blob

    def _touch(self, blob: _Blob) -> None:
        """Under ``_lock``: mark a verified blob used (its mtime, set on the open file) and move its record along."""
        now = time.time_ns()
        try:
            os.utime(blob.handle.fileno() if os.utime in os.supports_fd else self.blob_path(blob.sha256), ns=(now, now))
            self._verified[blob.sha256] = _stamp(os.fstat(blob.handle.fileno()))
        except OSError:
            pass  # not touched: the record still holds, the LRU order is a little off

    # ---- integrity ----------------------------------------------------------------------------------
    def _intact(self, blob: _Blob) -> bool:
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

    def _check(self, blob: _Blob) -> bool:
        """Under the blob's check lock: the size against the record, else the SHA-256; drop a bad blob."""
        sha = blob.sha256
        with self._lock:
            if not self._current(blob):
                return False
            stamp = _stamp(os.fstat(blob.handle.fileno()))
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
                if self._current(blob) and _stamp(os.fstat(blob.handle.fileno())) == stamp:  # nothing wrote it while it was read
                    self._touch(blob)
                return True
            self.corrupt_dropped += 1
            self._verified.pop(sha, None)
            if self._current(blob):
                self.blob_path(sha).unlink(missing_ok=True)
        log.error("cached blob %s is corrupt (%s): dropped; fetching it again from the hub", sha, fault)
        return False

    def _digest_fault(self, blob: _Blob) -> str | None:
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

    def _current(self, blob: _Blob) -> bool:
        """Under ``_lock``: the cache still names this open file (not dropped, evicted or replaced)."""
        try:
            stat = self.blob_path(blob.sha256).stat()
        except OSError:
            return False
        return (stat.st_dev, stat.st_ino) == (blob.stamp.dev, blob.stamp.ino)

    def _unpin(self, sha256: str) -> None:
        with self._lock:
            self._unpin_locked(sha256)

    def _unpin_locked(self, sha256: str) -> None:
        self._pins[sha256] -= 1
        if self._pins[sha256] <= 0:
            del self._pins[sha256]

    # ---- downloads ----------------------------------------------------------------------------------
    def _client(self) -> httpx.Client:
        return httpx.Client(verify=tls_verify(self._verify), timeout=self._timeout, transport=self._transport)

    def _download(self, url: str, token: str, expected: str | None, params: dict[str, str] | None = None) -> str:
        """Fetch ``url`` into ``<sha256>.part``, resuming after interruptions; check its SHA-256 and move it
        into the cache, pinned. The blob's SHA-256, or ``_Failure``."""
        part: Path | None = self.root / f"{expected}{PART_SUFFIX}" if expected else None
        if part is not None:
            self._writing.add(part.name)
        failures, connected, resumed, fresh_retry = 0, False, False, True
        try:
            with self._client() as client:
                while True:
                    have = part.stat().st_size if part is not None and part.exists() else 0
                    resumed = resumed or have > 0
                    progress = False
                    try:
                        part = self._attempt(client, url, token, params, part, have, expected)
                        connected = True
                    except _Progress as exc:
                        progress, connected, part, error = True, True, exc.part, exc.error
                    except _Restart as exc:
                        connected, error = True, exc
                    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                        if not connected:
                            raise _Failure(self._unreachable(url, exc)) from exc
                        error = exc
                    except httpx.TransportError as exc:
                        connected, error = True, exc
                    else:
                        digest = sha256_file(part)
                        if expected is None or digest == expected:
                            return self._insert(part, digest)
                        part.unlink(missing_ok=True)
                        again = resumed and fresh_retry
                        log.error("%s sent bytes with SHA-256 %s, not %s%s", url, digest, expected, "; fetching it again from zero" if again else "")
                        if again:
                            fresh_retry = resumed = False
                            continue
                        detail = f"the hub sent bytes with SHA-256 {digest}, not {expected}"
                        raise _Failure(problem(502, ErrorCode.INVALID_RESPONSE, "The artefact from the hub does not verify", detail))
                    if expected is None and part is not None and _SHA.match(part.name.removesuffix(PART_SUFFIX)):
                        expected = part.name.removesuffix(PART_SUFFIX)  # named by the hub's ETag
                    failures = 0 if progress else failures + 1
                    if failures >= self._attempts:
                        raise _Failure(self._unreachable(url, error))
                    log.warning("download of %s interrupted (%s); resuming", url, error)
                    if failures:
                        time.sleep(min(2.0, 0.1 * 2**failures))
        finally:
            if part is not None:
                self._writing.discard(part.name)
                if part.name.startswith("tmp-"):  # no ETag, so nothing to resume from later
                    part.unlink(missing_ok=True)

    def _attempt(
        self, client: httpx.Client, url: str, token: str, params: dict[str, str] | None, part: Path | None, have: int, expected: str | None
    ) -> Path:
        """One request; the part file, complete. ``_Progress``: bytes arrived, then the transfer broke; ``_Restart``:
        the part file was dropped, ask again; httpx errors; ``_Failure``: the hub's refusal or other bytes."""
        headers = {DOWNLOAD_TOKEN_HEADER: token, "Accept-Encoding": "identity"}
        if have:
            headers["Range"] = f"bytes={have}-"
            if expected:
                headers["If-Range"] = f'"{expected}"'
        with self._lock:
            self.upstream_requests += 1
        with client.stream("GET", url, headers=headers, params=params) as response:
            if response.status_code == 416 and part is not None and have:
                part.unlink(missing_ok=True)
                raise _Restart(f"the hub refused to resume at byte {have}; starting over")
            if response.status_code not in (200, 206):
                response.read()
                log.info("the hub answered %s for %s", response.status_code, url)
                media_type = response.headers.get("content-type", PROBLEM_MEDIA_TYPE)
                answer_headers = {"Content-Type": media_type, "Content-Length": str(len(response.content))}
                if "retry-after" in response.headers:
                    answer_headers["Retry-After"] = response.headers["retry-after"]
                raise _Failure(Answer(response.status_code, answer_headers, response.content))
            etag = _etag(response.headers.get("etag"))
            if expected is not None and etag is not None and etag != expected:
                detail = f"the hub offers {etag}, the token grants {expected}"
                raise _Failure(problem(502, ErrorCode.INVALID_RESPONSE, "The hub offers another artefact", detail))
            if part is None:  # a delta of unknown digest: the part file is named after the ETag
                part = self.root / f"{etag or 'tmp-' + uuid.uuid4().hex}{PART_SUFFIX}"
                self._writing.add(part.name)
            mode = "wb"
            if response.status_code == 206:
                start = _range_start(response.headers.get("content-range"))
                if start != have:
                    part.unlink(missing_ok=True)
                    raise _Restart(f"asked from byte {have}, the hub sent from {start}; starting over")
                mode = "ab"
            elif have:
                log.info("%s: the hub sent the whole blob instead of resuming at byte %s", url, have)
            wrote = 0
            with part.open(mode) as out:
                try:
                    for chunk in response.iter_bytes():  # as they come: every byte received counts for a resume
                        out.write(chunk)
                        wrote += len(chunk)
                except httpx.TransportError as exc:
                    if wrote:
                        raise _Progress(part, exc) from exc
                    raise
        return part

    def _unreachable(self, url: str, exc: Exception) -> Answer:
        log.warning("the hub is unreachable for %s: %s", url, exc)
        return problem(503, ErrorCode.HUB_UNREACHABLE, "The hub cannot be reached and the artefact is not cached", f"{type(exc).__name__}: {exc}")

    def _insert(self, part: Path, sha256: str) -> str:
        """Move a verified part into the cache, pinned for the caller, then keep the budget."""
        with self._lock:
            target = self.blob_path(sha256)
            part.replace(target)
            self._verified[sha256] = _stamp(target.stat())  # hashed as it arrived: no second read
            self._writing.discard(part.name)
            self._pins[sha256] += 1
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
            busy = path.name in self._writing if path.name.endswith(PART_SUFFIX) else self._pins[path.name] > 0
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

    # ---- prefetch -----------------------------------------------------------------------------------
    def prefetch(self, order: DeploymentOrder) -> Future[None] | None:
        """Fetch an ordered artefact (and its delta) in the background, best effort."""
        if self._closed:
            return None
        try:
            return self._executor.submit(self._prefetch, order)
        except RuntimeError:  # shut down meanwhile
            return None

    def _prefetch(self, order: DeploymentOrder) -> None:
        try:
            self.follow(order.signed_manifest.key_transitions)  # the device's manifest may lead to a new hub key
            grant = self.verify_token(order.token, order.artifact_id)
        except LookupError:
            return
        except VerificationError as exc:
            log.warning("not prefetching %s for execution %s: %s", order.artifact_id, order.execution_id, exc)
            return
        if grant.sha256 != order.signed_manifest.manifest.sha256:
            log.warning("not prefetching %s: the token and the manifest name different blobs", order.artifact_id)
            return
        wanted: list[Callable[[], _Blob]] = []
        if order.delta is not None:
            delta = order.delta
            wanted.append(lambda: self.acquire_delta(order.artifact_id, order.token, delta.base_sha256, grant.sha256, delta.sha256))
        wanted.append(lambda: self.acquire_content(order.artifact_id, order.token, grant.sha256))
        for acquire in wanted:
            if self._closed:
                return
            try:
                acquire().release()
            except _Failure as exc:
                log.info("prefetch of %s for execution %s failed: %s", order.artifact_id, order.execution_id, exc.answer.status)
        log.info("prefetched %s for execution %s", order.artifact_id, order.execution_id)


class _Restart(Exception):
    """The part file was dropped (the hub would not resume where it ended): ask again."""


class _Progress(Exception):
    """Bytes arrived, then the transfer broke: resume."""

    def __init__(self, part: Path, error: Exception) -> None:
        super().__init__(str(error))
        self.part, self.error = part, error


def _etag(value: str | None) -> str | None:
    if not value or value.startswith("W/"):
        return None
    tag = value.strip().strip('"')
    return tag if _SHA.match(tag) else None


def _range_start(value: str | None) -> int | None:
    match = re.match(r"^\s*bytes\s+([0-9]+)-[0-9]+/(?:[0-9]+|\*)\s*$", value or "")
    return int(match.group(1)) if match else None
