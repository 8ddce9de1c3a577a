"""Desired documents the broker must hold retained: one per node, one per device (relayed by its edge).

The database is the truth; ``desired_published`` on each row says which version the broker holds, and
``orders_published`` which version of the rollout controller's orders (``DesiredBody.deployments``, the
row's ``orders`` at ``orders_version``), and ``tasks_published`` which version of the scheduler's worker
orders (``DesiredBody.tasks``, the row's ``tasks`` at ``tasks_version``). A row is pending when any differs.
The bridge asks for what is pending, publishes it, and marks it published, so a change made while the
broker was away is published when it comes back. A deleted device's document is cleared (empty
retained payload) so that its edge forgets it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from sqlalchemy import and_, or_, select, update
from sqlalchemy.engine import Engine
from sqlmodel import Session

from cloud.tables import Device, Node
from interfaces.deployments import DeploymentOrder
from interfaces.lifecycle import NodeState
from interfaces.messages import HUB_SRC, DesiredBody, envelope
from interfaces.tasks import ORDER_ADAPTER
from interfaces.topics import NODE_DESIRED, RELAY_DESIRED

log = logging.getLogger("aisynergy.hub.desired")
CLEARED = -2  # desired_published of a deleted device whose retained document was removed
BATCH = 500


@dataclass(frozen=True)
class PendingDesired:
    table: str
    row_id: str
    version: int
    topic: str
    payload: bytes
    orders_version: int | None = None  # None: leave orders_published as it is (a cleared document)
    tasks_version: int | None = None  # likewise for tasks_published


class DesiredPublisher:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def pending(self) -> list[PendingDesired]:
        out: list[PendingDesired] = []
        with Session(self.engine) as session:
            nodes = session.execute(
                select(Node.id, Node.desired, Node.desired_version, Node.orders, Node.orders_version, Node.tasks, Node.tasks_version).where(
                    Node.state != NodeState.DELETED.value,
                    or_(and_(Node.desired_version > 0, Node.desired_published != Node.desired_version), Node.orders_published != Node.orders_version,
                        Node.tasks_published != Node.tasks_version),
                ).limit(BATCH)
            ).all()
            for node_id, desired, version, orders, orders_version, tasks, tasks_version in nodes:
                payload = _payload_or_none("node", node_id, version, desired, orders, orders_version, tasks, tasks_version)
                if payload is None:
                    continue
                out.append(PendingDesired("node", node_id, version, NODE_DESIRED.topic(node_id=node_id), payload, orders_version, tasks_version))
            devices = session.execute(
                select(Device.id, Device.node_id, Device.desired, Device.desired_version, Device.state, Device.orders, Device.orders_version, Device.tasks, Device.tasks_version).where(
                    or_(
                        and_(Device.state != NodeState.DELETED.value,
                             or_(Device.desired_published != Device.desired_version, Device.orders_published != Device.orders_version,
                                 Device.tasks_published != Device.tasks_version)),
                        and_(Device.state == NodeState.DELETED.value, Device.desired_published != CLEARED),
                    )
                ).limit(BATCH)
            ).all()  # fmt: skip
            for device_id, node_id, desired, version, state, orders, orders_version, tasks, tasks_version in devices:
                topic = RELAY_DESIRED.topic(node_id=node_id, device_id=device_id)
                if state == NodeState.DELETED.value:
                    out.append(PendingDesired("device", device_id, CLEARED, topic, b""))
                else:
                    payload = _payload_or_none("device", device_id, version, desired, orders, orders_version, tasks, tasks_version)
                    if payload is None:
                        continue
                    out.append(PendingDesired("device", device_id, version, topic, payload, orders_version, tasks_version))
        return out

    def mark_published(self, batch: list[PendingDesired]) -> None:
        with Session(self.engine) as session:
            for item in batch:
                table = Node if item.table == "node" else Device
                values = {"desired_published": item.version}
                if item.orders_version is not None:
                    values["orders_published"] = item.orders_version
                if item.tasks_version is not None:
                    values["tasks_published"] = item.tasks_version
                session.execute(update(table).where(table.id == item.row_id).values(**values))
            session.commit()


def _payload_or_none(kind: str, row_id: str, *args: Any) -> bytes | None:
    """The row's document, or None (logged) when it is not one the contract allows: one bad row must not
    hold back every other target's document."""
    try:
        return _payload(*args)
    except ValidationError as exc:
        log.error("the desired document of %s %s is invalid and is not published: %s", kind, row_id, str(exc).splitlines()[0:3])
        return None


def _payload(version: int, spec: dict[str, Any], orders: list[dict[str, Any]], orders_version: int, tasks: list[dict[str, Any]], tasks_version: int) -> bytes:
    body = DesiredBody(
        version=version, spec=spec, deployments=[DeploymentOrder.model_validate(o) for o in orders or []], deployments_version=orders_version,
        tasks=[ORDER_ADAPTER.validate_python(o) for o in tasks or []], tasks_version=tasks_version,
    )  # fmt: skip
    return envelope(HUB_SRC, body).model_dump_json().encode()
