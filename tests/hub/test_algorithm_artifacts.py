"""Algorithm artefacts (issue 18): a package built by ``aisynergy algorithm build`` is stored and signed like any
artefact, through ``POST /artifacts``, the chunked upload API and ``aisynergy algorithm upload``; a package the hub
cannot run (not a zip, no manifest, a bad manifest, another name or version, a member that leaves its folder) is
refused with a 422 that says why, and nothing of it is kept. An algorithm is not something to deploy."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from device.algorithm.cli import algorithm
from device.algorithm.package import build
from device.ota.verify import load_public_key, verify_manifest
from interfaces.auth import Role
from interfaces.deployments import SignedManifest
from interfaces.uploads import CHUNK_SHA256_HEADER
from tests.hub.conftest import HubUnderTest, assert_problem, hub_settings, running_hub
from tests.hub.live import serve

CODE = "validation_failed"
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "algorithms" / "numpy_cnn"


@pytest.fixture
def hub(sqlite_url: str, tmp_path: Path) -> Iterator[HubUnderTest]:
    yield from running_hub(hub_settings(tmp_path / "hub", sqlite_url))


@pytest.fixture
def package(tmp_path: Path) -> Path:
    source = tmp_path / "src"
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("__pycache__", "dist"))
    return build(source, tmp_path / "dist")


def manifest_of(path: Path) -> dict[str, Any]:
    with zipfile.ZipFile(path) as archive:
        return json.loads(archive.read("algorithm.json"))  # type: ignore[no-any-return]


def post(hub: HubUnderTest, data: bytes, name: str = "digits-numpy-cnn", version: str = "1.0.0", fmt: str = "zip") -> httpx.Response:
    fields = {"kind": "algorithm", "name": name, "version": version, "format": fmt}
    return hub.request("POST", "/artifacts", Role.OPERATOR, data=fields, files={"file": ("a.zip", data, "application/zip")})


def blob_files(hub: HubUnderTest) -> list[Path]:
    root = hub.settings.data_dir / "artifacts"
    return sorted(p for p in root.rglob("*") if p.is_file() and ".tmp" not in p.parts)


def zip_of(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def test_a_built_package_is_stored_and_signed(hub: HubUnderTest, package: Path) -> None:
    # Prepare
    manifest = manifest_of(package)

    # Execute
    r = post(hub, package.read_bytes(), manifest["name"], manifest["version"])

    # Assert
    assert r.status_code == 201, r.text
    artifact = r.json()
    assert (artifact["kind"], artifact["format"], artifact["sha256"]) == ("algorithm", "zip", hashlib.sha256(package.read_bytes()).hexdigest())
    key = load_public_key(hub.get("/signing-key.pub").content)
    verify_manifest(key, SignedManifest.model_validate(artifact["signed_manifest"]))
    assert hub.get(f"/artifacts/{artifact['id']}/content").content == package.read_bytes()


def _bad_manifest(package: Path, **change: Any) -> bytes:
    manifest = {**manifest_of(package), **change}
    with zipfile.ZipFile(package) as archive:
        members = {n: archive.read(n) for n in archive.namelist()}
    return zip_of({**members, "algorithm.json": json.dumps(manifest).encode()})


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("not_a_zip", "not a zip file"),
        ("no_manifest", "no algorithm.json"),
        ("manifest_not_json", "not a valid manifest"),
        ("bad_entry_point", "entry_point"),
        ("bad_specifier", "PEP 440"),
        ("schema_not_object", "config_schema"),
        ("other_version", "the artefact digits-numpy-cnn 1.0.0"),
        ("escaping_member", "outside the package"),
        ("absolute_member", "outside the package"),
        ("tar_format", "format zip"),
    ],
)
def test_a_package_the_hub_cannot_run_is_refused_and_nothing_kept(hub: HubUnderTest, package: Path, case: str, expected: str) -> None:
    # Prepare
    good = package.read_bytes()
    data, fmt = {
        "not_a_zip": (b"PK\x03\x04 but not really a zip", "zip"),
        "no_manifest": (zip_of({"numpy_cnn/__init__.py": b""}), "zip"),
        "manifest_not_json": (zip_of({"algorithm.json": b"{not json"}), "zip"),
        "bad_entry_point": (_bad_manifest(package, entry_point="numpy_cnn.client"), "zip"),
        "bad_specifier": (_bad_manifest(package, frameworks={"numpy": "at least 1"}), "zip"),
        "schema_not_object": (_bad_manifest(package, config_schema={"type": "array"}), "zip"),
        "other_version": (_bad_manifest(package, version="2.0.0"), "zip"),
        "escaping_member": (zip_of({"algorithm.json": json.dumps(manifest_of(package)).encode(), "../evil.py": b"x"}), "zip"),
        "absolute_member": (zip_of({"algorithm.json": json.dumps(manifest_of(package)).encode(), "/etc/evil.py": b"x"}), "zip"),
        "tar_format": (good, "tar.gz"),
    }[case]
    before = blob_files(hub)

    # Execute
    r = post(hub, data, fmt=fmt)

    # Assert
    problem = assert_problem(r, 422, CODE)
    assert expected in problem["detail"], problem["detail"]
    assert blob_files(hub) == before
    assert hub.get("/artifacts", params={"kind": "algorithm"}).json()["items"] == []


def test_a_refused_package_through_the_chunked_api_keeps_nothing_and_a_good_one_commits(hub: HubUnderTest, package: Path) -> None:
    # Prepare
    good, bad = package.read_bytes(), _bad_manifest(package, version="9.9.9")

    def upload(data: bytes) -> httpx.Response:
        body = {"kind": "algorithm", "name": "digits-numpy-cnn", "version": "1.0.0", "format": "zip", "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        session = hub.request("POST", "/artifacts/uploads", Role.OPERATOR, json=body).json()
        headers = {CHUNK_SHA256_HEADER: hashlib.sha256(data).hexdigest(), "Content-Type": "application/octet-stream"}
        assert hub.request("PUT", f"/artifacts/uploads/{session['id']}/chunks/0", Role.OPERATOR, content=data, headers=headers).status_code == 204
        return hub.request("POST", f"/artifacts/uploads/{session['id']}/commit", Role.OPERATOR)

    # Execute
    refused = upload(bad)
    stored = upload(good)

    # Assert
    assert "9.9.9" in assert_problem(refused, 422, CODE)["detail"]
    assert stored.status_code == 201, stored.text
    assert [a["sha256"] for a in hub.get("/artifacts", params={"kind": "algorithm"}).json()["items"]] == [hashlib.sha256(good).hexdigest()]


def test_an_algorithm_is_not_deployed(hub: HubUnderTest, package: Path) -> None:
    # Prepare
    artifact = post(hub, package.read_bytes()).json()
    node = hub.register("site-1")["node"]

    # Execute
    r = hub.request("POST", "/deployments", Role.OPERATOR, json={"name": "d", "artifact_id": artifact["id"], "target": {"kind": "node", "ids": [node["id"]]}})

    # Assert
    assert "training tasks run it" in assert_problem(r, 422, CODE)["detail"]


def test_the_upload_command_builds_a_folder_and_stores_it_and_refuses_a_bad_token(hub: HubUnderTest, package: Path, tmp_path: Path) -> None:
    # Prepare
    source = tmp_path / "src"
    runner = CliRunner()

    with serve(hub.app) as url:
        # Execute
        ok = runner.invoke(algorithm, ["upload", str(source), "--hub", url, "--token", hub.tokens[Role.OPERATOR]])
        again = runner.invoke(algorithm, ["upload", str(package), "--hub", url, "--token", hub.tokens[Role.OPERATOR]])
        viewer = runner.invoke(algorithm, ["upload", str(package), "--hub", url, "--token", hub.tokens[Role.VIEWER]])
        not_a_package = runner.invoke(algorithm, ["upload", str(tmp_path), "--hub", url, "--token", hub.tokens[Role.OPERATOR]])

    # Assert
    assert ok.exit_code == 0, ok.output
    stored = json.loads(ok.output)
    assert (stored["kind"], stored["name"], stored["version"]) == ("algorithm", "digits-numpy-cnn", "1.0.0")
    assert (again.exit_code, "409") == (2, again.output.split("Error: ")[1][:3]), again.output  # built twice, the same bytes: already stored
    assert viewer.exit_code == 2 and "403" in viewer.output, viewer.output
    assert not_a_package.exit_code == 2 and "algorithm.json" in not_a_package.output, not_a_package.output
