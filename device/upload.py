"""Publishing a large artefact from a site to the hub over a link that drops: the chunked upload API
(``/artifacts/uploads``, :mod:`interfaces.uploads`).

:func:`upload_artifact` hashes the file, starts a session (or resumes the one named in its state file), PUTs the
chunks the hub lacks, and commits. A connection error or a 5xx is retried with jittered back-off
(:func:`interfaces.reconnect.reconnect_delay`), after which the session is read again: a chunk cut mid-way is sent
again whole, one the hub stored before the answer was lost is not. The state file (JSON: the upload id and what it
uploads) lets a new process resume after this one died; it is removed once the artefact is stored.

    UploadError
    └── UploadRefused   the hub answered 4xx (its problem document in ``problem``)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from device.tls import tls_verify
from interfaces import API_PREFIX
from interfaces.deployments import ArtifactPublic
from interfaces.reconnect import reconnect_delay
from interfaces.uploads import CHUNK_MEDIA_TYPE, CHUNK_SHA256_HEADER, UploadSession, chunk_length

log = logging.getLogger("aisynergy.device.upload")


class UploadError(Exception):
    """The upload did not complete (the hub stayed unreachable, or refused it)."""


class UploadRefused(UploadError):
    def __init__(self, response: httpx.Response) -> None:
        try:
            self.problem: dict[str, Any] = response.json()
        except ValueError:
            self.problem = {"status": response.status_code, "detail": response.text[:500]}
        self.status = response.status_code
        super().__init__(f"the hub refused {response.request.method} {response.request.url.path}: {self.status} {self.problem.get('detail', '')}")


class _Retry(Exception):
    """A transient failure (a 5xx): back off, then try again."""


def _checked(response: httpx.Response, *ok: int) -> httpx.Response:
    if response.status_code in ok:
        return response
    if response.status_code >= 500:
        raise _Retry(f"{response.status_code} from the hub")
    raise UploadRefused(response)


class _State:
    """The state file: the upload id of this file's session, so that another run resumes it."""

    def __init__(self, path: Path | None, identity: dict[str, Any]) -> None:
        self.path, self.identity = path, identity

    def load(self) -> str | None:
        if self.path is None or not self.path.exists():
            return None
        try:
            saved = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        upload_id = saved.get("upload_id") if isinstance(saved, dict) else None
        return upload_id if isinstance(upload_id, str) and saved.get("artifact") == self.identity else None

    def save(self, upload_id: str) -> None:
        if self.path is None:
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps({"upload_id": upload_id, "artifact": self.identity}))
        os.replace(tmp, self.path)

    def clear(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)


GUESSED_CHUNK_BYTES = 8 * 1024 * 1024
"""The hub's default chunk size: the chunks' SHA-256 are computed for it in the same pass as the whole file's."""


def _digests(path: Path, chunk_size: int = GUESSED_CHUNK_BYTES) -> tuple[str, list[str]]:
    """The file's SHA-256 and the SHA-256 of each of its ``chunk_size`` chunks, reading it once."""
    whole, chunks = hashlib.sha256(), []
    with path.open("rb") as f:
        while data := f.read(chunk_size):
            whole.update(data)
            chunks.append(hashlib.sha256(data).hexdigest())
    return whole.hexdigest(), chunks


class _Uploader:
    def __init__(self, client: httpx.Client, path: Path, identity: dict[str, Any], state: _State, chunk_digests: list[str] | None = None) -> None:
        self.client, self.path, self.identity, self.state = client, path, identity, state
        self.chunk_digests = chunk_digests or []

    def session(self) -> UploadSession:
        """The saved session if the hub still has it, else a new one."""
        upload_id = self.state.load()
        if upload_id is not None:
            r = self.client.get(f"/artifacts/uploads/{upload_id}")
            if r.status_code != 404:
                return UploadSession.model_validate_json(_checked(r, 200).content)
            log.info("upload %s is gone from the hub; starting again", upload_id)
        session = UploadSession.model_validate_json(_checked(self.client.post("/artifacts/uploads", json=self.identity), 201).content)
        self.state.save(session.id)
        log.info("upload %s started: %s %s, %d chunks of %d bytes", session.id, self.identity["name"], self.identity["version"], session.chunk_count, session.chunk_size)
        return session

    def send_missing(self, session: UploadSession, progress: Callable[[], None]) -> None:
        held = set(session.received)
        with self.path.open("rb") as f:
            for index in range(session.chunk_count):
                if index in held:
                    continue
                f.seek(index * session.chunk_size)
                data = f.read(chunk_length(session.size, session.chunk_size, index))
                known = session.chunk_size == GUESSED_CHUNK_BYTES and index < len(self.chunk_digests)
                headers = {CHUNK_SHA256_HEADER: self.chunk_digests[index] if known else hashlib.sha256(data).hexdigest(), "Content-Type": CHUNK_MEDIA_TYPE}
                _checked(self.client.put(f"/artifacts/uploads/{session.id}/chunks/{index}", content=data, headers=headers), 204)
                progress()

    def commit(self, session: UploadSession) -> ArtifactPublic:
        r = self.client.post(f"/artifacts/uploads/{session.id}/commit")
        if r.status_code == 404:  # an earlier commit may have stored it before its answer was lost
            stored = self.find_stored()
            if stored is not None:
                return stored
        return ArtifactPublic.model_validate_json(_checked(r, 201).content)

    def find_stored(self) -> ArtifactPublic | None:
        r = self.client.post("/artifacts/uploads", json=self.identity)
        if r.status_code == 201:  # not stored after all: drop the session just made
            self.client.delete(f"/artifacts/uploads/{r.json()['id']}")
            return None
        doc = r.json() if r.status_code == 409 else {}
        if doc.get("code") != "artifact_exists" or doc.get("sha256") != self.identity["sha256"]:
            return None
        return ArtifactPublic.model_validate_json(_checked(self.client.get(f"/artifacts/{doc['artifact_id']}"), 200).content)


def upload_artifact(
    hub_url: str, token: str, path: Path, *, kind: str, name: str, version: str, format: str, state_file: Path | None = None,
    verify: ssl.SSLContext | bool | str = True, timeout_s: float = 120.0, attempts: int = 10, transport: httpx.BaseTransport | None = None,
) -> ArtifactPublic:  # fmt: skip
    """Upload the file at ``path`` as the artefact ``kind`` ``name`` ``version`` (``format``) to the hub at
    ``hub_url`` (its base, e.g. ``https://hub:8443``) with an operator token or a training task's publish grant; resumes the session saved in
    ``state_file``. Gives up (``UploadError``) after ``attempts`` failures in a row without a chunk stored;
    ``UploadRefused`` at once when the hub refuses (4xx)."""
    whole, chunk_digests = _digests(path)
    identity = {"kind": kind, "name": name, "version": version, "format": format, "size": path.stat().st_size, "sha256": whole}
    state = _State(state_file, identity)
    timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0))
    headers = {"Authorization": f"Bearer {token}"}
    failures = 0

    def progress() -> None:
        nonlocal failures
        failures = 0

    with httpx.Client(base_url=hub_url.rstrip("/") + API_PREFIX, headers=headers, timeout=timeout, verify=tls_verify(verify), transport=transport) as client:
        uploader = _Uploader(client, path, identity, state, chunk_digests)
        while True:
            try:
                session = uploader.session()
                uploader.send_missing(session, progress)
                artifact = uploader.commit(session)
            except (httpx.TransportError, _Retry) as exc:
                failures += 1
                if failures >= attempts:
                    raise UploadError(f"the upload of {path.name} failed {failures} times in a row: {exc}") from exc
                delay = reconnect_delay(failures)
                log.warning("upload of %s interrupted (%s); resuming in %.1f s", path.name, exc, delay)
                time.sleep(delay)
                continue
            state.clear()
            log.info("uploaded %s as artifact %s (%d bytes)", path.name, artifact.id, artifact.size)
            return artifact
