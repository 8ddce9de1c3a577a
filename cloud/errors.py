"""Hub errors. Every one becomes an RFC 9457 problem document with a stable code.

    ApiError
    ├── NotFound            404 not_found
    ├── Conflict            409 conflict / illegal_transition / node_deleted / idempotency_*
    ├── Unauthenticated     401 unauthenticated
    ├── Forbidden           403 forbidden
    ├── TooManyRequests     429 too_many_requests
    └── BadRequest          400/422 (bootstrap token, CSR, selector, cursor, ...)
"""

from __future__ import annotations

from typing import Any

from interfaces.errors import ErrorCode, Problem


_TITLES = {400: "Bad request", 401: "Unauthenticated", 403: "Forbidden", 404: "Not found", 409: "Conflict", 413: "Payload too large",
           422: "Validation failed", 429: "Too many requests", 502: "Bad gateway", 503: "Service unavailable", 504: "Gateway timeout"}


def _title(status: int, fallback: str) -> str:
    """The title of an error raised with another status than its class's (a BadRequest of status 504 is no "Bad request")."""
    from http import HTTPStatus

    if status in _TITLES:
        return _TITLES[status]
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return fallback


class ApiError(Exception):
    status = 400
    code = ErrorCode.VALIDATION_FAILED
    title = "Bad request"

    def __init__(self, detail: str, code: ErrorCode | None = None, status: int | None = None, **extra: Any) -> None:
        super().__init__(detail)
        self.detail = detail
        if code is not None:
            self.code = code
        if status is not None and status != self.status:
            self.status = status
            self.title = _title(status, self.title)  # a 504 is not a "Bad request"
        self.extra = extra

    def problem(self, instance: str | None = None) -> Problem:
        return Problem.of(self.code, self.status, self.title, self.detail, instance=instance, **self.extra)


class NotFound(ApiError):
    status, code, title = 404, ErrorCode.NOT_FOUND, "Not found"


class Conflict(ApiError):
    status, code, title = 409, ErrorCode.CONFLICT, "Conflict"


class Unauthenticated(ApiError):
    status, code, title = 401, ErrorCode.UNAUTHENTICATED, "Unauthenticated"


class Forbidden(ApiError):
    status, code, title = 403, ErrorCode.FORBIDDEN, "Forbidden"


class BadRequest(ApiError):
    status, code, title = 400, ErrorCode.VALIDATION_FAILED, "Bad request"


class ValidationFailed(ApiError):
    status, code, title = 422, ErrorCode.VALIDATION_FAILED, "Validation failed"


class TooManyRequests(ApiError):
    status, code, title = 429, ErrorCode.TOO_MANY_REQUESTS, "Too many requests"


class PayloadTooLarge(ApiError):
    status, code, title = 413, ErrorCode.PAYLOAD_TOO_LARGE, "Payload too large"


class UnsupportedMediaType(ApiError):
    status, code, title = 415, ErrorCode.UNSUPPORTED_MEDIA_TYPE, "Unsupported media type"


class MalformedRequest(ApiError):
    status, code, title = 400, ErrorCode.MALFORMED_REQUEST, "Malformed request"
