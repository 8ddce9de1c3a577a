"""Chunked, resumable uploads (/artifacts/uploads): a session, chunks PUT in any order and again, resumption after a
restart of the hub, the commit that stores and signs the artefact as POST /artifacts does, and every bad input
refused with a problem and nothing stored."""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlmodel import Session

from cloud.artifacts.uploads import ChunkStaging, UploadArea, _carry_on
from cloud.errors import NotFound
from cloud.tables import ArtifactUpload
from device.ota.verify import load_public_key, verify_manifest
from interfaces.auth import Role
from interfaces.deployments import SignedManifest
from interfaces.uploads import CHUNK_SHA256_HEADER
from tests.hub.conftest import HubUnderTest, assert_problem, hub_settings, running_hub

CHUNK = 64 * 1024
DATA = os.urandom(3 * CHUNK + 1000)  # four chunks, the last one short


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def piece(data: bytes, index: int) -> bytes:
    return data[index * CHUNK : (index + 1) * CHUNK]


@pytest.fixture
def hub(sqlite_url: str, tmp_path: Path) -> Iterator[HubUnderTest]:
    yield from running_hub(hub_settings(tmp_path, sqlite_url, upload_chunk_bytes=CHUNK))


def start(hub: HubUnderTest, data: bytes = DATA, role: Role = Role.OPERATOR, **fields: Any) -> httpx.Response:
    body = {"kind": "model", "name": "detector", "version": "1.0.0", "format": "onnx", "size": len(data), "sha256": sha(data), **fields}
    return hub.request("POST", "/artifacts/uploads", role, json=body)


def session_of(hub: HubUnderTest, data: bytes = DATA) -> dict[str, Any]:
    r = start(hub, data)
    assert r.status_code == 201, r.text
    return r.json()  # type: ignore[no-any-return]


def put(hub: HubUnderTest, upload_id: str, index: int, data: bytes, digest: str | None = None, role: Role = Role.OPERATOR) -> httpx.Response:
    headers = {CHUNK_SHA256_HEADER: digest or sha(data), "Content-Type": "application/octet-stream"}
    return hub.request("PUT", f"/artifacts/uploads/{upload_id}/chunks/{index}", role, content=data, headers=headers)


def expire(hub: HubUnderTest, upload_id: str) -> None:
    with Session(hub.engine) as session:
        row = session.get(ArtifactUpload, upload_id)
        assert row is not None
        row.expires_at = datetime.now(UTC) - timedelta(seconds=1)
        session.add(row)
        session.commit()


def staged_files(hub: HubUnderTest) -> list[Path]:
    root = hub.settings.data_dir / "uploads"
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


def blob_files(hub: HubUnderTest) -> list[Path]:
    root = hub.settings.data_dir / "artifacts"
    return sorted(p for p in root.rglob("*") if p.is_file())


def test_chunks_in_any_order_and_again_commit_to_a_signed_artefact(hub: HubUnderTest) -> None:
    # Prepare
    upload = session_of(hub)
    assert (upload["chunk_size"], upload["chunk_count"], upload["received"]) == (CHUNK, 4, [])

    # Execute
    for index in (3, 1, 0, 1, 2):  # chunk 1 twice: a retry of a stored chunk
        r = put(hub, upload["id"], index, piece(DATA, index))
        assert r.status_code == 204, r.text
    resumed = hub.request("GET", f"/artifacts/uploads/{upload['id']}", Role.OPERATOR).json()
    r = hub.request("POST", f"/artifacts/uploads/{upload['id']}/commit", Role.OPERATOR)

    # Assert
    assert resumed["received"] == [0, 1, 2, 3]
    assert r.status_code == 201, r.text
    artifact = r.json()
    assert (artifact["sha256"], artifact["size"], artifact["name"]) == (sha(DATA), len(DATA), "detector")
    assert hub.get(f"/artifacts/{artifact['id']}/content").content == DATA
    key = load_public_key(hub.get("/signing-key.pub").content)
    verify_manifest(key, SignedManifest.model_validate(artifact["signed_manifest"]))
    assert staged_files(hub) == []
    assert_problem(hub.request("GET", f"/artifacts/uploads/{upload['id']}", Role.OPERATOR), 404, "not_found")
    assert_problem(start(hub), 409, "artifact_exists")


def test_an_upload_resumes_after_the_hub_restarts(sqlite_url: str, tmp_path: Path) -> None:
    # Prepare
    settings = hub_settings(tmp_path, sqlite_url, upload_chunk_bytes=CHUNK)
    first = running_hub(settings)
    hub = next(first)
    upload = session_of(hub)
    assert put(hub, upload["id"], 0, piece(DATA, 0)).status_code == 204
    assert put(hub, upload["id"], 2, piece(DATA, 2)).status_code == 204
    first.close()

    # Execute
    again = running_hub(settings)
    hub = next(again)
    try:
        received = hub.request("GET", f"/artifacts/uploads/{upload['id']}", Role.OPERATOR).json()["received"]
        for index in sorted(set(range(4)) - set(received)):
            assert put(hub, upload["id"], index, piece(DATA, index)).status_code == 204
        r = hub.request("POST", f"/artifacts/uploads/{upload['id']}/commit", Role.OPERATOR)

        # Assert
        assert received == [0, 2]
        assert r.status_code == 201, r.text
        assert hub.get(f"/artifacts/{r.json()['id']}/content").content == DATA
    finally:
        again.close()


@pytest.mark.parametrize("case", ["bad hash", "short", "long", "index out of range", "other bytes for a stored chunk", "not octet-stream"])
def test_a_bad_chunk_is_refused_and_nothing_is_kept(hub: HubUnderTest, case: str) -> None:
    # Prepare
    upload = session_of(hub)
    assert put(hub, upload["id"], 0, piece(DATA, 0)).status_code == 204
    before, files = hub.snapshot(), staged_files(hub)
    other = os.urandom(CHUNK)

    # Execute
    if case == "bad hash":
        r = put(hub, upload["id"], 1, piece(DATA, 1), digest=sha(b"other"))
    elif case == "short":
        r = put(hub, upload["id"], 1, piece(DATA, 1)[:-1])
    elif case == "long":
        r = put(hub, upload["id"], 3, piece(DATA, 3) + b"x")
    elif case == "index out of range":
        r = put(hub, upload["id"], 4, piece(DATA, 3))
    elif case == "other bytes for a stored chunk":
        r = put(hub, upload["id"], 0, other)
    else:
        r = hub.request("PUT", f"/artifacts/uploads/{upload['id']}/chunks/1", Role.OPERATOR, json={"x": 1}, headers={CHUNK_SHA256_HEADER: sha(b"")})

    # Assert
    status, code = {"other bytes for a stored chunk": (409, "conflict"), "not octet-stream": (415, "unsupported_media_type")}.get(case, (422, "validation_failed"))
    assert_problem(r, status, code)
    assert hub.snapshot() == before
    assert staged_files(hub) == files
    assert hub.request("GET", f"/artifacts/uploads/{upload['id']}", Role.OPERATOR).json()["received"] == [0]


def test_a_commit_with_missing_chunks_is_refused_and_the_session_kept(hub: HubUnderTest) -> None:
    # Prepare
    upload = session_of(hub)
    for index in (0, 1, 3):
        assert put(hub, upload["id"], index, piece(DATA, index)).status_code == 204
    before = hub.snapshot()

    # Execute
    r = hub.request("POST", f"/artifacts/uploads/{upload['id']}/commit", Role.OPERATOR)

    # Assert
    doc = assert_problem(r, 422, "validation_failed")
    assert "first missing: 2" in doc["detail"]
    assert hub.snapshot() == before and blob_files(hub) == []
    assert hub.request("GET", f"/artifacts/uploads/{upload['id']}", Role.OPERATOR).json()["received"] == [0, 1, 3]


def test_a_whole_hash_mismatch_stores_nothing_and_keeps_the_session_to_send_again(hub: HubUnderTest) -> None:
    # Prepare: the chunks of other bytes of the same size, each with its own correct hash
    upload = session_of(hub)
    other = os.urandom(len(DATA))
    for index in range(4):
        assert put(hub, upload["id"], index, piece(other, index)).status_code == 204
    before = hub.snapshot()

    # Execute
    r = hub.request("POST", f"/artifacts/uploads/{upload['id']}/commit", Role.OPERATOR)
    resumed = hub.request("GET", f"/artifacts/uploads/{upload['id']}", Role.OPERATOR).json()
    for index in range(4):
        assert put(hub, upload["id"], index, piece(DATA, index)).status_code == 204
    again = hub.request("POST", f"/artifacts/uploads/{upload['id']}/commit", Role.OPERATOR)

    # Assert
    assert_problem(r, 422, "validation_failed")
    assert before["artifacts"] == [] and resumed["received"] == []
    assert again.status_code == 201, again.text
    assert again.json()["sha256"] == sha(DATA)


def test_an_expired_or_unknown_session_is_not_found_and_its_chunks_removed(hub: HubUnderTest) -> None:
    # Prepare
    upload = session_of(hub)
    assert put(hub, upload["id"], 0, piece(DATA, 0)).status_code == 204
    expire(hub, upload["id"])

    # Execute
    expired = put(hub, upload["id"], 1, piece(DATA, 1))
    unknown = [
        hub.request("GET", "/artifacts/uploads/upl-00000000000000000000000000", Role.OPERATOR),
        put(hub, "upl-00000000000000000000000000", 0, piece(DATA, 0)),
        hub.request("POST", "/artifacts/uploads/nope/commit", Role.OPERATOR),
        hub.request("DELETE", "/artifacts/uploads/nope", Role.OPERATOR),
    ]

    # Assert
    assert "expired" in assert_problem(expired, 404, "not_found")["detail"]
    for r in unknown:
        assert_problem(r, 404, "not_found")
    assert hub.snapshot()["artifact_uploads"] == [] and staged_files(hub) == []
    assert not (hub.settings.data_dir / "uploads" / upload["id"]).exists()


def test_a_new_session_removes_expired_ones(hub: HubUnderTest) -> None:
    # Prepare
    old = session_of(hub)
    assert put(hub, old["id"], 0, piece(DATA, 0)).status_code == 204
    expire(hub, old["id"])

    # Execute
    new = session_of(hub, DATA[:10])

    # Assert
    assert [(p.parent.name, p.name) for p in staged_files(hub)] == [(new["id"], "data")]  # the new one's, empty so far
    assert (hub.settings.data_dir / "uploads" / new["id"] / "data").stat().st_size == 0
    assert not (hub.settings.data_dir / "uploads" / old["id"]).exists()


def test_abort_removes_the_session_and_its_chunks(hub: HubUnderTest) -> None:
    # Prepare
    upload = session_of(hub)
    assert put(hub, upload["id"], 0, piece(DATA, 0)).status_code == 204

    # Execute
    r = hub.request("DELETE", f"/artifacts/uploads/{upload['id']}", Role.OPERATOR)

    # Assert
    assert r.status_code == 204
    assert staged_files(hub) == [] and hub.snapshot()["artifact_uploads"] == []
    assert_problem(hub.request("GET", f"/artifacts/uploads/{upload['id']}", Role.OPERATOR), 404, "not_found")


@pytest.mark.parametrize("fields", [
    {"size": "10"}, {"size": True}, {"size": 10.0}, {"size": 0}, {"size": 2**63}, {"sha256": "A" * 64}, {"kind": "weights"},
    {"version": "latest"}, {"extra": 1},
])  # fmt: skip
def test_a_session_body_is_read_strictly(hub: HubUnderTest, fields: dict[str, Any]) -> None:
    # Prepare
    before = hub.snapshot()

    # Execute
    r = start(hub, **fields)

    # Assert
    assert_problem(r, 422, "validation_failed")
    assert hub.snapshot() == before


def test_a_session_larger_than_the_artefact_limit_is_refused(hub: HubUnderTest) -> None:
    assert_problem(start(hub, size=hub.settings.max_artifact_bytes + 1), 422, "validation_failed")
    assert hub.snapshot()["artifact_uploads"] == []


def test_a_viewer_may_not_upload(hub: HubUnderTest) -> None:
    # Prepare
    upload = session_of(hub)
    before, files = hub.snapshot(), staged_files(hub)

    # Execute
    answers = [
        start(hub, DATA, Role.VIEWER, version="2.0.0"),
        hub.request("GET", f"/artifacts/uploads/{upload['id']}", Role.VIEWER),
        put(hub, upload["id"], 0, piece(DATA, 0), role=Role.VIEWER),
        hub.request("POST", f"/artifacts/uploads/{upload['id']}/commit", Role.VIEWER),
        hub.request("DELETE", f"/artifacts/uploads/{upload['id']}", Role.VIEWER),
    ]

    # Assert
    for r in answers:
        assert_problem(r, 403, "forbidden")
    assert hub.snapshot() == before and staged_files(hub) == files


def test_other_methods_answer_405_with_the_methods_of_the_upload_paths(hub: HubUnderTest) -> None:
    # Prepare
    upload = session_of(hub)
    chunk = f"/artifacts/uploads/{upload['id']}/chunks/0"

    # Execute
    posted = hub.request("POST", chunk, Role.OPERATOR, content=b"x", headers={CHUNK_SHA256_HEADER: sha(b"x"), "Content-Type": "application/octet-stream"})
    options = hub.request("OPTIONS", "/artifacts/uploads", Role.OPERATOR)

    # Assert
    assert_problem(posted, 405, "method_not_allowed")
    assert posted.headers["allow"] == "PUT"
    assert_problem(options, 405, "method_not_allowed")
    assert options.headers["allow"] == "POST"


# --- the whole SHA-256: declared in the commit, computed as the chunks arrive ----------------------------------


def commit(hub: HubUnderTest, upload_id: str, **body: Any) -> httpx.Response:
    return hub.request("POST", f"/artifacts/uploads/{upload_id}/commit", Role.OPERATOR, json=body or None)


def test_a_session_started_without_its_sha256_declares_it_in_the_commit(hub: HubUnderTest) -> None:
    # Prepare
    r = hub.request("POST", "/artifacts/uploads", Role.OPERATOR, json={"kind": "model", "name": "detector", "version": "1.0.0", "format": "onnx", "size": len(DATA)})
    assert r.status_code == 201, r.text
    upload = r.json()
    for index in range(4):
        assert put(hub, upload["id"], index, piece(DATA, index)).status_code == 204
    before = hub.snapshot()

    # Execute
    undeclared = commit(hub, upload["id"])
    strict = commit(hub, upload["id"], sha256=sha(DATA).upper())
    held = hub.request("GET", f"/artifacts/uploads/{upload['id']}", Role.OPERATOR).json()["received"]
    refused = hub.snapshot()
    declared = commit(hub, upload["id"], sha256=sha(DATA))

    # Assert
    assert upload["sha256"] is None
    doc = assert_problem(undeclared, 422, "validation_failed")
    assert doc["errors"][0]["loc"] == ["body", "sha256"] and "declare it in the commit" in doc["detail"]
    assert_problem(strict, 422, "validation_failed")
    assert refused == before and before["artifacts"] == [] and held == [0, 1, 2, 3]
    assert declared.status_code == 201, declared.text
    assert declared.json()["sha256"] == sha(DATA)
    assert hub.get(f"/artifacts/{declared.json()['id']}/content").content == DATA


def test_a_commit_declaring_another_sha256_than_its_session_changes_nothing(hub: HubUnderTest) -> None:
    # Prepare
    upload = session_of(hub)
    for index in range(4):
        assert put(hub, upload["id"], index, piece(DATA, index)).status_code == 204
    before, files = hub.snapshot(), staged_files(hub)

    # Execute
    r = commit(hub, upload["id"], sha256=sha(b"other"))

    # Assert
    doc = assert_problem(r, 422, "validation_failed")
    assert f"was started with SHA-256 {sha(DATA)}" in doc["detail"]
    assert hub.snapshot() == before and staged_files(hub) == files
    assert commit(hub, upload["id"], sha256=sha(DATA)).status_code == 201


def test_chunks_sent_in_order_are_hashed_as_they_arrive_so_the_commit_reads_nothing_again(hub: HubUnderTest, caplog: pytest.LogCaptureFixture) -> None:
    # Prepare
    upload = session_of(hub)
    for index in range(4):
        assert put(hub, upload["id"], index, piece(DATA, index)).status_code == 204
    area = UploadArea(hub.settings.data_dir / "uploads")
    deadline = time.monotonic() + 60  # the follower thread carries the hash on; a busy machine may take a while
    while (chain := area.existing_chain(upload["id"])) is None or chain.offset < len(DATA):
        assert time.monotonic() < deadline, "the whole SHA-256 was never carried through the chunks held"
        time.sleep(0.02)

    # Execute
    with caplog.at_level(logging.INFO, logger="aisynergy.hub.uploads"):
        r = commit(hub, upload["id"])

    # Assert
    assert r.status_code == 201, r.text
    assert f"(0 of its {len(DATA)} bytes read again to hash them)" in caplog.text
    assert hub.get(f"/artifacts/{r.json()['id']}/content").content == DATA


def writer(hub: HubUnderTest, upload: dict[str, Any], index: int, data: bytes) -> ChunkStaging:
    """A writer of one chunk, as the chunk route makes it (for interleavings no HTTP client can time)."""
    area = UploadArea(hub.settings.data_dir / "uploads")
    return ChunkStaging(area, upload["id"], index, len(piece(DATA, index)), sha(data), CHUNK, len(DATA))


def test_a_chunk_is_not_hashed_ahead_while_another_writer_of_it_may_still_write(hub: HubUnderTest) -> None:
    # Prepare: two writers of chunk 0 at once; the first stores it while the second is still open
    upload = session_of(hub)
    first, second = writer(hub, upload, 0, piece(DATA, 0)), writer(hub, upload, 0, piece(DATA, 0))
    first.write_all([piece(DATA, 0)])
    assert first.finish() is True
    area = UploadArea(hub.settings.data_dir / "uploads")
    chain = area.chain(upload["id"], CHUNK, len(DATA))
    fd = os.open(area.data(upload["id"]), os.O_RDONLY)
    try:
        # Execute
        with chain.lock:
            while_open = _carry_on(area, upload["id"], chain, fd, settled_only=True)
        second.discard()
        with chain.lock:
            after = _carry_on(area, upload["id"], chain, fd, settled_only=True)
    finally:
        os.close(fd)

    # Assert
    assert while_open == 0 and after == CHUNK
    assert chain.hash.hexdigest() == sha(piece(DATA, 0))


def test_bytes_of_an_overlapping_writer_are_found_at_commit_and_the_chunks_sent_again(hub: HubUnderTest) -> None:
    # Prepare: a second writer of chunk 0 with other bytes writes over part of the first's before the first stores it
    upload = session_of(hub)
    other = os.urandom(CHUNK)
    first, second = writer(hub, upload, 0, piece(DATA, 0)), writer(hub, upload, 0, other)
    first.write_all([piece(DATA, 0)])
    second.write_all([other[: CHUNK // 2]])
    assert first.finish() is True
    second.discard()  # cut mid-way: its bytes stay in the file, its mark says it is done
    for index in (1, 2, 3):
        assert put(hub, upload["id"], index, piece(DATA, index)).status_code == 204

    # Execute
    mixed = commit(hub, upload["id"])
    stored = hub.snapshot()["artifacts"]
    for index in range(4):
        assert put(hub, upload["id"], index, piece(DATA, index)).status_code == 204
    again = commit(hub, upload["id"])

    # Assert
    doc = assert_problem(mixed, 422, "validation_failed")
    assert doc["errors"][0]["type"] == "digest_mismatch" and stored == []
    assert again.status_code == 201, again.text
    assert hub.get(f"/artifacts/{again.json()['id']}/content").content == DATA


def test_a_writer_still_open_at_the_commit_cannot_touch_the_artefact(hub: HubUnderTest) -> None:
    # Prepare: a request for chunk 1 that hangs on while a retry of it and the other chunks arrive
    upload = session_of(hub)
    stale = writer(hub, upload, 1, b"\0" * CHUNK)
    for index in range(4):
        assert put(hub, upload["id"], index, piece(DATA, index)).status_code == 204
    r = commit(hub, upload["id"])
    assert r.status_code == 201, r.text

    # Execute
    stale.write_all([b"\0" * CHUNK])
    with pytest.raises(NotFound):
        stale.finish()
    stale.discard()

    # Assert
    assert hub.get(f"/artifacts/{r.json()['id']}/content").content == DATA
    blob = hub.settings.data_dir / "artifacts" / sha(DATA)[:2] / sha(DATA)[2:]
    assert blob.read_bytes() == DATA
