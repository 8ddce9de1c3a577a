"""Events the hub records about a node when an integrator changes who may act as it (DESIGN §6).

They are ``source`` hub rows of the node's events (``GET /nodes/{id}/events``): a bootstrap token issued, a
certificate issued or revoked, a device deleted. Each names the caller (``by``: token id, ``by_name``, ``role``)
and, for a device's identity, the ``device_id``; the row's ``ts`` is when.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlmodel import Session

from cloud.auth import TokenIdentity
from cloud.tables import NodeEventRow
from interfaces.ids import new_id


def record(session: Session, node_id: str, type: str, actor: TokenIdentity | None, message: str, **data: Any) -> None:
    """Add the event (not committed: it lands with the change it records). ``actor`` None: the hub itself."""
    at = datetime.now(UTC)
    who = {"by": actor.id, "by_name": actor.name, "role": actor.role} if actor is not None else {"by": "hub"}
    session.add(NodeEventRow(
        message_id=new_id("audit"), node_id=node_id, source="hub", seq=None, type=type, severity="warning",
        message=message[:1024], data={**data, **who}, ts=at, received_at=at,
    ))  # fmt: skip
