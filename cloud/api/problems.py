"""Turn every error into an RFC 9457 problem document with a stable code."""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cloud.api.state import hub_state
from cloud.errors import ApiError
from interfaces.errors import PROBLEM_MEDIA_TYPE, ErrorCode, Problem

log = logging.getLogger("aisynergy.hub.api")

_HTTP_CODES = {
    400: ErrorCode.MALFORMED_REQUEST,
    401: ErrorCode.UNAUTHENTICATED,
    403: ErrorCode.FORBIDDEN,
    404: ErrorCode.NOT_FOUND,
    405: ErrorCode.METHOD_NOT_ALLOWED,
    409: ErrorCode.CONFLICT,
    413: ErrorCode.PAYLOAD_TOO_LARGE,
    415: ErrorCode.UNSUPPORTED_MEDIA_TYPE,
    422: ErrorCode.VALIDATION_FAILED,
}


def problem_response(problem: Problem, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(
        problem.model_dump(mode="json", exclude_none=True), status_code=problem.status, media_type=PROBLEM_MEDIA_TYPE, headers=headers
    )


def simple_problem(code: ErrorCode, status: int, title: str, detail: str, instance: str | None = None) -> JSONResponse:
    return problem_response(Problem.of(code, status, title, detail, instance=instance))


HTTP_METHODS = frozenset({"get", "put", "post", "delete", "options", "head", "patch", "trace"})


def allowed_methods(request: Request) -> str:
    """Every method the API answers on this path (RFC 9110 15.5.6: a 405 lists them all in Allow), from the
    app's OpenAPI paths; the router names only the first route whose path matched."""
    state = hub_state(request)
    table = state.allowed_methods
    if table is None:
        table = [(re.compile("^" + re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(path)) + "$"), {m.upper() for m in ops if m in HTTP_METHODS})
                 for path, ops in request.app.openapi().get("paths", {}).items()]  # fmt: skip
        state.allowed_methods = table
    matches = [(pattern.pattern.count("[^/]+"), ops) for pattern, ops in table if pattern.match(request.url.path)]
    # a concrete path goes before a templated one that also matches (OpenAPI 3 "Path Templating Matching"):
    # /artifacts/uploads is not /artifacts/{artifact_id}
    fewest = min((templated for templated, _ in matches), default=0)
    methods = set().union(*(ops for templated, ops in matches if templated == fewest))
    return ", ".join(sorted(methods))


def _clean_errors(errors: Any) -> list[dict[str, Any]]:
    out = []
    for err in errors:
        out.append({"loc": [str(p) for p in err.get("loc", ())], "msg": str(err.get("msg", "")), "type": str(err.get("type", ""))})
    return out


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return problem_response(exc.problem(instance=request.url.path), headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = _clean_errors(exc.errors())
        if any(e["type"] == "json_invalid" for e in errors):
            problem = Problem.of(ErrorCode.MALFORMED_REQUEST, 400, "Malformed request", "the body is not valid JSON", errors=errors)
        else:
            problem = Problem.of(ErrorCode.VALIDATION_FAILED, 422, "Validation failed", "the request does not match the schema", errors=errors)
        problem.instance = request.url.path
        return problem_response(problem)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _HTTP_CODES.get(exc.status_code, ErrorCode.MALFORMED_REQUEST if exc.status_code < 500 else ErrorCode.INTERNAL)
        problem = Problem.of(code, exc.status_code, str(exc.detail) if exc.detail else "Error", str(exc.detail), instance=request.url.path)
        headers = dict(exc.headers) if exc.headers else {}
        if exc.status_code == 405:
            headers["Allow"] = allowed_methods(request) or headers.get("allow", "")
        return problem_response(problem, headers or None)



class UnexpectedErrors:
    """ASGI middleware: an exception no handler took becomes a 500 ``internal_error`` problem document, and goes no
    further. (Starlette's own last-resort handler raises it again after answering, and the server then closes the
    connection: a client's keep-alive connection would die with its request.) One raised after the answer began
    (a stream) can only end the connection: it is raised on to the server."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watch(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception:
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise
            await simple_problem(ErrorCode.INTERNAL, 500, "Internal error", "the hub failed to handle this request", scope.get("path"))(scope, receive, send)


# For route declarations: every route may answer with these problem documents.
PROBLEM_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": Problem, "content": {PROBLEM_MEDIA_TYPE: {}}, "description": desc}
    for status, desc in {
        400: "Malformed request", 401: "Unauthenticated", 403: "Forbidden", 404: "Not found", 409: "Conflict",
        413: "Payload too large", 415: "Unsupported media type", 422: "Validation failed",
    }.items()
}  # fmt: skip
