"""Artefacts: /artifacts and /signing-key.pub (DESIGN §4.2).

Uploads are multipart/form-data streamed straight to the blob store (never held whole in memory); downloads
stream from it in chunks and honour single HTTP byte ranges, so an interrupted download resumes where it
stopped. Targets download with the ``X-Download-Token`` of their deployment order; integrators with a token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, Header, Query, Request, Response, status
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials
from pydantic import ValidationError
from python_multipart import MultipartParser
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import parse_options_header
from sqlmodel import Session

from cloud.api.deps import DEFAULT_PAGE, Cursor, ArtifactCaller, IdempotencyKey, Limit, Operator, SessionDep, SettingsDep, Viewer, _bearer, require
from cloud.api import spec
from cloud.api.problems import PROBLEM_RESPONSES, problem_response
from cloud.api.state import hub_state
from cloud.artifacts import (
    CHUNK, DELTA_RETRY_AFTER_S, BlobStore, DeltaBusy, artifact_to_wire, create_artifact, delete_artifact, ensure_absent, get_artifact,
    list_artifacts, offer_delta,
)  # fmt: skip
from cloud.errors import ApiError, Forbidden, MalformedRequest, PayloadTooLarge, Unauthenticated, UnsupportedMediaType, ValidationFailed
from cloud.signing import TokenRejected
from interfaces import API_PREFIX
from interfaces.auth import Role
from interfaces.deployments import (
    DELTA_MEDIA_TYPE, DOWNLOAD_TOKEN_HEADER, SHA256_RE, VERSION_RE, ArtifactCreate, ArtifactFormat, ArtifactKind, ArtifactPublic, DownloadGrant,
    KeyTransitions,
)  # fmt: skip
from interfaces.errors import ErrorCode, Problem
from interfaces.ranges import RangeNotSatisfiable, parse_byte_range
from interfaces.pagination import Page

router = APIRouter(tags=["artifacts"], responses=PROBLEM_RESPONSES)

T = TypeVar("T")
FILE_FIELD = "file"
MAX_FIELD_BYTES = 1024
MAX_PARTS = 16
FORM_OVERHEAD = 64 * 1024
"""Allowance for the multipart framing and the small fields around the file when checking Content-Length."""
_RANGE_RESPONSES: dict[int | str, dict[str, Any]] = {
    206: {"description": "Partial content (a single byte range)"},
    304: {"description": "Not modified (If-None-Match)"},
    416: {"model": Problem, "content": {"application/problem+json": {}}, "description": "Range not satisfiable"},
}






def _with_session(request: Request, fn: Callable[..., T], *args: Any) -> T:
    with Session(hub_state(request).engine, expire_on_commit=False) as session:
        return fn(session, *args)


# --- upload ----------------------------------------------------------------------------------------


class _Form:
    """A streaming multipart/form-data parser: the ``file`` part is handed out in batches (``take``) for the
    blob writer, the other parts (small form fields) are kept in memory."""

    def __init__(self, boundary: bytes, max_file_bytes: int) -> None:
        self.max_file_bytes = max_file_bytes
        self.fields: dict[str, bytearray] = {}
        self.file_seen = False
        self.file_size = 0
        self.ended = False
        self._pending: list[bytes] = []
        self.pending_size = 0
        self._headers: dict[bytes, bytes] = {}
        self._header_field = bytearray()
        self._header_value = bytearray()
        self._current: str | None = None
        self._parser = MultipartParser(boundary, callbacks={  # type: ignore[arg-type]
            "on_part_begin": self._part_begin, "on_header_field": self._on_header_field, "on_header_value": self._on_header_value,
            "on_header_end": self._header_end, "on_headers_finished": self._headers_finished, "on_part_data": self._part_data,
            "on_end": self._end,
        })  # fmt: skip

    def feed(self, chunk: bytes) -> None:
        try:
            self._parser.write(chunk)
        except MultipartParseError as exc:
            raise MalformedRequest(f"the multipart body is malformed: {exc}") from exc

    def finish(self) -> None:
        self._parser.finalize()
        if not self.ended:
            raise MalformedRequest("the multipart body ended before its closing boundary")

    def take(self) -> list[bytes]:
        pending, self._pending, self.pending_size = self._pending, [], 0
        return pending

    def has_all_fields(self) -> bool:
        return all(name in self.fields for name in ArtifactCreate.model_fields)

    def validated(self) -> ArtifactCreate:
        try:
            values = {name: bytes(value).decode("utf-8") for name, value in self.fields.items()}
        except UnicodeDecodeError as exc:
            raise ValidationFailed("form fields must be UTF-8", errors=[{"loc": ["body"], "msg": str(exc), "type": "unicode_decode"}]) from exc
        try:
            body = ArtifactCreate.model_validate(values)
        except ValidationError as exc:
            errors = [{"loc": ["body", *(str(p) for p in e["loc"])], "msg": e["msg"], "type": e["type"]} for e in exc.errors()]
            raise ValidationFailed("the form fields do not match the schema", errors=errors) from exc
        if self.ended and not self.file_seen:
            raise ValidationFailed("the artefact's bytes are missing", errors=[{"loc": ["body", FILE_FIELD], "msg": "Field required", "type": "missing"}])
        return body

    # parser callbacks

    def _part_begin(self) -> None:
        self._headers = {}
        self._current = None

    def _on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_field += data[start:end]

    def _on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def _header_end(self) -> None:
        self._headers[bytes(self._header_field).lower()] = bytes(self._header_value)
        self._header_field, self._header_value = bytearray(), bytearray()

    def _headers_finished(self) -> None:
        disposition, params = parse_options_header(self._headers.get(b"content-disposition", b""))
        if disposition != b"form-data" or b"name" not in params:
            raise MalformedRequest("each part needs Content-Disposition: form-data with a name")
        name = params[b"name"].decode("utf-8", errors="replace")
        if name == FILE_FIELD:
            if self.file_seen:
                raise ValidationFailed("send one file part", errors=[{"loc": ["body", FILE_FIELD], "msg": "more than one file part", "type": "duplicate"}])
            self.file_seen = True
        elif name in self.fields:
            raise ValidationFailed(f"the field {name} appears twice", errors=[{"loc": ["body", name[:64]], "msg": "repeated field", "type": "duplicate"}])
        elif len(self.fields) >= MAX_PARTS:
            raise ValidationFailed("too many form fields", errors=[{"loc": ["body"], "msg": f"at most {MAX_PARTS} fields", "type": "too_long"}])
        else:
            self.fields[name] = bytearray()
        self._current = name

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._current == FILE_FIELD:
            self.file_size += end - start
            if self.file_size > self.max_file_bytes:
                raise PayloadTooLarge(f"artefacts are limited to {self.max_file_bytes} bytes")
            self._pending.append(bytes(data[start:end]))
            self.pending_size += end - start
        elif self._current is not None:
            value = self.fields[self._current]
            value += data[start:end]
            if len(value) > MAX_FIELD_BYTES:
                raise ValidationFailed(f"the field {self._current} is too long", errors=[{"loc": ["body", self._current[:64]], "msg": f"at most {MAX_FIELD_BYTES} bytes", "type": "too_long"}])

    def _end(self) -> None:
        self.ended = True


def _boundary(content_type: str | None) -> bytes:
    media_type, params = parse_options_header(content_type or "")
    if media_type != b"multipart/form-data":
        raise UnsupportedMediaType("send multipart/form-data with the fields file, kind, name, version and format")
    boundary = params.get(b"boundary")
    if not boundary or len(boundary) > 200:
        raise MalformedRequest("the multipart/form-data content type needs a boundary")
    return boundary


def _write_all(writer: Any, chunks: list[bytes]) -> None:
    for chunk in chunks:
        writer.write(chunk)


def _store(request: Request, body: ArtifactCreate, writer: Any) -> ArtifactPublic:
    with Session(hub_state(request).engine, expire_on_commit=False) as session:
        state = hub_state(request)
        row = create_artifact(session, state.signing, state.blobs, body, writer)
        return artifact_to_wire(row)


_UPLOAD_SCHEMA = {
    "type": "object",
    "required": [FILE_FIELD, "kind", "name", "version", "format"],
    "additionalProperties": False,
    "properties": {
        FILE_FIELD: {"type": "string", "format": "binary", "description": "the artefact's bytes"},
        "kind": {"type": "string", "enum": [k.value for k in ArtifactKind]},
        "name": {"type": "string", "minLength": 1, "maxLength": 128, "pattern": r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"},
        "version": {"type": "string", "minLength": 1, "maxLength": 64, "pattern": VERSION_RE},
        "format": {"type": "string", "enum": [f.value for f in ArtifactFormat]},
    },
}
UploadIdempotencyKey = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key", min_length=1, max_length=255, pattern=r"^[\x20-\x7e]+$",
        description="Accepted but not replayed (the upload is streamed, not buffered): a retry of a stored upload is answered 409 artifact_exists with its id",
    ),
]  # fmt: skip


@router.post(
    "/artifacts", status_code=status.HTTP_201_CREATED,
    openapi_extra={"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": _UPLOAD_SCHEMA}}}},
)  # fmt: skip
async def upload_artifact(request: Request, response: Response, settings: SettingsDep, _: Operator, __: UploadIdempotencyKey = None) -> ArtifactPublic:
    """Upload an artefact as multipart/form-data: fields ``kind`` (model|application|firmware), ``name``,
    ``version``, ``format`` and the bytes as ``file``. The hub stores it content-addressed by SHA-256 and signs
    its manifest with its Ed25519 key. 409 ``artifact_exists`` (with ``artifact_id``) when this kind, name and
    version is stored already; 413 above ``max_artifact_bytes``; on any error nothing is stored."""
    boundary = _boundary(request.headers.get("content-type"))
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > settings.max_artifact_bytes + FORM_OVERHEAD:
        raise PayloadTooLarge(f"artefacts are limited to {settings.max_artifact_bytes} bytes")
    blobs = hub_state(request).blobs
    # the writer's temporary file is made and removed in a worker thread (removing gigabytes can take a while)
    writing = blobs.writer()
    writer = await run_in_threadpool(writing.__enter__)
    try:
        form = _Form(boundary, settings.max_artifact_bytes)
        checked = False
        async for chunk in request.stream():
            form.feed(chunk)
            if form.pending_size >= CHUNK:
                await run_in_threadpool(_write_all, writer, form.take())
            if form.file_seen and not checked:
                checked = True
                if form.has_all_fields():  # the fields came first: refuse bad or duplicate ones before the bytes
                    await run_in_threadpool(_with_session, request, ensure_absent, form.validated())
        form.finish()
        await run_in_threadpool(_write_all, writer, form.take())
        public = await run_in_threadpool(_store, request, form.validated(), writer)
    finally:
        await run_in_threadpool(writing.__exit__, None, None, None)
    response.headers["Location"] = f"{API_PREFIX}/artifacts/{public.id}"
    return public


# --- reads -----------------------------------------------------------------------------------------


@router.get("/artifacts")
def list_all_artifacts(
    session: SessionDep, _: Viewer, kind: ArtifactKind | None = None,
    name: Annotated[str | None, Query(min_length=1, max_length=128)] = None, limit: Limit = DEFAULT_PAGE, cursor: Cursor = None,
) -> Page[ArtifactPublic]:  # fmt: skip
    """List artefacts, oldest first, filtered by kind and name."""
    rows, next_cursor = list_artifacts(session, kind, name, limit, cursor)
    return Page[ArtifactPublic](items=[artifact_to_wire(r) for r in rows], next_cursor=next_cursor)


@router.get("/artifacts/{artifact_id}")
def get_one_artifact(artifact_id: str, session: SessionDep, caller: ArtifactCaller) -> ArtifactPublic:
    """Read one artefact with its signed manifest (also with a publish grant, for an artefact it covers)."""
    artifact = get_artifact(session, artifact_id)
    caller.check(artifact.kind, artifact.name, artifact.version)
    return artifact_to_wire(artifact)


_viewer = require(Role.VIEWER)


async def download_access(
    artifact_id: str, request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    token: Annotated[str | None, Header(alias=DOWNLOAD_TOKEN_HEADER, description="a download token from a deployment order (instead of a bearer token)")] = None,
) -> DownloadGrant | None:  # fmt: skip
    """A download token for this artefact, or else a bearer token with at least the viewer role."""
    if token is not None:
        signing = hub_state(request).signing
        try:
            return signing.verify_download_token(token, artifact_id)
        except TokenRejected as exc:
            raise Unauthenticated(str(exc), code=ErrorCode.INVALID_DOWNLOAD_TOKEN) from exc
    await _viewer(request, credentials)
    return None


DownloadAccess = Annotated[DownloadGrant | None, Depends(download_access)]


def _check_grant(grant: DownloadGrant | None, sha256: str) -> None:
    if grant is not None and grant.sha256 != sha256:
        raise Unauthenticated("the download token is for other content", code=ErrorCode.INVALID_DOWNLOAD_TOKEN)


def _chunks(blobs: BlobStore, sha256: str, start: int, length: int) -> Iterator[bytes]:
    with blobs.open(sha256) as f:
        f.seek(start)
        left = length
        while left > 0:
            data = f.read(min(CHUNK, left))
            if not data:
                break
            left -= len(data)
            yield data


def serve_blob(request: Request, blobs: BlobStore, sha256: str, media_type: str, headers: dict[str, str]) -> Response:
    """The blob, or one byte range of it (206), with ``ETag``, ``Accept-Ranges``, ``If-Range`` and ``If-None-Match``."""
    if not blobs.exists(sha256):
        raise ApiError(f"the content {sha256} is missing from the blob store", code=ErrorCode.INTERNAL, status=500)
    size = blobs.size(sha256)
    etag = f'"{sha256}"'
    headers = {**headers, "ETag": etag, "Accept-Ranges": "bytes"}
    if_none_match = request.headers.get("if-none-match")
    if if_none_match is not None and (if_none_match.strip() == "*" or etag in [t.strip() for t in if_none_match.split(",")]):
        return Response(status_code=status.HTTP_304_NOT_MODIFIED, headers=headers)
    wanted = request.headers.get("range")
    if_range = request.headers.get("if-range")
    if wanted is not None and if_range is not None and if_range.strip() != etag:
        wanted = None  # the client holds another version: send it all
    try:
        span = parse_byte_range(wanted, size)
    except RangeNotSatisfiable:
        problem = Problem.of(ErrorCode.RANGE_NOT_SATISFIABLE, 416, "Range not satisfiable", f"the content has {size} bytes", instance=request.url.path)
        return problem_response(problem, {**headers, "Content-Range": f"bytes */{size}"})
    if span is None:
        return StreamingResponse(_chunks(blobs, sha256, 0, size), media_type=media_type, headers={**headers, "Content-Length": str(size)})
    start, end = span
    headers |= {"Content-Range": f"bytes {start}-{end}/{size}", "Content-Length": str(end - start + 1)}
    return StreamingResponse(_chunks(blobs, sha256, start, end - start + 1), status_code=status.HTTP_206_PARTIAL_CONTENT, media_type=media_type, headers=headers)


@router.get("/artifacts/{artifact_id}/content", response_class=Response, responses=_RANGE_RESPONSES | {200: spec.bytes_response("application/octet-stream", "The artefact's bytes")})
def artifact_content(artifact_id: str, request: Request, session: SessionDep, grant: DownloadAccess) -> Response:
    """The artefact's bytes (HTTP Range: one ``bytes=a-b``, ``a-`` or ``-n`` range; several ranges get the whole
    content). Authorised by a viewer bearer token or the ``X-Download-Token`` of a deployment order."""
    row = get_artifact(session, artifact_id)
    _check_grant(grant, row.sha256)
    filename = f"{row.name}-{row.version}.{row.format}"
    return serve_blob(request, hub_state(request).blobs, row.sha256, "application/octet-stream", {"Content-Disposition": f'attachment; filename="{filename}"'})


@router.get("/artifacts/{artifact_id}/delta", response_class=Response, responses=_RANGE_RESPONSES | {
    200: spec.bytes_response(DELTA_MEDIA_TYPE, "A bsdiff4 patch"),
    503: {"model": Problem, "content": {"application/problem+json": {}}, "description": "Busy computing other patches (Retry-After)"},
})
def artifact_delta(
    artifact_id: str, request: Request, session: SessionDep, grant: DownloadAccess,
    base: Annotated[str, Query(alias="from", pattern=SHA256_RE, description="SHA-256 of the version the target runs")],
) -> Response:  # fmt: skip
    """A bsdiff4 patch from the bytes the target runs (``from``) to this artefact; 404 when the base is not stored
    or a patch would not be smaller than the artefact (download the content then). Same authorisation and Range
    support as the content, except that a download token allows only the base its order names (403 otherwise);
    503 with ``Retry-After`` while the hub computes as many patches as it may at once (or download the content).
    ``X-Delta-Base`` and ``X-Delta-Sha256`` name the base and the patch."""
    row = get_artifact(session, artifact_id)
    _check_grant(grant, row.sha256)
    if grant is not None and grant.base_sha256 != base:
        # a patch from other bytes would let the holder rebuild much of those bytes
        raise Forbidden(f"the download token allows no delta from {base}")
    try:
        offer = offer_delta(session, hub_state(request).blobs, base, row, wait=False)
    except DeltaBusy as exc:
        problem = Problem.of(ErrorCode.BUSY, 503, "Busy", f"{exc}: retry later, or download the content", instance=request.url.path)
        return problem_response(problem, {"Retry-After": str(DELTA_RETRY_AFTER_S)})
    session.commit()
    if offer is None:
        raise ApiError(f"no delta from {base} to artifact {artifact_id}: download the content", code=ErrorCode.NOT_FOUND, status=404)
    return serve_blob(request, hub_state(request).blobs, offer.sha256, DELTA_MEDIA_TYPE, {"X-Delta-Base": offer.base_sha256, "X-Delta-Sha256": offer.sha256})


# --- delete ----------------------------------------------------------------------------------------


@router.delete("/artifacts/{artifact_id}", status_code=status.HTTP_204_NO_CONTENT)
def delete_one_artifact(artifact_id: str, request: Request, session: SessionDep, _: Operator, __: IdempotencyKey = None) -> Response:
    """Delete an artefact, and its bytes when no other artefact has the same. Refused (409 ``artifact_in_use``,
    with the ``reason``) while it is in use: a deployment of it is PENDING, RUNNING or PAUSED; an execution of a
    deployment of it is in flight (QUEUED ... INSTALLING), ACTIVE or ROLLING_BACK; or an ACTIVE execution
    recorded it as ``previous`` (it is the version a rollback reinstalls)."""
    delete_artifact(session, hub_state(request).blobs, artifact_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


# --- the signing key -------------------------------------------------------------------------------


@router.get("/signing-key.pub", response_class=Response, tags=["pki"], openapi_extra={"security": []}, responses=spec.pem_response("PEM"))
def signing_key(request: Request) -> Response:
    """The hub's Ed25519 public key (PEM) that signs artefact manifests and download tokens; ``X-Key-Id`` is the
    ``key_id`` of the manifests it signs. Targets pin it at enrolment (``signing_key_pem``)."""
    signing = hub_state(request).signing
    return Response(signing.public_pem, media_type=spec.PEM_MEDIA_TYPE, headers={"X-Key-Id": signing.key_id})


@router.get("/signing-key/transitions", response_model=KeyTransitions, tags=["pki"], openapi_extra={"security": []})
def signing_key_transitions(request: Request) -> KeyTransitions:
    """Every hand-over of the signing key the hub keeps, oldest first, each signed by the key it retires
    (``aisynergy hub rotate signing-key``): a target that pins an older key checks them from that key on and
    pins the current one. Public: they prove themselves."""
    signing = hub_state(request).signing
    return KeyTransitions(current_key_id=signing.key_id, transitions=list(signing.transitions))
