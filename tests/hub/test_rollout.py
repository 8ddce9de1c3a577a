"""The rollout controller (cloud/rollout.py) driven tick by tick, with targets reporting through the ingest.

Every test runs on SQLite and on PostgreSQL (``database_url``).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from cloud.desired import DesiredPublisher
from cloud.tables import Device, Node
from interfaces.deployments import DeploymentOrder, ExecutionState
from interfaces.messages import DesiredBody, Envelope
from tests.hub.deployments_support import Fleet, running_fleet


@pytest.fixture
def fleet(database_url: str, tmp_path: Path) -> Iterator[Fleet]:
    yield from running_fleet(database_url, tmp_path)


INSTALL_PATH = ["QUEUED", "DOWNLOADING", "DOWNLOADED", "VERIFYING", "INSTALLING", "ACTIVE"]


def _states(history: list[dict]) -> list[str]:
    return [h["to_state"] for h in history]


def _released(fleet: Fleet, deployment_id: str) -> set[str]:
    return {t for t, e in fleet.executions(deployment_id).items() if e["released_at"] is not None}


def test_canary_then_rolling_batches_release_in_order_and_succeed(fleet: Fleet) -> None:
    # Prepare
    devices = fleet.devices(20, labels={"fleet": "cams"})
    art = fleet.artifact("2.0.0")
    dep = fleet.deploy(art.id, selector="fleet=cams", strategy={"type": "canary", "percent": 10, "then": {"type": "rolling", "batch_size": 5}})
    assert (dep["state"], dep["batches"], dep["total"]) == ("PENDING", 5, 20)
    by_target = fleet.executions(dep["id"])
    assert [sum(1 for e in by_target.values() if e["batch"] == b) for b in range(5)] == [2, 5, 5, 5, 3]

    # Execute: release batch after batch; each target reports only that it is ACTIVE (the first one step by step)
    released_per_tick: list[set[str]] = []
    seen: set[str] = set()
    for batch in range(5):
        fleet.tick()
        assert fleet.tick() == 0  # a second tick changes nothing
        now_released = _released(fleet, dep["id"]) - seen
        released_per_tick.append(now_released)
        seen |= now_released
        assert fleet.detail(dep["id"])["current_batch"] == batch
        executions = fleet.executions(dep["id"])
        for target in now_released:
            execution_id = executions[target]["id"]
            if target == devices[0]:
                for state in INSTALL_PATH[1:]:
                    fleet.report(target, execution_id, state, detail=f"now {state}")
            else:
                fleet.report(target, execution_id, ExecutionState.ACTIVE)
    fleet.tick()

    # Assert
    assert [len(r) for r in released_per_tick] == [2, 5, 5, 5, 3]
    for batch, released in enumerate(released_per_tick):
        assert {t for t, e in by_target.items() if e["batch"] == batch} == released
    detail = fleet.detail(dep["id"])
    assert detail["state"] == "SUCCEEDED"
    assert detail["counts"]["ACTIVE"] == 20 and detail["total"] == 20
    for target, execution in fleet.executions(dep["id"]).items():
        assert execution["state"] == "ACTIVE"
        assert _states(execution["history"]) == INSTALL_PATH
        assert execution["history"][0]["from_state"] is None
        assert [h["from_state"] for h in execution["history"][1:]] == INSTALL_PATH[:-1]
        reasons = [h["reason"] for h in execution["history"]]
        if target == devices[0]:
            assert reasons[1:] == [f"now {s}" for s in INSTALL_PATH[1:]]
        else:
            assert reasons[1:-1] == ["implied by a later report"] * 4
        orders, _version = fleet.orders(target)
        assert len(orders) == 1
        order = DeploymentOrder.model_validate(orders[0])
        assert (order.execution_id, order.deployment_id, order.artifact_id, order.action) == (execution["id"], dep["id"], art.id, "install")
        assert order.path == f"/artifacts/{art.id}/content"
        assert order.signed_manifest.manifest.sha256 == art.sha256
        assert order.allow_downgrade is False
        grant = fleet.controller.signing.verify_download_token(order.token, art.id)
        assert grant.target_id == target and grant.sha256 == art.sha256


def test_failure_threshold_with_halt_fails_and_releases_nothing_more(fleet: Fleet) -> None:
    # Prepare
    devices = fleet.devices(20)
    art = fleet.artifact()
    dep = fleet.deploy(art.id, ids=devices, strategy={"type": "rolling", "batch_size": 10}, max_failure_percent=10, failure_policy="halt")
    fleet.tick()
    executions = fleet.executions(dep["id"])
    first = [d for d in devices if executions[d]["batch"] == 0]

    # Execute: two failures (10 %) are within the threshold; the third is not
    fleet.report(first[0], executions[first[0]]["id"], "FAILED", detail="disk full")
    fleet.report(first[1], executions[first[1]]["id"], "REJECTED", detail="bad signature")
    fleet.tick()
    assert fleet.detail(dep["id"])["state"] == "RUNNING"
    fleet.report(first[2], executions[first[2]]["id"], "FAILED")
    fleet.tick()
    for d in first[3:]:
        fleet.report(d, executions[d]["id"], "ACTIVE")
    fleet.tick()

    # Assert
    detail = fleet.detail(dep["id"])
    assert detail["state"] == "FAILED"
    assert "15%" in detail["reason"] and "halted" in detail["reason"]
    assert detail["current_batch"] == 0
    after = fleet.executions(dep["id"])
    for d in devices:
        if d in first:
            assert after[d]["released_at"] is not None
        else:
            assert after[d]["state"] == "CANCELED" and after[d]["released_at"] is None
            assert fleet.orders(d) == ([], 0)
    assert detail["counts"]["CANCELED"] == 10 and detail["counts"]["ACTIVE"] == 7


def test_failure_threshold_with_rollback_orders_the_previous_version_back(fleet: Fleet) -> None:
    # Prepare: 10 devices run 1.0.0, except the last one, which reported nothing
    devices = fleet.devices(10)
    v1 = fleet.artifact("1.0.0")
    v2 = fleet.artifact("2.0.0")
    for d in devices[:-1]:
        fleet.set_installed(d, v1)
    dep = fleet.deploy(v2.id, ids=devices, max_failure_percent=10, failure_policy="rollback")
    fleet.tick()
    ex = {d: e["id"] for d, e in fleet.executions(dep["id"]).items()}
    assert fleet.executions(dep["id"])[devices[0]]["previous"]["sha256"] == v1.sha256
    install = DeploymentOrder.model_validate(fleet.orders(devices[0])[0][0])
    assert install.delta is not None and install.delta.base_sha256 == v1.sha256  # it runs 1.0.0: a patch is offered
    assert fleet.executions(dep["id"])[devices[0]]["delta"] is True
    assert DeploymentOrder.model_validate(fleet.orders(devices[-1])[0][0]).delta is None and not fleet.executions(dep["id"])[devices[-1]]["delta"]
    for d in devices[:6] + devices[-1:]:
        fleet.report(d, ex[d], "ACTIVE")
    fleet.report(devices[6], ex[devices[6]], "FAILED")
    fleet.report(devices[7], ex[devices[7]], "FAILED")  # 20 % > 10 %
    fleet.report(devices[8], ex[devices[8]], "DOWNLOADING")  # still in flight

    # Execute: the breach starts the rollback
    fleet.tick()
    assert fleet.tick() == 0  # rollback orders are not issued twice

    # Assert: ACTIVE and FAILED ones get rollback orders of 1.0.0, same execution, downgrade allowed
    detail = fleet.detail(dep["id"])
    assert detail["state"] == "RUNNING" and detail["reason"].startswith("rolling back")
    for d in devices[:8]:
        orders, _ = fleet.orders(d)
        order = DeploymentOrder.model_validate(orders[0])
        assert (order.action, order.execution_id, order.artifact_id, order.allow_downgrade) == ("rollback", ex[d], v1.id, True)
        assert order.signed_manifest.manifest.version == "1.0.0"
    assert DeploymentOrder.model_validate(fleet.orders(devices[8])[0][0]).action == "install"  # in flight: not yet
    no_previous = fleet.executions(dep["id"])[devices[-1]]
    assert no_previous["state"] == "ROLLBACK_FAILED"
    assert _states(no_previous["history"])[-2:] == ["ROLLING_BACK", "ROLLBACK_FAILED"]
    assert "no previous version" in no_previous["history"][-1]["reason"]

    # Execute: the in-flight one becomes ACTIVE later and is ordered back too; everyone reports ROLLED_BACK
    fleet.report(devices[8], ex[devices[8]], "ACTIVE")
    fleet.tick()
    assert DeploymentOrder.model_validate(fleet.orders(devices[8])[0][0]).action == "rollback"
    fleet.report(devices[0], ex[devices[0]], "ROLLING_BACK")
    for d in devices[:9]:
        fleet.report(d, ex[d], "ROLLED_BACK")
        if d != devices[8]:
            assert fleet.detail(dep["id"])["state"] == "RUNNING"
    fleet.tick()

    # Assert
    detail = fleet.detail(dep["id"])
    assert detail["state"] == "ROLLED_BACK"
    assert detail["counts"]["ROLLED_BACK"] == 9 and detail["counts"]["ROLLBACK_FAILED"] == 1
    history = _states(fleet.executions(dep["id"])[devices[0]]["history"])
    assert history == INSTALL_PATH + ["ROLLING_BACK", "ROLLED_BACK"]
    assert _states(fleet.executions(dep["id"])[devices[6]]["history"])[-3:] == ["FAILED", "ROLLING_BACK", "ROLLED_BACK"]


def test_timeout_withdraws_the_order_and_a_late_report_is_ignored(fleet: Fleet) -> None:
    # Prepare
    devices = fleet.devices(2)
    art = fleet.artifact()
    dep = fleet.deploy(art.id, ids=devices, timeout_s=60)
    t0 = datetime.now(UTC)
    fleet.tick(t0)
    ex = {d: e["id"] for d, e in fleet.executions(dep["id"]).items()}
    fleet.report(devices[0], ex[devices[0]], "DOWNLOADING")
    fleet.report(devices[1], ex[devices[1]], "ACTIVE")
    _, version_before = fleet.orders(devices[0])

    # Execute
    fleet.tick(t0 + timedelta(seconds=59))
    assert fleet.executions(dep["id"])[devices[0]]["state"] == "DOWNLOADING"
    fleet.tick(t0 + timedelta(seconds=61))
    fleet.report(devices[0], ex[devices[0]], "ACTIVE")  # too late

    # Assert
    execution = fleet.executions(dep["id"])[devices[0]]
    assert execution["state"] == "TIMED_OUT"
    assert "60 s" in execution["history"][-1]["reason"]
    assert fleet.orders(devices[0]) == ([], version_before + 1)
    assert fleet.ingest.counters["execution_reports_illegal"] == 1
    assert fleet.executions(dep["id"])[devices[1]]["state"] == "ACTIVE"
    detail = fleet.detail(dep["id"])
    assert detail["state"] == "FAILED"  # 50 % failed, max 0 %


def test_a_restarted_controller_resumes_without_ordering_twice(fleet: Fleet) -> None:
    # Prepare
    devices = fleet.devices(6)
    art = fleet.artifact()
    dep = fleet.deploy(art.id, ids=devices, strategy={"type": "rolling", "batch_size": 2})
    fleet.tick()
    released = fleet.released_at(dep["id"])
    versions = fleet.all_orders_versions()

    # Execute: a "restarted hub" (fresh controller, same database) ticks mid-rollout
    restarted = fleet.fresh_controller()
    restarted.tick()
    restarted.tick()

    # Assert: nothing was released or ordered again
    assert fleet.released_at(dep["id"]) == released
    assert fleet.all_orders_versions() == versions
    assert restarted.counters["released"] == 0

    # Execute: the first batch finishes; yet another fresh controller goes on with batch 1 only
    ex = fleet.executions(dep["id"])
    for d in devices:
        if ex[d]["released_at"]:
            fleet.report(d, ex[d]["id"], "ACTIVE")
    again = fleet.fresh_controller()
    again.tick()

    # Assert
    assert again.counters["released"] == 2
    after = fleet.executions(dep["id"])
    assert sorted(e["batch"] for e in after.values() if e["released_at"]) == [0, 0, 1, 1]
    assert fleet.detail(dep["id"])["current_batch"] == 1
    for d, (version, _published) in fleet.all_orders_versions().items():
        if d in devices:
            assert version == (1 if after[d]["released_at"] else 0)


def test_desired_publisher_carries_the_orders(fleet: Fleet) -> None:
    # Prepare: one device target, one node target; everything published so far
    devices = fleet.devices(1)
    node_id = fleet.node_of[devices[0]]
    publisher = DesiredPublisher(fleet.engine)
    publisher.mark_published(publisher.pending())
    assert publisher.pending() == []
    model = fleet.artifact()
    app = fleet.artifact("1.0.0", name="agent", kind="application")
    dep_device = fleet.deploy(model.id, ids=devices)
    dep_node = fleet.deploy(app.id, ids=[node_id], kind="node")

    # Execute
    fleet.tick()
    pending = {p.row_id: p for p in publisher.pending()}

    # Assert: both documents are pending with the orders, though neither desired version moved
    assert set(pending) == {devices[0], node_id}
    for row_id, dep, table in ((devices[0], dep_device, Device), (node_id, dep_node, Node)):
        orders, version = fleet.orders(row_id, table)
        doc = Envelope[DesiredBody].model_validate_json(pending[row_id].payload).body
        assert doc.deployments_version == version == 1
        assert [o.model_dump(mode="json") for o in doc.deployments] == orders
        assert doc.deployments[0].deployment_id == dep["id"]
        assert doc.version == 0
    publisher.mark_published(list(pending.values()))
    assert publisher.pending() == []
    assert fleet.all_orders_versions()[devices[0]] == (1, 1)


def test_node_targets_report_through_node_events(fleet: Fleet) -> None:
    # Prepare
    node_id = fleet.hub.register("edge-1")["node"]["id"]
    art = fleet.artifact("1.0.0", name="agent", kind="application")
    dep = fleet.deploy(art.id, ids=[node_id], kind="node")
    fleet.tick()
    execution_id = fleet.executions(dep["id"])[node_id]["id"]

    # Execute
    fleet.report(node_id, execution_id, "INSTALLING", node=True)
    fleet.report(node_id, execution_id, "ACTIVE", node=True)
    fleet.tick()

    # Assert
    execution = fleet.executions(dep["id"])[node_id]
    assert _states(execution["history"]) == INSTALL_PATH
    assert fleet.detail(dep["id"])["state"] == "SUCCEEDED"


def test_illegal_unknown_foreign_and_malformed_reports_are_ignored_and_counted(fleet: Fleet) -> None:
    # Prepare
    devices = fleet.devices(3)
    art = fleet.artifact()
    dep = fleet.deploy(art.id, ids=devices[:2], strategy={"type": "rolling", "batch_size": 1})
    fleet.tick()
    ex = {d: e["id"] for d, e in fleet.executions(dep["id"]).items()}
    first, second = devices[0], devices[1]  # ids keep their order: batch 0, batch 1
    fleet.report(first, ex[first], "INSTALLING")

    # Execute
    fleet.report(first, ex[first], "DOWNLOADING")  # backwards
    fleet.report(first, "x-00000000000000000000000000", "ACTIVE")  # unknown execution
    fleet.report(devices[2], ex[first], "ACTIVE")  # another device's execution
    fleet.report(second, ex[second], "ACTIVE")  # not released yet
    fleet.report_raw(first, {"execution_id": ex[first], "state": "DONE"})  # malformed
    fleet.report(first, ex[first], "INSTALLING")  # a repeat

    # Assert
    counters = fleet.ingest.counters
    assert counters["execution_reports_applied"] == 1
    assert counters["execution_reports_illegal"] == 1
    assert counters["execution_reports_unknown"] == 1
    assert counters["execution_reports_wrong_target"] == 1
    assert counters["execution_reports_not_released"] == 1
    assert counters["execution_reports_malformed"] == 1
    assert counters["execution_reports_unchanged"] == 1
    after = fleet.executions(dep["id"])
    assert after[first]["state"] == "INSTALLING" and after[second]["state"] == "QUEUED"
    assert _states(after[first]["history"]) == INSTALL_PATH[:5]


def test_a_newer_deployment_of_the_same_kind_supersedes(fleet: Fleet) -> None:
    # Prepare: an old rollout in flight on two devices, and another kind on the same devices
    devices = fleet.devices(2)
    v1 = fleet.artifact("1.0.0")
    v2 = fleet.artifact("2.0.0")
    fw = fleet.artifact("1.0.0", name="fw", kind="firmware")
    old = fleet.deploy(v1.id, ids=devices)
    firmware = fleet.deploy(fw.id, ids=devices)
    fleet.tick()
    old_ex = {d: e["id"] for d, e in fleet.executions(old["id"]).items()}
    fleet.report(devices[0], old_ex[devices[0]], "ACTIVE")
    fleet.report(devices[1], old_ex[devices[1]], "DOWNLOADING")

    # Execute
    new = fleet.deploy(v2.id, ids=devices)
    old_after = fleet.detail(old["id"])
    fleet.tick()

    # Assert: the in-flight one is canceled, the ACTIVE one stays; the order for the kind is replaced
    assert old_after["superseded_by"] == new["id"]
    old_ex_after = {e["target_id"]: e for e in old_after["executions"]}
    assert old_ex_after[devices[1]]["state"] == "CANCELED"
    assert old_ex_after[devices[1]]["history"][-1]["reason"] == f"superseded by {new['id']}"
    assert old_ex_after[devices[0]]["state"] == "ACTIVE"
    assert fleet.detail(firmware["id"])["superseded_by"] is None
    new_ex = fleet.executions(new["id"])
    for d in devices:
        orders, _ = fleet.orders(d)
        by_kind = {o["signed_manifest"]["manifest"]["kind"]: o for o in orders}
        assert set(by_kind) == {"model", "firmware"}
        assert by_kind["model"]["execution_id"] == new_ex[d]["id"]
    fleet.report(devices[1], old_ex[devices[1]], "ACTIVE")  # the old order's late report
    assert fleet.ingest.counters["execution_reports_illegal"] == 1
    assert fleet.detail(old["id"])["state"] == "SUCCEEDED"  # one ACTIVE, one superseded: it is done
