"""Artefacts over REST (DESIGN §4.2): streamed upload, signed manifests, Range downloads, download tokens,
binary deltas, and deletion refused while an artefact is in use."""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import bsdiff4
import pytest
from sqlmodel import Session, select

from cloud.artifacts import FileBlobStore, artifact_in_use, offer_delta
from cloud.tables import Artifact, ArtifactDelta, Deployment, Execution
from device.ota.verify import VerificationError, load_public_key, verify_manifest
from interfaces.auth import Role
from interfaces.deployments import DELTA_MEDIA_TYPE, DOWNLOAD_TOKEN_HEADER, SignedManifest
from tests.hub.conftest import SQLITE_ONLY, HubUnderTest, assert_problem, hub_settings, running_hub

PAYLOAD = os.urandom(100_000)


def upload(
    hub: HubUnderTest, data: bytes = PAYLOAD, role: Role | None = Role.OPERATOR, *,
    kind: str = "model", name: str = "detector", version: str = "1.0.0", format: str = "onnx", **kwargs: Any,
) -> Any:  # fmt: skip
    fields = {"kind": kind, "name": name, "version": version, "format": format}
    return hub.request("POST", "/artifacts", role, data=fields, files={"file": ("model.onnx", data, "application/octet-stream")}, **kwargs)


def stored(hub: HubUnderTest, data: bytes = PAYLOAD, **fields: str) -> dict[str, Any]:
    r = upload(hub, data, **fields)
    assert r.status_code == 201, r.text
    return r.json()  # type: ignore[no-any-return]


def blob_files(hub: HubUnderTest) -> list[Path]:
    """Every file under the blob store (blobs and temporary uploads)."""
    root = hub.settings.data_dir / "artifacts"
    return sorted(p for p in root.rglob("*") if p.is_file())


def add_deployment(hub: HubUnderTest, artifact_id: str, state: str) -> str:
    with Session(hub.engine) as session:
        now = datetime.now(UTC)
        row = Deployment(
            id="dep-" + os.urandom(6).hex(), artifact_id=artifact_id, kind="model", target={"kind": "device", "ids": ["d-x"]},
            strategy={"type": "all_at_once"}, max_failure_percent=0, failure_policy="halt", timeout_s=600, state=state,
            created_at=now, updated_at=now,
        )  # fmt: skip
        session.add(row)
        session.commit()
        return row.id


def set_deployment_state(hub: HubUnderTest, deployment_id: str, state: str) -> None:
    with Session(hub.engine) as session:
        row = session.get(Deployment, deployment_id)
        assert row is not None
        row.state = state
        session.add(row)
        session.commit()


# ---- upload, list, read ---------------------------------------------------------------------------


def test_upload_list_and_get(hub: HubUnderTest) -> None:
    # Execute
    r = upload(hub)

    # Assert
    assert r.status_code == 201, r.text
    created = r.json()
    assert r.headers["location"] == f"/api/v1/artifacts/{created['id']}"
    assert created["sha256"] == hashlib.sha256(PAYLOAD).hexdigest()
    assert created["size"] == len(PAYLOAD)
    assert (created["kind"], created["name"], created["version"], created["format"]) == ("model", "detector", "1.0.0", "onnx")
    assert created["content_url"] == f"/api/v1/artifacts/{created['id']}/content"
    manifest = created["signed_manifest"]["manifest"]
    assert manifest["sha256"] == created["sha256"] and manifest["size"] == len(PAYLOAD)
    assert hub.get(f"/artifacts/{created['id']}").json() == created
    assert hub.get("/artifacts").json() == {"items": [created], "next_cursor": None}


def test_list_filters_and_pages(hub: HubUnderTest) -> None:
    # Prepare
    ids = [stored(hub, os.urandom(100), version=f"1.0.{i}")["id"] for i in range(3)]
    firmware = stored(hub, os.urandom(100), kind="firmware", name="fw", format="firmware")["id"]

    # Execute
    first = hub.get("/artifacts", params={"kind": "model", "limit": 2}).json()
    second = hub.get("/artifacts", params={"kind": "model", "limit": 2, "cursor": first["next_cursor"]}).json()
    by_name = hub.get("/artifacts", params={"name": "fw"}).json()

    # Assert
    assert [a["id"] for a in first["items"] + second["items"]] == ids
    assert second["next_cursor"] is None
    assert [a["id"] for a in by_name["items"]] == [firmware]
    assert_problem(hub.get("/artifacts", params={"kind": "toaster"}), 422, "validation_failed")


def test_content_equals_the_upload(hub: HubUnderTest) -> None:
    # Prepare
    created = stored(hub)

    # Execute
    r = hub.get(f"/artifacts/{created['id']}/content")

    # Assert
    assert r.status_code == 200
    assert r.content == PAYLOAD
    assert r.headers["content-length"] == str(len(PAYLOAD))
    assert r.headers["accept-ranges"] == "bytes"
    assert r.headers["etag"] == f'"{created["sha256"]}"'
    assert r.headers["content-type"] == "application/octet-stream"


def test_same_bytes_under_two_versions_share_one_blob(hub: HubUnderTest) -> None:
    # Execute
    one = stored(hub, version="1.0.0")
    two = stored(hub, version="1.0.1")

    # Assert
    assert one["sha256"] == two["sha256"] and one["id"] != two["id"]
    assert len(blob_files(hub)) == 1


def test_a_large_upload_streams_past_the_json_body_limit(hub: HubUnderTest) -> None:
    # Prepare
    data = os.urandom(3 * 1024 * 1024 + 17)
    assert len(data) > hub.settings.max_body_bytes

    # Execute
    created = stored(hub, data)
    content = hub.get(f"/artifacts/{created['id']}/content")

    # Assert
    assert created["size"] == len(data)
    assert content.content == data


def test_fields_may_follow_the_file(hub: HubUnderTest) -> None:
    # Prepare: a hand-made body with the file part first
    boundary = "b0undary"
    parts = [("file", PAYLOAD, True), ("kind", b"model", False), ("name", b"late", False), ("version", b"2.0", False), ("format", b"onnx", False)]
    body = b"".join(
        f'--{boundary}\r\nContent-Disposition: form-data; name="{n}"{"; filename=x.bin" if f else ""}\r\n\r\n'.encode() + v + b"\r\n" for n, v, f in parts
    ) + f"--{boundary}--\r\n".encode()

    # Execute
    r = hub.request("POST", "/artifacts", Role.OPERATOR, content=body, headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})

    # Assert
    assert r.status_code == 201, r.text
    assert (r.json()["name"], r.json()["size"]) == ("late", len(PAYLOAD))


# ---- refused uploads ------------------------------------------------------------------------------


def test_viewer_may_not_upload_and_no_token_is_401(hub: HubUnderTest) -> None:
    # Execute
    viewer = upload(hub, role=Role.VIEWER)
    anonymous = upload(hub, role=None)

    # Assert
    assert_problem(viewer, 403, "forbidden")
    assert_problem(anonymous, 401, "unauthenticated")
    assert hub.get("/artifacts").json()["items"] == []
    assert blob_files(hub) == []


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"kind": "toaster"}, "kind"),
        ({"version": "one"}, "version"),
        ({"version": "1.0.0.0.0"}, "version"),
        ({"name": "../etc"}, "name"),
        ({"format": "exe"}, "format"),
    ],
)
def test_bad_fields_are_422_and_nothing_is_stored(hub: HubUnderTest, fields: dict[str, str], field: str) -> None:
    # Prepare
    before = hub.snapshot()

    # Execute
    r = upload(hub, **fields)

    # Assert
    problem = assert_problem(r, 422, "validation_failed")
    assert ["body", field] in [e["loc"] for e in problem["errors"]], problem
    assert hub.snapshot() == before
    assert blob_files(hub) == []


def test_missing_file_unknown_field_and_wrong_content_type(hub: HubUnderTest) -> None:
    # Prepare
    fields = {"kind": "model", "name": "m", "version": "1.0", "format": "onnx"}
    before = hub.snapshot()

    # Execute
    no_file = hub.request("POST", "/artifacts", Role.OPERATOR, data=fields, files={"other": ("x", b"x")})
    extra = hub.request("POST", "/artifacts", Role.OPERATOR, data={**fields, "colour": "red"}, files={"file": ("x", b"x")})
    json_body = hub.request("POST", "/artifacts", Role.OPERATOR, json=fields)

    # Assert
    problem = assert_problem(no_file, 422, "validation_failed")
    assert any(e["loc"][-1] in ("file", "other") for e in problem["errors"]), problem
    assert any(e["type"] == "extra_forbidden" for e in assert_problem(extra, 422, "validation_failed")["errors"])
    assert_problem(json_body, 415, "unsupported_media_type")
    assert hub.snapshot() == before
    assert blob_files(hub) == []


def test_duplicate_is_409_with_the_existing_id(hub: HubUnderTest) -> None:
    # Prepare
    first = stored(hub)
    before = hub.snapshot()

    # Execute
    again = upload(hub, os.urandom(1000))

    # Assert
    problem = assert_problem(again, 409, "artifact_exists")
    assert problem["artifact_id"] == first["id"]
    assert hub.snapshot() == before
    assert len(blob_files(hub)) == 1


def test_upload_above_the_configured_maximum_is_413_and_leaves_nothing(database_url: str, tmp_path: Path) -> None:
    for hub in running_hub(hub_settings(tmp_path, database_url, max_artifact_bytes=100 * 1024)):
        # Prepare
        before = hub.snapshot()

        def chunks() -> Iterator[bytes]:  # no Content-Length: the limit holds while streaming
            boundary = b"--xyz"
            yield boundary + b'\r\nContent-Disposition: form-data; name="kind"\r\n\r\nmodel\r\n'
            yield boundary + b'\r\nContent-Disposition: form-data; name="name"\r\n\r\nbig\r\n'
            yield boundary + b'\r\nContent-Disposition: form-data; name="version"\r\n\r\n1.0\r\n'
            yield boundary + b'\r\nContent-Disposition: form-data; name="format"\r\n\r\nbin\r\n'
            yield boundary + b'\r\nContent-Disposition: form-data; name="file"; filename="big.bin"\r\n\r\n'
            for _ in range(40):
                yield os.urandom(4096)
            yield b"\r\n" + boundary + b"--\r\n"

        # Execute
        with_length = upload(hub, os.urandom(100 * 1024 + 1))
        far_above = upload(hub, os.urandom(300 * 1024), version="3.0")  # refused on its Content-Length alone
        streamed = hub.request("POST", "/artifacts", Role.OPERATOR, content=chunks(), headers={"Content-Type": "multipart/form-data; boundary=xyz"})
        at_limit = upload(hub, os.urandom(100 * 1024), version="2.0")

        # Assert
        assert_problem(with_length, 413, "payload_too_large")
        assert_problem(far_above, 413, "payload_too_large")
        assert "content-length" not in streamed.request.headers
        assert_problem(streamed, 413, "payload_too_large")
        assert at_limit.status_code == 201, at_limit.text
        after = hub.snapshot()
        assert after["artifacts"] != before["artifacts"] and len(after["artifacts"]) == 1
        assert len(blob_files(hub)) == 1  # the one at the limit; no temporary file left behind


# ---- Range, ETag, If-Range ------------------------------------------------------------------------


@SQLITE_ONLY
@pytest.mark.parametrize(
    ("range_header", "first", "last"),
    [("bytes=0-99", 0, 99), ("bytes=99990-", 99_990, 99_999), ("bytes=-10", 99_990, 99_999), ("bytes=50-200000", 50, 99_999), ("bytes=-200000", 0, 99_999)],
)
def test_range_requests_are_206(hub: HubUnderTest, range_header: str, first: int, last: int) -> None:
    # Prepare
    created = stored(hub)

    # Execute
    r = hub.get(f"/artifacts/{created['id']}/content", headers={"Range": range_header})

    # Assert
    assert r.status_code == 206, r.text
    assert r.content == PAYLOAD[first : last + 1]
    assert r.headers["content-range"] == f"bytes {first}-{last}/{len(PAYLOAD)}"
    assert r.headers["content-length"] == str(last - first + 1)


@SQLITE_ONLY
@pytest.mark.parametrize("range_header", ["bytes=100000-", "bytes=200000-300000", "bytes=-0", "bytes=" + "9" * 5000 + "-"])
def test_unsatisfiable_range_is_416(hub: HubUnderTest, range_header: str) -> None:
    # Prepare
    created = stored(hub)

    # Execute
    r = hub.get(f"/artifacts/{created['id']}/content", headers={"Range": range_header})

    # Assert
    assert_problem(r, 416, "range_not_satisfiable")
    assert r.headers["content-range"] == f"bytes */{len(PAYLOAD)}"


@SQLITE_ONLY
@pytest.mark.parametrize("range_header", ["bytes=0-1,5-6", "items=0-5", "bytes=9-2", "bytes=abc"])
def test_several_or_malformed_ranges_get_everything(hub: HubUnderTest, range_header: str) -> None:
    # Prepare
    created = stored(hub)

    # Execute
    r = hub.get(f"/artifacts/{created['id']}/content", headers={"Range": range_header})

    # Assert
    assert r.status_code == 200
    assert r.content == PAYLOAD


def test_if_range_and_if_none_match(hub: HubUnderTest) -> None:
    # Prepare
    created = stored(hub)
    path = f"/artifacts/{created['id']}/content"
    etag = f'"{created["sha256"]}"'

    # Execute
    same = hub.get(path, headers={"Range": "bytes=10-19", "If-Range": etag})
    other = hub.get(path, headers={"Range": "bytes=10-19", "If-Range": '"' + "0" * 64 + '"'})
    cached = hub.get(path, headers={"If-None-Match": etag})

    # Assert
    assert (same.status_code, same.content) == (206, PAYLOAD[10:20])
    assert (other.status_code, other.content) == (200, PAYLOAD)
    assert (cached.status_code, cached.content, cached.headers["etag"]) == (304, b"", etag)


# ---- signatures and download tokens ---------------------------------------------------------------


def test_manifest_signature_verifies_with_the_published_key(hub: HubUnderTest) -> None:
    # Prepare
    created = stored(hub)
    pub = hub.get("/signing-key.pub", None)

    # Execute
    key = load_public_key(pub.text)
    signed = SignedManifest.model_validate(hub.get(f"/artifacts/{created['id']}").json()["signed_manifest"])
    tampered = signed.model_copy(update={"manifest": signed.manifest.model_copy(update={"size": signed.manifest.size + 1})})

    # Assert
    assert pub.status_code == 200 and pub.headers["content-type"].startswith("application/x-pem-file")
    assert pub.headers["x-key-id"] == signed.key_id
    verify_manifest(key, signed)
    with pytest.raises(VerificationError):
        verify_manifest(key, tampered)


def test_download_tokens(hub: HubUnderTest) -> None:
    # Prepare
    created = stored(hub)
    other = stored(hub, os.urandom(10), version="9.9")
    signing = hub.state.signing
    path = f"/artifacts/{created['id']}/content"
    good = signing.issue_download_token(created["id"], created["sha256"], "d-target", ttl_s=60)
    expired = signing.issue_download_token(created["id"], created["sha256"], "d-target", ttl_s=-1)
    for_other = signing.issue_download_token(other["id"], other["sha256"], "d-target", ttl_s=60)
    payload, signature = good.split(".")
    forged = payload + "." + signature[:-4] + ("AAAA" if not signature.endswith("AAAA") else "BBBB")

    # Execute
    ok = hub.get(path, None, headers={DOWNLOAD_TOKEN_HEADER: good, "Range": "bytes=0-9"})
    answers = {name: hub.get(path, None, headers={DOWNLOAD_TOKEN_HEADER: t}) for name, t in [("expired", expired), ("other", for_other), ("forged", forged), ("garbage", "x.y")]}
    no_credentials = hub.get(path, None)

    # Assert
    assert (ok.status_code, ok.content) == (206, PAYLOAD[:10])
    for r in answers.values():
        assert_problem(r, 401, "invalid_download_token")
    assert_problem(no_credentials, 401, "unauthenticated")


# ---- deltas ---------------------------------------------------------------------------------------


def test_delta_patches_the_base_into_the_target(hub: HubUnderTest) -> None:
    # Prepare
    base = os.urandom(200 * 1024)
    target = bytearray(base)
    for i in (10, 50_000, 150_000, 204_000):
        target[i] ^= 0xFF
    target = bytes(target) + b"tail"
    old = stored(hub, base, version="1.0.0")
    new = stored(hub, target, version="1.0.1")
    token = hub.state.signing.issue_download_token(new["id"], new["sha256"], "d-target", ttl_s=60, base_sha256=old["sha256"])

    # Execute
    r = hub.get(f"/artifacts/{new['id']}/delta", None, params={"from": old["sha256"]}, headers={DOWNLOAD_TOKEN_HEADER: token})
    again = hub.get(f"/artifacts/{new['id']}/delta", params={"from": old["sha256"]}, headers={"Range": "bytes=0-3"})

    # Assert
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == DELTA_MEDIA_TYPE
    assert r.headers["x-delta-base"] == old["sha256"]
    assert r.headers["x-delta-sha256"] == hashlib.sha256(r.content).hexdigest()
    assert bsdiff4.patch(base, r.content) == target
    assert len(r.content) < len(target) // 20
    assert (again.status_code, again.content) == (206, r.content[:4])
    with Session(hub.engine) as session:
        assert len(session.exec(select(ArtifactDelta)).all()) == 1  # computed once


def test_no_delta_for_an_unknown_base_or_one_not_worth_it(hub: HubUnderTest) -> None:
    # Prepare
    old = stored(hub, os.urandom(5000), version="1.0.0")
    new = stored(hub, os.urandom(5000), version="1.0.1")  # unrelated bytes: a patch is no smaller

    # Execute
    unknown = hub.get(f"/artifacts/{new['id']}/delta", params={"from": "ab" * 32})
    useless = hub.get(f"/artifacts/{new['id']}/delta", params={"from": old["sha256"]})
    malformed = hub.get(f"/artifacts/{new['id']}/delta", params={"from": "nope"})

    # Assert
    assert_problem(unknown, 404, "not_found")
    assert_problem(useless, 404, "not_found")
    assert_problem(malformed, 422, "validation_failed")


def test_concurrent_delta_offers_record_one_row(hub: HubUnderTest) -> None:
    # Prepare
    base = os.urandom(64 * 1024)
    old = stored(hub, base, version="1.0.0")
    new = stored(hub, base + b"more", version="1.0.1")
    offers: list[Any] = []

    def offer() -> None:
        with Session(hub.engine, expire_on_commit=False) as session:
            target = session.get(Artifact, new["id"])
            assert target is not None
            offers.append(offer_delta(session, hub.state.blobs, old["sha256"], target))
            session.commit()

    # Execute
    threads = [threading.Thread(target=offer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    # Assert
    assert len(offers) == 4 and all(o is not None for o in offers)
    assert len({o.sha256 for o in offers}) == 1
    with Session(hub.engine) as session:
        rows = session.exec(select(ArtifactDelta)).all()
    assert len(rows) == 1 and rows[0].sha256 == offers[0].sha256
    assert hub.state.blobs.exists(offers[0].sha256)


def test_a_delta_recorded_by_another_process_wins_and_keeps_the_callers_work(hub: HubUnderTest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another hub process recorded the pair between our look-up and our insert: its row stands, ours is
    rolled back to the savepoint only (the caller's pending work survives), and our patch blob is removed."""
    # Prepare
    from cloud.artifacts import deltas as service

    base = os.urandom(32 * 1024)
    old = stored(hub, base, version="1.0.0")
    new = stored(hub, base + b"x", version="1.0.1")
    theirs = hub.state.blobs.put_bytes(b"their patch")
    with Session(hub.engine) as session:
        session.add(ArtifactDelta(base_sha256=old["sha256"], target_sha256=new["sha256"], sha256=theirs[0], size=theirs[1], created_at=datetime.now(UTC)))
        session.commit()
    real, misses = service._recorded, iter([None, None])
    monkeypatch.setattr(service, "_recorded", lambda *a: next(misses, None) or real(*a))
    deployment_id = "dep-pending-work"

    # Execute
    with Session(hub.engine, expire_on_commit=False) as session:
        now = datetime.now(UTC)
        session.add(Deployment(
            id=deployment_id, artifact_id=new["id"], kind="model", target={}, strategy={}, max_failure_percent=0,
            failure_policy="halt", timeout_s=1, state="SUCCEEDED", created_at=now, updated_at=now,
        ))  # fmt: skip
        target = session.get(Artifact, new["id"])
        assert target is not None
        offer = offer_delta(session, hub.state.blobs, old["sha256"], target)
        session.commit()

    # Assert
    assert offer is not None and offer.sha256 == theirs[0]
    with Session(hub.engine) as session:
        assert session.get(Deployment, deployment_id) is not None
        assert len(session.exec(select(ArtifactDelta)).all()) == 1
    assert len(blob_files(hub)) == 3  # two artefacts and their patch: ours is gone


# ---- delete ---------------------------------------------------------------------------------------


def test_delete_is_refused_while_a_deployment_uses_it(hub: HubUnderTest) -> None:
    # Prepare
    created = stored(hub)
    deployment = add_deployment(hub, created["id"], "RUNNING")
    before = hub.snapshot()

    # Execute
    refused = hub.request("DELETE", f"/artifacts/{created['id']}", Role.OPERATOR)
    after_refusal = hub.snapshot()
    set_deployment_state(hub, deployment, "SUCCEEDED")
    allowed = hub.request("DELETE", f"/artifacts/{created['id']}", Role.OPERATOR)

    # Assert
    problem = assert_problem(refused, 409, "artifact_in_use")
    assert deployment in problem["reason"]
    assert after_refusal == before
    assert allowed.status_code == 204, allowed.text
    assert_problem(hub.get(f"/artifacts/{created['id']}"), 404, "not_found")
    assert blob_files(hub) == []
    # the final deployment stays listed, without its artefact
    listed = hub.get("/deployments")
    assert listed.status_code == 200, listed.text
    assert [d["artifact"] for d in listed.json()["items"] if d["id"] == deployment] == [None]


def test_in_use_by_executions_and_as_a_rollback_target(hub: HubUnderTest) -> None:
    # Prepare
    old = stored(hub, os.urandom(100), version="1.0.0")
    new = stored(hub, os.urandom(100), version="2.0.0")
    deployment = add_deployment(hub, new["id"], "SUCCEEDED")
    now = datetime.now(UTC)
    with Session(hub.engine) as session:
        session.add(Execution(
            id="x-1", deployment_id=deployment, target_kind="device", target_id="d-1", state="INSTALLING",
            previous={"name": "detector", "version": "1.0.0", "sha256": old["sha256"]}, updated_at=now,
        ))  # fmt: skip
        session.commit()

    def reasons() -> tuple[str | None, str | None]:
        with Session(hub.engine) as session:
            return artifact_in_use(session, old["id"]), artifact_in_use(session, new["id"])

    # Execute
    in_flight = reasons()
    with Session(hub.engine) as session:
        row = session.get(Execution, "x-1")
        assert row is not None
        row.state = "ACTIVE"
        session.add(row)
        session.commit()
    active = reasons()
    with Session(hub.engine) as session:
        row = session.get(Execution, "x-1")
        assert row is not None
        row.state = "ROLLED_BACK"
        session.add(row)
        session.commit()
    done = reasons()

    # Assert
    assert in_flight[0] is None and "INSTALLING" in (in_flight[1] or "")
    assert "rollback target" in (active[0] or "") and "ACTIVE" in (active[1] or "")
    assert done == (None, None)


def test_a_shared_blob_outlives_one_of_its_artefacts(hub: HubUnderTest) -> None:
    # Prepare
    one = stored(hub, version="1.0.0")
    two = stored(hub, version="1.0.1")

    # Execute
    first = hub.request("DELETE", f"/artifacts/{one['id']}", Role.OPERATOR)
    content = hub.get(f"/artifacts/{two['id']}/content")
    second = hub.request("DELETE", f"/artifacts/{two['id']}", Role.OPERATOR)

    # Assert
    assert first.status_code == 204 and second.status_code == 204
    assert content.content == PAYLOAD
    assert blob_files(hub) == []


def test_viewer_may_not_delete(hub: HubUnderTest) -> None:
    # Prepare
    created = stored(hub)

    # Execute
    r = hub.request("DELETE", f"/artifacts/{created['id']}", Role.VIEWER)

    # Assert
    assert_problem(r, 403, "forbidden")
    assert hub.get(f"/artifacts/{created['id']}").status_code == 200


# ---- enrolment and the blob store ------------------------------------------------------------------


def test_enrolment_answer_pins_the_signing_key(hub: HubUnderTest) -> None:
    # Prepare
    registered = hub.register("gw-ota")

    # Execute
    r = hub.enrol(registered["node"]["id"], registered["bootstrap_token"])

    # Assert
    assert r.status_code == 201, r.text
    assert r.json()["signing_key_pem"] == hub.get("/signing-key.pub", None).text


def test_file_blob_store_abandons_uncommitted_writes(tmp_path: Path) -> None:
    # Prepare
    store = FileBlobStore(tmp_path / "blobs")

    # Execute
    with pytest.raises(RuntimeError), store.writer() as writer:
        writer.write(b"half")
        raise RuntimeError("client went away")
    sha, size = store.put_bytes(b"whole")

    # Assert
    assert (sha, size) == (hashlib.sha256(b"whole").hexdigest(), 5)
    assert store.temporary_files() == []
    assert store.path(sha) == tmp_path / "blobs" / sha[:2] / sha[2:]
    with store.open(sha) as f:
        assert f.read() == b"whole"
    store.delete(sha)
    assert not store.exists(sha) and store.path(sha) is None
    with pytest.raises(ValueError):
        store.open("../../etc/passwd")
