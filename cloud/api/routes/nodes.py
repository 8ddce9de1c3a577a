"""Edge node management: /nodes (DESIGN §4.1)."""

from __future__ import annotations

from datetime import timedelta

from fastapi import APIRouter, Request, Response, status
from fastapi.concurrency import run_in_threadpool

from cloud.api.deps import DEFAULT_PAGE, Admin, CADep, Cursor, IdempotencyKey, Limit, Operator, Selector, SessionDep, SettingsDep, Viewer
from cloud.api.problems import PROBLEM_RESPONSES
from cloud.api.state import hub_state
from cloud.config import Settings
from cloud.pki import CertificateAuthority
from cloud.tables import Certificate, Node
from cloud.api import commands
from cloud.api.deps import poke_desired, read_one
from cloud.convert import device_to_wire, node_event_to_wire, node_status_to_wire, node_to_wire, transition_to_wire, twin_to_wire
from cloud.services import devices as device_service
from cloud.services import nodes as node_service
from cloud.services import revocation
from interfaces.lifecycle import NodeState
from interfaces.nodes import (
    AdminStateUpdate,
    BootstrapTokenIssued,
    BootstrapTokenReissue,
    CertificateIssued,
    CertificateRenewal,
    CertificateRequest,
    CommandRequest,
    CommandResult,
    DevicePublic,
    NodeCreate,
    NodeEvent,
    NodePublic,
    NodeRegistered,
    NodeStatus,
    NodeTransition,
    NodeUpdate,
    Twin,
    TwinUpdate,
)
from interfaces.topics import NODE_CMD, NODE_CMD_REPLY
from interfaces.pagination import Page

router = APIRouter(prefix="/nodes", tags=["nodes"], responses=PROBLEM_RESPONSES)


@router.post("", status_code=status.HTTP_201_CREATED)
def register_node(body: NodeCreate, session: SessionDep, ca: CADep, _: Operator, __: IdempotencyKey = None) -> NodeRegistered:
    """Pre-register an edge node; returns its one-time bootstrap token and the CA fingerprint it checks first."""
    node, token, expires = node_service.register(session, body)
    return NodeRegistered(node=node_to_wire(node), bootstrap_token=token, bootstrap_expires_at=expires, ca_sha256=ca.fingerprint)


@router.get("")
def list_nodes(
    session: SessionDep, _: Viewer, selector: Selector = None, state: NodeState | None = None,
    limit: Limit = DEFAULT_PAGE, cursor: Cursor = None,
) -> Page[NodePublic]:  # fmt: skip
    """List nodes, filtered by label selector and state."""
    rows, next_cursor = node_service.list_nodes(session, selector, state, limit, cursor)
    return Page[NodePublic](items=[node_to_wire(r) for r in rows], next_cursor=next_cursor)


@router.get("/{node_id}")
def get_node(node_id: str, session: SessionDep, _: Viewer) -> NodePublic:
    """Read one node."""
    return node_to_wire(node_service.get(session, node_id))


@router.patch("/{node_id}")
def update_node(node_id: str, body: NodeUpdate, session: SessionDep, _: Operator, __: IdempotencyKey = None) -> NodePublic:
    """Change a node's name, labels or description."""
    return node_to_wire(node_service.update_node(session, node_id, body))


@router.delete("/{node_id}", status_code=status.HTTP_204_NO_CONTENT)
def delete_node(node_id: str, request: Request, session: SessionDep, ca: CADep, _: Admin, __: IdempotencyKey = None) -> Response:
    """Delete a node: revoke its certificate (the broker refuses it) and delete its devices."""
    node_service.delete(session, node_id)
    revocation.publish(session, ca)
    bridge = hub_state(request).bridge
    if bridge is not None:
        bridge.forget_node(node_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.put("/{node_id}/admin-state")
def set_admin_state(node_id: str, body: AdminStateUpdate, session: SessionDep, _: Operator, __: IdempotencyKey = None) -> NodePublic:
    """Lock (no new deployments or task workers) or unlock a node."""
    return node_to_wire(node_service.set_admin_state(session, node_id, body.admin_state))


@router.get("/{node_id}/status")
def node_status(node_id: str, session: SessionDep, _: Viewer) -> NodeStatus:
    """Connection state, last heartbeat, resources and agent version."""
    return node_status_to_wire(node_service.get(session, node_id))


@router.get("/{node_id}/events")
def node_events(node_id: str, session: SessionDep, _: Viewer, limit: Limit = DEFAULT_PAGE, cursor: Cursor = None) -> Page[NodeEvent]:
    """The node's events in arrival order: its own (``source`` node; execution and task reports go to their
    deployments and tasks instead), and those the hub recorded about it (``source`` hub): a ``message_rejected``
    for each message from the node that the hub dropped as malformed (at most 20 a minute; ``data.suppressed``
    counts those left out)."""
    rows, next_cursor = node_service.events(session, node_id, limit, cursor)
    return Page[NodeEvent](items=[node_event_to_wire(r) for r in rows], next_cursor=next_cursor)


@router.get("/{node_id}/history")
def node_history(node_id: str, session: SessionDep, _: Viewer, limit: Limit = 100) -> list[NodeTransition]:
    """The node's lifecycle transitions, oldest first."""
    return [transition_to_wire(r) for r in node_service.history(session, node_id, limit)]


@router.post("/{node_id}/bootstrap-token", status_code=status.HTTP_201_CREATED)
def reissue_bootstrap_token(node_id: str, session: SessionDep, ca: CADep, caller: Operator, __: IdempotencyKey = None, body: BootstrapTokenReissue | None = None) -> BootstrapTokenIssued:
    """Issue a fresh one-time bootstrap token (to re-enrol a node that lost its identity).

    The operator role suffices for a node that never enrolled; for one that holds (or held) a certificate this
    needs the admin role (403 otherwise). An earlier token not used yet expires. Each issue is recorded as a
    `bootstrap_token_issued` event on the node (source `hub`: `data.by`, `by_name`, `role`; `ts` is when).
    Enrolling with the new token revokes nothing: the node's earlier certificate stays valid (the node keeps
    working) until an admin calls `POST /nodes/{id}/certificates/revoke-superseded` once the re-enrolled node is
    back online, or until it expires."""
    token, expires = node_service.reissue_bootstrap(session, node_id, (body or BootstrapTokenReissue()).ttl_s, caller)
    return BootstrapTokenIssued(bootstrap_token=token, bootstrap_expires_at=expires, ca_sha256=ca.fingerprint)


@router.post("/{node_id}/certificates/revoke-superseded")
def revoke_superseded_certificates(node_id: str, session: SessionDep, ca: CADep, caller: Admin, __: IdempotencyKey = None) -> dict[str, list[str]]:
    """Revoke every certificate of the node but its newest (after a re-enrolment); returns the revoked serials.

    The broker refuses them from then on (CRL). Recorded as a `certificates_revoked` event on the node."""
    serials = node_service.revoke_superseded(session, node_id, caller)
    revocation.publish(session, ca)
    return {"revoked": serials}


@router.post("/{node_id}/certificate", status_code=status.HTTP_201_CREATED, openapi_extra={"security": []})
def enrol_node(node_id: str, body: CertificateRequest, request: Request, session: SessionDep, ca: CADep, settings: SettingsDep, __: IdempotencyKey = None) -> CertificateIssued:
    """Sign the node's CSR (CN = node id) in exchange for its one-time bootstrap token."""
    validity = timedelta(days=settings.certificate_validity_days)
    node, cert, pem = node_service.enrol(session, ca, node_id, body, validity)
    revocation.publish(session, ca)
    return _issued(node, cert, pem, request, ca, settings)


@router.post("/{node_id}/certificate/renewal", openapi_extra={"security": []})
def renew_node_certificate(node_id: str, body: CertificateRenewal, request: Request, session: SessionDep, ca: CADep, settings: SettingsDep, __: IdempotencyKey = None) -> CertificateIssued:
    """Sign a new certificate for the holder of the node's key: its certificate (at most 30 days expired) and a CSR of the same key.

    No token: the CSR's signature proves the key. The certificate must be one the hub issued to this node and did
    not revoke; one expired longer than the grace window is refused (`certificate_expired_beyond_grace`: re-enrol
    with a new bootstrap token). The old certificate stays valid until it expires. Recorded as a
    `certificate_renewed` event on the node (source `hub`)."""
    node, cert, pem = node_service.renew(session, ca, node_id, body, timedelta(days=settings.certificate_validity_days))
    return _issued(node, cert, pem, request, ca, settings)


def _issued(node: Node, cert: Certificate, pem: str, request: Request, ca: CertificateAuthority, settings: Settings) -> CertificateIssued:
    return CertificateIssued(
        node_id=node.id, certificate_pem=pem, ca_pem=ca.ca_pem, serial=cert.serial, not_after=cert.not_after,
        mqtt_url=settings.public_mqtt_url or settings.broker_url, heartbeat_interval_s=settings.heartbeat_interval_s, offline_timeout_s=settings.offline_timeout_s,
        signing_key_pem=hub_state(request).signing.keys_pem,
    )  # fmt: skip


@router.get("/{node_id}/twin")
def get_node_twin(node_id: str, session: SessionDep, _: Viewer) -> Twin:
    """The node's desired and reported documents and their difference."""
    return twin_to_wire(node_service.get(session, node_id))


@router.put("/{node_id}/twin")
def put_node_twin(node_id: str, body: TwinUpdate, request: Request, session: SessionDep, _: Operator, __: IdempotencyKey = None) -> Twin:
    """Replace the node's desired document (its version goes up by one); the hub publishes it retained."""
    twin = twin_to_wire(node_service.put_twin(session, node_id, body))
    poke_desired(request)
    return twin


@router.post("/{node_id}/commands", responses={504: PROBLEM_RESPONSES[409] | {"description": "No answer in time"}})
async def node_command(node_id: str, body: CommandRequest, request: Request, _: Operator, __: IdempotencyKey = None) -> CommandResult:
    """Send a command to the node's agent and return its answer (504 command_timeout if none in time)."""
    # read in a worker thread with a short-lived session: none is held while waiting for the answer
    node = await run_in_threadpool(read_one, request, node_service.get, node_id)
    return await commands.send(request, node.state, NODE_CMD.topic(node_id=node_id), NODE_CMD_REPLY.topic(node_id=node_id), body)


@router.get("/{node_id}/devices")
def node_devices(node_id: str, session: SessionDep, _: Viewer, selector: Selector = None, limit: Limit = DEFAULT_PAGE, cursor: Cursor = None) -> Page[DevicePublic]:
    """The devices under this node."""
    rows, next_cursor = device_service.list_devices(session, node_id, selector, limit, cursor)
    return Page[DevicePublic](items=[device_to_wire(r) for r in rows], next_cursor=next_cursor)


