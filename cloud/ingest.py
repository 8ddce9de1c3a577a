"""Ingest of what agents report: state, heartbeats, reported documents, device and node events (and the
``message_rejected`` events the hub records on a node whose message it dropped, DESIGN §6).

Messages are queued in memory (consecutive heartbeats of one node or device collapse into the latest)
and written every ``flush_interval`` in one transaction: per 500 rows one SELECT of current states,
one bulk UPDATE, one bulk INSERT of lifecycle transitions, and one INSERT per event table that skips ids
already stored (an edge may resend after a lost acknowledgement: each event is kept once). At 10,000
nodes heartbeating every 10 s this is 5 transactions a second instead of 1,000.

Execution progress (events of type ``EXECUTION_EVENT`` from a device, relayed by its edge, or from an
edge node itself) is applied to the deployment executions in the same transaction
(``cloud.services.deployments.apply_progress``); a malformed or refused report is logged and counted
(``execution_reports_<outcome>``), never fatal. Task workers' reports (``interfaces.tasks.TASK_EVENTS``) go to
the task tables the same way (``cloud.services.task_reports``; counted as ``task_<kind>_<outcome>``) and are
not stored as device events.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError
from sqlalchemy import insert, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine
from sqlmodel import Session

from cloud.services import task_reports
from cloud.services.deployments import APPLIED, apply_progress
from cloud.tables import Device, DeviceEventRow, Node, NodeEventRow, NodeTransitionRow
from interfaces.deployments import EXECUTION_EVENT, ExecutionProgress
from interfaces.lifecycle import CONNECTED_STATES, NodeState, path_to, state_after_report
from interfaces.messages import (
    HUB_SRC,
    ConnectionState,
    Envelope,
    EventBody,
    ExecutionEvent,
    Health,
    HeartbeatBody,
    ReportedBody,
    StateBody,
    acted_event,
)
from interfaces.tasks import TASK_EVENTS

log = logging.getLogger("aisynergy.hub.ingest")
CHUNK = 500
NODE, DEVICE = "node", "device"
_TABLES: dict[str, Any] = {NODE: Node, DEVICE: Device}


@dataclass
class _Op:
    at: datetime
    body: HeartbeatBody | StateBody | ReportedBody


class StatusIngest:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._pending: dict[tuple[str, str, str], list[_Op]] = {}
        self._events: list[tuple[str, str, Envelope[EventBody], datetime]] = []
        self._node_events: list[tuple[str, Envelope[EventBody], datetime]] = []
        self._acks: list[Any] = []
        self._lock = threading.Lock()
        self.counters: dict[str, int] = defaultdict(int)
        self.on_persisted: Callable[[list[Any]], None] | None = None
        """Called (from the flushing thread) with the ``hold_ack`` tokens whose messages are now committed."""
        self.on_tasks_changed: Callable[[], None] | None = None
        """Called (from the flushing thread) after a commit that the task scheduler should act on at once."""
        self._wake_scheduler = False

    def offer(self, node_id: str, body: HeartbeatBody | StateBody | ReportedBody, at: datetime | None = None,
              kind: str = NODE, via: str | None = None) -> None:  # fmt: skip
        """Queue a report of node ``node_id`` (or of device ``node_id`` relayed by edge ``via``)."""
        op = _Op(at or datetime.now(UTC), body)
        with self._lock:
            ops = self._pending.setdefault((kind, node_id, via or node_id), [])
            if ops and isinstance(body, HeartbeatBody) and isinstance(ops[-1].body, HeartbeatBody):
                ops[-1] = op
                self.counters["heartbeats_coalesced"] += 1
            else:
                ops.append(op)

    def hold_ack(self, token: Any) -> None:
        """Keep a message's acknowledgement until what was offered with it is committed (``on_persisted``)."""
        with self._lock:
            self._acks.append(token)

    def offer_event(self, node_id: str, device_id: str, message: Envelope[EventBody], at: datetime | None = None) -> None:
        """Queue an event of device ``device_id`` relayed by edge ``node_id``, received ``at`` (default: now)."""
        with self._lock:
            self._events.append((node_id, device_id, message, at or datetime.now(UTC)))

    def offer_node_event(self, node_id: str, message: Envelope[EventBody], at: datetime | None = None) -> None:
        """Queue an event of an edge node: its own (execution progress and task reports are acted on, the rest
        stored), or one the hub records about it (``src`` hub: a message from the node that it dropped)."""
        with self._lock:
            self._node_events.append((node_id, message, at or datetime.now(UTC)))

    @property
    def backlog(self) -> int:
        return len(self._pending) + len(self._events) + len(self._node_events)

    def flush(self) -> int:
        """Write everything queued; returns the number of rows updated or inserted."""
        with self._lock:
            pending, self._pending = self._pending, {}
            events, self._events = self._events, []
            node_events, self._node_events = self._node_events, []
            acks, self._acks = self._acks, []
        if not pending and not events and not node_events:
            self._persisted(acks)
            return 0
        written = 0
        with Session(self.engine) as session:
            for kind in (NODE, DEVICE):
                keys = [(i, via) for k, i, via in pending if k == kind]
                for start in range(0, len(keys), CHUNK):
                    chunk = {key: pending[(kind, *key)] for key in keys[start : start + CHUNK]}
                    written += self._flush_chunk(session, kind, chunk)
            if events:
                written += self._insert_events(session, events)
            if node_events:
                live_nodes = set(session.execute(
                    select(Node.id).where(Node.id.in_({n for n, _, _ in node_events}), Node.state != NodeState.DELETED.value)  # type: ignore[attr-defined]
                ).scalars())  # fmt: skip
                self.counters["dropped_unknown_node"] += sum(1 for n, _, _ in node_events if n not in live_nodes)
                live = [(NODE, n, m, at) for n, m, at in node_events if n in live_nodes]
                written += self._apply_progress(session, [r for r in live if r[2].body.type == EXECUTION_EVENT])
                written += self._apply_task_reports(session, [r for r in live if r[2].body.type in TASK_EVENTS])
                written += self._insert_node_events(session, [(n, m, at) for _, n, m, at in live if m.body.type != EXECUTION_EVENT and m.body.type not in TASK_EVENTS])
            session.commit()
        self._persisted(acks)
        if self._wake_scheduler:
            self._wake_scheduler = False
            if self.on_tasks_changed is not None:
                self.on_tasks_changed()
        self.counters["flushes"] += 1
        self.counters["rows_written"] += written
        return written

    def _persisted(self, acks: list[Any]) -> None:
        if acks and self.on_persisted is not None:
            self.on_persisted(acks)

    def _flush_chunk(self, session: Session, kind: str, ops: dict[tuple[str, str], list[_Op]]) -> int:
        """``ops`` is keyed by (id, edge id): a device's reports count only from the edge it is under."""
        table = _TABLES[kind]
        ids = [row_id for row_id, _via in ops]
        if kind == DEVICE:
            owner = dict(session.execute(select(Device.id, Device.node_id).where(Device.id.in_(ids))).all())  # type: ignore[attr-defined]
            current = {row_id: state for row_id, state in session.execute(select(table.id, table.state).where(table.id.in_(ids))).all()}
            current = {(i, owner.get(i)): st for i, st in current.items()}
        else:
            current = {(i, i): st for i, st in session.execute(select(table.id, table.state).where(table.id.in_(ids))).all()}
        groups: dict[tuple[str, ...], list[dict[str, Any]]] = defaultdict(list)
        transitions: list[dict[str, Any]] = []
        for (row_id, via), row_ops in ops.items():
            state = current.get((row_id, via))
            if state is None or state == NodeState.DELETED:
                self.counters[f"dropped_unknown_{kind}"] += len(row_ops)
                continue
            values = self._apply(row_id, NodeState(state), row_ops, transitions, kind)
            groups[tuple(sorted(values))].append(values)
        for rows in groups.values():
            session.execute(update(table), rows)
        if transitions and kind == NODE:
            session.execute(insert(NodeTransitionRow), transitions)
        return sum(len(r) for r in groups.values())

    @staticmethod
    def _apply(row_id: str, state: NodeState, row_ops: list[_Op], transitions: list[dict[str, Any]], kind: str) -> dict[str, Any]:
        values: dict[str, Any] = {"id": row_id}
        for op in row_ops:
            body = op.body
            if isinstance(body, ReportedBody):
                values.update(reported=body.status, reported_version=body.version, reported_at=op.at)
                continue
            if isinstance(body, HeartbeatBody):
                healthy = body.health is Health.OK
                target = state_after_report(state, connected=True, healthy=healthy)
                reason = "heartbeat" if healthy else f"heartbeat reports {body.health}: {body.health_detail or ''}".strip()
                values.update(
                    last_heartbeat_at=op.at, health=body.health.value, agent_version=body.agent_version,
                    uptime_s=body.uptime_s, resources=body.resources.model_dump(mode="json"),
                )  # fmt: skip
                if kind == NODE:
                    values["health_detail"] = body.health_detail
            elif body.state is ConnectionState.ONLINE:
                target = state if state in CONNECTED_STATES else NodeState.ONLINE
                reason = "agent connected"
                values["last_heartbeat_at"] = op.at
                if body.agent_version:
                    values["agent_version"] = body.agent_version
            else:
                target = state_after_report(state, connected=False, healthy=False)
                reason = f"agent {body.reason or 'went offline'}" if body.reason != "will" else "last will: connection lost"
            for step in path_to(state, target):
                transitions.append({"node_id": row_id, "from_state": state.value, "to_state": step.value, "at": op.at, "reason": reason[:256]})
                state = step
                values["state"] = state.value
                values["last_state_change_at"] = op.at
        return values

    def _insert_events(self, session: Session, events: list[tuple[str, str, Envelope[EventBody], datetime]]) -> int:
        live = set(session.execute(
            select(Device.id, Device.node_id).where(Device.id.in_({d for _, d, _, _ in events}), Device.state != NodeState.DELETED.value)  # type: ignore[attr-defined]
        ).all())  # fmt: skip
        known = [(n, d, m, at) for n, d, m, at in events if (d, n) in live]
        self.counters["dropped_unknown_device"] += len(events) - len(known)
        # task reports land in the task tables (kept once there); every other event is stored as it is
        progress = self._apply_task_reports(session, [(DEVICE, d, m, at) for n, d, m, at in known if m.body.type in TASK_EVENTS])
        rows = [
            {"message_id": m.id, "node_id": n, "device_id": d, "seq": m.body.seq, "type": m.body.type, "severity": m.body.severity,
             "message": m.body.message, "data": m.body.data, "ts": m.ts, "received_at": at}
            for n, d, m, at in known if m.body.type not in TASK_EVENTS
        ]  # fmt: skip
        progress += self._apply_progress(session, [(DEVICE, d, m, at) for n, d, m, at in known if m.body.type == EXECUTION_EVENT])
        if not rows:
            return progress
        self.counters["events_stored"] += _insert_once(session, DeviceEventRow, rows)
        return len(rows)

    def _insert_node_events(self, session: Session, events: list[tuple[str, Envelope[EventBody], datetime]]) -> int:
        if not events:
            return 0
        rows = [
            {"message_id": m.id, "node_id": n, "source": "hub" if m.src == HUB_SRC else "node", "seq": m.body.seq, "type": m.body.type,
             "severity": m.body.severity, "message": m.body.message, "data": m.body.data, "ts": m.ts, "received_at": at}
            for n, m, at in events
        ]  # fmt: skip
        self.counters["node_events_stored"] += _insert_once(session, NodeEventRow, rows)
        return len(rows)

    def _apply_task_reports(self, session: Session, reports: list[tuple[str, str, Envelope[EventBody], datetime]]) -> int:
        """Apply task workers' reports (cloud.services.task_reports); wake the scheduler when one calls for it."""
        if not reports:
            return 0
        counts, poke = task_reports.apply(session, reports)
        for key, n in counts.items():
            self.counters[key] += n
        if poke:
            self._wake_scheduler = True
        return sum(n for key, n in counts.items() if key.endswith("_applied"))

    def _apply_progress(self, session: Session, reports: list[tuple[str, str, Envelope[EventBody], datetime]]) -> int:
        """Apply execution progress reports (kind, target id, event); ordered by execution, each in arrival order."""
        parsed: list[tuple[str, str, ExecutionProgress, datetime]] = []
        for kind, target_id, message, at in reports:
            try:
                event = acted_event(message.body)
                assert isinstance(event, ExecutionEvent)  # the callers pass only EXECUTION_EVENT
                parsed.append((kind, target_id, event.data, at))
            except ValidationError as exc:
                self.counters["execution_reports_malformed"] += 1
                log.warning("malformed execution report %s from %s: %s", message.id, target_id, exc.errors()[:1])
        parsed.sort(key=lambda r: r[2].execution_id)  # a stable order of row locks across writers
        applied = 0
        for kind, target_id, progress, at in parsed:
            try:
                outcome = apply_progress(session, kind, target_id, progress, at)
            except Exception:  # noqa: BLE001 - one bad report must not lose the batch
                log.exception("execution report from %s for %s failed", target_id, progress.execution_id)
                outcome = "failed"
            self.counters[f"execution_reports_{outcome}"] += 1
            applied += outcome == APPLIED
        return applied


def _insert_once(session: Session, table: Any, rows: list[dict[str, Any]]) -> int:
    """Insert ``rows``, skipping a ``message_id`` already stored (a resent message); the number inserted."""
    dialect = session.get_bind().dialect.name
    stmt = (postgresql.insert if dialect == "postgresql" else sqlite.insert)(table).on_conflict_do_nothing(index_elements=["message_id"])
    return max(session.connection().execute(stmt, rows).rowcount, 0)
