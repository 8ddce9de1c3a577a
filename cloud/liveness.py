"""Liveness: a node that misses ``offline_after_missed`` heartbeats goes OFFLINE (DESIGN §4.1).

The MQTT last will usually gets there first; this catches the silent cases (a cut cable, a broker
that lost the session, a hub that was down when the will was published).
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import and_, insert, or_, select, update
from sqlalchemy.engine import Engine
from sqlmodel import Session

from cloud.tables import Device, Node, NodeTransitionRow
from interfaces.lifecycle import CONNECTED_STATES, NodeState

log = logging.getLogger("aisynergy.hub.liveness")


def mark_silent_nodes_offline(engine: Engine, timeout_s: float, missed: int) -> list[str]:
    """Move every connected node or device whose last contact is older than ``timeout_s`` to OFFLINE.

    A device's heartbeats reach the hub through its edge, so while that edge is cut off its devices
    show OFFLINE at the hub too (they keep working with their edge)."""
    changed = _mark(engine, Node, timeout_s, missed)
    devices = _mark(engine, Device, timeout_s, missed)
    if devices:
        log.info("%d device(s) missed their heartbeats and are OFFLINE", len(devices))
    return changed + devices


def _mark(engine: Engine, table: Any, timeout_s: float, missed: int) -> list[str]:
    now = datetime.now(UTC)
    cutoff = now - timedelta(seconds=timeout_s)
    connected = [s.value for s in CONNECTED_STATES]
    stale = or_(table.last_heartbeat_at < cutoff, table.last_heartbeat_at.is_(None))
    changed: list[str] = []
    with Session(engine) as session:
        rows = session.execute(select(table.id, table.state).where(table.state.in_(connected), stale)).all()
        for node_id, state in rows:
            result = session.execute(
                update(table)
                .where(and_(table.id == node_id, table.state == state, stale))
                .values(state=NodeState.OFFLINE.value, last_state_change_at=now)
            )
            if result.rowcount != 1:  # type: ignore[attr-defined]
                continue  # a heartbeat got there first
            changed.append(node_id)
            if table is Node:
                session.execute(insert(NodeTransitionRow).values(
                    node_id=node_id, from_state=state, to_state=NodeState.OFFLINE.value, at=now,
                    reason=f"missed {missed} heartbeats ({timeout_s:g} s without contact)",
                ))  # fmt: skip
        session.commit()
    if changed and table is Node:
        log.info("%d node(s) missed their heartbeats and are OFFLINE: %s", len(changed), ", ".join(changed[:10]))
    return changed
