"""``GET /metrics`` (cloud/metrics.py): Prometheus text exposition, gauges counted from the database at scrape
time, counters from the components' memory, a viewer token required. Runs on SQLite and PostgreSQL."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cloud import tables
from cloud.bridge import MqttBridge
from interfaces.auth import Role
from interfaces.deployments import DeploymentState, ExecutionState
from interfaces.lifecycle import AdminState, NodeState
from tests.hub.conftest import HubUnderTest, assert_problem, hub_settings, running_hub


@pytest.fixture
def mhub(database_url: str, tmp_path: Path) -> Iterator[HubUnderTest]:
    yield from running_hub(hub_settings(tmp_path, database_url))


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(hub: HubUnderTest, role: Role = Role.VIEWER) -> tuple[Samples, dict[str, str]]:
    """Every sample as {(name, sorted labels): value}, and each family's type."""
    r = hub.client.get("/metrics", headers=hub.auth(role))
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain"), r.headers
    samples: Samples = {}
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(r.text):
        types[family.name] = family.type
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in samples, f"duplicate series {key}"
            samples[key] = s.value
    return samples, types


def series(samples: Samples, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {labels: value for (n, labels), value in samples.items() if n == name}


def test_metrics_needs_a_viewer_token(mhub: HubUnderTest) -> None:
    # Act
    missing = mhub.client.get("/metrics")
    wrong = mhub.client.get("/metrics", headers={"Authorization": "Bearer not-a-token"})
    basic = mhub.client.get("/metrics", headers={"Authorization": "Basic dXNlcjpwYXNz"})

    # Assert
    assert_problem(missing, 401, "unauthenticated")
    assert_problem(wrong, 401, "unauthenticated")
    assert_problem(basic, 401, "unauthenticated")
    for role in Role:  # viewer is the least role, and enough
        assert mhub.client.get("/metrics", headers=mhub.auth(role)).status_code == 200


def test_gauges_count_the_rows_per_state(mhub: HubUnderTest) -> None:
    # Prepare: 3 nodes (one locked, one deleted), 3 devices on the first (one deleted)
    a, b, c = (mhub.register(f"gw-{i}")["node"]["id"] for i in range(3))
    r = mhub.request("PUT", f"/nodes/{b}/admin-state", Role.OPERATOR, json={"admin_state": "LOCKED"})
    assert r.status_code == 200, r.text
    assert mhub.request("DELETE", f"/nodes/{c}", Role.ADMIN).status_code == 204
    devices = [mhub.add_device(a)["id"] for _ in range(3)]
    assert mhub.request("DELETE", f"/devices/{devices[0]}", Role.ADMIN).status_code == 204
    nodes_by_api = {n["id"]: n for n in mhub.get("/nodes", params={"limit": 500}).json()["items"]}

    # Act
    samples, types = scrape(mhub)

    # Assert: every known state is a series; the counts match the rows
    nodes = series(samples, "aisynergy_nodes")
    assert len(nodes) == len(NodeState) * len(AdminState)
    assert nodes[(("admin_state", "UNLOCKED"), ("state", "REGISTERED"))] == 1
    assert nodes[(("admin_state", "LOCKED"), ("state", "REGISTERED"))] == 1
    deleted = sum(v for labels, v in nodes.items() if ("state", "DELETED") in labels)
    assert deleted == 1
    assert sum(nodes.values()) == 3
    assert sum(v for labels, v in nodes.items() if ("state", "DELETED") not in labels) == len(nodes_by_api)  # the API lists the live ones
    device_counts = series(samples, "aisynergy_devices")
    assert device_counts == {(("state", s.value),): {"REGISTERED": 2, "DELETED": 1}.get(s.value, 0) for s in NodeState}
    assert series(samples, "aisynergy_deployments") == {(("state", s.value),): 0 for s in DeploymentState}
    assert series(samples, "aisynergy_executions") == {(("state", s.value),): 0 for s in ExecutionState}
    for name in ("aisynergy_nodes", "aisynergy_devices", "aisynergy_deployments", "aisynergy_executions"):
        assert types[name] == "gauge"


def test_task_gauges_follow_the_task_tables(mhub: HubUnderTest) -> None:
    # Prepare: two held inference tasks (PENDING until started), where the task API is there
    held = {"type": "inference", "spec": {"model": {"name": "mlp"}}, "start": False}
    created = [mhub.request("POST", "/tasks", Role.OPERATOR, json=held) for _ in range(2)]
    made = sum(r.status_code == 201 for r in created)
    assert made in (0, 2), [r.text for r in created]

    # Act
    samples, types = scrape(mhub)

    # Assert: absent until cloud/tables.py has the task tables, then one series per known state and type
    from interfaces.tasks import TaskState, TaskType, WorkerState

    tasks, workers = series(samples, "aisynergy_tasks"), series(samples, "aisynergy_task_workers")
    if getattr(tables, "Task", None) is None:
        assert not tasks
    else:
        assert types["aisynergy_tasks"] == "gauge"
        expected = {(("state", s.value), ("type", t.value)): 0 for s in TaskState for t in TaskType}
        expected[(("state", "PENDING"), ("type", "inference"))] = made
        assert tasks == expected
    if getattr(tables, "TaskWorker", None) is None:
        assert not workers
    else:
        assert workers == {(("state", s.value),): 0 for s in WorkerState}


def test_counters_come_from_the_components(mhub: HubUnderTest) -> None:
    # Prepare: the test hub runs without MQTT: a stand-in bridge with known counters
    state = mhub.state
    connected = threading.Event()
    state.bridge = cast(MqttBridge, SimpleNamespace(connected=connected, counters={"messages_received": 5, "dropped_invalid": 2}))
    try:
        # Act
        samples, types = scrape(mhub)
        connected.set()
        again, _ = scrape(mhub)
    finally:
        state.bridge = None

    # Assert
    assert samples[("aisynergy_mqtt_messages_received_total", ())] == 5
    assert samples[("aisynergy_mqtt_dropped_invalid_total", ())] == 2
    assert types["aisynergy_mqtt_messages_received"] == "counter"
    assert samples[("aisynergy_mqtt_connected", ())] == 0
    assert again[("aisynergy_mqtt_connected", ())] == 1
    for key, value in dict(state.scheduler.counters).items():
        assert samples[(f"aisynergy_scheduler_{key}_total", ())] <= value
        assert types[f"aisynergy_scheduler_{key}"] == "counter"
    rollout = state.rollout.counters
    for key in ("ticks", "released", "timed_out", "rollback_orders"):
        assert samples[(f"aisynergy_rollout_{key}_total", ())] <= rollout[key]  # read at scrape time; ticks only grow
    assert samples[("aisynergy_rollout_ticks_total", ())] >= 1
    for key, value in dict(state.ingest.counters).items():
        assert samples[(f"aisynergy_ingest_{key}_total", ())] <= value
    assert ("aisynergy_ingest_backlog", ()) in samples


def test_no_bridge_no_mqtt_metrics_and_metrics_is_documented(mhub: HubUnderTest) -> None:
    # Act
    samples, _ = scrape(mhub)
    doc = mhub.client.get("/openapi.json").json()

    # Assert
    assert not [name for name, _ in samples if name.startswith("aisynergy_mqtt_")]
    assert "get" in doc["paths"]["/metrics"]
    assert doc["paths"]["/metrics"]["get"]["security"]  # a bearer token
    assert mhub.state.metrics_registry is not None  # one registry per app, made on the first scrape
