"""A corrupt entry in the edge's artefact cache is found before it is served, dropped and fetched again from
the (stand-in) hub, so that devices behind the edge get the signed bytes; the full SHA-256 check runs once
per change of a cached file, not on every Range request."""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import pytest

from cloud.signing import SigningKey
from device.ota.download import Downloader
from device.ota.updater import Updater
from interfaces.deployments import ArtifactFormat, ArtifactKind, ArtifactManifest, DeploymentOrder, ExecutionProgress, ExecutionState
from tests.edge.test_edge_artifacts import Edge, HubArtefacts, cached, make_edge, sha


@pytest.fixture
def signing(tmp_path: Path) -> SigningKey:
    return SigningKey.load_or_create(tmp_path / "hub-pki")


@pytest.fixture
def hub(signing: SigningKey) -> Iterator[HubArtefacts]:
    stand_in = HubArtefacts(signing)
    stand_in.blobs = {"art-1": os.urandom(300_000)}
    yield stand_in
    stand_in.stop()


@pytest.fixture
def edge(tmp_path: Path, hub: HubArtefacts, signing: SigningKey) -> Iterator[Edge]:
    running = make_edge(tmp_path, hub, signing)
    yield running
    running.close()


class Device:
    """A device behind the edge: its real updater, which checks the manifest's signature, size and SHA-256."""

    def __init__(self, data_dir: Path, signing: SigningKey, edge: Edge) -> None:
        self.events: list[ExecutionProgress] = []
        base = edge.base + "/api/v1"
        downloader = Downloader(
            base, data_dir / "ota" / "partial", attempts=2, max_delay_s=0.05, verify=edge.device_tls, server_name=edge.node_id
        )
        self.updater = Updater(data_dir, signing.public_pem, base, self.events.append, downloader=downloader)

    def deploy(self, order: DeploymentOrder) -> ExecutionProgress:
        self.updater.apply([order])
        return self.events[-1]

    def states(self) -> list[ExecutionState]:
        return [event.state for event in self.events]

    def installed_bytes(self) -> bytes:
        return Path(self.updater.store.state.current[ArtifactKind.APPLICATION.value].file).read_bytes()


def order_for(hub: HubArtefacts, artifact_id: str, execution_id: str, device: str) -> DeploymentOrder:
    data = hub.blobs[artifact_id]
    manifest = ArtifactManifest(
        name="app", version="1.0.0", kind=ArtifactKind.APPLICATION, format=ArtifactFormat.BINARY,
        sha256=sha(data), size=len(data), created_at=datetime.now(UTC),
    )  # fmt: skip
    return DeploymentOrder(
        execution_id=execution_id,
        deployment_id="dp-1",
        artifact_id=artifact_id,
        signed_manifest=hub.signing.sign_manifest(manifest),
        path=f"/artifacts/{artifact_id}/content",
        token=hub.token(artifact_id, device=device),
    )


def flip_byte(path: Path, offset: int) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def deployed_once(tmp_path: Path, hub: HubArtefacts, signing: SigningKey, edge: Edge) -> Path:
    """A first device goes ACTIVE through the edge, which keeps the blob: its cache file."""
    first = Device(tmp_path / "dev-a", signing, edge)
    assert first.deploy(order_for(hub, "art-1", "ex-a", "dev-a")).state is ExecutionState.ACTIVE
    assert len(hub.fetches()) == 1
    return edge.cache.blob_path(sha(hub.blobs["art-1"]))


def test_a_flipped_byte_in_the_cache_is_fetched_again_before_the_next_device_downloads(
    tmp_path: Path, hub: HubArtefacts, signing: SigningKey, edge: Edge
) -> None:
    # Prepare
    data = hub.blobs["art-1"]
    blob = deployed_once(tmp_path, hub, signing, edge)
    flip_byte(blob, 150_000)
    assert sha(blob.read_bytes()) != sha(data)
    second = Device(tmp_path / "dev-b", signing, edge)

    # Execute
    final = second.deploy(order_for(hub, "art-1", "ex-b", "dev-b"))

    # Assert
    assert final.state is ExecutionState.ACTIVE, final.detail
    assert ExecutionState.REJECTED not in second.states()
    assert sha(second.installed_bytes()) == sha(data)
    assert len(hub.fetches()) == 2  # the edge fetched it again before it served a byte
    assert (edge.cache.store.corrupt_dropped, edge.cache.store.integrity_checks) == (1, 1)
    assert blob.read_bytes() == data
    assert cached(edge.cache) == {sha(data)}


def test_a_truncated_cache_file_is_dropped_by_its_size_and_fetched_again(
    tmp_path: Path, hub: HubArtefacts, signing: SigningKey, edge: Edge
) -> None:
    # Prepare
    data = hub.blobs["art-1"]
    blob = deployed_once(tmp_path, hub, signing, edge)
    os.truncate(blob, 123_456)
    second = Device(tmp_path / "dev-b", signing, edge)

    # Execute
    final = second.deploy(order_for(hub, "art-1", "ex-b", "dev-b"))

    # Assert
    assert final.state is ExecutionState.ACTIVE, final.detail
    assert second.installed_bytes() == data
    assert len(hub.fetches()) == 2
    assert (edge.cache.store.corrupt_dropped, edge.cache.store.integrity_checks) == (1, 0)  # the size gave it away: no hashing
    assert blob.read_bytes() == data


def test_a_device_resuming_after_the_cache_file_changed_gets_the_signed_rest(hub: HubArtefacts, edge: Edge) -> None:
    # Prepare: the device holds the first 100 000 bytes, then the edge's copy goes bad
    data, token = hub.blobs["art-1"], hub.token("art-1")
    head = edge.content("art-1", token, Range="bytes=0-99999")
    assert (head.status_code, head.content) == (206, data[:100_000])
    flip_byte(edge.cache.blob_path(sha(data)), 250_000)

    # Execute
    rest = edge.content("art-1", token, Range="bytes=100000-")

    # Assert
    assert rest.status_code == 206
    assert sha(head.content + rest.content) == sha(data)
    assert len(hub.fetches()) == 2
    assert edge.cache.store.corrupt_dropped == 1


def test_with_the_hub_gone_a_corrupt_entry_is_503_and_the_retry_gets_the_signed_bytes(
    tmp_path: Path, hub: HubArtefacts, signing: SigningKey, edge: Edge
) -> None:
    # Prepare
    data = hub.blobs["art-1"]
    blob = deployed_once(tmp_path, hub, signing, edge)
    flip_byte(blob, 7)
    hub.stop()

    # Execute
    refused = edge.content("art-1", hub.token("art-1"))
    hub.start()
    second = Device(tmp_path / "dev-b", signing, edge)
    final = second.deploy(order_for(hub, "art-1", "ex-b", "dev-b"))

    # Assert
    assert (refused.status_code, refused.json()["code"]) == (503, "hub_unreachable")  # a 5xx: the device's downloader retries
    assert final.state is ExecutionState.ACTIVE, final.detail
    assert sha(second.installed_bytes()) == sha(data)
    assert edge.cache.store.corrupt_dropped == 1
    assert blob.read_bytes() == data


def test_devices_that_find_one_corrupt_entry_together_share_one_check_and_one_download(hub: HubArtefacts, edge: Edge) -> None:
    # Prepare
    data, token = hub.blobs["art-1"], hub.token("art-1")
    assert edge.content("art-1", token).status_code == 200
    flip_byte(edge.cache.blob_path(sha(data)), 299_999)
    hub.delay_s = 0.3

    # Execute
    with ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(lambda _: edge.content("art-1", token), range(6)))

    # Assert
    assert [r.status_code for r in responses] == [200] * 6
    assert all(sha(r.content) == sha(data) for r in responses)
    assert len(hub.fetches()) == 2
    assert (edge.cache.store.corrupt_dropped, edge.cache.store.integrity_checks) == (1, 1)


def test_the_full_check_runs_once_per_change_of_the_file_not_per_request(tmp_path: Path, hub: HubArtefacts, signing: SigningKey) -> None:
    # Prepare: a blob downloaded by one edge process, which hashed it as it arrived
    data, token = hub.blobs["art-1"], hub.token("art-1")
    first = make_edge(tmp_path, hub, signing)
    try:
        assert first.content("art-1", token).content == data
        ranges = [first.content("art-1", token, Range=f"bytes={i * 1000}-{i * 1000 + 999}") for i in range(5)]
        checks_in_the_first_run = first.cache.store.integrity_checks
    finally:
        first.close()
    hub.stop()
    restarted = make_edge(tmp_path, hub, signing)  # no record survives a restart
    blob = restarted.cache.blob_path(sha(data))
    try:
        # Execute
        after_restart = [restarted.content("art-1", token, Range=f"bytes={i * 1000}-{i * 1000 + 999}") for i in range(5)]
        checks_after_restart = restarted.cache.store.integrity_checks
        stat = blob.stat()
        os.utime(blob, ns=(stat.st_atime_ns, stat.st_mtime_ns - 10**9))  # changed on disk, not in content
        after_touch = [restarted.content("art-1", token, Range="bytes=0-9") for _ in range(3)]

        # Assert
        assert [r.content for r in ranges] == [data[i * 1000 : i * 1000 + 1000] for i in range(5)]
        assert checks_in_the_first_run == 0
        assert [r.content for r in after_restart] == [data[i * 1000 : i * 1000 + 1000] for i in range(5)]
        assert checks_after_restart == 1
        assert [(r.status_code, r.content) for r in after_touch] == [(206, data[:10])] * 3
        assert (restarted.cache.store.integrity_checks, restarted.cache.store.corrupt_dropped) == (2, 0)
    finally:
        restarted.close()


def test_a_corrupt_cached_delta_is_fetched_again(hub: HubArtefacts, edge: Edge) -> None:
    # Prepare
    base, patch = sha(b"version 1"), b"BSDIFF40 patch bytes " * 50
    hub.deltas[("art-1", base)] = patch
    token, path = hub.token("art-1", base=base), f"/api/v1/artifacts/art-1/delta?from={base}"
    assert edge.get(path, token).content == patch
    flip_byte(edge.cache.blob_path(sha(patch)), 3)

    # Execute
    again = edge.get(path, token)

    # Assert
    assert (again.status_code, again.content) == (200, patch)
    assert len(hub.fetches("/delta")) == 2
    assert edge.cache.store.corrupt_dropped == 1
    assert cached(edge.cache) == {sha(patch)}


def test_an_intact_cache_serves_without_asking_the_hub(hub: HubArtefacts, edge: Edge) -> None:
    # Prepare
    data, token = hub.blobs["art-1"], hub.token("art-1")
    assert edge.content("art-1", token).status_code == 200
    hub.stop()

    # Execute
    responses = [edge.content("art-1", token) for _ in range(3)]

    # Assert
    assert [r.content for r in responses] == [data] * 3
    assert (edge.cache.store.corrupt_dropped, edge.cache.store.integrity_checks, edge.cache.store.hits) == (0, 0, 3)
