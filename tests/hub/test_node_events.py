"""Node events (DESIGN §6): a message from a node that the hub drops is answered with a ``message_rejected`` event
recorded on that node, at most ``REJECTIONS_PER_MINUTE`` a minute; the node's own events are stored beside them;
``GET /nodes/{id}/events`` pages through both. The bridge is fed as the broker would feed it (no broker needed)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlmodel import Session, select

from cloud import bridge as bridge_module
from cloud.bridge import REJECTIONS_PER_MINUTE, MqttBridge
from cloud.tables import NodeEventRow
from interfaces.auth import Role
from interfaces.deployments import EXECUTION_EVENT
from interfaces.messages import MAX_MESSAGE_BYTES, MESSAGE_REJECTED_EVENT, ConnectionState, EventBody, StateBody, envelope
from interfaces.pagination import encode_cursor
from interfaces.topics import NODE_CMD_REPLY, NODE_EVENTS, NODE_HEARTBEAT, NODE_STATE, RELAY_HEARTBEAT
from tests.hub.conftest import HubUnderTest, assert_problem


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    c = _Clock()
    monkeypatch.setattr(bridge_module.time, "monotonic", c)
    return c


@pytest.fixture
def fed(hub: HubUnderTest, tmp_path: Path) -> Iterator[MqttBridge]:
    """A bridge over the hub's own ingest, fed by hand (``dispatch`` is what the MQTT loop calls)."""
    yield MqttBridge("mqtt://127.0.0.1:1", tmp_path, "hub-test", hub.state.ingest)


def _events(hub: HubUnderTest, node_id: str, **params: Any) -> list[dict[str, Any]]:
    hub.state.ingest.flush()
    r = hub.get(f"/nodes/{node_id}/events", params=params)
    assert r.status_code == 200, r.text
    return r.json()["items"]  # type: ignore[no-any-return]


def _event(src: str, type: str, message_id: str | None = None, **data: Any) -> bytes:
    e = envelope(src, EventBody(type=type, severity="warning", message=f"{type} happened", data=data))
    if message_id:
        e = e.model_copy(update={"id": message_id})
    return e.model_dump_json().encode()


def test_malformed_oversized_and_forged_messages_are_answered_with_an_error_event_and_change_nothing(hub: HubUnderTest, fed: MqttBridge, clock: _Clock) -> None:
    # Prepare: an online node with a device
    node_id = hub.register("gw")["node"]["id"]
    device_id = hub.add_device(node_id)["id"]
    fed.dispatch(NODE_STATE.topic(node_id=node_id), envelope(node_id, StateBody(state=ConnectionState.ONLINE, agent_version="1")).model_dump_json().encode())
    hub.state.ingest.flush()
    before = hub.get(f"/nodes/{node_id}").json()

    # Execute: four messages the hub must drop
    fed.dispatch(NODE_HEARTBEAT.topic(node_id=node_id), b'{"v": 1, "not": "an envelope"}')
    fed.dispatch(NODE_STATE.topic(node_id=node_id), envelope("someone-else", StateBody(state=ConnectionState.OFFLINE)).model_dump_json().encode())
    fed.dispatch(NODE_EVENTS.topic(node_id=node_id), b"x" * (MAX_MESSAGE_BYTES + 1))
    fed.dispatch(RELAY_HEARTBEAT.topic(node_id=node_id, device_id=device_id), b"\xff\xfe not utf-8")

    # Assert: one error event each, recorded by the hub, in order; the node is as it was
    events = _events(hub, node_id)
    assert [(e["type"], e["source"], e["severity"]) for e in events] == [(MESSAGE_REJECTED_EVENT, "hub", "error")] * 4
    assert [e["data"]["topic"] for e in events] == [
        NODE_HEARTBEAT.topic(node_id=node_id), NODE_STATE.topic(node_id=node_id), NODE_EVENTS.topic(node_id=node_id),
        RELAY_HEARTBEAT.topic(node_id=node_id, device_id=device_id),
    ]  # fmt: skip
    assert [e["data"]["rejected_total"] for e in events] == [1, 2, 3, 4]
    assert "validation error" in events[0]["message"]
    assert "someone-else" in events[1]["message"]
    assert f"exceed the {MAX_MESSAGE_BYTES} byte limit" in events[2]["message"]
    assert events[3]["data"]["device_id"] == device_id
    assert all(e["node_id"] == node_id and e["message_id"] for e in events)
    after = hub.get(f"/nodes/{node_id}").json()
    assert after["state"] == before["state"] == "ONLINE"
    assert fed.counters["dropped_invalid"] == 3 and fed.counters["dropped_src_mismatch"] == 1
    assert fed.counters["rejections_recorded"] == 4


def test_a_node_sending_garbage_gets_at_most_the_limit_of_events_a_minute(hub: HubUnderTest, fed: MqttBridge, clock: _Clock) -> None:
    # Prepare
    node_id = hub.register("gw")["node"]["id"]
    other = hub.register("gw-2")["node"]["id"]
    topic = NODE_HEARTBEAT.topic(node_id=node_id)

    # Execute: 5 more than the limit within a minute, one from another node, then one after the minute
    for _ in range(REJECTIONS_PER_MINUTE + 5):
        fed.dispatch(topic, b"{}")
        clock.now += 0.5
    fed.dispatch(NODE_HEARTBEAT.topic(node_id=other), b"{}")
    clock.now += 60
    fed.dispatch(topic, b"{}")

    # Assert: the limit per node; the next event after the window says how many were left out
    events = _events(hub, node_id, limit=500)
    assert len(events) == REJECTIONS_PER_MINUTE + 1
    assert "suppressed" not in events[0]["data"]
    assert events[-1]["data"]["suppressed"] == 5
    assert events[-1]["data"]["rejected_total"] == REJECTIONS_PER_MINUTE + 6
    assert len(_events(hub, other)) == 1
    assert fed.counters["rejections_suppressed"] == 5


def test_the_nodes_own_events_are_stored_once_and_reports_go_to_their_tables(hub: HubUnderTest, fed: MqttBridge) -> None:
    # Prepare
    node_id = hub.register("gw")["node"]["id"]
    topic = NODE_EVENTS.topic(node_id=node_id)

    # Execute: the edge's own error event (sent twice, as after a lost acknowledgement), an execution report
    # for no execution, and a malformed command reply
    fed.dispatch(topic, _event(node_id, MESSAGE_REJECTED_EVENT, message_id="m-edge-1", topic="synergy/v1/devices/d-1/state"))
    fed.dispatch(topic, _event(node_id, MESSAGE_REJECTED_EVENT, message_id="m-edge-1", topic="synergy/v1/devices/d-1/state"))
    fed.dispatch(topic, _event(node_id, EXECUTION_EVENT, execution_id="x-unknown", state="DOWNLOADING"))
    fed.dispatch(NODE_CMD_REPLY.topic(node_id=node_id), b"not json")

    # Assert
    events = _events(hub, node_id)
    assert [(e["source"], e["message_id"] if e["source"] == "node" else "-") for e in events] == [("node", "m-edge-1"), ("hub", "-")]
    assert events[0]["data"] == {"topic": "synergy/v1/devices/d-1/state"}
    assert events[1]["data"]["topic"] == NODE_CMD_REPLY.topic(node_id=node_id)


def test_events_of_unknown_and_deleted_nodes_are_dropped(hub: HubUnderTest, fed: MqttBridge) -> None:
    # Prepare
    node_id = hub.register("gw")["node"]["id"]
    assert hub.request("DELETE", f"/nodes/{node_id}").status_code == 204
    dropped = hub.state.ingest.counters["dropped_unknown_node"]

    # Execute
    fed.dispatch(NODE_HEARTBEAT.topic(node_id=node_id), b"{}")
    fed.dispatch(NODE_HEARTBEAT.topic(node_id="n-unknown"), b"{}")
    hub.state.ingest.flush()

    # Assert
    assert hub.state.ingest.counters["dropped_unknown_node"] == dropped + 2
    with Session(hub.engine) as session:
        assert session.exec(select(NodeEventRow)).all() == []
    assert_problem(hub.get(f"/nodes/{node_id}/events"), 404, "not_found")


def test_node_events_page_in_arrival_order_and_refuse_bad_requests(hub: HubUnderTest, fed: MqttBridge, clock: _Clock) -> None:
    # Prepare: five events
    node_id = hub.register("gw")["node"]["id"]
    for i in range(5):
        fed.dispatch(NODE_EVENTS.topic(node_id=node_id), _event(node_id, "edge.note", n=i))

    # Execute: pages of two
    hub.state.ingest.flush()
    seen, cursor = [], None
    while True:
        page = hub.get(f"/nodes/{node_id}/events", params={"limit": 2, **({"cursor": cursor} if cursor else {})}).json()
        seen += [e["data"]["n"] for e in page["items"]]
        cursor = page["next_cursor"]
        if not cursor:
            break

    # Assert
    assert seen == [0, 1, 2, 3, 4]
    assert_problem(hub.get("/nodes/n-unknown/events"), 404, "not_found")
    assert_problem(hub.get(f"/nodes/{node_id}/events", params={"cursor": "%%%"}), 400, "invalid_cursor")
    assert_problem(hub.get(f"/nodes/{node_id}/events", params={"cursor": encode_cursor("not-a-number")}), 400, "invalid_cursor")
    assert_problem(hub.get(f"/nodes/{node_id}/events", params={"limit": 0}), 422, "validation_failed")
    assert hub.get(f"/nodes/{node_id}/events", role=None).status_code == 401
    assert hub.get(f"/nodes/{node_id}/events", role=Role.VIEWER).status_code == 200
