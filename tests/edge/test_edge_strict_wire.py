"""Strict wire at the edge, with the real stack (hub, its broker, an edge process and its devices' broker): a device's
heartbeat with a wrong type (a number as a string, a boolean for a number, ``Infinity``, which is not JSON) is refused
by the edge, counted, answered with a ``message_rejected`` event on the node's events that reaches the hub, and never
relayed: the hub keeps the device's last good readings (DESIGN §6)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from interfaces.messages import MESSAGE_REJECTED_EVENT, ConnectionState, StateBody, envelope
from interfaces.topics import DEVICE_HEARTBEAT, DEVICE_STATE
from tests.edge.support import needs_mosquitto
from tests.integration.devstack import DevStack, start_devstack
from tests.strict_wire_support import GOOD, WRONG, good_heartbeat, wrong_heartbeat
from tests.support import Identity, MqttProbe, enrol, wait_for

pytestmark = [pytest.mark.broker, needs_mosquitto]


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[DevStack]:
    s = start_devstack(tmp_path, f"sqlite:///{tmp_path / 'hub.db'}")
    try:
        yield s
    finally:
        s.close()


def _device(stack: DevStack, tmp_path: Path) -> Identity:
    """A device of the edge with its certificate, enrolled at the hub directly (a raw MQTT client speaks for it)."""
    with stack.hub.client("operator") as api:
        device_id = api.post("/devices", json={"node_id": stack.node_id, "name": "dev-strict", "model": "m"}).json()["id"]
        token = api.post(f"/devices/{device_id}/bootstrap-token", json={}).json()["bootstrap_token"]
    return enrol(stack.hub, device_id, token, tmp_path / "dev-strict", kind="devices")


def _device_status(stack: DevStack, device_id: str) -> dict[str, Any]:
    with stack.hub.client("viewer") as api:
        return api.get(f"/devices/{device_id}/status").json()  # type: ignore[no-any-return]


def _rejections(stack: DevStack) -> list[dict[str, Any]]:
    with stack.hub.client("viewer") as api:
        items = api.get(f"/nodes/{stack.node_id}/events", params={"limit": 100}).json()["items"]
    return [e for e in items if e["type"] == MESSAGE_REJECTED_EVENT]


def _hub_dropped(stack: DevStack) -> int:
    health = stack.hub.health()
    assert health is not None and health["mqtt"]["connected"]
    return int(health["mqtt"].get("dropped_invalid", 0))


def test_a_device_heartbeat_with_a_wrong_type_is_refused_at_the_edge_counted_answered_and_changes_nothing(
    stack: DevStack, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # Prepare: an online device whose good heartbeat the edge relayed to the hub
    device = _device(stack, tmp_path)
    topic = DEVICE_HEARTBEAT.topic(device_id=device.node_id)
    probe = MqttProbe(device, stack.downstream.port).connect()
    request.addfinalizer(probe.close)
    wait_for(probe.connected, 60, what="the device connected")
    online = envelope(device.node_id, StateBody(state=ConnectionState.ONLINE, agent_version="good")).model_dump_json()
    # the devices' broker delivers the device's messages to the edge once it has reloaded the access file the hub
    # rewrote; until then the edge hears nothing, so say it again
    wait_for(
        lambda: probe.publish(DEVICE_STATE.topic(device_id=device.node_id), online, retain=True)
        and _device_status(stack, device.node_id)["state"] == "ONLINE",
        60, interval=0.5, what="the device ONLINE at the hub",
    )  # fmt: skip
    probe.publish(topic, good_heartbeat(device.node_id, 1, 7.5))
    wait_for(lambda: _device_status(stack, device.node_id)["uptime_s"] == 7.5, 60, what="the good heartbeat at the hub")
    before, hub_dropped_before, rejected_before = _device_status(stack, device.node_id), _hub_dropped(stack), len(_rejections(stack))

    # Execute: the four heartbeats of the report, on the device's heartbeat topic
    for path, raw_value, _field in WRONG:
        assert probe.publish(topic, wrong_heartbeat(device.node_id, path, raw_value)) == "Success"

    # Assert: the edge answered each with a message_rejected event of its own, which reached the hub
    found = wait_for(lambda: (e := _rejections(stack)[rejected_before:]) and len(e) >= len(WRONG) and e, 60, what="four rejections at the hub")
    events: list[dict[str, Any]] = found  # type: ignore[assignment]
    assert [(e["source"], e["severity"], e["data"]["topic"], e["data"]["device_id"]) for e in events] == [("node", "error", topic, device.node_id)] * 4
    totals = [e["data"]["rejected_total"] for e in events]  # the edge's count of what it refused, one more each time
    assert totals == list(range(totals[0], totals[0] + 4)) and totals[0] >= 1
    for event, (_path, _raw, field) in zip(events, WRONG, strict=True):
        assert field in event["message"], event["message"]

    # ... and relayed none of them: the hub dropped nothing, and holds the device's last good readings
    assert _hub_dropped(stack) == hub_dropped_before
    after = _device_status(stack, device.node_id)
    assert after["resources"] == before["resources"] == GOOD.model_dump(mode="json")
    assert (after["uptime_s"], after["agent_version"], after["last_heartbeat_at"]) == (7.5, "good", before["last_heartbeat_at"])

    # the next good heartbeat is relayed as before
    probe.publish(topic, good_heartbeat(device.node_id, 2, 8.5))
    wait_for(lambda: _device_status(stack, device.node_id)["uptime_s"] == 8.5, 60, what="the next good heartbeat at the hub")
