"""Devices under edge nodes and their twins (desired / reported)."""

from __future__ import annotations

import logging

from sqlalchemy import select, update
from sqlmodel import Session

from cloud.errors import Conflict, NotFound
from cloud.services.labels import apply_patch, clear_labels, selector_clause, set_labels
from cloud.services.nodes import get as get_node
from cloud.services.nodes import now
from cloud.services.paging import page, parse_selector_or_400
from cloud.tables import Device
from interfaces.errors import ErrorCode
from interfaces.ids import is_id, new_id
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
    device = session.get(Device, device_id) if is_id(device_id) else None
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
    return apply_patch(session, get(session, device_id), body)  # type: ignore[no-any-return]


def delete(session: Session, device_id: str) -> None:
    device = get(session, device_id)
    device.state = NodeState.DELETED.value
    device.deleted_at = device.updated_at = now()
    clear_labels(session, device.id)
    session.add(device)
    session.commit()
    log.info("deleted device %s", device_id)


def put_twin(session: Session, device_id: str, body: TwinUpdate) -> Device:
    """Replace the desired document and bump its version.

    The version check and the bump are one conditional UPDATE, so two writers holding the same
    ``expected_version`` cannot both win; without ``expected_version`` the last writer wins.
    """
    for _attempt in range(5):
        device = get(session, device_id)
        expected = device.desired_version if body.expected_version is None else body.expected_version
        result = session.execute(
            update(Device)
            .where(Device.id == device_id, Device.desired_version == expected)  # type: ignore[arg-type]
            .values(desired=dict(body.desired), desired_version=expected + 1, updated_at=now())
        )
        if result.rowcount == 1:  # type: ignore[attr-defined]
            session.commit()
            session.refresh(device)
            return device
        session.rollback()
        if body.expected_version is not None:
            break
    current = get(session, device_id).desired_version
    raise Conflict(f"desired version is {current}, not {expected}", code=ErrorCode.CONFLICT, current_version=current)
