"""The system under test, as the suite sees it: a REST base URL, a broker URL, tokens and a CA.

Nothing here knows how the hub is built; every answer is validated into the models of ``interfaces/``.
"""

from __future__ import annotations

import ssl
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from pydantic import BaseModel, ValidationError

from conformance.outcomes import CaseSkipped, Unexpected
from interfaces.errors import PROBLEM_MEDIA_TYPE, ErrorCode, Problem
from interfaces.ids import new_id

API_BASE = "/api/v1"
RUN_LABEL = "conformance-run"  # every node and device the suite makes carries this label


@dataclass
class Target:
    hub_url: str
    broker_url: str
    token: str
    ca_path: Path | None = None
    operator_token: str | None = None
    viewer_token: str | None = None
    max_wait_s: float = 120.0
    run_id: str = field(default_factory=lambda: new_id("run").split("-", 1)[1][-10:])
    work_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="aisynergy-conformance-")))
    _ca_pem: str | None = None

    def __post_init__(self) -> None:
        self.hub_url = self.hub_url.rstrip("/")
        parts = urlsplit(self.broker_url)
        if parts.scheme not in ("mqtts", "ssl") or not parts.hostname:
            raise ValueError(f"--broker must be an mqtts://host[:port] URL, not {self.broker_url!r}")
        self.broker_host, self.broker_port = parts.hostname, parts.port or 8883

    # ---- HTTP ----------------------------------------------------------------------------------------
    def _verify(self) -> ssl.SSLContext | bool:
        if not self.hub_url.startswith("https://"):
            return True
        if self.ca_path is None:
            return True
        return ssl.create_default_context(cafile=str(self.ca_path))

    def client(self, token: str | None = "admin", **kw: Any) -> httpx.Client:
        """An HTTP client on the API base. ``token``: a role name (admin, operator, viewer), a literal
        token, or None for no Authorization header."""
        headers = {}
        literal = {"admin": self.token, "operator": self.operator_token, "viewer": self.viewer_token}.get(token or "", token)
        if token in ("operator", "viewer") and literal is None:
            raise CaseSkipped(f"no {token} token given (--{token}-token)")
        if literal:
            headers["Authorization"] = f"Bearer {literal}"
        return httpx.Client(base_url=self.hub_url + API_BASE, headers=headers, verify=self._verify(), timeout=kw.pop("timeout", 30), **kw)

    def call(self, method: str, path: str, token: str | None = "admin", **kw: Any) -> httpx.Response:
        with self.client(token) as c:
            return c.request(method, path, **kw)

    def ok(self, method: str, path: str, model: type[BaseModel] | None = None, token: str | None = "admin", **kw: Any) -> Any:
        """A call that must succeed (2xx); the body validated into ``model`` (or the JSON)."""
        r = self.call(method, path, token, **kw)
        if r.status_code // 100 != 2:
            raise Unexpected(f"{method} {path}: HTTP {r.status_code} {r.text[:500]}")
        if model is None:
            return r.json() if r.content else None
        try:
            return model.model_validate(r.json())
        except ValidationError as exc:
            raise Unexpected(f"{method} {path}: the answer is not a {model.__name__}: {exc}") from None

    @property
    def ca_pem(self) -> str:
        """The hub CA (``--ca``, or ``GET /ca.crt``), trusted for the broker's TLS."""
        if self._ca_pem is None:
            if self.ca_path is not None:
                self._ca_pem = self.ca_path.read_text()
            else:
                r = self.call("GET", "/ca.crt", token=None)
                if r.status_code != 200:
                    raise Unexpected(f"GET /ca.crt: HTTP {r.status_code}")
                self._ca_pem = r.text
        return self._ca_pem

    def ca_file(self) -> Path:
        path = self.work_dir / "ca.crt"
        if not path.exists():
            path.write_text(self.ca_pem)
        return path

    def labels(self, **more: str) -> dict[str, str]:
        return {RUN_LABEL: self.run_id, **more}


def problem(r: httpx.Response, status: int, code: ErrorCode | str) -> Problem:
    """Assert that ``r`` is the documented RFC 9457 problem document with this status and code."""
    if r.status_code != status:
        raise Unexpected(f"expected HTTP {status} ({code}), got {r.status_code}: {r.text[:300]}")
    media = r.headers.get("content-type", "").split(";")[0].strip()
    if media != PROBLEM_MEDIA_TYPE:
        raise Unexpected(f"HTTP {status}: content type {media!r}, not {PROBLEM_MEDIA_TYPE}")
    try:
        doc = Problem.model_validate(r.json())
    except (ValidationError, ValueError) as exc:
        raise Unexpected(f"HTTP {status}: not a problem document: {exc}") from None
    if doc.code != code or doc.status != status:
        raise Unexpected(f"problem code {doc.code}/{doc.status}, expected {code}/{status}: {doc.detail}")
    return doc
