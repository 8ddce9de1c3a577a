"""The web console (issue 20, seeds/000's WEB front end): static files served by the hub at ``/console/``, ``/``
redirecting there. It is a client of the public REST API only (``/api/v1``, its SSE log streams, ``/openapi.json``
for the task types' JSON Schemas): whatever it shows or does, an integrator can do with the API.

The files are plain HTML, CSS and JavaScript (no build step) in ``static/``; the charts are uPlot, vendored from npm
by ``vendor.sh`` (``VENDOR.sha256``). The integrator token signs in: kept in the tab's ``sessionStorage`` (gone with
the tab, never a cookie, so no CSRF), sent as ``Authorization: Bearer``. The pages' own policy: scripts, styles and
connections from this origin only, no framing, no referrer (:data:`CONSOLE_HEADERS`).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, RedirectResponse, Response

STATIC = Path(__file__).resolve().parent / "static"
PREFIX = "/console"
CONSOLE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "form-action 'none'; frame-ancestors 'none'; base-uri 'none'",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",
}
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}


def _file(relative: str) -> Response:
    path = (STATIC / relative).resolve()
    if STATIC not in path.parents or not path.is_file() or path.suffix not in TYPES:
        return Response(status_code=404, content="not found", media_type="text/plain")
    return FileResponse(path, media_type=TYPES[path.suffix], headers=CONSOLE_HEADERS)


def install(app: FastAPI) -> None:
    """``GET /`` -> ``/console/``; ``GET /console/`` the page; ``GET /console/{file}`` its assets."""

    @app.get("/", include_in_schema=False)
    def root() -> RedirectResponse:
        return RedirectResponse(PREFIX + "/", status_code=307)

    @app.get(PREFIX, include_in_schema=False)
    def console_bare() -> RedirectResponse:
        return RedirectResponse(PREFIX + "/", status_code=307)

    @app.get(PREFIX + "/", include_in_schema=False)
    def console_page() -> Response:
        return _file("index.html")

    @app.get(PREFIX + "/{name:path}", include_in_schema=False)
    def console_asset(name: str) -> Response:
        return _file(name)
