"""ASGI middleware: request size limit, JSON content type, and ``Idempotency-Key`` replay.

A write (POST, PUT, PATCH, DELETE) that carries ``Idempotency-Key`` is run once per (caller, key):
a retry with the same request gets the stored response (``Idempotent-Replayed: true``); the same key
with a different request is refused (422 ``idempotency_key_reused``); a retry while the first is
still running gets 409 ``idempotency_in_progress``. Server errors are not stored, so they can be retried.

The key is looked at only once an existing route has let the caller in: it is claimed by a dependency of the
route (``cloud.api.deps.IdempotencyKey``) after the route's role check, so a path or method the API does not
have (404, 405), a missing or unknown token (401) and a role that may not do this (403) are answered as if no
key had been sent, nothing is recorded and the key stays free. The caller is the bearer token the hub
verifies at that moment (its id and role), not the header's text: a revoked token gets no replay (the route
answers 401). Callers of routes open to anyone (enrolment) share one scope per path, so another body under the
same key is 422 there. An answer that carries a secret (any
``token``, ``*_token`` or ``*secret`` field: bootstrap and download tokens) is kept only as its SHA-256; its
replay is 409 ``idempotency_not_replayable`` (the secret was issued once; issue a new one).

Multipart uploads to a ``streamed_uploads`` path (POST /artifacts) pass through unbuffered: the route streams
them to disk under its own size limit. They are not replayed by ``Idempotency-Key`` (their bodies are never
held to compare); the route answers a repeated upload with 409 ``artifact_exists`` instead.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Collection
from datetime import UTC, datetime

import anyio
from sqlalchemy import delete, select
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cloud.api.problems import simple_problem
from cloud.errors import Conflict, ValidationFailed
from cloud.tables import IdempotencyRecord
from interfaces.errors import ErrorCode

WRITE_METHODS = {"POST", "PUT", "PATCH", "DELETE"}
_KEY_RE = re.compile(r"^[\x20-\x7e]{1,255}$")  # as documented on the Idempotency-Key header
_NOT_REPLAYED = {b"content-length", b"date", b"server", b"transfer-encoding", b"connection"}
JSON_TYPES = ("application/json", "application/merge-patch+json")
FORM_TYPES = ("multipart/form-data",)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key == name:
            return value.decode("latin-1")
    return None


def _media_type(scope: Scope) -> str:
    return (_header(scope, b"content-type") or "").split(";")[0].strip().lower()


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole body, or None once it passes ``limit`` bytes."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _is_secret_name(name: str) -> bool:
    name = name.lower()
    return name in ("token", "secret") or name.endswith(("_token", "_secret", "-token"))


def _holds_secret(value: object) -> bool:
    if isinstance(value, dict):
        return any((_is_secret_name(str(k)) and isinstance(v, str) and v != "") or _holds_secret(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_holds_secret(v) for v in value)
    return False


def carries_secret(body: bytes, headers: list[list[str]]) -> bool:
    """Whether an answer hands out a secret (a bootstrap token, a download token, ...) that must not be kept."""
    if any(_is_secret_name(name) for name, _value in headers):
        return True
    try:
        return _holds_secret(json.loads(body))
    except ValueError:  # not JSON (an empty 204, a file): nothing named to look for
        return False


def _replay(body: bytes) -> Receive:
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if sent:
            await anyio.sleep_forever()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive


class SecurityHeaders:
    """``X-Content-Type-Options: nosniff`` on every response, and ``Cache-Control: no-store`` on every one that
    does not say otherwise and carries no ``ETag`` (an artefact's bytes may be cached by their tag; an answer with
    a bootstrap token, a download token or anyone's data may not be kept by any cache on the way)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                names = {name.lower() for name, _value in headers}
                headers.append((b"x-content-type-options", b"nosniff"))
                if b"cache-control" not in names and b"etag" not in names:
                    headers.append((b"cache-control", b"no-store"))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, with_headers)


class RequestGuard:
    def __init__(
        self, app: ASGIApp, engine: Callable[[], Engine], max_body_bytes: int, streamed_uploads: Collection[str] = (),
        streamed_chunks: re.Pattern[str] | None = None,
    ) -> None:  # fmt: skip
        self.app = app
        self.engine = engine
        self.max_body_bytes = max_body_bytes
        self.streamed_uploads = frozenset(streamed_uploads)
        self.streamed_chunks = streamed_chunks  # paths whose octet-stream bodies the route streams (and bounds) itself (other methods: 405)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in WRITE_METHODS:
            await self.app(scope, receive, send)
            return
        if scope["method"] == "POST" and scope["path"] in self.streamed_uploads and _media_type(scope) in FORM_TYPES:
            await self.app(scope, receive, send)
            return
        if (
            self.streamed_chunks is not None and self.streamed_chunks.match(scope["path"])
            and _media_type(scope) == "application/octet-stream"
        ):  # fmt: skip
            await self.app(scope, receive, send)
            return
        length = _header(scope, b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            await simple_problem(ErrorCode.PAYLOAD_TOO_LARGE, 413, "Payload too large", f"bodies are limited to {self.max_body_bytes} bytes", scope.get("path"))(scope, receive, send)
            return
        body = await _read_body(receive, self.max_body_bytes)
        if body is None:
            await simple_problem(ErrorCode.PAYLOAD_TOO_LARGE, 413, "Payload too large", f"bodies are limited to {self.max_body_bytes} bytes", scope.get("path"))(scope, receive, send)
            return
        ctype = (_header(scope, b"content-type") or "").split(";")[0].strip().lower()
        if body and not (ctype in JSON_TYPES or ctype.endswith("+json") or ctype in FORM_TYPES):
            await simple_problem(ErrorCode.UNSUPPORTED_MEDIA_TYPE, 415, "Unsupported media type", "send application/json", scope.get("path"))(scope, receive, send)
            return
        key = _header(scope, b"idempotency-key")
        if key is None or not _KEY_RE.match(key):  # a malformed key is refused by the route's header validation
            await self.app(scope, _replay(body), send)
            return
        await self._idempotent(scope, body, key, send)

    async def _idempotent(self, scope: Scope, body: bytes, key: str, send: Send) -> None:
        fingerprint = hashlib.sha256(
            b"\0".join([scope["method"].encode(), scope["path"].encode(), scope.get("query_string", b""), body])
        ).hexdigest()
        slot = IdempotencySlot(self, key, fingerprint)
        scope = {**scope, SLOT_KEY: slot}
        captured: dict[str, object] = {"status": 500, "headers": [], "body": []}

        async def capture(message: Message) -> None:
            if message["type"] == "http.response.start":
                captured["status"] = message["status"]
                captured["headers"] = [
                    [k.decode("latin-1"), v.decode("latin-1")] for k, v in message.get("headers", []) if k.lower() not in _NOT_REPLAYED
                ]
            elif message["type"] == "http.response.body":
                captured["body"].append(message.get("body", b""))  # type: ignore[union-attr]
            await send(message)

        try:
            await self.app(scope, _replay(body), capture)
        finally:
            if slot.principal is not None:  # the route claimed the key for its caller: keep (or free) it
                status = int(captured["status"])  # type: ignore[call-overload]
                raw = b"".join(captured["body"])  # type: ignore[arg-type]
                await anyio.to_thread.run_sync(self._complete, slot.principal, key, status, captured["headers"], raw)

    def _claim(self, principal: str, key: str, fingerprint: str) -> IdempotencyRecord | None:
        """None: claimed for this request; a record: the stored answer to replay; raises when the key is taken."""
        with Session(self.engine()) as session:
            row = session.exec(select(IdempotencyRecord).where(IdempotencyRecord.principal == principal, IdempotencyRecord.key == key)).scalars().first()  # type: ignore[call-overload]
            if row is None:
                session.add(IdempotencyRecord(principal=principal, key=key, request_hash=fingerprint, created_at=datetime.now(UTC)))
                try:
                    session.commit()
                    return None
                except IntegrityError:
                    session.rollback()
                    raise Conflict("a request with this Idempotency-Key is still running", code=ErrorCode.IDEMPOTENCY_IN_PROGRESS) from None
            if row.request_hash != fingerprint:
                raise ValidationFailed("this Idempotency-Key was used for a different request", code=ErrorCode.IDEMPOTENCY_KEY_REUSED)
            if row.status_code is None:
                raise Conflict("a request with this Idempotency-Key is still running", code=ErrorCode.IDEMPOTENCY_IN_PROGRESS)
            if row.response_sha256 is not None:
                raise Conflict(
                    f"the first request under this Idempotency-Key was answered (HTTP {row.status_code}) with a secret the hub does not keep: "
                    "the token was issued; issue a new one", code=ErrorCode.IDEMPOTENCY_NOT_REPLAYABLE,
                )  # fmt: skip
            return row

    def _complete(self, principal: str, key: str, status: int, headers: object, body: bytes) -> None:
        with Session(self.engine()) as session:
            row = session.exec(select(IdempotencyRecord).where(IdempotencyRecord.principal == principal, IdempotencyRecord.key == key)).scalars().first()  # type: ignore[call-overload]
            if row is None:
                return
            if status >= 500 or status in (401, 403):
                # not stored: a server error can be retried, and a refused caller writes nothing
                session.delete(row)
            else:
                row.status_code = status
                if carries_secret(body, headers):  # type: ignore[arg-type]
                    # kept as a hash only: the secret is never written down in clear, and never handed out twice
                    row.response_sha256 = hashlib.sha256(body).hexdigest()
                else:
                    row.response_headers = headers  # type: ignore[assignment]
                    row.response_body = body.decode("utf-8", errors="replace")
                session.add(row)
            session.commit()


SLOT_KEY = "aisynergy.idempotency"


class IdempotentReplay(Exception):
    """Raised by the route's key dependency: answer with the stored response of the first request."""

    def __init__(self, record: IdempotencyRecord) -> None:
        super().__init__(record.key)
        self.record = record


def replay_response(_request: object, exc: Exception) -> Response:
    record = exc.record  # type: ignore[attr-defined]
    headers = {k: v for k, v in record.response_headers or [] if k.lower() != "content-length"}
    response = Response((record.response_body or "").encode(), status_code=record.status_code, headers=headers)
    response.headers["Idempotent-Replayed"] = "true"
    return response


class IdempotencySlot:
    """One request's Idempotency-Key, claimed by the route once it has let the caller in."""

    def __init__(self, guard: RequestGuard, key: str, fingerprint: str) -> None:
        self.guard, self.key, self.fingerprint = guard, key, fingerprint
        self.principal: str | None = None

    async def claim(self, caller: str) -> None:
        """Claim the key for ``caller`` (a verified token, or everyone on an open route); raises
        ``IdempotentReplay`` with the first answer, or an ``ApiError`` when the key is taken."""
        principal = hashlib.sha256(caller.encode()).hexdigest()
        record = await anyio.to_thread.run_sync(self.guard._claim, principal, self.key, self.fingerprint)
        if record is not None:
            raise IdempotentReplay(record)
        self.principal = principal


def purge_idempotency(engine: Engine, ttl_s: int) -> int:
    cutoff = datetime.fromtimestamp(datetime.now(UTC).timestamp() - ttl_s, UTC)
    with Session(engine) as session:
        result = session.execute(delete(IdempotencyRecord).where(IdempotencyRecord.created_at < cutoff))
        session.commit()
        return result.rowcount  # type: ignore[attr-defined,no-any-return]




class ConditionalGet:
    """Entity tags on the API's JSON reads, so a client that polls (the console) costs a request and a hash, not a
    transfer: a ``GET`` under ``/api/v1`` answered 200 with a JSON body of at most :attr:`MAX_BYTES` gets ``ETag``
    (a weak tag of the body's SHA-256) and keeps ``Cache-Control: no-store`` (no cache on the way keeps anyone's
    data; the client keeps the body itself); a request whose ``If-None-Match`` names that tag is answered 304 with
    no body. Streams (Server-Sent Events, artefact bytes) and answers that carry their own tag pass through as they are."""

    MAX_BYTES = 4 << 20

    def __init__(self, app: ASGIApp, prefix: str) -> None:
        self.app = app
        self.prefix = prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "GET" or not scope["path"].startswith(self.prefix):
            await self.app(scope, receive, send)
            return
        request_headers = {name.lower(): value for name, value in scope.get("headers", [])}
        if b"text/event-stream" in request_headers.get(b"accept", b""):
            await self.app(scope, receive, send)
            return
        wanted = {tag.strip() for tag in request_headers.get(b"if-none-match", b"").split(b",") if tag.strip()}
        start: Message | None = None
        body = bytearray()
        passing = False

        async def buffered(message: Message) -> None:
            nonlocal start, passing
            if passing:
                await send(message)
                return
            if message["type"] == "http.response.start":
                named = {name.lower(): value for name, value in message.get("headers", [])}
                if message["status"] != 200 or b"etag" in named or not named.get(b"content-type", b"").startswith(b"application/json"):
                    passing = True
                    await send(message)
                    return
                start = message
                return
            body.extend(message.get("body", b""))
            if message.get("more_body", False):
                if len(body) > self.MAX_BYTES:  # too large to tag: send what there is and the rest as it comes
                    passing = True
                    assert start is not None
                    await send(start)
                    await send({"type": "http.response.body", "body": bytes(body), "more_body": True})
                return
            assert start is not None
            tag = b'W/"' + hashlib.sha256(bytes(body)).hexdigest()[:32].encode() + b'"'
            headers = [(n, v) for n, v in start.get("headers", []) if n.lower() not in (b"content-length", b"cache-control")]
            headers += [(b"etag", tag), (b"cache-control", b"no-store")]
            if tag in wanted or b"*" in wanted:
                kept = [(n, v) for n, v in headers if n.lower() != b"content-type"]
                await send({"type": "http.response.start", "status": 304, "headers": kept})
                await send({"type": "http.response.body", "body": b""})
                return
            await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": bytes(body)})

        await self.app(scope, receive, buffered)
