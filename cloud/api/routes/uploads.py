"""Chunked, resumable artefact uploads: /artifacts/uploads (the protocol in :mod:`interfaces.uploads`).

For artefacts too large for one unbroken ``POST /artifacts``: create a session, PUT its chunks (raw bytes with
``X-Chunk-SHA256``; each streamed to disk, never held whole), GET the session to resume, commit (with the whole
SHA-256 when the session was started without it). Operators and
admins, as for ``POST /artifacts``; and a ``training`` task's worker with its publish grant, for the model artefacts
the grant names (``interfaces.uploads.PublishClaims``).
"""

from __future__ import annotations

import asyncio
import re
from typing import Annotated

from fastapi import APIRouter, Header, Path, Request, Response, status
from fastapi.concurrency import run_in_threadpool
from sqlmodel import Session

from cloud.api.deps import IdempotencyKey, Publisher, SessionDep, SettingsDep, UploadCaller, read_one
from cloud.api.problems import PROBLEM_RESPONSES
from cloud.api.state import hub_state
from cloud.artifacts import CHUNK, artifact_to_wire
from cloud.artifacts.uploads import (
    ChunkStaging, UploadArea, abort_upload, commit_upload, create_upload, expected_length, get_upload, upload_to_wire,
)  # fmt: skip
from cloud.errors import UnsupportedMediaType, ValidationFailed
from cloud.tables import ArtifactUpload
from interfaces import API_PREFIX
from interfaces.deployments import SHA256_RE, ArtifactPublic
from interfaces.strict import INT64_MAX
from interfaces.uploads import CHUNK_MEDIA_TYPE, CHUNK_SHA256_HEADER, UploadCommit, UploadCreate, UploadSession

router = APIRouter(tags=["artifacts"], responses=PROBLEM_RESPONSES)

UPLOADS_DIR = "uploads"
"""The chunks' directory under the hub's data dir, beside the blob store (``artifacts``)."""
STREAMED_CHUNKS = re.compile("^" + re.escape(API_PREFIX) + r"/artifacts/uploads/[^/]+/chunks/[^/]+$")
"""The chunk PUTs whose bodies the request guard passes on unread (the route streams and bounds them itself)."""

WRITE_BATCH = 4 * CHUNK
"""Bytes of a chunk gathered before they are written and hashed (in a worker thread, while the next ones arrive)."""

UploadId = Annotated[str, Path(min_length=1, max_length=64)]
ChunkIndex = Annotated[int, Path(ge=0, le=INT64_MAX, description="0-based; every chunk has chunk_size bytes but the last")]
ChunkSha256 = Annotated[str, Header(alias=CHUNK_SHA256_HEADER, pattern=SHA256_RE, description="SHA-256 of the chunk's bytes, lower-case hex")]


def upload_area(request: Request) -> UploadArea:
    return UploadArea(hub_state(request).settings.data_dir / UPLOADS_DIR)


@router.post("/artifacts/uploads", status_code=status.HTTP_201_CREATED)
def start_upload(body: UploadCreate, request: Request, response: Response, session: SessionDep, settings: SettingsDep, caller: UploadCaller, __: IdempotencyKey = None) -> UploadSession:
    """Start a chunked upload of an artefact (its kind, name, version, format, size and SHA-256): the session says
    the chunk size and how many chunks to PUT. 409 ``artifact_exists`` when this kind, name and version is stored;
    422 for a ``size`` above ``max_artifact_bytes``."""
    caller.check(body.kind.value, body.name, body.version)
    area = upload_area(request)
    row = create_upload(session, area, body, settings.upload_chunk_bytes, settings.upload_ttl_s, settings.max_artifact_bytes)
    response.headers["Location"] = f"{API_PREFIX}/artifacts/uploads/{row.id}"
    return upload_to_wire(row, area)


@router.get("/artifacts/uploads/{upload_id}")
def read_upload(upload_id: UploadId, request: Request, session: SessionDep, caller: UploadCaller) -> UploadSession:
    """An upload session with the chunks the hub holds (what a client resumes from)."""
    area = upload_area(request)
    return upload_to_wire(_own_upload(session, area, upload_id, caller), area)


def _own_upload(session: Session, area: UploadArea, upload_id: str, caller: Publisher) -> ArtifactUpload:
    row = get_upload(session, area, upload_id)
    caller.check(row.kind, row.name, row.version)
    return row


def _open_chunk(session: Session, area: UploadArea, upload_id: str, index: int, sha256: str, declared: str | None, caller: Publisher) -> ChunkStaging:
    row = _own_upload(session, area, upload_id, caller)
    length = expected_length(row, index)
    if declared is not None and declared.isdigit() and int(declared) != length:
        raise ValidationFailed(
            f"chunk {index} of upload {upload_id} has exactly {length} bytes; Content-Length says {declared}",
            errors=[{"loc": ["header", "content-length"], "msg": f"exactly {length}", "type": "chunk_length"}],
        )  # fmt: skip
    return ChunkStaging(area, upload_id, index, length, sha256, row.chunk_size, row.size)


@router.put(
    "/artifacts/uploads/{upload_id}/chunks/{index}", status_code=status.HTTP_204_NO_CONTENT, response_class=Response,
    openapi_extra={"requestBody": {"required": True, "content": {CHUNK_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}}}},
)  # fmt: skip
async def put_chunk(upload_id: UploadId, index: ChunkIndex, sha256: ChunkSha256, request: Request, caller: UploadCaller) -> Response:
    """Send one chunk's bytes (``application/octet-stream``) with its SHA-256 in ``X-Chunk-SHA256``. 204 when
    stored, and again for a retry with the same SHA-256; 409 when the hub holds the chunk with another one; 422
    for a length other than the chunk's or bytes that do not match the header (nothing is kept)."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != CHUNK_MEDIA_TYPE:
        raise UnsupportedMediaType(f"send the chunk's bytes as {CHUNK_MEDIA_TYPE}")
    area = upload_area(request)
    staging = await run_in_threadpool(read_one, request, lambda s, i: _open_chunk(s, area, i, index, sha256, request.headers.get("content-length"), caller), upload_id)
    writing: asyncio.Future[None] | None = None  # the batch being written while the next one is received
    try:
        pending: list[bytes] = []
        size = 0
        async for data in request.stream():
            pending.append(data)
            size += len(data)
            if size >= WRITE_BATCH:
                if writing is not None:
                    await writing
                writing = asyncio.ensure_future(run_in_threadpool(staging.write_all, pending))
                pending, size = [], 0
        if writing is not None:
            await writing
        writing = None
        await run_in_threadpool(staging.write_all, pending)
        await run_in_threadpool(staging.finish)
    finally:
        if writing is not None:  # the request ended mid-way: the batch in flight ends before the file is closed
            await asyncio.wait([writing])
        await run_in_threadpool(staging.discard)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.post("/artifacts/uploads/{upload_id}/commit", status_code=status.HTTP_201_CREATED)
def commit(upload_id: UploadId, request: Request, response: Response, session: SessionDep, caller: UploadCaller, body: UploadCommit | None = None, __: IdempotencyKey = None) -> ArtifactPublic:
    """Join the chunks, check the SHA-256 declared at the start (or in this body, when the session was started
    without one), and store and sign the artefact as ``POST /artifacts`` does; the session ends. 422 when chunks are
    missing or no SHA-256 was declared, or when the joined bytes have another SHA-256 (the session stays, without its
    chunks: send them again); 409 ``artifact_exists`` when the artefact was stored meanwhile."""
    _own_upload(session, upload_area(request), upload_id, caller)
    state = hub_state(request)
    declared = body.sha256 if body is not None else None
    artifact = artifact_to_wire(commit_upload(session, state.signing, state.blobs, upload_area(request), upload_id, declared))
    response.headers["Location"] = f"{API_PREFIX}/artifacts/{artifact.id}"
    return artifact


@router.delete("/artifacts/uploads/{upload_id}", status_code=status.HTTP_204_NO_CONTENT, response_class=Response)
def abort(upload_id: UploadId, request: Request, session: SessionDep, caller: UploadCaller, __: IdempotencyKey = None) -> Response:
    """Abort an upload: the session and its chunks are removed."""
    _own_upload(session, upload_area(request), upload_id, caller)
    abort_upload(session, upload_area(request), upload_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
