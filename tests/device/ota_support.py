"""Helpers for the OTA tests: an artefact server with Range and the token check, signed orders."""

from __future__ import annotations

import hashlib
import re
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from cloud.signing import SigningKey
from interfaces import API_PREFIX
from interfaces.deployments import (
    DOWNLOAD_TOKEN_HEADER,
    ArtifactFormat,
    ArtifactKind,
    ArtifactManifest,
    DeltaOffer,
    DeploymentOrder,
    OrderAction,
)  # fmt: skip
from interfaces.ids import new_id

MODELS = Path(__file__).parent.parent / "fixtures" / "models"
V1, V2 = (MODELS / "mlp-1.0.0.onnx").read_bytes(), (MODELS / "mlp-1.1.0.onnx").read_bytes()
TOKEN = "download-token-1"


@dataclass
class BlobServer:
    """Serves ``blobs`` (path below the API prefix -> bytes) the way an edge's artefact cache does."""

    blobs: dict[str, bytes] = field(default_factory=dict)
    drop_after: dict[str, int] = field(default_factory=dict)  # path -> bytes to send before dropping, once
    ignore_range: bool = False
    requests: list[tuple[str, str | None]] = field(default_factory=list)  # (path, Range header)
    url: str = ""

    @property
    def base_url(self) -> str:
        return self.url + API_PREFIX

    def paths(self) -> list[str]:
        return [p for p, _ in self.requests]

    def answer(self, handler: BaseHTTPRequestHandler) -> None:
        path = handler.path.removeprefix(API_PREFIX)
        range_header = handler.headers.get("Range")
        self.requests.append((path, range_header))
        if handler.headers.get(DOWNLOAD_TOKEN_HEADER) != TOKEN:
            return _send(handler, 401, b"no token")
        data = self.blobs.get(path)
        if data is None:
            return _send(handler, 404, b"not found")
        start = 0
        if range_header and not self.ignore_range:
            start = int(re.fullmatch(r"bytes=(\d+)-", range_header).group(1))  # type: ignore[union-attr]
            if start >= len(data):
                return _send(handler, 416, b"")
        body = data[start:]
        handler.send_response(206 if start else 200)
        if start:
            handler.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        handler.send_header("Content-Length", str(len(body)))
        handler.send_header("Accept-Ranges", "bytes")
        handler.end_headers()
        cut = self.drop_after.pop(path, None)
        if cut is not None:
            handler.wfile.write(body[:cut])
            handler.wfile.flush()
            handler.connection.shutdown(socket.SHUT_RDWR)
            handler.close_connection = True
            return
        handler.wfile.write(body)


def _send(handler: BaseHTTPRequestHandler, status: int, body: bytes) -> None:
    handler.send_response(status)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


@contextmanager
def blob_server() -> Iterator[BlobServer]:
    server = BlobServer()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            server.answer(self)

        def log_message(self, format: str, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        httpd.shutdown()
        httpd.server_close()


def make_order(
    signing: SigningKey,
    server: BlobServer,
    data: bytes,
    version: str,
    *,
    name: str = "classifier",
    kind: ArtifactKind = ArtifactKind.MODEL,
    fmt: ArtifactFormat = ArtifactFormat.ONNX,
    action: OrderAction = OrderAction.INSTALL,
    allow_downgrade: bool = False,
    delta: DeltaOffer | None = None,
    served: bytes | None = None,
    execution_id: str | None = None,
) -> DeploymentOrder:
    """A signed order for ``data``; the server serves ``served`` (default: ``data``) at its path."""
    sha = hashlib.sha256(data).hexdigest()
    manifest = ArtifactManifest(name=name, version=version, kind=kind, format=fmt, sha256=sha, size=len(data), created_at=datetime.now(UTC))
    artifact_id = f"art-{sha[:12]}"
    path = f"/artifacts/{artifact_id}/content"
    server.blobs[path] = data if served is None else served
    return DeploymentOrder(
        execution_id=execution_id or new_id("ex"),
        deployment_id=new_id("dp"),
        action=action,
        artifact_id=artifact_id,
        signed_manifest=signing.sign_manifest(manifest),
        path=path,
        token=TOKEN,
        delta=delta,
        allow_downgrade=allow_downgrade,
    )


def offer_delta(server: BlobServer, base: bytes, patch: bytes, served: bytes | None = None) -> DeltaOffer:
    sha = hashlib.sha256(patch).hexdigest()
    path = f"/artifacts/deltas/{sha[:12]}/content"
    server.blobs[path] = patch if served is None else served
    return DeltaOffer(base_sha256=hashlib.sha256(base).hexdigest(), sha256=sha, size=len(patch), path=path)
