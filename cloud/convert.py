"""Rows <-> wire models, in one place (``node_to_wire``, ``device_to_wire``, ...)."""

from __future__ import annotations

from datetime import UTC, datetime

from cloud.services.twins import diff
from cloud.tables import Device, DeviceEventRow, Node, NodeEventRow, NodeTransitionRow
from interfaces.lifecycle import CONNECTED_STATES, AdminState, NodeState
from interfaces.messages import Health
from interfaces.nodes import DeviceEvent, DevicePublic, DeviceStatus, NodeEvent, NodeKind, NodePublic, NodeStatus, NodeTransition, Twin
from interfaces.resources import Resources


def utc(value: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes; everything we store is UTC."""
    if value is None:
        return None
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def node_to_wire(row: Node) -> NodePublic:
    return NodePublic(
        id=row.id,
        name=row.name,
        kind=NodeKind(row.kind),
        labels=dict(row.labels),
        description=row.description,
        state=NodeState(row.state),
        admin_state=AdminState(row.admin_state),
        created_at=utc(row.created_at),  # type: ignore[arg-type]
        updated_at=utc(row.updated_at),  # type: ignore[arg-type]
        certificate_serial=row.certificate_serial,
        certificate_not_after=utc(row.certificate_not_after),
    )


def node_status_to_wire(row: Node) -> NodeStatus:
    state = NodeState(row.state)
    return NodeStatus(
        node_id=row.id,
        state=state,
        admin_state=AdminState(row.admin_state),
        connected=state in CONNECTED_STATES,
        last_heartbeat_at=utc(row.last_heartbeat_at),
        last_state_change_at=utc(row.last_state_change_at),
        health=Health(row.health) if row.health else None,
        health_detail=row.health_detail,
        agent_version=row.agent_version,
        uptime_s=row.uptime_s,
        resources=Resources.model_validate(row.resources) if row.resources else None,
    )


def transition_to_wire(row: NodeTransitionRow) -> NodeTransition:
    return NodeTransition(
        from_state=NodeState(row.from_state) if row.from_state else None,
        to_state=NodeState(row.to_state),
        at=utc(row.at),  # type: ignore[arg-type]
        reason=row.reason,
    )


def device_to_wire(row: Device) -> DevicePublic:
    return DevicePublic(
        id=row.id,
        node_id=row.node_id,
        name=row.name,
        model=row.model,
        labels=dict(row.labels),
        description=row.description,
        state=NodeState(row.state),
        created_at=utc(row.created_at),  # type: ignore[arg-type]
        updated_at=utc(row.updated_at),  # type: ignore[arg-type]
    )


def twin_to_wire(row: Device | Node) -> Twin:
    is_device = isinstance(row, Device)
    return Twin(
        device_id=row.id if is_device else None,
        node_id=row.node_id if is_device else row.id,  # type: ignore[union-attr]
        diff=diff(row.desired, row.reported),
        desired=dict(row.desired),
        desired_version=row.desired_version,
        reported=dict(row.reported),
        reported_version=row.reported_version,
        reported_at=utc(row.reported_at),
        in_sync=row.reported_version == row.desired_version,
    )


def device_status_to_wire(row: Device) -> DeviceStatus:
    state = NodeState(row.state)
    return DeviceStatus(
        device_id=row.id,
        node_id=row.node_id,
        state=state,
        connected=state in CONNECTED_STATES,
        last_heartbeat_at=utc(row.last_heartbeat_at),
        last_state_change_at=utc(row.last_state_change_at),
        health=Health(row.health) if row.health else None,
        agent_version=row.agent_version,
        uptime_s=row.uptime_s,
        resources=Resources.model_validate(row.resources) if row.resources else None,
    )


def node_event_to_wire(row: NodeEventRow) -> NodeEvent:
    return NodeEvent(
        node_id=row.node_id, source=row.source, seq=row.seq, message_id=row.message_id, type=row.type, severity=row.severity,  # type: ignore[arg-type]
        message=row.message, data=dict(row.data), ts=utc(row.ts), received_at=utc(row.received_at),  # type: ignore[arg-type]
    )  # fmt: skip


def device_event_to_wire(row: DeviceEventRow) -> DeviceEvent:
    return DeviceEvent(
        device_id=row.device_id, seq=row.seq, message_id=row.message_id, type=row.type, severity=row.severity,
        message=row.message, data=dict(row.data), ts=utc(row.ts), received_at=utc(row.received_at),  # type: ignore[arg-type]
    )  # fmt: skip
