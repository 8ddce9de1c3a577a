"""Downloads from the hub into the cache: a blob is fetched with the device's token into ``<sha256>.part``, resumed
with ``Range: bytes=<have>-`` after an interruption (a 206 must start there; a 200 starts over), and moved into the
store only when its SHA-256 is the one expected (the grant's; a delta's: the hub's ETag, or the order's offer)."""

from __future__ import annotations

import logging
import re
import ssl
import threading
import time
import uuid
from pathlib import Path

import httpx

from device.ota.verify import sha256_file
from device.tls import tls_verify
from edge.artifacts.answers import Answer, Refused, problem
from edge.artifacts.store import PART_SUFFIX, BlobStore
from interfaces.deployments import DOWNLOAD_TOKEN_HEADER, SHA256_RE
from interfaces.errors import PROBLEM_MEDIA_TYPE, ErrorCode

log = logging.getLogger("aisynergy.edge.artifacts")

_SHA = re.compile(SHA256_RE)


class Downloader:
    """Fetches blobs from the hub into ``store``; ``upstream_requests`` counts the requests sent for them (metrics,
    tests). Thread-safe."""

    def __init__(
        self, store: BlobStore, *, verify: ssl.SSLContext | bool | str = True, timeout_s: float = 30.0, attempts: int = 5,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.store = store
        self.upstream_requests = 0
        self._lock = threading.Lock()
        self._verify = verify
        self._timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0))
        self._attempts = attempts
        self._transport = transport

    def client(self) -> httpx.Client:
        return httpx.Client(verify=tls_verify(self._verify), timeout=self._timeout, transport=self._transport)

    def download(self, url: str, token: str, expected: str | None, params: dict[str, str] | None = None) -> str:
        """Fetch ``url`` into ``<sha256>.part``, resuming after interruptions; check its SHA-256 and move it
        into the cache, pinned. The blob's SHA-256, or ``Refused``."""
        part: Path | None = self.store.root / f"{expected}{PART_SUFFIX}" if expected else None
        if part is not None:
            self.store.writing.add(part.name)
        failures, connected, resumed, fresh_retry = 0, False, False, True
        try:
            with self.client() as client:
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
                            raise Refused(self._unreachable(url, exc)) from exc
                        error = exc
                    except httpx.TransportError as exc:
                        connected, error = True, exc
                    else:
                        digest = sha256_file(part)
                        if expected is None or digest == expected:
                            return self.store.insert(part, digest)
                        part.unlink(missing_ok=True)
                        again = resumed and fresh_retry
                        log.error("%s sent bytes with SHA-256 %s, not %s%s", url, digest, expected, "; fetching it again from zero" if again else "")
                        if again:
                            fresh_retry = resumed = False
                            continue
                        detail = f"the hub sent bytes with SHA-256 {digest}, not {expected}"
                        raise Refused(problem(502, ErrorCode.INVALID_RESPONSE, "The artefact from the hub does not verify", detail))
                    if expected is None and part is not None and _SHA.match(part.name.removesuffix(PART_SUFFIX)):
                        expected = part.name.removesuffix(PART_SUFFIX)  # named by the hub's ETag
                    failures = 0 if progress else failures + 1
                    if failures >= self._attempts:
                        raise Refused(self._unreachable(url, error))
                    log.warning("download of %s interrupted (%s); resuming", url, error)
                    if failures:
                        time.sleep(min(2.0, 0.1 * 2**failures))
        finally:
            if part is not None:
                self.store.writing.discard(part.name)
                if part.name.startswith("tmp-"):  # no ETag, so nothing to resume from later
                    part.unlink(missing_ok=True)

    def _attempt(
        self, client: httpx.Client, url: str, token: str, params: dict[str, str] | None, part: Path | None, have: int, expected: str | None
    ) -> Path:
        """One request; the part file, complete. ``_Progress``: bytes arrived, then the transfer broke; ``_Restart``:
        the part file was dropped, ask again; httpx errors; ``Refused``: the hub's refusal or other bytes."""
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
                raise Refused(Answer(response.status_code, answer_headers, response.content))
            etag = _etag(response.headers.get("etag"))
            if expected is not None and etag is not None and etag != expected:
                detail = f"the hub offers {etag}, the token grants {expected}"
                raise Refused(problem(502, ErrorCode.INVALID_RESPONSE, "The hub offers another artefact", detail))
            if part is None:  # a delta of unknown digest: the part file is named after the ETag
                part = self.store.root / f"{etag or 'tmp-' + uuid.uuid4().hex}{PART_SUFFIX}"
                self.store.writing.add(part.name)
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
