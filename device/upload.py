"""Publishing a large artefact from a site to the hub over a link that drops: the chunked upload API
(``/artifacts/uploads``, :mod:`interfaces.uploads`).

:func:`upload_artifact` starts a session (or resumes the one named in its state file), PUTs the chunks the hub lacks
while a thread hashes the file ahead of them, and commits with the whole file's SHA-256. A connection error or a 5xx is retried with jittered back-off
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
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from device.tls import server_name_extension, tls_verify
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


class _Client(httpx.Client):
    """An ``httpx.Client`` whose every request names ``server_name`` for TLS (see :mod:`device.tls`)."""

    server_name: str | None = None

    def request(self, method: str, url: httpx.URL | str, **kwargs: Any) -> httpx.Response:  # type: ignore[override]
        if self.server_name:
            kwargs["extensions"] = {**(kwargs.get("extensions") or {}), **server_name_extension(self.server_name)}
        return super().request(method, url, **kwargs)


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


IN_FLIGHT = 2
"""Chunks sent at once: while the hub writes and hashes one, the next one is on its way."""


class _Digests:
    """The SHA-256 of each ``chunk_size`` chunk of the file and of the whole, computed in a thread that reads the file
    once, ahead of the chunks being sent (so hashing overlaps the network): :meth:`chunk` waits for one chunk's,
    :meth:`whole` for the file's."""

    def __init__(self, path: Path, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self._chunks: list[str] = []
        self._whole: str | None = None
        self._error: BaseException | None = None
        self._ready = threading.Condition()
        self._thread = threading.Thread(target=self._run, args=(path,), name="upload-digests", daemon=True)
        self._thread.start()

    def _run(self, path: Path) -> None:
        whole = hashlib.sha256()
        try:
            with path.open("rb") as f:
                while data := f.read(self.chunk_size):
                    whole.update(data)
                    digest = hashlib.sha256(data).hexdigest()
                    with self._ready:
                        self._chunks.append(digest)
                        self._ready.notify_all()
            with self._ready:
                self._whole = whole.hexdigest()
                self._ready.notify_all()
        except BaseException as exc:  # noqa: BLE001 - handed to the thread that waits for a digest
            with self._ready:
                self._error = exc
                self._ready.notify_all()

    def _wait(self, done: Callable[[], bool]) -> None:
        with self._ready:
            self._ready.wait_for(lambda: done() or self._error is not None)
            if self._error is not None:
                raise UploadError(f"could not read the file to upload: {self._error}") from self._error

    def chunk(self, index: int) -> str:
        self._wait(lambda: len(self._chunks) > index)
        return self._chunks[index]

    def whole(self) -> str:
        self._wait(lambda: self._whole is not None)
        assert self._whole is not None
        return self._whole


class _Uploader:
    def __init__(self, client: httpx.Client, path: Path, identity: dict[str, Any], state: _State) -> None:
        self.client, self.path, self.identity, self.state = client, path, identity, state
        self.digests: _Digests | None = None

    def digests_for(self, session: UploadSession) -> _Digests:
        if self.digests is None or self.digests.chunk_size != session.chunk_size:
            self.digests = _Digests(self.path, session.chunk_size)
        return self.digests

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
        """PUT the chunks the hub lacks, :data:`IN_FLIGHT` at a time (each on its own connection), in order."""
        missing = [index for index in range(session.chunk_count) if index not in set(session.received)]
        digests = self.digests_for(session)

        def put(index: int) -> None:
            with self.path.open("rb") as f:
                f.seek(index * session.chunk_size)
                data = f.read(chunk_length(session.size, session.chunk_size, index))
            headers = {CHUNK_SHA256_HEADER: digests.chunk(index), "Content-Type": CHUNK_MEDIA_TYPE}
            _checked(self.client.put(f"/artifacts/uploads/{session.id}/chunks/{index}", content=data, headers=headers), 204)

        with ThreadPoolExecutor(max_workers=IN_FLIGHT, thread_name_prefix="upload") as pool:
            sending: deque[Future[None]] = deque()
            try:
                for index in missing:
                    if len(sending) >= IN_FLIGHT:
                        sending.popleft().result()
                        progress()
                    sending.append(pool.submit(put, index))
                while sending:
                    sending.popleft().result()
                    progress()
            finally:
                for future in sending:
                    future.cancel()

    def commit(self, session: UploadSession) -> ArtifactPublic:
        """Commit with the file's SHA-256; None when the hub found the joined chunks other than the file (it dropped
        them: they are sent again)."""
        whole = self.digests_for(session).whole()
        r = self.client.post(f"/artifacts/uploads/{session.id}/commit", json={"sha256": whole})
        if r.status_code == 404:  # an earlier commit may have stored it before its answer was lost
            stored = self.find_stored(whole)
            if stored is not None:
                return stored
        return ArtifactPublic.model_validate_json(_checked(r, 201).content)

    def find_stored(self, whole: str) -> ArtifactPublic | None:
        r = self.client.post("/artifacts/uploads", json=self.identity)
        if r.status_code == 201:  # not stored after all: drop the session just made
            self.client.delete(f"/artifacts/uploads/{r.json()['id']}")
            return None
        doc = r.json() if r.status_code == 409 else {}
        if doc.get("code") != "artifact_exists" or doc.get("sha256") != whole:
            return None
        return ArtifactPublic.model_validate_json(_checked(self.client.get(f"/artifacts/{doc['artifact_id']}"), 200).content)


def _mismatch(exc: UploadRefused) -> bool:
    """The hub found the joined chunks other than the file (and dropped them)."""
    return exc.status == 422 and any(e.get("type") == "digest_mismatch" for e in exc.problem.get("errors") or [] if isinstance(e, dict))


def upload_artifact(
    hub_url: str, token: str, path: Path, *, kind: str, name: str, version: str, format: str, state_file: Path | None = None,
    verify: ssl.SSLContext | bool | str = True, timeout_s: float = 120.0, attempts: int = 10, transport: httpx.BaseTransport | None = None,
    server_name: str | None = None,
) -> ArtifactPublic:  # fmt: skip
    """Upload the file at ``path`` as the artefact ``kind`` ``name`` ``version`` (``format``) to the hub at
    ``hub_url`` (its base, e.g. ``https://hub:8443``) with an operator token or a training task's publish grant; resumes the session saved in
    ``state_file``. Gives up (``UploadError``) after ``attempts`` failures in a row without a chunk stored;
    ``UploadRefused`` at once when the hub refuses (4xx). ``server_name``: the name in the server's certificate when it
    is not the URL's host (a device's edge: its node id)."""
    stat = path.stat()
    identity = {"kind": kind, "name": name, "version": version, "format": format, "size": stat.st_size}
    state = _State(state_file, {**identity, "mtime_ns": stat.st_mtime_ns})
    timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0))
    headers = {"Authorization": f"Bearer {token}"}
    failures = 0
    resent = False

    def progress() -> None:
        nonlocal failures
        failures = 0

    with _Client(base_url=hub_url.rstrip("/") + API_PREFIX, headers=headers, timeout=timeout, verify=tls_verify(verify), transport=transport) as client:
        client.server_name = server_name
        uploader = _Uploader(client, path, identity, state)
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
            except UploadRefused as exc:
                if resent or not _mismatch(exc):
                    raise
                resent = True  # the chunks the hub held were not this file's (a resumed session of another one)
                log.warning("the chunks the hub held did not join to %s; sending them again", path.name)
                continue
            state.clear()
            log.info("uploaded %s as artifact %s (%d bytes)", path.name, artifact.id, artifact.size)
            return artifact


def hand_over(
    edge_url: str, token: str, path: Path, *, verify: ssl.SSLContext | bool | str = True, server_name: str | None = None, timeout_s: float = 120.0,
    attempts: int = 10, transport: httpx.BaseTransport | None = None,
) -> str:  # fmt: skip
    """Hand the update file at ``path`` to the aggregator on this device's edge (``PUT <edge>/api/v1/fl/updates`` with
    the round's publish grant, ``edge.fl.UpdateIntake``): one streamed request, sent again after a transport error or
    a 5xx (the edge's aggregator not started yet) up to ``attempts`` times. The id the edge answered (the file's
    SHA-256, checked here); ``UploadRefused`` at once on a 4xx, ``UploadError`` when it never got through."""
    from interfaces.tasks import FL_UPDATES_PATH

    digest = hashlib.sha256()
    with path.open("rb") as content:
        while block := content.read(1 << 20):
            digest.update(block)
    size, expected = path.stat().st_size, digest.hexdigest()
    timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0))
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/octet-stream", "Content-Length": str(size)}
    with _Client(base_url=edge_url.rstrip("/") + API_PREFIX, timeout=timeout, verify=tls_verify(verify), transport=transport) as client:
        client.server_name = server_name
        for failures in range(1, attempts + 1):
            try:
                with path.open("rb") as content:
                    response = _checked(client.put(FL_UPDATES_PATH, content=content, headers=headers), 201)
            except (httpx.TransportError, _Retry) as exc:
                if failures >= attempts:
                    raise UploadError(f"handing {path.name} to the edge failed {failures} times in a row: {exc}") from exc
                delay = reconnect_delay(failures)
                log.warning("handing %s to the edge failed (%s); again in %.1f s", path.name, exc, delay)
                time.sleep(delay)
                continue
            try:
                answered = json.loads(response.content)
            except ValueError as exc:
                raise UploadError(f"the edge answered no JSON: {exc}") from exc
            if not isinstance(answered, dict) or answered.get("id") != expected or answered.get("size") != size:
                raise UploadError(f"the edge kept another file than {path.name} ({str(answered)[:200]})")
            return expected
    raise UploadError(f"handing {path.name} to the edge failed")  # pragma: no cover - the loop returns or raises
