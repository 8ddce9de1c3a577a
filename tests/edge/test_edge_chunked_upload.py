"""The site's client of the chunked upload API (device/upload.py) against a hub behind a real HTTP server:
a run that dies mid-way leaves its upload id in the state file, and the next run sends only the chunks the hub
lacks; a refusal is raised at once."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from device.upload import UploadError, UploadRefused, upload_artifact
from interfaces.auth import Role
from tests.hub.conftest import HubUnderTest, hub_settings, running_hub
from tests.hub.live import serve

CHUNK = 64 * 1024


class Counting(httpx.HTTPTransport):
    """Counts the chunk PUTs; after ``fail_after`` of them every request fails as a dropped link would."""

    def __init__(self, fail_after: int | None = None) -> None:
        super().__init__()
        self.puts, self.fail_after = 0, fail_after

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if self.fail_after is not None and self.puts >= self.fail_after:
            raise httpx.ConnectError("the link is down", request=request)
        if request.method == "PUT":
            self.puts += 1
        return super().handle_request(request)


@pytest.fixture
def hub(sqlite_url: str, tmp_path: Path) -> Iterator[HubUnderTest]:
    yield from running_hub(hub_settings(tmp_path / "hub", sqlite_url, upload_chunk_bytes=CHUNK))


def test_a_second_run_resumes_from_the_state_file_and_sends_only_the_missing_chunks(hub: HubUnderTest, tmp_path: Path) -> None:
    # Prepare
    data = os.urandom(5 * CHUNK + 123)  # six chunks
    source, state = tmp_path / "model.onnx", tmp_path / "upload.json"
    source.write_bytes(data)
    fields = {"kind": "model", "name": "site-model", "version": "2.0.0", "format": "onnx", "state_file": state}
    with serve(hub.app) as url:
        dying = Counting(fail_after=2)
        with pytest.raises(UploadError):
            upload_artifact(url, hub.tokens[Role.OPERATOR], source, transport=dying, attempts=2, **fields)  # type: ignore[arg-type]
        saved = state.read_text()

        # Execute
        resumed = Counting()
        artifact = upload_artifact(url, hub.tokens[Role.OPERATOR], source, transport=resumed, **fields)  # type: ignore[arg-type]

    # Assert
    assert dying.puts == 2 and resumed.puts == 4
    assert '"upload_id"' in saved and not state.exists()
    assert (artifact.sha256, artifact.size) == (hashlib.sha256(data).hexdigest(), len(data))
    assert hub.get(f"/artifacts/{artifact.id}/content").content == data


def test_a_refusal_is_raised_at_once(hub: HubUnderTest, tmp_path: Path) -> None:
    # Prepare
    source = tmp_path / "model.onnx"
    source.write_bytes(b"x" * 1000)
    transport = Counting()

    # Execute
    with serve(hub.app) as url, pytest.raises(UploadRefused) as refused:
        upload_artifact(url, hub.tokens[Role.VIEWER], source, kind="model", name="m", version="1.0.0", format="onnx", transport=transport)

    # Assert
    assert refused.value.status == 403 and refused.value.problem["code"] == "forbidden"
    assert transport.puts == 0


def test_a_resumed_session_whose_chunks_are_not_this_files_is_sent_again(hub: HubUnderTest, tmp_path: Path) -> None:
    # Prepare: the state file names a session that holds every chunk, of other bytes of the same size
    data, other = os.urandom(2 * CHUNK + 7), os.urandom(2 * CHUNK + 7)
    source, state = tmp_path / "model.onnx", tmp_path / "upload.json"
    source.write_bytes(data)
    identity = {"kind": "model", "name": "site-model", "version": "4.0.0", "format": "onnx", "size": len(data)}
    session = hub.request("POST", "/artifacts/uploads", Role.OPERATOR, json=identity).json()
    for index in range(3):
        chunk = other[index * CHUNK : (index + 1) * CHUNK]
        headers = {"X-Chunk-SHA256": hashlib.sha256(chunk).hexdigest(), "Content-Type": "application/octet-stream"}
        assert hub.request("PUT", f"/artifacts/uploads/{session['id']}/chunks/{index}", Role.OPERATOR, content=chunk, headers=headers).status_code == 204
    state.write_text(json.dumps({"upload_id": session["id"], "artifact": {**identity, "mtime_ns": source.stat().st_mtime_ns}}))
    transport = Counting()

    # Execute
    with serve(hub.app) as url:
        artifact = upload_artifact(url, hub.tokens[Role.OPERATOR], source, state_file=state, transport=transport, **{k: v for k, v in identity.items() if k != "size"})  # type: ignore[arg-type]

    # Assert
    assert transport.puts == 3  # none at first (the hub held them all), then each again
    assert artifact.sha256 == hashlib.sha256(data).hexdigest()
    assert hub.get(f"/artifacts/{artifact.id}/content").content == data and not state.exists()
