"""The devices' way to the hub's chunked upload API: a device that trains (a ``training`` worker on it) publishes its
model through the edge it enrolled through, as it downloads through it (:mod:`edge.artifacts`).

The edge's device server forwards these requests, unchanged, to the hub's routes of the same path
(:mod:`interfaces.uploads`):

    POST   /api/v1/artifacts/uploads                           a session
    GET    /api/v1/artifacts/uploads/{id}                      what the hub holds (to resume)
    DELETE /api/v1/artifacts/uploads/{id}
    PUT    /api/v1/artifacts/uploads/{id}/chunks/{index}       a chunk: its bytes streamed through, never held whole
    POST   /api/v1/artifacts/uploads/{id}/commit

and only with a publish grant as the credential (``Authorization: Bearer aisynergy-publish.…``): the hub checks it
(its signature, its expiry, the task's worker, the names and version it allows) and answers; anything else is 401
here and never reaches the hub, so a device on the LAN cannot use the edge to reach the hub's API. The hub's answers
pass through (status, body, ``Location``); an unreachable hub is 503 ``hub_unreachable``, which the device's client
retries (:mod:`device.upload`). Bodies are bounded: a chunk by :data:`MAX_CHUNK_BYTES`, the others by 64 KiB.
"""

from __future__ import annotations

import json
import logging
import re
import ssl
import threading
from collections.abc import Iterator
from typing import Protocol

import httpx

from device.tls import tls_verify
from interfaces import API_PREFIX
from interfaces.errors import ERROR_TYPE_PREFIX, PROBLEM_MEDIA_TYPE, ErrorCode
from interfaces.uploads import PUBLISH_TOKEN_PREFIX

log = logging.getLogger("aisynergy.edge.uploads")

MAX_CHUNK_BYTES = 256 * 1024 * 1024
"""The largest chunk forwarded (the hub's ``upload_chunk_bytes`` is at most this)."""
MAX_BODY_BYTES = 64 * 1024
PIECE = 1024 * 1024
HUB_UNREACHABLE = "hub_unreachable"
_FORWARDED = ("authorization", "content-type", "content-length", "x-chunk-sha256", "idempotency-key")
_ROUTES: list[tuple[re.Pattern[str], frozenset[str]]] = [
    (re.compile(rf"^{re.escape(API_PREFIX)}/artifacts/uploads$"), frozenset({"POST"})),
    (re.compile(rf"^{re.escape(API_PREFIX)}/artifacts/uploads/[A-Za-z0-9_-]{{1,64}}$"), frozenset({"GET", "DELETE"})),
    (re.compile(rf"^{re.escape(API_PREFIX)}/artifacts/uploads/[A-Za-z0-9_-]{{1,64}}/chunks/(0|[1-9][0-9]{{0,9}})$"), frozenset({"PUT"})),
    (re.compile(rf"^{re.escape(API_PREFIX)}/artifacts/uploads/[A-Za-z0-9_-]{{1,64}}/commit$"), frozenset({"POST"})),
]


class Readable(Protocol):
    """The device's request body (the handler's ``rfile``)."""

    def read(self, size: int, /) -> bytes: ...


class RelayAnswer:
    """What the device is answered: ``close`` when the connection cannot carry another request (a body not read)."""

    def __init__(self, status: int, body: bytes, content_type: str, location: str | None = None, close: bool = False) -> None:
        self.status, self.body, self.content_type, self.location, self.close = status, body, content_type, location, close


def _problem(status: int, code: str, title: str, detail: str, close: bool = False) -> RelayAnswer:
    """An RFC 9457 problem document, as the hub and the rest of the edge's listener answer them."""
    document = {"type": ERROR_TYPE_PREFIX + code, "title": title, "status": status, "code": code, "detail": detail}
    return RelayAnswer(status, json.dumps(document).encode(), PROBLEM_MEDIA_TYPE, close=close)


class _BodyEnded(Exception):
    pass


class UploadRelay:
    """Forwards the upload routes above to ``hub_url`` (checked with ``verify``). Thread-safe: one connection pool."""

    def __init__(self, hub_url: str, verify: ssl.SSLContext | str | bool = True, timeout_s: float = 120.0) -> None:
        self.hub_url = hub_url.rstrip("/")
        self._client = httpx.Client(verify=tls_verify(verify), timeout=httpx.Timeout(timeout_s, connect=10.0))
        self.forwarded = 0  # requests sent on to the hub (metrics, tests)
        self._count = threading.Lock()

    def close(self) -> None:
        self._client.close()

    @staticmethod
    def handles(path: str) -> bool:
        return any(pattern.match(path) for pattern, _ in _ROUTES)

    def forward(self, method: str, path: str, headers: dict[str, str], body: Readable) -> RelayAnswer:
        """Answer one device request for ``path`` (no query: none of these routes takes one); ``headers`` lower-case."""
        allowed = next(methods for pattern, methods in _ROUTES if pattern.match(path))
        if method not in allowed:
            return _problem(405, ErrorCode.METHOD_NOT_ALLOWED.value, "Method not allowed", f"{method} {path}: use {', '.join(sorted(allowed))}", close=True)
        credential = headers.get("authorization", "")
        scheme, _, token = credential.partition(" ")
        if scheme.lower() != "bearer" or not token.startswith(PUBLISH_TOKEN_PREFIX):
            return _problem(401, ErrorCode.UNAUTHENTICATED.value, "Unauthenticated",
                            "the edge relays uploads with a training task's publish grant only", close=True)  # fmt: skip
        length = headers.get("content-length")
        has_body = method in ("POST", "PUT")
        if has_body and (length is None or not length.isdigit()):
            return _problem(411, ErrorCode.MALFORMED_REQUEST.value, "Content-Length required", f"{method} {path} needs a Content-Length", close=True)
        if not has_body and length not in (None, "0"):  # a body nobody reads: the connection cannot carry another request
            return _problem(400, ErrorCode.MALFORMED_REQUEST.value, "Unexpected body", f"{method} {path} takes no body", close=True)
        size = int(length) if has_body and length is not None else 0
        limit = MAX_CHUNK_BYTES if method == "PUT" else MAX_BODY_BYTES
        if size > limit:
            return _problem(413, ErrorCode.PAYLOAD_TOO_LARGE.value, "Request body too large", f"{size} bytes is more than {limit}", close=True)
        forwarded = {name: headers[name] for name in _FORWARDED if name in headers}
        content: bytes | Iterator[bytes] | None = None
        if method == "PUT":
            content = _pieces(body, size)
        elif has_body:
            content = body.read(size)
            if len(content) != size:
                return _problem(400, ErrorCode.MALFORMED_REQUEST.value, "Body ended early", f"{len(content)} of {size} bytes", close=True)
        try:
            response = self._client.request(method, self.hub_url + path, content=content, headers=forwarded)
        except _BodyEnded as exc:
            return _problem(400, ErrorCode.MALFORMED_REQUEST.value, "Body ended early", str(exc), close=True)
        except httpx.TransportError as exc:
            log.warning("the hub is unreachable for %s %s: %s", method, path, exc)
            return _problem(503, HUB_UNREACHABLE, "The hub cannot be reached", f"{type(exc).__name__}: {exc}", close=method == "PUT")
        with self._count:
            self.forwarded += 1
        if path.endswith("/commit"):
            log.info("relayed the commit of upload %s to the hub: %s", path.split("/")[-2], response.status_code)
        return RelayAnswer(response.status_code, response.content, response.headers.get("content-type", "application/json"),
                           location=response.headers.get("location"))  # fmt: skip


def _pieces(body: Readable, size: int) -> Iterator[bytes]:
    """The chunk's ``size`` bytes from the device's connection, a piece at a time."""
    left = size
    while left:
        piece = body.read(min(PIECE, left))
        if not piece:
            raise _BodyEnded(f"the chunk ended after {size - left} of {size} bytes")
        left -= len(piece)
        yield piece
