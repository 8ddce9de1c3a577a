"""Deltas at the hub: a download token allows the patch only from the base its order names (the version the
target runs), patches are computed at most ``MAX_CONCURRENT_DELTAS`` at a time (a request that finds every
slot busy is 503 with Retry-After), and a deployment computes its targets' patches in the background."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import bsdiff4
import httpx
import pytest
from sqlmodel import Session, select

import cloud.artifacts as artifacts
from cloud.artifacts import deltas
from cloud.tables import ArtifactDelta
from interfaces.auth import Role
from interfaces.deployments import DOWNLOAD_TOKEN_HEADER, DeploymentOrder
from tests.hub.conftest import SQLITE_ONLY, HubUnderTest, assert_problem
from tests.hub.deployments_support import Fleet, running_fleet


@pytest.fixture(autouse=True)
def no_delta_in_progress() -> None:
    """A deployment of an earlier test may still compute its patches (and hold a slot)."""
    _until(lambda: not any(t.name.startswith("deltas-") for t in threading.enumerate()), "earlier deltas")


@pytest.fixture
def fleet(database_url: str, tmp_path: Path) -> Iterator[Fleet]:
    yield from running_fleet(database_url, tmp_path)


def _recorded_bases(fleet_or_hub: Fleet | HubUnderTest) -> set[tuple[str, str]]:
    with Session(fleet_or_hub.engine) as session:
        return {(r.base_sha256, r.target_sha256) for r in session.exec(select(ArtifactDelta)).all()}


def _until(condition: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


class GatedDiff:
    """``bsdiff4.diff`` that waits for ``open`` and counts how many run at once."""

    def __init__(self) -> None:
        self.real = bsdiff4.diff
        self.open = threading.Event()
        self.lock = threading.Lock()
        self.running = 0
        self.most = 0
        self.calls: list[bytes] = []

    def __call__(self, old: bytes, new: bytes) -> bytes:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
            self.calls.append(old)
        try:
            assert self.open.wait(60), "the test never let the diff run"
            return self.real(old, new)
        finally:
            with self.lock:
                self.running -= 1


def test_a_token_for_one_artefact_gets_no_delta_from_an_unrelated_one(fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: the device runs 1.0.0 and is ordered 2.0.0; the hub also holds a secret it must not leak
    secret_bytes = b"another tenant's model: weights " * 64
    device = fleet.devices(1)[0]
    v1 = fleet.artifact("1.0.0")
    v2 = fleet.artifact("2.0.0")
    secret = fleet.artifact("9.9.9", name="secret", data=secret_bytes)
    fleet.set_installed(device, v1)
    diffed: list[bytes] = []
    real = bsdiff4.diff
    monkeypatch.setattr(deltas.bsdiff4, "diff", lambda old, new: diffed.append(old) or real(old, new))
    fleet.deploy(v2.id, ids=[device])
    fleet.tick()
    order = DeploymentOrder.model_validate(fleet.orders(device)[0][0])
    assert order.delta is not None and order.delta.base_sha256 == v1.sha256
    task_token = fleet.controller.signing.issue_download_token(v2.id, v2.sha256, device, ttl_s=60)  # names no base

    # Execute
    leak = fleet.hub.get(f"/artifacts/{v2.id}/delta", None, params={"from": secret.sha256}, headers={DOWNLOAD_TOKEN_HEADER: order.token})
    no_base = fleet.hub.get(f"/artifacts/{v2.id}/delta", None, params={"from": v1.sha256}, headers={DOWNLOAD_TOKEN_HEADER: task_token})
    entitled = fleet.hub.get(f"/artifacts/{v2.id}/delta", None, params={"from": v1.sha256}, headers={DOWNLOAD_TOKEN_HEADER: order.token})

    # Assert
    assert_problem(leak, 403, "forbidden")
    assert_problem(no_base, 403, "forbidden")
    assert secret_bytes not in diffed
    assert (secret.sha256, v2.sha256) not in _recorded_bases(fleet)
    assert entitled.status_code == 200, entitled.text
    assert bsdiff4.patch(artifacts.read_blob(fleet.blobs, v1.sha256), entitled.content) == artifacts.read_blob(fleet.blobs, v2.sha256)


@SQLITE_ONLY
def test_a_burst_of_distinct_bases_computes_at_most_the_cap_and_the_rest_is_503(hub: HubUnderTest, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: one target and more bases than slots (a viewer may ask for any base)
    from tests.hub.test_artifacts import stored

    target_bytes = b"the target version " * 400
    target = stored(hub, target_bytes, name="burst", version="2.0.0")
    bases = [stored(hub, target_bytes[: 7000 - i * 100] + bytes([i]) * 50, name="burst", version=f"1.0.{i}") for i in range(6)]
    gate = GatedDiff()
    monkeypatch.setattr(deltas.bsdiff4, "diff", gate)
    answers: dict[str, httpx.Response] = {}

    def ask(base: dict[str, Any]) -> None:
        answers[base["sha256"]] = hub.get(f"/artifacts/{target['id']}/delta", Role.VIEWER, params={"from": base["sha256"]})

    # Execute
    threads = [threading.Thread(target=ask, args=(b,)) for b in bases]
    for t in threads:
        t.start()
    refused_count = len(bases) - deltas.MAX_CONCURRENT_DELTAS
    _until(lambda: len(answers) == refused_count and gate.running == deltas.MAX_CONCURRENT_DELTAS, "the refusals")
    refused = dict(answers)
    gate.open.set()
    for t in threads:
        t.join(timeout=60)

    # Assert
    assert gate.most == deltas.MAX_CONCURRENT_DELTAS
    assert len(gate.calls) == deltas.MAX_CONCURRENT_DELTAS  # the refused ones computed nothing
    for r in refused.values():
        assert_problem(r, 503, "busy")
        assert int(r.headers["retry-after"]) > 0
    served = {sha: r for sha, r in answers.items() if sha not in refused}
    assert len(served) == deltas.MAX_CONCURRENT_DELTAS
    for sha, r in served.items():
        assert r.status_code == 200, r.text
        assert bsdiff4.patch(artifacts.read_blob(hub.state.blobs, sha), r.content) == target_bytes
    assert {b for b, _ in _recorded_bases(hub)} == set(served)


def test_a_deployment_prepares_its_targets_deltas_in_the_background(fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: two devices run 1.0.0, one runs 1.1.0, one reports nothing
    devices = fleet.devices(4)
    v1, v11, v2 = fleet.artifact("1.0.0"), fleet.artifact("1.1.0"), fleet.artifact("2.0.0")
    for device, running in zip(devices, [v1, v1, v11], strict=False):
        fleet.set_installed(device, running)
    gate = GatedDiff()
    monkeypatch.setattr(deltas.bsdiff4, "diff", gate)

    # Execute: the deployment is answered while no patch is done yet
    dep = fleet.deploy(v2.id, ids=devices)
    assert _recorded_bases(fleet) == set()
    _until(lambda: gate.running == 1, "the background computation")
    gate.open.set()
    _until(lambda: _recorded_bases(fleet) == {(v1.sha256, v2.sha256), (v11.sha256, v2.sha256)}, "both patches recorded")
    fleet.tick()

    # Assert: the orders carry the patches, computed once each
    assert len(gate.calls) == 2
    offers = {d: DeploymentOrder.model_validate(fleet.orders(d)[0][0]).delta for d in devices}
    assert offers[devices[0]] is not None and offers[devices[0]].base_sha256 == v1.sha256
    assert offers[devices[2]] is not None and offers[devices[2]].base_sha256 == v11.sha256
    assert offers[devices[3]] is None
    assert all(e["delta"] is (d != devices[3]) for d, e in fleet.executions(dep["id"]).items())
