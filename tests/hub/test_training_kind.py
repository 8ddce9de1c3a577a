"""The ``training`` kind on the hub (issue 18): admission (the algorithm stored, the configuration against its schema,
initial parameters, the output pinned), placement by the sites' frameworks, the order's run and publish grant, what a
grant may and may not do on the API, and the results kept only when they are the granted artefacts."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from device.algorithm.package import build
from interfaces.auth import Role
from interfaces.messages import HeartbeatBody
from interfaces.tasks import TASK_TRAINED_EVENT, TrainedModel, TrainingTaskOrder
from interfaces.uploads import PublishClaims
from tests.hub.conftest import assert_problem
from tests.hub.tasks_support import TaskFleet, resources, running_task_fleet

BEHAVE = Path(__file__).resolve().parents[1] / "fixtures" / "algorithms" / "behave"
ALGORITHM = {"name": "behave", "version": "1.0.0"}


@pytest.fixture
def fleet(sqlite_url: str, tmp_path: Path) -> Iterator[TaskFleet]:
    yield from running_task_fleet(sqlite_url, tmp_path / "hub")


def upload(fleet: TaskFleet, tmp_path: Path, source: Path = BEHAVE, name: str = "behave", version: str = "1.0.0") -> dict[str, Any]:
    package = build(source, tmp_path / f"built-{name}")
    r = fleet.hub.request("POST", "/artifacts", Role.OPERATOR, data={"kind": "algorithm", "name": name, "version": version, "format": "zip"},
                          files={"file": ("a.zip", package.read_bytes(), "application/zip")})  # fmt: skip
    assert r.status_code == 201, r.text
    return r.json()  # type: ignore[no-any-return]


def site(fleet: TaskFleet, name: str, frameworks: dict[str, str]) -> str:
    node_id = fleet.node(name)
    fleet.seq += 1
    beat = HeartbeatBody(seq=fleet.seq, agent_version="test", uptime_s=1, resources=resources().model_copy(update={"frameworks": frameworks}))
    fleet.ingest.offer(node_id, beat)
    fleet.ingest.flush()
    return node_id


def training(fleet: TaskFleet, expect: int = 201, **spec: Any) -> dict[str, Any]:
    return fleet.create("training", {"algorithm": ALGORITHM, "steps": 2, **spec}, expect=expect, placement={"target": "node"})


def grant_of(fleet: TaskFleet, worker: dict[str, Any]) -> str:
    order = fleet.orders(worker["target_id"], table=_node_table())[0]
    assert isinstance(order, TrainingTaskOrder) and order.run is not None
    return order.run.publish.token


def _node_table() -> Any:
    from cloud.tables import Node

    return Node


def start_upload(fleet: TaskFleet, token: str, name: str, version: str = "1.0.0", kind: str = "model", data: bytes = b"x" * 10) -> Any:
    body = {"kind": kind, "name": name, "version": version, "format": "safetensors", "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    return fleet.hub.client.post("/api/v1/artifacts/uploads", json=body, headers={"Authorization": f"Bearer {token}"})


def test_admission_checks_the_algorithm_its_configuration_and_the_initial_parameters_and_pins_the_output(fleet: TaskFleet, tmp_path: Path) -> None:
    # an algorithm the hub does not have
    assert "upload it first" in assert_problem(fleet.hub.request("POST", "/tasks", Role.OPERATOR, json={
        "type": "training", "spec": {"algorithm": ALGORITHM, "steps": 1}, "placement": {"target": "node"}}), 422, "validation_failed")["detail"]  # fmt: skip
    upload(fleet, tmp_path)

    # a configuration against the schema: each failing path named, nothing stored
    r = fleet.hub.request("POST", "/tasks", Role.OPERATOR, json={"type": "training", "spec": {"algorithm": ALGORITHM, "steps": 1, "config": {"mode": "x", "extra": 1}},
                                                                "placement": {"target": "node"}})  # fmt: skip
    doc = assert_problem(r, 422, "validation_failed")
    assert [e["loc"] for e in doc["errors"]] == [["body", "spec", "config", "mode"], ["body", "spec", "config"]], doc
    assert fleet.hub.get("/tasks").json()["items"] == []

    # initial parameters must be a safetensors model; checkpoints no rarer than the steps
    dataset, _ = fleet.dataset()
    assert "safetensors" in assert_problem(fleet.hub.request("POST", "/tasks", Role.OPERATOR, json={
        "type": "training", "spec": {"algorithm": ALGORITHM, "steps": 1, "initial_parameters": dataset}, "placement": {"target": "node"}}), 422, "validation_failed")["detail"]  # fmt: skip
    training(fleet, expect=422, steps=2, checkpoint_every=3)

    # the output: the algorithm's name and version, then the next free one; an explicit one taken by another task: 409
    first, second = training(fleet), training(fleet)
    assert first["spec"]["output"] == {"name": "behave", "version": "1.0.0"} and second["spec"]["output"] == {"name": "behave", "version": "1.0.1"}
    assert_problem(fleet.hub.request("POST", "/tasks", Role.OPERATOR, json={
        "type": "training", "spec": {"algorithm": ALGORITHM, "steps": 1, "output": {"version": "1.0.1"}}, "placement": {"target": "node"}}), 409, "conflict")  # fmt: skip
    # devices are sites too (placed like nodes, by their frameworks)
    on_device = fleet.create("training", {"algorithm": ALGORITHM, "steps": 1}, placement={"target": "device"})
    assert on_device["placement"]["target"] == "device" and on_device["spec"]["output"] == {"name": "behave", "version": "1.0.2"}


def test_placement_takes_one_site_with_the_frameworks_and_says_why_the_others_are_left_out(fleet: TaskFleet, tmp_path: Path) -> None:
    # Prepare: behave needs numpy >= 1.26
    upload(fleet, tmp_path)
    old = site(fleet, "old", {"numpy": "1.21.0"})
    site(fleet, "bare", {})

    # Execute / Assert: none qualifies, and the reason names each site and what it lacks
    task = training(fleet)
    fleet.tick()
    waiting = fleet.task(task["id"])
    assert waiting["state"] == "PENDING" and f"{old} lacks numpy >=1.26 (it has 1.21.0)" in waiting["reason"] and "(not installed)" in waiting["reason"]

    # two sites qualify: one worker, on one of them, with the run and a grant for the two outputs only
    good = {site(fleet, "a", {"numpy": "2.1.0"}), site(fleet, "b", {"numpy": "1.26.4", "torch": "2.13.0+cpu"})}
    fleet.tick()
    (worker,) = fleet.workers(task["id"])
    assert worker["target_kind"] == "node" and worker["target_id"] in good
    order = fleet.orders(worker["target_id"], table=_node_table())[0]
    assert isinstance(order, TrainingTaskOrder) and order.run is not None
    assert order.run.manifest.name == "behave" and order.run.package.signed_manifest.manifest.kind.value == "algorithm"
    assert (order.run.cpu_cores, order.run.memory_bytes, order.run.accelerators) == (1.0, 512 << 20, [])
    assert order.run.publish.names == ["behave", "behave-parameters"] and order.run.publish.version == "1.0.0"


def test_a_publish_grant_uploads_only_the_granted_models_and_opens_nothing_else(fleet: TaskFleet, tmp_path: Path) -> None:
    # Prepare: a placed worker and its grant
    upload(fleet, tmp_path)
    site(fleet, "a", {"numpy": "2.1.0"})
    task = training(fleet)
    fleet.tick()
    (worker,) = fleet.workers(task["id"])
    token = grant_of(fleet, worker)

    # Assert: the granted names and version, through the chunked API
    assert start_upload(fleet, token, "behave-parameters").status_code == 201
    assert_problem(start_upload(fleet, token, "behave", version="2.0.0"), 403, "forbidden")
    assert_problem(start_upload(fleet, token, "other"), 403, "forbidden")
    assert_problem(start_upload(fleet, token, "behave", kind="dataset"), 403, "forbidden")
    # nothing else of the API
    for path in ("/tasks", "/nodes", "/artifacts"):
        assert_problem(fleet.hub.client.get("/api/v1" + path, headers={"Authorization": f"Bearer {token}"}), 401, "unauthenticated")
    algorithm_id = fleet.hub.get("/artifacts").json()["items"][0]["id"]
    assert_problem(fleet.hub.client.get(f"/api/v1/artifacts/{algorithm_id}", headers={"Authorization": f"Bearer {token}"}), 403, "forbidden")
    # a forged or expired grant
    signing = fleet.hub.state.signing
    claims = PublishClaims(task_id=task["id"], worker_id=worker["id"], target_id=worker["target_id"], names=["behave"], version="1.0.0", exp=int(time.time()) - 1)
    assert "expired" in assert_problem(start_upload(fleet, signing.issue_publish_token(claims), "behave"), 401, "unauthenticated")["detail"]
    forged = token[:-6] + ("AAAAAA" if not token.endswith("AAAAAA") else "BBBBBB")
    assert_problem(start_upload(fleet, forged, "behave"), 401, "unauthenticated")


def test_a_result_is_kept_only_when_it_names_the_granted_artefacts(fleet: TaskFleet, tmp_path: Path) -> None:
    upload(fleet, tmp_path)
    site(fleet, "a", {"numpy": "2.1.0"})
    task = training(fleet)
    fleet.tick()
    (worker,) = fleet.workers(task["id"])
    fleet.report(worker)
    dataset, _ = fleet.dataset()

    # another artefact than the granted one: refused (logged), and SUCCEEDED without a result counts as FAILED
    wrong = TrainedModel(task_id=task["id"], worker_id=worker["id"], parameters=dataset, steps=2, resumed_from=0, num_examples=10, loss=0.5)
    fleet.send(worker["target_id"], TASK_TRAINED_EVENT, wrong)
    assert fleet.hub.get(f"/tasks/{task['id']}/outputs").json()["trained"] == []
    logs = [line["text"] for line in fleet.hub.get(f"/tasks/{task['id']}/logs").json()["items"]]
    assert any("is refused" in text and "not the model behave-parameters 1.0.0" in text for text in logs), logs
    fleet.report(worker, "SUCCEEDED")
    fleet.tick()
    assert fleet.workers(task["id"])[0]["state"] == "FAILED"
    assert "trained model never arrived" in fleet.workers(task["id"])[0]["detail"]

