"""Strict wire at the hub, over a real broker: an edge node's heartbeat with a wrong type (a number as a string, a
boolean for a number, ``Infinity``, which is not JSON) is refused, counted and answered with a ``message_rejected``
event on the node (DESIGN §6), and the node's last good readings stay as they were. A free-form document the REST
API takes for MQTT (a twin's desired document) is bounded JSON too."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from interfaces.auth import Role
from interfaces.messages import MESSAGE_REJECTED_EVENT, ConnectionState, StateBody, envelope
from interfaces.topics import NODE_HEARTBEAT, NODE_STATE
from tests.hub.conftest import HubUnderTest, assert_problem
from tests.strict_wire_support import GOOD, WRONG, good_heartbeat, wrong_heartbeat
from tests.support import Broker, Hub, Identity, MqttProbe, enrol, start_hub, stop, wait_for


@pytest.fixture
def hub_process(broker: Broker, sqlite_url: str) -> Iterator[Hub]:
    h = start_hub(broker.data_dir, sqlite_url, broker.url, heartbeat_interval=5, offline_after_missed=3)
    try:
        yield h
    finally:
        stop(h.proc)


def _node(hub: Hub, tmp_path: Path) -> Identity:
    with hub.client("operator") as api:
        reg = api.post("/nodes", json={"name": "gw-strict"}).json()
    return enrol(hub, reg["node"]["id"], reg["bootstrap_token"], tmp_path / "gw-strict")


def _status(hub: Hub, node_id: str) -> dict[str, Any]:
    with hub.client("viewer") as api:
        return api.get(f"/nodes/{node_id}/status").json()  # type: ignore[no-any-return]


def _rejections(hub: Hub, node_id: str) -> list[dict[str, Any]]:
    with hub.client("viewer") as api:
        items = api.get(f"/nodes/{node_id}/events", params={"limit": 100}).json()["items"]
    return [e for e in items if e["type"] == MESSAGE_REJECTED_EVENT]


def _dropped(hub: Hub) -> int:
    """The hub's count of the messages it dropped as malformed (a counter appears when it first counts)."""
    health = hub.health()
    assert health is not None and health["mqtt"]["connected"]
    return int(health["mqtt"].get("dropped_invalid", 0))


@pytest.mark.broker
def test_a_node_heartbeat_with_a_wrong_type_is_refused_counted_answered_and_changes_nothing(
    broker: Broker, hub_process: Hub, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    hub = hub_process
    # Prepare: an online node whose good heartbeat the hub holds
    node = _node(hub, tmp_path)
    probe = MqttProbe(node, broker.port).connect()
    request.addfinalizer(probe.close)
    wait_for(probe.connected, 60, what="the node connected")
    online = envelope(node.node_id, StateBody(state=ConnectionState.ONLINE, agent_version="good")).model_dump_json()
    assert probe.publish(NODE_STATE.topic(node_id=node.node_id), online, retain=True) == "Success"
    probe.publish(NODE_HEARTBEAT.topic(node_id=node.node_id), good_heartbeat(node.node_id, 1, 7.5))
    wait_for(lambda: _status(hub, node.node_id)["uptime_s"] == 7.5, 60, what="the good heartbeat stored")
    before, dropped_before = _status(hub, node.node_id), _dropped(hub)

    # Execute: the four heartbeats of the report, on the node's own heartbeat topic
    for path, raw_value, _field in WRONG:
        probe.publish(NODE_HEARTBEAT.topic(node_id=node.node_id), wrong_heartbeat(node.node_id, path, raw_value))

    # Assert: one message_rejected event each, recorded by the hub on the node, naming the topic and the field
    events = wait_for(lambda: (found := _rejections(hub, node.node_id)) and len(found) >= len(WRONG) and found, 60, what="four rejections")
    assert [(e["source"], e["severity"], e["data"]["topic"]) for e in events] == [("hub", "error", NODE_HEARTBEAT.topic(node_id=node.node_id))] * 4  # type: ignore[union-attr]
    assert [e["data"]["rejected_total"] for e in events] == [1, 2, 3, 4]  # type: ignore[union-attr]
    for event, (_path, _raw, field) in zip(events, WRONG, strict=True):  # type: ignore[arg-type]
        assert field in event["message"], event["message"]
    assert _dropped(hub) == dropped_before + 4  # the hub's count of dropped messages
    after = _status(hub, node.node_id)
    assert after["resources"] == before["resources"] == GOOD.model_dump(mode="json")
    assert (after["uptime_s"], after["agent_version"], after["last_heartbeat_at"]) == (7.5, "good", before["last_heartbeat_at"])

    # the next good heartbeat is taken as before
    probe.publish(NODE_HEARTBEAT.topic(node_id=node.node_id), good_heartbeat(node.node_id, 2, 8.5))
    wait_for(lambda: _status(hub, node.node_id)["uptime_s"] == 8.5, 60, what="the next good heartbeat stored")


@pytest.mark.parametrize(
    "raw",
    [b'{"desired": {"rate": NaN}}', b'{"desired": {"rate": [1, Infinity]}}', ('{"desired": ' + '{"x": ' * 40 + "{}" + "}" * 41).encode()],
    ids=["nan", "infinity", "too-deep"],
)
def test_a_desired_document_that_is_not_bounded_json_is_refused_and_nothing_is_stored(sqlite_hub: HubUnderTest, raw: bytes) -> None:
    # Prepare
    device_id = sqlite_hub.add_device(sqlite_hub.register("gw")["node"]["id"])["id"]
    before = sqlite_hub.snapshot()

    # Execute
    r = sqlite_hub.request("PUT", f"/devices/{device_id}/twin", Role.OPERATOR, content=raw, headers={"Content-Type": "application/json"})

    # Assert
    assert_problem(r, 422, "validation_failed")
    assert sqlite_hub.snapshot() == before
