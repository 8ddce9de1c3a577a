"""Devices under edge nodes and their twins (desired / reported)."""

from __future__ import annotations

import logging

from sqlalchemy import select
from sqlmodel import Session

from cloud.errors import Conflict, NotFound
from cloud.services.labels import clear_labels, selector_clause, set_labels
from cloud.services.nodes import get as get_node
from cloud.services.nodes import now
from cloud.services.paging import page, parse_selector_or_400
from cloud.tables import Device
from interfaces.errors import ErrorCode
from interfaces.ids import new_id
from interfaces.lifecycle import NodeState
from interfaces.nodes import DeviceCreate, DeviceUpdate, TwinUpdate

log = logging.getLogger("aisynergy.hub.devices")


def create(session: Session, body: DeviceCreate) -> Device:
    get_node(session, body.node_id)
    at = now()
    device = Device(
        id=new_id("d"),
        node_id=body.node_id,
        name=body.name,
        model=body.model,
        description=body.description,
        labels=dict(body.labels),
        state=NodeState.REGISTERED.value,
        created_at=at,
        updated_at=at,
    )
    session.add(device)
    set_labels(session, device.id, device.labels)
    session.commit()
    log.info("registered device %s under node %s", device.id, device.node_id)
    return device


def get(session: Session, device_id: str) -> Device:
    device = session.get(Device, device_id)
    if device is None or device.state == NodeState.DELETED.value:
        raise NotFound(f"device {device_id} does not exist")
    return device


def list_devices(session: Session, node_id: str | None, selector: str | None, limit: int, cursor: str | None) -> tuple[list[Device], str | None]:
    requirements = parse_selector_or_400(selector)
    query = select(Device).where(Device.state != NodeState.DELETED.value, *selector_clause(Device.id, requirements))
    if node_id is not None:
        get_node(session, node_id)
        query = query.where(Device.node_id == node_id)
    return page(session, query, Device.id, limit, cursor)


def update_device(session: Session, device_id: str, body: DeviceUpdate) -> Device:
    device = get(session, device_id)
    if body.name is not None:
        device.name = body.name
    if body.model is not None:
        device.model = body.model
    if body.description is not None:
        device.description = body.description
    if body.labels is not None:
        device.labels = dict(body.labels)
        set_labels(session, device.id, device.labels)
    device.updated_at = now()
    session.add(device)
    session.commit()
    return device


def delete(session: Session, device_id: str) -> None:
    device = get(session, device_id)
    device.state = NodeState.DELETED.value
    device.deleted_at = device.updated_at = now()
    clear_labels(session, device.id)
    session.add(device)
    session.commit()
    log.info("deleted device %s", device_id)


def put_twin(session: Session, device_id: str, body: TwinUpdate) -> Device:
    device = get(session, device_id)
    if body.expected_version is not None and body.expected_version != device.desired_version:
        raise Conflict(
            f"desired version is {device.desired_version}, not {body.expected_version}",
            code=ErrorCode.CONFLICT,
            current_version=device.desired_version,
        )
    device.desired = dict(body.desired)
    device.desired_version += 1
    device.updated_at = now()
    session.add(device)
    session.commit()
    return device
