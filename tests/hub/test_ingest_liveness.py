"""Status ingest, liveness and leases against a real, migrated database (no broker: the ingest is transport-neutral)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select, update
from sqlalchemy.engine import Engine
from sqlmodel import Session

from cloud import lease
from cloud.db import make_engine, upgrade
from cloud.ingest import StatusIngest
from cloud.liveness import mark_silent_nodes_offline
from cloud.services import nodes as node_service
from cloud.tables import Lease, Node, NodeTransitionRow
from interfaces.messages import ConnectionState, Health, HeartbeatBody, StateBody
from interfaces.nodes import NodeCreate
from interfaces.resources import CpuReading, DiskReading, MemoryReading, NetworkReading, Resources

T0 = datetime(2030, 1, 1, tzinfo=UTC)


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    upgrade(database_url)
    e = make_engine(database_url)
    try:
        yield e
    finally:
        e.dispose()


@pytest.fixture
def ingest(engine: Engine) -> StatusIngest:
    return StatusIngest(engine)


def _register(engine: Engine, name: str = "gw") -> str:
    with Session(engine, expire_on_commit=False) as session:
        node, _token, _expires = node_service.register(session, NodeCreate(name=name))
        return node.id


def _node(engine: Engine, node_id: str) -> Node:
    with Session(engine) as session:
        node = session.get(Node, node_id)
        assert node is not None
        session.expunge(node)
        return node


def _transitions(engine: Engine, node_id: str) -> list[tuple[str | None, str, str]]:
    with Session(engine) as session:
        rows = session.execute(select(NodeTransitionRow).where(NodeTransitionRow.node_id == node_id).order_by(NodeTransitionRow.id)).scalars()
        return [(r.from_state, r.to_state, r.reason) for r in rows]


def _transitions_with_time(engine: Engine, node_id: str) -> list[tuple[str | None, str, datetime]]:
    with Session(engine) as session:
        rows = session.execute(select(NodeTransitionRow).where(NodeTransitionRow.node_id == node_id).order_by(NodeTransitionRow.id)).scalars()
        return [(r.from_state, r.to_state, r.at) for r in rows]


def _utc(value: datetime | None) -> datetime | None:
    return value.replace(tzinfo=UTC) if value is not None and value.tzinfo is None else value


def _resources(cpu: float = 0.25) -> Resources:
    return Resources(
        cpu=CpuReading(cores=4, utilisation=cpu),
        memory=MemoryReading(total_bytes=8 << 30, available_bytes=4 << 30),
        disk=DiskReading(path="/", total_bytes=64 << 30, free_bytes=32 << 30),
        network=NetworkReading(bytes_sent=1, bytes_received=2),
    )


def _heartbeat(seq: int, health: Health = Health.OK, detail: str | None = None, cpu: float = 0.25) -> HeartbeatBody:
    return HeartbeatBody(seq=seq, health=health, health_detail=detail, agent_version="1.2.3", uptime_s=float(seq * 10), resources=_resources(cpu))


ONLINE = StateBody(state=ConnectionState.ONLINE, agent_version="1.2.3")
WILL = StateBody(state=ConnectionState.OFFLINE, reason="will")


# ---- ingest -----------------------------------------------------------------------------------------


def test_online_state_makes_the_node_online(engine: Engine, ingest: StatusIngest) -> None:
    # Prepare
    node_id = _register(engine)
    ingest.offer(node_id, ONLINE, at=T0)

    # Execute
    written = ingest.flush()

    # Assert
    assert written == 1
    node = _node(engine, node_id)
    assert node.state == "ONLINE"
    assert node.agent_version == "1.2.3"
    assert _utc(node.last_heartbeat_at) == T0
    assert _utc(node.last_state_change_at) == T0
    assert _transitions(engine, node_id) == [(None, "REGISTERED", "registered"), ("REGISTERED", "ONLINE", "agent connected")]
    assert ingest.backlog == 0
    assert ingest.flush() == 0


def test_heartbeats_coalesce_into_one_write_of_the_last(engine: Engine, ingest: StatusIngest) -> None:
    # Prepare
    node_id = _register(engine)
    ingest.offer(node_id, ONLINE, at=T0)
    ingest.flush()
    for seq in (1, 2, 3):
        ingest.offer(node_id, _heartbeat(seq, cpu=seq / 10), at=T0 + timedelta(seconds=seq))

    # Execute
    backlog = ingest.backlog
    written = ingest.flush()

    # Assert
    assert backlog == 1
    assert written == 1
    assert ingest.counters["heartbeats_coalesced"] == 2
    node = _node(engine, node_id)
    assert _utc(node.last_heartbeat_at) == T0 + timedelta(seconds=3)
    assert node.uptime_s == 30.0
    assert node.resources is not None and node.resources["cpu"]["utilisation"] == 0.3
    assert node.health == "ok"
    assert node.state == "ONLINE"
    assert len(_transitions(engine, node_id)) == 2  # heartbeats of an ONLINE node change no state


def test_unhealthy_heartbeat_and_recovery(engine: Engine, ingest: StatusIngest) -> None:
    # Prepare
    node_id = _register(engine)
    ingest.offer(node_id, ONLINE, at=T0)
    ingest.flush()

    # Execute
    ingest.offer(node_id, _heartbeat(1, Health.DEGRADED, "disk almost full"), at=T0 + timedelta(seconds=1))
    ingest.flush()
    degraded = _node(engine, node_id)
    ingest.offer(node_id, _heartbeat(2), at=T0 + timedelta(seconds=2))
    ingest.flush()
    recovered = _node(engine, node_id)

    # Assert
    assert (degraded.state, degraded.health, degraded.health_detail) == ("UNHEALTHY", "degraded", "disk almost full")
    assert (recovered.state, recovered.health) == ("ONLINE", "ok")
    assert [(f, t) for f, t, _ in _transitions(engine, node_id)][1:] == [("REGISTERED", "ONLINE"), ("ONLINE", "UNHEALTHY"), ("UNHEALTHY", "ONLINE")]
    assert "disk almost full" in _transitions(engine, node_id)[2][2]


def test_last_will_makes_the_node_offline(engine: Engine, ingest: StatusIngest) -> None:
    # Prepare
    node_id = _register(engine)
    ingest.offer(node_id, ONLINE, at=T0)
    ingest.flush()

    # Execute
    ingest.offer(node_id, WILL, at=T0 + timedelta(seconds=5))
    ingest.flush()

    # Assert
    node = _node(engine, node_id)
    assert node.state == "OFFLINE"
    assert _utc(node.last_state_change_at) == T0 + timedelta(seconds=5)
    assert _transitions(engine, node_id)[-1] == ("ONLINE", "OFFLINE", "last will: connection lost")


def test_offline_before_ever_online_changes_nothing(engine: Engine, ingest: StatusIngest) -> None:
    # Prepare
    node_id = _register(engine)

    # Execute
    ingest.offer(node_id, WILL, at=T0)
    ingest.flush()

    # Assert
    assert _node(engine, node_id).state == "REGISTERED"
    assert len(_transitions(engine, node_id)) == 1


def test_order_is_preserved_across_state_and_heartbeat(engine: Engine, ingest: StatusIngest) -> None:
    # Prepare: one batch that goes online, heartbeats, loses its connection, comes back unhealthy
    node_id = _register(engine)
    ingest.offer(node_id, ONLINE, at=T0)
    ingest.offer(node_id, _heartbeat(1), at=T0 + timedelta(seconds=1))
    ingest.offer(node_id, WILL, at=T0 + timedelta(seconds=2))
    ingest.offer(node_id, _heartbeat(2, Health.DEGRADED), at=T0 + timedelta(seconds=3))
    ingest.offer(node_id, _heartbeat(3, Health.DEGRADED), at=T0 + timedelta(seconds=4))

    # Execute
    written = ingest.flush()

    # Assert
    assert written == 1
    assert ingest.counters["heartbeats_coalesced"] == 1  # only the two adjacent heartbeats
    steps = [(f, t, _utc(at)) for f, t, at in _transitions_with_time(engine, node_id)][1:]
    assert steps == [
        ("REGISTERED", "ONLINE", T0),
        ("ONLINE", "OFFLINE", T0 + timedelta(seconds=2)),
        ("OFFLINE", "ONLINE", T0 + timedelta(seconds=4)),  # an unhealthy node passes through ONLINE
        ("ONLINE", "UNHEALTHY", T0 + timedelta(seconds=4)),
    ]
    node = _node(engine, node_id)
    assert node.state == "UNHEALTHY"
    assert _utc(node.last_heartbeat_at) == T0 + timedelta(seconds=4)


def test_unknown_and_deleted_nodes_are_dropped_and_counted(engine: Engine, ingest: StatusIngest) -> None:
    # Prepare
    live = _register(engine, "live")
    deleted = _register(engine, "deleted")
    with Session(engine) as session:
        node_service.delete(session, deleted)
    deleted_history = _transitions(engine, deleted)
    ingest.offer("n-doesnotexist0000000000000", ONLINE, at=T0)
    ingest.offer("n-doesnotexist0000000000000", _heartbeat(1), at=T0)
    ingest.offer(deleted, ONLINE, at=T0)
    ingest.offer(live, ONLINE, at=T0)

    # Execute
    written = ingest.flush()

    # Assert
    assert written == 1
    assert ingest.counters["dropped_unknown_node"] == 3
    assert _node(engine, live).state == "ONLINE"
    assert _node(engine, deleted).state == "DELETED"
    assert _transitions(engine, deleted) == deleted_history
    with Session(engine) as session:
        assert session.get(Node, "n-doesnotexist0000000000000") is None


def test_one_flush_writes_many_nodes(engine: Engine, ingest: StatusIngest) -> None:
    # Prepare: some nodes heartbeat, others change state, in one batch
    ids = [_register(engine, f"gw-{i}") for i in range(12)]
    for i, node_id in enumerate(ids):
        ingest.offer(node_id, ONLINE, at=T0)
        if i % 3 == 0:
            ingest.offer(node_id, _heartbeat(1, Health.DEGRADED), at=T0 + timedelta(seconds=1))
        elif i % 3 == 1:
            ingest.offer(node_id, WILL, at=T0 + timedelta(seconds=1))

    # Execute
    written = ingest.flush()

    # Assert
    assert written == len(ids)
    states = [_node(engine, node_id).state for node_id in ids]
    assert states == [("UNHEALTHY", "OFFLINE", "ONLINE")[i % 3] for i in range(len(ids))]


# ---- liveness ---------------------------------------------------------------------------------------


def test_silent_nodes_go_offline_fresh_ones_stay(engine: Engine, ingest: StatusIngest) -> None:
    # Prepare
    now = datetime.now(UTC)
    stale, stale_unhealthy, fresh, never_connected = (_register(engine, n) for n in ("stale", "sick", "fresh", "new"))
    ingest.offer(stale, ONLINE, at=now - timedelta(hours=1))
    ingest.offer(stale_unhealthy, _heartbeat(1, Health.DEGRADED), at=now - timedelta(hours=1))
    ingest.offer(fresh, ONLINE, at=now)
    ingest.flush()

    # Execute
    changed = mark_silent_nodes_offline(engine, timeout_s=300, missed=3)
    again = mark_silent_nodes_offline(engine, timeout_s=300, missed=3)

    # Assert
    assert sorted(changed) == sorted([stale, stale_unhealthy])
    assert again == []
    assert _node(engine, stale).state == "OFFLINE"
    assert _node(engine, stale_unhealthy).state == "OFFLINE"
    assert _node(engine, fresh).state == "ONLINE"
    assert _node(engine, never_connected).state == "REGISTERED"
    last = _transitions(engine, stale)[-1]
    assert last[:2] == ("ONLINE", "OFFLINE")
    assert "missed 3 heartbeats" in last[2]
    assert _transitions(engine, stale_unhealthy)[-1][:2] == ("UNHEALTHY", "OFFLINE")


def test_a_silent_node_that_reports_again_comes_back(engine: Engine, ingest: StatusIngest) -> None:
    # Prepare
    now = datetime.now(UTC)
    node_id = _register(engine)
    ingest.offer(node_id, ONLINE, at=now - timedelta(hours=1))
    ingest.flush()
    mark_silent_nodes_offline(engine, timeout_s=300, missed=3)

    # Execute
    ingest.offer(node_id, _heartbeat(7), at=now)
    ingest.flush()

    # Assert
    assert _node(engine, node_id).state == "ONLINE"
    assert mark_silent_nodes_offline(engine, timeout_s=300, missed=3) == []


# ---- leases -----------------------------------------------------------------------------------------


def _expire(engine: Engine, name: str) -> None:
    with Session(engine) as session:
        session.execute(update(Lease).where(Lease.name == name).values(expires_at=datetime.now(UTC) - timedelta(seconds=1)))
        session.commit()


def _lease(engine: Engine, name: str) -> Lease:
    with Session(engine) as session:
        row = session.get(Lease, name)
        assert row is not None
        session.expunge(row)
        return row


def test_lease_has_one_holder_until_it_expires(engine: Engine) -> None:
    # Execute + Assert: A takes it, B cannot
    assert lease.acquire(engine, "liveness", "replica-a", ttl_s=60) is True
    first_expiry = _utc(_lease(engine, "liveness").expires_at)
    assert lease.acquire(engine, "liveness", "replica-b", ttl_s=60) is False
    assert _lease(engine, "liveness").holder == "replica-a"

    # A renews: still its own, later expiry
    assert lease.acquire(engine, "liveness", "replica-a", ttl_s=120) is True
    renewed = _lease(engine, "liveness")
    assert renewed.holder == "replica-a"
    assert _utc(renewed.expires_at) > first_expiry  # type: ignore[operator]

    # once A's lease has expired, B takes it and A is out
    _expire(engine, "liveness")
    assert lease.acquire(engine, "liveness", "replica-b", ttl_s=60) is True
    assert _lease(engine, "liveness").holder == "replica-b"
    assert lease.acquire(engine, "liveness", "replica-a", ttl_s=60) is False


def test_leases_are_independent_by_name(engine: Engine) -> None:
    # Execute
    a = lease.acquire(engine, "liveness", "replica-a", ttl_s=60)
    b = lease.acquire(engine, "rollout", "replica-b", ttl_s=60)

    # Assert
    assert a and b
    assert (_lease(engine, "liveness").holder, _lease(engine, "rollout").holder) == ("replica-a", "replica-b")


class _PahoStub:
    """Records what the bridge acknowledges (the paho client inside aiomqtt)."""

    def __init__(self) -> None:
        self.acked: list[tuple[int, int]] = []

    def ack(self, mid: int, qos: int) -> None:
        self.acked.append((mid, qos))


class _ClientStub:
    def __init__(self) -> None:
        self._client = _PahoStub()


def test_a_stored_report_is_acknowledged_only_after_its_commit(engine: Engine, ingest: StatusIngest, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A hub killed between receiving a QoS 1 report and committing it has not acknowledged it: the broker redelivers."""
    from cloud.bridge import MqttBridge
    from interfaces.messages import envelope
    from interfaces.topics import NODE_CMD_REPLY, NODE_STATE

    # Prepare
    node_id = _register(engine)
    bridge = MqttBridge("mqtt://127.0.0.1:1", tmp_path, "hub-test", ingest)
    client = _ClientStub()
    bridge._client, bridge._generation = client, 1  # type: ignore[assignment]
    state = envelope(node_id, StateBody(state=ConnectionState.ONLINE, agent_version="1")).model_dump_json().encode()

    # Execute: a report (stored by the ingest) and a message the ingest does not keep
    bridge.dispatch(NODE_STATE.topic(node_id=node_id), state, None, (1, 17, 1))
    bridge.dispatch(NODE_CMD_REPLY.topic(node_id=node_id), b"not json", None, (1, 18, 1))
    acked_before_flush = list(client._client.acked)
    bridge._acknowledge(_flushed(ingest))

    # Assert
    assert acked_before_flush == [(18, 1)]  # only the dropped one, at once
    assert client._client.acked == [(18, 1), (17, 1)]
    assert _node(engine, node_id).state == "ONLINE"


def test_an_acknowledgement_from_an_earlier_connection_is_not_sent(engine: Engine, ingest: StatusIngest, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from cloud.bridge import MqttBridge
    from interfaces.messages import envelope
    from interfaces.topics import NODE_STATE

    # Prepare
    node_id = _register(engine)
    bridge = MqttBridge("mqtt://127.0.0.1:1", tmp_path, "hub-test", ingest)
    client = _ClientStub()
    bridge._client, bridge._generation = client, 1  # type: ignore[assignment]
    state = envelope(node_id, StateBody(state=ConnectionState.ONLINE, agent_version="1")).model_dump_json().encode()
    bridge.dispatch(NODE_STATE.topic(node_id=node_id), state, None, (1, 5, 1))

    # Execute: the connection was replaced before the commit
    bridge._generation = 2
    bridge._acknowledge(_flushed(ingest))

    # Assert: the broker will redeliver it on the new connection; that copy is acknowledged then
    assert client._client.acked == []
    assert bridge.counters["acks_dropped_reconnected"] == 1


def _flushed(ingest: StatusIngest) -> list[tuple[int, int, int]]:
    persisted: list[tuple[int, int, int]] = []
    ingest.on_persisted = persisted.extend
    ingest.flush()
    return persisted
