"""Devices under edge nodes and their twins (desired / reported)."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlmodel import Session

from cloud.auth import TokenIdentity
from cloud.errors import NotFound
from cloud.services import audit, enrolment, twins
from cloud.services.labels import apply_patch, clear_labels, selector_clause, set_labels
from cloud.services.nodes import get as get_node
from cloud.services.nodes import issue_recorded_bootstrap, now, revoke_recorded
from cloud.services.paging import page, parse_selector_or_400
from cloud.pki import CertificateAuthority
from cloud.tables import Certificate, Device, DeviceEventRow
from interfaces.ids import is_id, new_id
from interfaces.lifecycle import NodeState
from interfaces.nodes import CertificateRenewal, CertificateRequest, DeviceCreate, DeviceUpdate, TwinUpdate

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


def delete(session: Session, device_id: str, actor: TokenIdentity) -> None:
    """Mark the device DELETED and revoke its certificates; recorded on its node (``device_deleted``)."""
    device = get(session, device_id)
    device.state = NodeState.DELETED.value
    device.deleted_at = device.updated_at = now()
    revoked = enrolment.revoke_all(session, device.id, device.deleted_at)
    clear_labels(session, device.id)
    session.add(device)
    audit.record(session, device.node_id, "device_deleted", actor, f"device {device_id} deleted", device_id=device_id, revoked=revoked)
    session.commit()
    log.info("deleted device %s", device_id)


def put_twin(session: Session, device_id: str, body: TwinUpdate) -> Device:
    return twins.put_desired(session, Device, get, device_id, body)  # type: ignore[no-any-return]


def reissue_bootstrap(session: Session, device_id: str, ttl_s: int, actor: TokenIdentity) -> tuple[str, datetime]:
    """A token for the device (recorded on its node); the admin role once the device ever enrolled."""
    device = get(session, device_id)
    return issue_recorded_bootstrap(session, device.node_id, device_id, ttl_s, actor, "device")


def revoke_superseded(session: Session, device_id: str, actor: TokenIdentity) -> list[str]:
    """Revoke the device's certificates but its newest (recorded on its node); returns their serials."""
    device = get(session, device_id)
    return revoke_recorded(session, device.node_id, device_id, device.certificate_serial, actor, "device")


def enrol(session: Session, ca: CertificateAuthority, device_id: str, body: CertificateRequest, validity: timedelta) -> tuple[Device, Certificate, str]:
    """Devices enrol like nodes (their edge forwards the request); deleting a node deletes its devices."""
    return enrolment.enrol(session, ca, Device, device_id, body.csr_pem, body.bootstrap_token, validity)  # type: ignore[no-any-return]


def renew(session: Session, ca: CertificateAuthority, device_id: str, body: CertificateRenewal, validity: timedelta) -> tuple[Device, Certificate, str]:
    """A new certificate for the holder of the device's key (:func:`cloud.services.enrolment.renew`)."""
    return enrolment.renew(session, ca, Device, device_id, body, validity)  # type: ignore[no-any-return]


def events(session: Session, device_id: str, limit: int, cursor: str | None) -> tuple[list[DeviceEventRow], str | None]:
    """A device's events in arrival order, a page after ``cursor``."""
    get(session, device_id)
    return page(session, select(DeviceEventRow).where(DeviceEventRow.device_id == device_id), DeviceEventRow.id, limit, cursor, numeric=True)
