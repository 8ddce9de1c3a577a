"""The task commands' calls to the hub beyond single JSON requests: the dataset upload (or reuse) of ``--inputs``
and the streamed download of a task's gathered outputs."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import Any

import click
import httpx

from cloud.cli.deploy import _Hub, _problem_line
from interfaces import API_PREFIX
from interfaces.pagination import MAX_LIMIT

INPUT_FORMATS = {".npy": "npy", ".safetensors": "safetensors"}


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def input_format(path: Path) -> str:
    """``npy`` or ``safetensors`` by the file's suffix."""
    fmt = INPUT_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise click.BadParameter(f"{path.name}: inputs must be a .npy or .safetensors file", param_hint="--inputs")
    return fmt


def dataset_identity(path: Path) -> tuple[str, str, str, str]:
    """(name, version, format, sha256) under which ``path`` is uploaded: ``inputs-<16 hex of its SHA-256>``, ``1``."""
    fmt = input_format(path)
    sha256 = file_sha256(path)
    return f"inputs-{sha256[:16]}", "1", fmt, sha256


def upload_inputs(hub: _Hub, path: Path) -> tuple[str, bool]:
    """Upload ``path`` as a dataset artefact, or find the one uploaded before; returns (artifact id, reused).

    The same bytes always get the same name, so a second run (or a concurrent one: 409 ``artifact_exists``,
    which carries the stored id) reuses the stored artefact instead of uploading again.
    """
    name, version, fmt, sha256 = dataset_identity(path)
    page = hub.call("GET", "/artifacts", params={"kind": "dataset", "name": name, "limit": MAX_LIMIT})
    for item in page["items"]:
        if item["version"] == version:
            _check_same_bytes(item.get("sha256"), sha256, item["id"], name)
            return item["id"], True
    with path.open("rb") as stream:
        r = hub.request("POST", "/artifacts", data={"kind": "dataset", "name": name, "version": version, "format": fmt}, files={"file": (path.name, stream)})
    if r.status_code == 409:
        doc = _json_or_none(r)
        if isinstance(doc, dict) and doc.get("code") == "artifact_exists" and doc.get("artifact_id"):
            _check_same_bytes(doc.get("sha256"), sha256, doc["artifact_id"], name)
            return str(doc["artifact_id"]), True
    if r.status_code >= 400:
        raise click.ClickException(_problem_line(r))
    return str(r.json()["id"]), False


def _check_same_bytes(stored: str | None, local: str, artifact_id: str, name: str) -> None:
    if stored and stored != local:
        raise click.ClickException(f"dataset {name} version 1 ({artifact_id}) holds other bytes (sha256 {stored[:16]}...) than this file")


def _json_or_none(r: httpx.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        return None


def download_outputs(hub: _Hub, task_id: str, out: str) -> int:
    """Stream ``GET /tasks/{id}/outputs/content`` to ``out`` (a file written whole or not at all, or ``-``); bytes written."""
    url = f"{API_PREFIX}/tasks/{task_id}/outputs/content"
    target = None if out == "-" else Path(out)
    partial = target.with_name(target.name + ".part") if target is not None else None
    size = 0
    try:
        with hub.client.stream("GET", url, headers=hub.headers()) as r:
            if r.status_code >= 400:
                r.read()
                raise click.ClickException(_problem_line(r))
            sink = sys.stdout.buffer if partial is None else partial.open("wb")
            try:
                for chunk in r.iter_bytes():
                    sink.write(chunk)
                    size += len(chunk)
            finally:
                if partial is None:
                    sink.flush()
                else:
                    sink.close()
    except httpx.HTTPError as exc:
        if partial is not None:
            partial.unlink(missing_ok=True)
        raise click.ClickException(f"download from {hub.url} failed: {exc}") from exc
    except BaseException:
        if partial is not None:
            partial.unlink(missing_ok=True)
        raise
    if partial is not None and target is not None:
        partial.replace(target)
    return size
