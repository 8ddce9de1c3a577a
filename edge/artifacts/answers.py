"""What the edge answers a device's artefact download: the routes, problem documents, and a blob or one byte range
of it (200, 206, 416; ``Accept-Ranges``, ``ETag: "<sha256>"``), sent with ``sendfile`` when the socket allows."""

from __future__ import annotations

import json
import logging
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO, Protocol
from urllib.parse import parse_qs, urlsplit

from device.ota.verify import VerificationError
from interfaces import API_PREFIX
from interfaces.deployments import DELTA_MEDIA_TYPE, DOWNLOAD_TOKEN_HEADER, SHA256_RE, DownloadGrant
from interfaces.errors import ERROR_TYPE_PREFIX, PROBLEM_MEDIA_TYPE, ErrorCode
from interfaces.ranges import RangeNotSatisfiable, parse_byte_range

if TYPE_CHECKING:
    from edge.artifacts.store import Blob

CHUNK = 64 * 1024
ROUTE = re.compile(rf"^{re.escape(API_PREFIX)}/artifacts/([^/]+)/(content|delta)$")
CONTENT_MEDIA_TYPE = "application/octet-stream"
_SHA = re.compile(SHA256_RE)

log = logging.getLogger("aisynergy.edge.artifacts")


@dataclass
class Answer:
    """What the device listener sends back: status, headers and a body (bytes, or a region of a pinned blob)."""

    status: int
    headers: dict[str, str]
    body: bytes = b""
    blob: Blob | None = None
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


class Refused(Exception):
    """A download ended with an answer for the device instead of a blob."""

    def __init__(self, answer: Answer) -> None:
        super().__init__(answer.status)
        self.answer = answer


def serve(blob: Blob, headers: Mapping[str, str], media_type: str) -> Answer:
    """The answer that sends the pinned ``blob``, whole or the one range the request asks for (``headers``: lower-case
    names); the blob is released here when nothing of it is sent."""
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


class Source(Protocol):
    """What :func:`answer` needs of the cache: the token's grant, and the blobs, pinned (``Refused`` else)."""

    def verify_token(self, token: str, artifact_id: str) -> DownloadGrant: ...

    def acquire_content(self, artifact_id: str, token: str, sha256: str) -> Blob: ...

    def acquire_delta(self, artifact_id: str, token: str, base: str, target: str, expected: str | None = None) -> Blob: ...


def handles(path: str) -> bool:
    return ROUTE.match(urlsplit(path).path) is not None


def answer(source: Source, method: str, target: str, headers: Mapping[str, str]) -> Answer:
    """Answer one device request (``target``: path and query) from ``source``. The caller sends the answer, then
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
        grant = source.verify_token(token, artifact_id)
    except LookupError:
        return problem(503, ErrorCode.HUB_UNREACHABLE, "The hub's signing key is not pinned and the hub cannot be reached")
    except VerificationError as exc:
        log.info("refused a download of %s: %s", artifact_id, exc)
        return problem(401, ErrorCode.INVALID_DOWNLOAD_TOKEN, "Invalid download token", str(exc))
    try:
        if route == "content":
            blob = source.acquire_content(artifact_id, token, grant.sha256)
            media_type = CONTENT_MEDIA_TYPE
        else:
            base = parse_qs(split.query).get("from", [""])[0]
            if not _SHA.match(base):
                return problem(422, ErrorCode.VALIDATION_FAILED, "Invalid delta base", "from must be a lower-case hex SHA-256")
            if grant.base_sha256 != base:  # as at the hub: a cached patch from other bytes would reveal them
                log.info("refused a delta to %s from %s: the token names another base", artifact_id, base[:12])
                return problem(403, ErrorCode.FORBIDDEN, "Forbidden", f"the download token allows no delta from {base}")
            blob = source.acquire_delta(artifact_id, token, base, grant.sha256)
            media_type = DELTA_MEDIA_TYPE
    except Refused as exc:
        return exc.answer
    return serve(blob, lower, media_type)
