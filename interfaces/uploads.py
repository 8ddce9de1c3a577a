"""Resumable, chunked uploads of large artefacts (``/artifacts/uploads``, DESIGN §4.2).

A client declares the artefact (kind, name, version, format, its size and SHA-256) and gets an upload session: the
hub's chunk size, the number of chunks and the chunks it holds. It then PUTs each chunk's raw bytes
(``application/octet-stream``) with the chunk's SHA-256 in :data:`CHUNK_SHA256_HEADER` (lower-case hex), in any
order and as often as it must: a chunk the hub holds with the same SHA-256 is answered 204 again, with another
409. Every chunk is ``chunk_size`` bytes but the last, which holds the rest. Once all are in, a commit joins them,
checks the whole SHA-256 and stores and signs the artefact as ``POST /artifacts`` does. The whole SHA-256 is declared
when the session starts or, so that a client hashes the file while it sends it, in the commit (:class:`UploadCommit`). A session lasts until
``expires_at``; its chunks outlive a restart of the hub, so a client resumes from ``received`` (GET the session).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from interfaces.deployments import ArtifactFormat, ArtifactKind, ArtifactName, Sha256, Version, b64url, unb64url
from interfaces.strict import BY_VALUE, INT64_MAX
from interfaces.text import NoNul

CHUNK_SHA256_HEADER = "X-Chunk-SHA256"
"""The header of a chunk PUT that holds the SHA-256 of its bytes (64 lower-case hex digits)."""
CHUNK_MEDIA_TYPE = "application/octet-stream"
MAX_CHUNKS = 1 << 20
"""No session has more chunks than this (with the hub's chunk size and artefact limit it has far fewer)."""


def chunk_count(size: int, chunk_size: int) -> int:
    """How many chunks ``size`` bytes make (the last one may be shorter)."""
    return -(-size // chunk_size)


def chunk_length(size: int, chunk_size: int, index: int) -> int:
    """The exact length of chunk ``index`` (0-based) of ``size`` bytes."""
    return min(chunk_size, size - index * chunk_size)


class UploadCreate(NoNul):
    """The body of ``POST /artifacts/uploads``: the artefact's identity as ``POST /artifacts`` takes it, plus the
    size and SHA-256 of its bytes. Strict: no field is coerced from another type."""

    model_config = ConfigDict(extra="forbid", strict=True)

    kind: Annotated[ArtifactKind, BY_VALUE]
    name: ArtifactName
    version: Version
    format: Annotated[ArtifactFormat, BY_VALUE]
    size: int = Field(ge=1, le=INT64_MAX, description="bytes of the whole artefact (at most the hub's max_artifact_bytes)")
    sha256: Sha256 | None = Field(default=None, description="SHA-256 of the whole artefact, checked at commit; or declare it in the commit (a client then hashes the file while it sends it)")


class UploadSession(BaseModel):
    """An upload in progress: what a client resumes from."""

    id: str
    kind: ArtifactKind
    name: str
    version: str
    format: ArtifactFormat
    size: int = Field(ge=1, le=INT64_MAX)
    sha256: str | None = Field(description="as declared at the start; null when the commit declares it")
    chunk_size: int = Field(ge=1, le=INT64_MAX, description="bytes of every chunk but the last")
    chunk_count: int = Field(ge=1, le=MAX_CHUNKS)
    received: list[int] = Field(max_length=MAX_CHUNKS, description="indexes (0-based, ascending) of the chunks the hub holds")
    created_at: datetime
    expires_at: datetime = Field(description="after this the session and its chunks are removed")


class UploadCommit(NoNul):
    """The body of ``POST /artifacts/uploads/{id}/commit`` (optional): the whole artefact's SHA-256, when the session
    was started without it (when it was, the same one or none)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    sha256: Sha256 | None = Field(default=None, description="SHA-256 of the whole artefact")


# --- publish grants ----------------------------------------------------------------------------------

PUBLISH_TOKEN_PREFIX = "aisynergy-publish."
"""A bearer credential that starts with this is a publish grant (never an operator's token)."""
PUBLISH_TOKEN_DOMAIN = b"aisynergy-publish-grant-v1\n"


class PublishClaims(NoNul):
    """What a publish grant allows: the worker ``worker_id`` of task ``task_id`` on ``target_id`` may upload, through the
    chunked API only, model artefacts named ``names`` at ``version``, until ``exp``. Signed by the hub's signing key."""

    model_config = ConfigDict(extra="forbid", strict=True)

    task_id: str = Field(min_length=1, max_length=64)
    worker_id: str = Field(min_length=1, max_length=64)
    target_id: str = Field(min_length=1, max_length=64)
    names: list[ArtifactName] = Field(min_length=1, max_length=2)
    version: Version
    exp: int = Field(ge=0, le=INT64_MAX, description="expiry, Unix seconds")

    def allows(self, kind: str, name: str, version: str) -> bool:
        return kind == ArtifactKind.MODEL.value and name in self.names and version == self.version


def publish_signing_bytes(claims: PublishClaims) -> bytes:
    return PUBLISH_TOKEN_DOMAIN + json.dumps(claims.model_dump(mode="json"), sort_keys=True, separators=(",", ":")).encode()


def encode_publish_token(claims: PublishClaims, signature: bytes) -> str:
    """``aisynergy-publish.<base64url(claims JSON)>.<base64url(signature)>``."""
    payload = json.dumps(claims.model_dump(mode="json"), sort_keys=True, separators=(",", ":")).encode()
    return PUBLISH_TOKEN_PREFIX + b64url(payload) + "." + b64url(signature)


def decode_publish_token(token: str) -> tuple[PublishClaims, bytes]:
    """Split and parse a grant (the caller verifies the signature); ValueError when malformed."""
    if len(token) > 4096 or not token.startswith(PUBLISH_TOKEN_PREFIX):
        raise ValueError("malformed publish grant")
    body = token[len(PUBLISH_TOKEN_PREFIX) :]
    if body.count(".") != 1:
        raise ValueError("malformed publish grant")
    payload, signature = body.split(".")
    try:
        return PublishClaims.model_validate_json(unb64url(payload)), unb64url(signature)
    except Exception as exc:  # noqa: BLE001 - any decoding problem is one answer: malformed
        raise ValueError("malformed publish grant") from exc

