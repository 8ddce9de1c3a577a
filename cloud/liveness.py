"""Liveness: a node that misses ``offline_after_missed`` heartbeats goes OFFLINE (DESIGN §4.1).

The MQTT last will usually gets there first; this catches the silent cases (a cut cable, a broker
that lost the session, a hub that was down when the will was published).
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

from sqlalchemy import and_, insert, or_, select, update
from sqlalchemy.engine import Engine
from sqlmodel import Session

from cloud.tables import Node, NodeTransitionRow
from interfaces.lifecycle import CONNECTED_STATES, NodeState

log = logging.getLogger("aisynergy.hub.liveness")


def mark_silent_nodes_offline(engine: Engine, timeout_s: float, missed: int) -> list[str]:
    """Move every connected node whose last contact is older than ``timeout_s`` to OFFLINE."""
    now = datetime.now(UTC)
    cutoff = now - timedelta(seconds=timeout_s)
    connected = [s.value for s in CONNECTED_STATES]
    stale = or_(Node.last_heartbeat_at < cutoff, Node.last_heartbeat_at.is_(None))  # type: ignore[union-attr,operator]
    changed: list[str] = []
    with Session(engine) as session:
        rows = session.execute(select(Node.id, Node.state).where(Node.state.in_(connected), stale)).all()  # type: ignore[attr-defined]
        for node_id, state in rows:
            result = session.execute(
                update(Node)
                .where(and_(Node.id == node_id, Node.state == state, stale))
                .values(state=NodeState.OFFLINE.value, last_state_change_at=now)
            )
            if result.rowcount == 1:  # type: ignore[attr-defined]
                session.execute(insert(NodeTransitionRow).values(
                    node_id=node_id, from_state=state, to_state=NodeState.OFFLINE.value, at=now,
                    reason=f"missed {missed} heartbeats ({timeout_s:g} s without contact)",
                ))  # fmt: skip
                changed.append(node_id)
        session.commit()
    if changed:
        log.info("%d node(s) missed their heartbeats and are OFFLINE: %s", len(changed), ", ".join(changed[:10]))
    return changed
