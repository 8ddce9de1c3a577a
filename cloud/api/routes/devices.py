"""Devices under nodes and their twins: /devices (DESIGN §4.1)."""

from __future__ import annotations

from fastapi import APIRouter, Response, status

from cloud.api.deps import DEFAULT_PAGE, Cursor, IdempotencyKey, Limit, Operator, Selector, SessionDep, Viewer
from cloud.api.problems import PROBLEM_RESPONSES
from cloud.convert import device_to_wire, twin_to_wire
from cloud.services import devices as device_service
from interfaces.nodes import DeviceCreate, DevicePublic, DeviceUpdate, Twin, TwinUpdate
from interfaces.pagination import Page

router = APIRouter(prefix="/devices", tags=["devices"], responses=PROBLEM_RESPONSES)


@router.post("", status_code=status.HTTP_201_CREATED)
def create_device(body: DeviceCreate, session: SessionDep, _: Operator, __: IdempotencyKey = None) -> DevicePublic:
    """Register a device under an edge node."""
    return device_to_wire(device_service.create(session, body))


@router.get("")
def list_devices(session: SessionDep, _: Viewer, node_id: str | None = None, selector: Selector = None, limit: Limit = DEFAULT_PAGE, cursor: Cursor = None) -> Page[DevicePublic]:
    """List devices, filtered by node and label selector."""
    rows, next_cursor = device_service.list_devices(session, node_id, selector, limit, cursor)
    return Page[DevicePublic](items=[device_to_wire(r) for r in rows], next_cursor=next_cursor)


@router.get("/{device_id}")
def get_device(device_id: str, session: SessionDep, _: Viewer) -> DevicePublic:
    """Read one device."""
    return device_to_wire(device_service.get(session, device_id))


@router.patch("/{device_id}")
def update_device(device_id: str, body: DeviceUpdate, session: SessionDep, _: Operator, __: IdempotencyKey = None) -> DevicePublic:
    """Change a device's name, model, labels or description."""
    return device_to_wire(device_service.update_device(session, device_id, body))


@router.delete("/{device_id}", status_code=status.HTTP_204_NO_CONTENT)
def delete_device(device_id: str, session: SessionDep, _: Operator, __: IdempotencyKey = None) -> Response:
    """Delete a device."""
    device_service.delete(session, device_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.get("/{device_id}/twin")
def get_twin(device_id: str, session: SessionDep, _: Viewer) -> Twin:
    """The device twin: desired and reported documents with their versions."""
    return twin_to_wire(device_service.get(session, device_id))


@router.put("/{device_id}/twin")
def put_twin(device_id: str, body: TwinUpdate, session: SessionDep, _: Operator, __: IdempotencyKey = None) -> Twin:
    """Replace the desired document (its version goes up by one)."""
    return twin_to_wire(device_service.put_twin(session, device_id, body))
