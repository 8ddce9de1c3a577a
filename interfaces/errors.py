"""Error codes and the RFC 9457 problem document every REST error is returned as."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

PROBLEM_MEDIA_TYPE = "application/problem+json"


class ErrorCode(StrEnum):
    """Stable, documented error codes; ``type`` is ``urn:aisynergy:error:<code>``."""

    MALFORMED_REQUEST = "malformed_request"  # body is not valid JSON / not parseable
    VALIDATION_FAILED = "validation_failed"  # well-formed but fails the model (unknown field, bad value)
    UNAUTHENTICATED = "unauthenticated"  # no or unknown bearer token
    FORBIDDEN = "forbidden"  # token's role may not do this
    NOT_FOUND = "not_found"
    CONFLICT = "conflict"  # uniqueness clash
    ILLEGAL_TRANSITION = "illegal_transition"  # state machine refuses the move
    BOOTSTRAP_TOKEN_INVALID = "bootstrap_token_invalid"  # unknown or wrong for this node
    BOOTSTRAP_TOKEN_EXPIRED = "bootstrap_token_expired"
    BOOTSTRAP_TOKEN_USED = "bootstrap_token_used"
    CSR_INVALID = "csr_invalid"  # unparseable CSR, bad signature, wrong subject, weak key
    NODE_DELETED = "node_deleted"
    CERTIFICATE_INVALID = "certificate_invalid"  # a renewal's certificate is not a PEM certificate (422)
    CERTIFICATE_UNKNOWN = "certificate_unknown"  # not issued by the hub CA to this id, or not recorded for it (403)
    CERTIFICATE_REVOKED = "certificate_revoked"  # a renewal's certificate was revoked (403)
    CERTIFICATE_EXPIRED_BEYOND_GRACE = "certificate_expired_beyond_grace"  # expired longer ago than the grace: re-enrol (403)
    CSR_KEY_MISMATCH = "csr_key_mismatch"  # a renewal's CSR holds another key than its certificate (403)
    PAYLOAD_TOO_LARGE = "payload_too_large"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    IDEMPOTENCY_KEY_REUSED = "idempotency_key_reused"  # same key, different request
    IDEMPOTENCY_IN_PROGRESS = "idempotency_in_progress"  # same key, first request still running
    IDEMPOTENCY_NOT_REPLAYABLE = "idempotency_not_replayable"  # same key, the first answer carried a secret not kept
    INVALID_SELECTOR = "invalid_selector"
    INVALID_CURSOR = "invalid_cursor"
    TARGET_OFFLINE = "target_offline"  # a command for a node or device that is not connected
    COMMAND_TIMEOUT = "command_timeout"  # no answer within the command's timeout
    BROKER_UNAVAILABLE = "broker_unavailable"  # the hub is not connected to the broker
    HUB_UNREACHABLE = "hub_unreachable"  # an edge forwarding a device's enrolment cannot reach the hub (503)
    INVALID_RESPONSE = "invalid_response"  # an edge got an answer from the hub that is not what it asked for (502)
    TARGET_LOCKED = "target_locked"  # a deployment names a target whose node is admin-state LOCKED (409)
    ARTIFACT_EXISTS = "artifact_exists"  # an artefact of this kind, name and version is stored already (409; artifact_id)
    ARTIFACT_IN_USE = "artifact_in_use"  # a deployment, execution or rollback target still needs it (409; reason)
    RANGE_NOT_SATISFIABLE = "range_not_satisfiable"  # a Range outside the content (416)
    INVALID_DOWNLOAD_TOKEN = "invalid_download_token"  # forged, expired or for another artefact (401)
    BUSY = "busy"  # the hub does as much of this work at once as it may: retry after Retry-After seconds (503)
    TOO_MANY_REQUESTS = "too_many_requests"  # the token holds as many of these at once as it may (429; limit)
    PRIVACY_BUDGET_EXCEEDED = "privacy_budget_exceeded"  # a device's privacy budget cannot afford the training task (409; targets)
    INTERNAL = "internal_error"


ERROR_TYPE_PREFIX = "urn:aisynergy:error:"


class Problem(BaseModel):
    """An RFC 9457 problem document with the project's stable ``code``."""

    model_config = ConfigDict(extra="allow")

    type: str = Field(description="urn:aisynergy:error:<code>", pattern=r"^urn:aisynergy:error:[a-z_]+$")
    title: str
    status: int
    code: ErrorCode
    detail: str | None = None
    instance: str | None = None
    errors: list[dict[str, Any]] | None = Field(default=None, description="Per-field validation errors")
    current_state: str | None = Field(default=None, description="Set on illegal_transition")

    @classmethod
    def of(cls, code: ErrorCode, status: int, title: str, detail: str | None = None, **extra: Any) -> Problem:
        return cls(type=ERROR_TYPE_PREFIX + code.value, title=title, status=status, code=code, detail=detail, **extra)
