"""REST API of deployments (DESIGN §4.2): creation rules, batches, actions, reading, and the CLI.

Every test runs on SQLite and on PostgreSQL (``database_url``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from cloud.services.deployments import plan_batches
from interfaces.auth import Role
from interfaces.deployments import AllAtOnce, Canary, Rolling
from tests.hub.conftest import assert_problem
from tests.hub.deployments_support import Fleet, running_fleet


@pytest.fixture
def fleet(database_url: str, tmp_path: Path) -> Iterator[Fleet]:
    yield from running_fleet(database_url, tmp_path)


@pytest.mark.parametrize(
    ("n", "strategy", "sizes"),
    [
        (20, Canary(percent=10, then=Rolling(batch_size=5)), [2, 5, 5, 5, 3]),
        (20, Canary(percent=10), [2, 18]),
        (3, Canary(percent=1), [1, 2]),
        (1, Canary(percent=50), [1]),
        (7, Rolling(batch_size=3), [3, 3, 1]),
        (7, AllAtOnce(), [7]),
    ],
)  # fmt: skip
def test_plan_batches(n: int, strategy: Canary | Rolling | AllAtOnce, sizes: list[int]) -> None:
    assert plan_batches(n, strategy) == sizes


def test_create_resolves_targets_once_and_refuses_bad_ones(fleet: Fleet) -> None:
    # Prepare
    devices = fleet.devices(3, labels={"zone": "a"})
    locked_devices = fleet.devices(2, labels={"zone": "a"}, node_name="locked-gw")
    locked_node = fleet.node_of[locked_devices[0]]
    r = fleet.hub.request("PUT", f"/nodes/{locked_node}/admin-state", Role.OPERATOR, json={"admin_state": "LOCKED"})
    assert r.status_code == 200, r.text
    gone = fleet.devices(1)[0]
    assert fleet.hub.request("DELETE", f"/devices/{gone}", Role.ADMIN).status_code == 204
    v1 = fleet.artifact("1.0.0")
    v2 = fleet.artifact("2.0.0")
    fleet.set_installed(devices[0], v1)

    def create(**body: object) -> object:
        return fleet.hub.request("POST", "/deployments", Role.OPERATOR, json={"artifact_id": v2.id, **body})

    before = fleet.hub.snapshot()

    # Execute + Assert: refusals change nothing
    assert_problem(create(target={"ids": devices}, artifact_id="art-00000000000000000000000000"), 404, "not_found")
    doc = assert_problem(create(target={"ids": [devices[0], gone, "d-nope"]}), 422, "validation_failed")
    assert doc["unknown_ids"] == [gone, "d-nope"]
    doc = assert_problem(create(target={"ids": devices + locked_devices[:1]}), 409, "target_locked")
    assert doc["locked_ids"] == locked_devices[:1]
    assert_problem(create(target={"selector": "zone=b"}), 422, "validation_failed")
    assert_problem(create(target={"selector": "zone=a", "ids": devices}), 422, "validation_failed")
    assert_problem(create(target={"selector": "=a"}), 400, "invalid_selector")
    assert_problem(fleet.hub.request("POST", "/deployments", Role.VIEWER, json={"artifact_id": v2.id, "target": {"ids": devices}}), 403, "forbidden")
    assert fleet.hub.snapshot() == before

    # Execute: by selector, the locked node's devices are skipped and said so
    dep = fleet.deploy(v2.id, selector="zone=a")

    # Assert
    assert dep["state"] == "PENDING" and dep["total"] == 3 and dep["batches"] == 1
    assert sorted(e["target_id"] for e in dep["executions"]) == sorted(devices)
    assert "LOCKED" in dep["reason"] and all(d in dep["reason"] for d in locked_devices)
    assert dep["artifact"]["version"] == "2.0.0" and dep["artifact"]["sha256"] == v2.sha256
    assert dep["counts"]["QUEUED"] == 3
    executions = {e["target_id"]: e for e in dep["executions"]}
    assert executions[devices[0]]["previous"]["sha256"] == v1.sha256
    assert executions[devices[1]]["previous"] is None
    for e in dep["executions"]:
        assert [(h["from_state"], h["to_state"]) for h in e["history"]] == [(None, "QUEUED")]
        assert e["released_at"] is None


def test_read_list_and_paginate(fleet: Fleet) -> None:
    # Prepare
    devices = fleet.devices(2)
    art = fleet.artifact()
    deps = [fleet.deploy(art.id, ids=devices[i : i + 1], name=f"d{i}") for i in range(2)]
    fleet.tick()
    fleet.report(devices[0], deps[0]["executions"][0]["id"], "ACTIVE")
    fleet.tick()

    # Execute
    page1 = fleet.hub.get("/deployments", params={"limit": 1}).json()
    page2 = fleet.hub.get("/deployments", params={"limit": 1, "cursor": page1["next_cursor"]}).json()
    succeeded = fleet.hub.get("/deployments", params={"state": "SUCCEEDED"}).json()
    execution = deps[0]["executions"][0]
    one = fleet.hub.get(f"/deployments/{deps[0]['id']}/executions/{execution['id']}")

    # Assert
    assert [d["id"] for d in page1["items"] + page2["items"]] == [d["id"] for d in deps]
    assert page2["next_cursor"] is None
    assert "executions" not in page1["items"][0]
    assert [d["id"] for d in succeeded["items"]] == [deps[0]["id"]]
    assert succeeded["items"][0]["counts"]["ACTIVE"] == 1
    assert one.status_code == 200 and one.json()["state"] == "ACTIVE" and len(one.json()["history"]) == 6
    assert_problem(fleet.hub.get(f"/deployments/{deps[1]['id']}/executions/{execution['id']}"), 404, "not_found")
    assert_problem(fleet.hub.get("/deployments/dep-00000000000000000000000000"), 404, "not_found")
    assert_problem(fleet.hub.get("/deployments", role=None), 401, "unauthenticated")


def test_pause_resume_cancel_and_illegal_actions(fleet: Fleet) -> None:
    # Prepare
    devices = fleet.devices(4)
    art = fleet.artifact()
    dep = fleet.deploy(art.id, ids=devices, strategy={"type": "rolling", "batch_size": 2})
    dep_id = dep["id"]

    def act(action: str) -> object:
        return fleet.hub.request("POST", f"/deployments/{dep_id}/{action}", Role.OPERATOR)

    # Execute + Assert: resume of a running deployment is refused with its state
    fleet.tick()
    doc = assert_problem(act("resume"), 409, "illegal_transition")
    assert doc["current_state"] == "RUNNING"
    assert_problem(fleet.hub.request("POST", f"/deployments/{dep_id}/pause", Role.VIEWER), 403, "forbidden")

    # pause: the first batch finishes, the next is not released
    r = act("pause")
    assert r.status_code == 200 and r.json()["state"] == "PAUSED"
    assert_problem(act("pause"), 409, "illegal_transition")
    ex = fleet.executions(dep_id)
    for d in devices[:2]:
        fleet.report(d, ex[d]["id"], "ACTIVE")
    fleet.tick()
    assert {t for t, e in fleet.executions(dep_id).items() if e["released_at"]} == set(devices[:2])

    # resume: the next batch goes out
    assert act("resume").json()["state"] == "RUNNING"
    fleet.tick()
    ex = fleet.executions(dep_id)
    assert all(ex[d]["released_at"] for d in devices)
    fleet.report(devices[2], ex[devices[2]]["id"], "DOWNLOADING")

    # cancel: in-flight executions are canceled and their orders withdrawn; finished ones stay
    r = act("cancel")
    assert r.status_code == 200 and r.json()["state"] == "CANCELED"
    fleet.tick()
    ex = fleet.executions(dep_id)
    assert [ex[d]["state"] for d in devices] == ["ACTIVE", "ACTIVE", "CANCELED", "CANCELED"]
    assert fleet.orders(devices[2]) == ([], 2) and fleet.orders(devices[3]) == ([], 2)
    assert len(fleet.orders(devices[0])[0]) == 1
    for action in ("pause", "resume", "cancel"):
        assert assert_problem(act(action), 409, "illegal_transition")["current_state"] == "CANCELED"
    assert_problem(fleet.hub.request("POST", "/deployments/dep-00000000000000000000000000/cancel", Role.OPERATOR), 404, "not_found")


def test_manual_rollback_of_a_succeeded_deployment(fleet: Fleet) -> None:
    # Prepare
    devices = fleet.devices(2)
    v1 = fleet.artifact("1.0.0")
    v2 = fleet.artifact("2.0.0")
    for d in devices:
        fleet.set_installed(d, v1)
    dep = fleet.deploy(v2.id, ids=devices)
    fleet.tick()
    ex = {e["target_id"]: e["id"] for e in dep["executions"]}
    for d in devices:
        fleet.report(d, ex[d], "ACTIVE")
    fleet.tick()
    assert fleet.detail(dep["id"])["state"] == "SUCCEEDED"

    # Execute
    r = fleet.hub.request("POST", f"/deployments/{dep['id']}/rollback", Role.OPERATOR)
    assert r.status_code == 200, r.text
    doc = assert_problem(fleet.hub.request("POST", f"/deployments/{dep['id']}/rollback", Role.OPERATOR), 409, "illegal_transition")
    fleet.tick()
    for d in devices:
        order = fleet.orders(d)[0][0]
        assert (order["action"], order["artifact_id"], order["execution_id"]) == ("rollback", v1.id, ex[d])
        fleet.report(d, ex[d], "ROLLED_BACK")
    fleet.tick()

    # Assert
    assert doc["current_state"] == "SUCCEEDED"
    detail = fleet.detail(dep["id"])
    assert detail["state"] == "ROLLED_BACK" and detail["counts"]["ROLLED_BACK"] == 2


def test_cli_create_watch_and_errors(fleet: Fleet, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from cloud.cli import deploy as cli

    # Prepare: the CLI talks to the in-process hub through the TestClient
    monkeypatch.setattr(cli, "_client", lambda hub_url, token, ca_file=None: fleet.hub.client)
    devices = fleet.devices(2)
    runner = CliRunner()
    token = fleet.hub.tokens[Role.OPERATOR]
    model = tmp_path / "detector.onnx"
    model.write_bytes(b"onnx bytes " * 100)

    # Execute: upload, create, then a watch that ends when the deployment does
    uploaded = runner.invoke(cli.deploy, ["--token", token, "upload", str(model), "--kind", "model", "--name", "detector", "--version", "1.0.0", "--format", "onnx"])
    assert uploaded.exit_code == 0, uploaded.output
    art_id = uploaded.output.split()[0]
    listed_artifacts = runner.invoke(cli.deploy, ["--token", token, "artifacts"])
    created = runner.invoke(cli.deploy, ["--token", token, "create", "--artifact", art_id, "--ids", ",".join(devices), "--strategy", "rolling:1"])
    assert created.exit_code == 0, created.output
    dep_id = created.output.strip().splitlines()[-1].split()[0]
    fleet.tick()
    ex = fleet.executions(dep_id)
    fleet.report(devices[0], ex[devices[0]]["id"], "ACTIVE")
    fleet.tick()
    fleet.report(devices[1], fleet.executions(dep_id)[devices[1]]["id"], "FAILED")
    fleet.tick()
    watched = runner.invoke(cli.deploy, ["--token", token, "watch", dep_id, "--interval", "0.01"])
    listed = runner.invoke(cli.deploy, ["--token", token, "list"])
    refused = runner.invoke(cli.deploy, ["--token", token, "pause", dep_id])
    missing = runner.invoke(cli.deploy, ["--token", token, "create", "--artifact", "art-00000000000000000000000000", "--ids", devices[0]])

    # Assert
    assert art_id.startswith("art-") and f"sha256={hashlib.sha256(model.read_bytes()).hexdigest()}" in uploaded.output
    assert listed_artifacts.exit_code == 0 and art_id in listed_artifacts.output
    assert dep_id.startswith("dep-")
    assert watched.exit_code == 1, watched.output
    assert "FAILED" in watched.output
    assert listed.exit_code == 0 and dep_id in listed.output
    assert refused.exit_code == 1 and "illegal_transition" in refused.output and "FAILED" in refused.output
    assert missing.exit_code == 1 and "not_found" in missing.output
