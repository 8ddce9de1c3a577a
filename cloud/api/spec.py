"""The OpenAPI document as the hub answers: FastAPI's, with every error body the problem document it is.

FastAPI files a route's declared error models under ``application/json`` (and its own 422 as
``HTTPValidationError``); the hub sends every error as ``application/problem+json`` (``cloud.api.problems``).
``problem_bodies`` puts the ``Problem`` schema under that media type on each error response of each operation,
so that a client, a generator or a validator reads what the wire carries. ``absent_not_null`` states an optional
query or header parameter as its type alone: FastAPI writes ``int | None`` as "integer or null", but a parameter
is text on the wire, and one left out is absent, never the text "null" (which the hub refuses: 422).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from interfaces.errors import PROBLEM_MEDIA_TYPE

PEM_MEDIA_TYPE = "application/x-pem-file"
PROBLEM_REF = {"$ref": "#/components/schemas/Problem"}


def pem_response(description: str) -> dict[int | str, dict[str, Any]]:
    """``responses`` of a route that answers a PEM document."""
    return {200: {"content": {PEM_MEDIA_TYPE: {"schema": {"type": "string"}}}, "description": description}}


def bytes_response(media_type: str, description: str) -> dict[str, Any]:
    """One response of raw bytes of ``media_type``."""
    return {"content": {media_type: {"schema": {"type": "string", "format": "binary"}}}, "description": description}


def _is_error(status: str) -> bool:
    return status == "default" or (status[:1] in "45" and status.isdigit())


def problem_bodies(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with each error response's body the ``Problem`` schema under ``application/problem+json``, and
    FastAPI's unused validation-error schemas gone."""
    for operations in doc.get("paths", {}).values():
        for operation in operations.values():
            if not isinstance(operation, dict):
                continue
            for status, response in operation.get("responses", {}).items():
                if _is_error(str(status)):
                    response["content"] = {PROBLEM_MEDIA_TYPE: {"schema": dict(PROBLEM_REF)}}
    schemas = doc.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    return doc


def absent_not_null(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with each optional parameter's ``anyOf: [X, null]`` written as ``X``."""
    for operations in doc.get("paths", {}).values():
        for operation in operations.values():
            for parameter in operation.get("parameters", []) if isinstance(operation, dict) else []:
                schema = parameter.get("schema", {})
                kinds = schema.get("anyOf")
                if parameter.get("required") or not isinstance(kinds, list):
                    continue
                rest = [k for k in kinds if k != {"type": "null"}]
                if len(rest) == 1 and len(rest) < len(kinds):
                    del schema["anyOf"]
                    schema.update(rest[0])
    return doc


def install(app: FastAPI) -> None:
    """Serve (and generate) the finished document: ``app.openapi()`` returns it."""
    generate: Callable[[], dict[str, Any]] = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = absent_not_null(problem_bodies(generate()))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
