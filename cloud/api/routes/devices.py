"""Devices under nodes and their twins: /devices (DESIGN §4.1)."""

from __future__ import annotations

from datetime import timedelta

from fastapi import APIRouter, Request, Response, status
from fastapi.concurrency import run_in_threadpool

from cloud.api import commands
from cloud.api.deps import (
    DEFAULT_PAGE, Admin, CADep, Cursor, IdempotencyKey, Limit, Operator, Selector, SessionDep, SettingsDep, Viewer, poke_desired, read_one,
)  # fmt: skip
from cloud.api.problems import PROBLEM_RESPONSES
from cloud.api.state import hub_state
from cloud.config import Settings
from cloud.pki import CertificateAuthority
from cloud.tables import Certificate, Device
from cloud.convert import device_event_to_wire, device_status_to_wire, device_to_wire, twin_to_wire
from cloud.services import devices as device_service
from cloud.services import revocation
from interfaces.nodes import (
    BootstrapTokenIssued, BootstrapTokenReissue, CertificateRenewal, CertificateRequest, CommandRequest, CommandResult, DeviceCertificateIssued, DeviceCreate,
    DeviceEvent, DevicePublic, DeviceStatus, DeviceUpdate, Twin, TwinUpdate,
)  # fmt: skip
from interfaces.pagination import Page
from interfaces.topics import RELAY_CMD, RELAY_CMD_REPLY

router = APIRouter(prefix="/devices", tags=["devices"], responses=PROBLEM_RESPONSES)


@router.post("", status_code=status.HTTP_201_CREATED)
def create_device(body: DeviceCreate, request: Request, session: SessionDep, ca: CADep, _: Operator, __: IdempotencyKey = None) -> DevicePublic:
    """Register a device under an edge node (its edge learns of it from the hub)."""
    device = device_service.create(session, body)
    revocation.publish_devices(session, ca)
    poke_desired(request)
    return device_to_wire(device)


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
def delete_device(device_id: str, request: Request, session: SessionDep, ca: CADep, caller: Admin, __: IdempotencyKey = None) -> Response:
    """Delete a device: revoke its certificate and cut it off at the broker (admin, as deleting a node).

    Recorded as a `device_deleted` event on its node (source `hub`: who and when)."""
    device_service.delete(session, device_id, caller)
    revocation.publish(session, ca)
    poke_desired(request)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.get("/{device_id}/twin")
def get_twin(device_id: str, session: SessionDep, _: Viewer) -> Twin:
    """The device twin: desired and reported documents with their versions."""
    return twin_to_wire(device_service.get(session, device_id))


@router.put("/{device_id}/twin")
def put_twin(device_id: str, body: TwinUpdate, request: Request, session: SessionDep, _: Operator, __: IdempotencyKey = None) -> Twin:
    """Replace the desired document (its version goes up by one); its edge passes it on to the device."""
    twin = twin_to_wire(device_service.put_twin(session, device_id, body))
    poke_desired(request)
    return twin


@router.get("/{device_id}/status")
def device_status(device_id: str, session: SessionDep, _: Viewer) -> DeviceStatus:
    """Connection state, last heartbeat and resources, as relayed by the device's edge."""
    return device_status_to_wire(device_service.get(session, device_id))


@router.get("/{device_id}/events")
def device_events(device_id: str, session: SessionDep, _: Viewer, limit: Limit = DEFAULT_PAGE, cursor: Cursor = None) -> Page[DeviceEvent]:
    """The device's events in arrival order (each kept once, however often its edge resent it)."""
    rows, next_cursor = device_service.events(session, device_id, limit, cursor)
    return Page[DeviceEvent](items=[device_event_to_wire(r) for r in rows], next_cursor=next_cursor)


@router.post("/{device_id}/bootstrap-token", status_code=status.HTTP_201_CREATED)
def reissue_device_bootstrap_token(device_id: str, session: SessionDep, ca: CADep, caller: Operator, __: IdempotencyKey = None, body: BootstrapTokenReissue | None = None) -> BootstrapTokenIssued:
    """Issue a one-time bootstrap token with which the device enrols (through its edge).

    The operator role suffices for a device that never enrolled; for one that holds (or held) a certificate this
    needs the admin role (403 otherwise). Each issue is recorded as a `bootstrap_token_issued` event on the
    device's node (source `hub`, `data.device_id`, `data.by`, `by_name`, `role`; `ts` is when). Enrolling with the
    new token revokes nothing: the earlier certificate stays valid until an admin calls
    `POST /devices/{id}/certificates/revoke-superseded`, or it expires."""
    token, expires = device_service.reissue_bootstrap(session, device_id, (body or BootstrapTokenReissue()).ttl_s, caller)
    edge = device_service.get(session, device_id).node_id  # its listener's certificate is the node's, named by its id
    return BootstrapTokenIssued(bootstrap_token=token, bootstrap_expires_at=expires, ca_sha256=ca.fingerprint, tls_server_name=edge)


@router.post("/{device_id}/certificates/revoke-superseded")
def revoke_superseded_device_certificates(device_id: str, session: SessionDep, ca: CADep, caller: Admin, __: IdempotencyKey = None) -> dict[str, list[str]]:
    """Revoke every certificate of the device but its newest (after a re-enrolment); returns the revoked serials.

    The broker refuses them from then on (CRL). Recorded as a `certificates_revoked` event on its node."""
    serials = device_service.revoke_superseded(session, device_id, caller)
    revocation.publish(session, ca)
    return {"revoked": serials}


@router.post("/{device_id}/certificate", status_code=status.HTTP_201_CREATED, openapi_extra={"security": []})
def enrol_device(device_id: str, body: CertificateRequest, request: Request, session: SessionDep, ca: CADep, settings: SettingsDep, __: IdempotencyKey = None) -> DeviceCertificateIssued:
    """Sign the device's CSR (CN = device id) in exchange for its bootstrap token; its edge forwards this."""
    device, cert, pem = device_service.enrol(session, ca, device_id, body, timedelta(days=settings.certificate_validity_days))
    revocation.publish(session, ca)
    return _issued(device, cert, pem, request, ca, settings)


@router.post("/{device_id}/certificate/renewal", openapi_extra={"security": []})
def renew_device_certificate(device_id: str, body: CertificateRenewal, request: Request, session: SessionDep, ca: CADep, settings: SettingsDep, __: IdempotencyKey = None) -> DeviceCertificateIssued:
    """Sign a new certificate for the holder of the device's key, as for a node (its edge forwards this).

    The certificate must be one the hub issued to this device and did not revoke, at most 30 days expired
    (`certificate_expired_beyond_grace` otherwise: re-enrol with a new bootstrap token); the CSR must hold its key
    (`csr_key_mismatch`). The old certificate stays valid until it expires. Recorded as a `certificate_renewed`
    event on the device's node (source `hub`, `data.device_id`)."""
    device, cert, pem = device_service.renew(session, ca, device_id, body, timedelta(days=settings.certificate_validity_days))
    return _issued(device, cert, pem, request, ca, settings)


def _issued(device: Device, cert: Certificate, pem: str, request: Request, ca: CertificateAuthority, settings: Settings) -> DeviceCertificateIssued:
    return DeviceCertificateIssued(
        device_id=device.id, node_id=device.node_id, certificate_pem=pem, ca_pem=ca.ca_pem, serial=cert.serial,
        not_after=cert.not_after, mqtt_url=settings.public_mqtt_url or settings.broker_url,
        heartbeat_interval_s=settings.heartbeat_interval_s, offline_timeout_s=settings.offline_timeout_s, signing_key_pem=hub_state(request).signing.keys_pem,
    )  # fmt: skip


@router.post("/{device_id}/commands", responses={504: PROBLEM_RESPONSES[409] | {"description": "No answer in time"}})
async def device_command(device_id: str, body: CommandRequest, request: Request, _: Operator, __: IdempotencyKey = None) -> CommandResult:
    """Send a command to the device through its edge and return its answer (504 command_timeout if none in time)."""
    # read in a worker thread with a short-lived session: none is held while waiting for the answer
    device = await run_in_threadpool(read_one, request, device_service.get, device_id)
    ids = {"node_id": device.node_id, "device_id": device.id}
    return await commands.send(request, device.state, RELAY_CMD.topic(**ids), RELAY_CMD_REPLY.topic(**ids), body)
