"""Edge node management (DESIGN §4.1): registration, enrolment, lifecycle, revocation.

Transport-neutral: REST routes and the MQTT bridge both call into here.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

from sqlalchemy import select
from sqlmodel import Session

from cloud.auth import TokenIdentity
from cloud.errors import Conflict, Forbidden, NotFound
from cloud.pki import CertificateAuthority
from cloud.services import audit, enrolment, twins
from cloud.services.labels import apply_patch, clear_labels, selector_clause, set_labels
from cloud.services.paging import page, parse_selector_or_400
from cloud.tables import Certificate, Device, Node, NodeEventRow, NodeTransitionRow
from interfaces.auth import Role
from interfaces.errors import ErrorCode
from interfaces.ids import is_id, new_id
from interfaces.lifecycle import AdminState, IllegalTransition, NodeState, check_transition
from interfaces.nodes import CertificateRenewal, CertificateRequest, NodeCreate, NodeUpdate, TwinUpdate

log = logging.getLogger("aisynergy.hub.nodes")


def now() -> datetime:
    return datetime.now(UTC)


def record_transition(session: Session, node_id: str, from_state: str | None, to_state: NodeState, reason: str, at: datetime) -> None:
    session.add(NodeTransitionRow(node_id=node_id, from_state=from_state, to_state=to_state.value, at=at, reason=reason[:256]))


def transition(session: Session, node: Node, target: NodeState, reason: str) -> None:
    """Move ``node`` to ``target`` if the lifecycle allows it; record the step."""
    current = NodeState(node.state)
    if current == target:
        return
    try:
        check_transition(current, target)
    except IllegalTransition as exc:
        raise Conflict(str(exc), code=ErrorCode.ILLEGAL_TRANSITION, current_state=current.value) from exc
    at = now()
    record_transition(session, node.id, node.state, target, reason, at)
    node.state = target.value
    node.last_state_change_at = at
    node.updated_at = at


def register(session: Session, body: NodeCreate) -> tuple[Node, str, datetime]:
    at = now()
    node = Node(
        id=new_id("n"),
        name=body.name,
        kind=body.kind.value,
        description=body.description,
        labels=dict(body.labels),
        state=NodeState.REGISTERED.value,
        admin_state=AdminState.UNLOCKED.value,
        created_at=at,
        updated_at=at,
        last_state_change_at=at,
    )
    session.add(node)
    set_labels(session, node.id, node.labels)
    record_transition(session, node.id, None, NodeState.REGISTERED, "registered", at)
    token, expires = enrolment.issue_bootstrap(session, node.id, body.bootstrap_ttl_s)
    session.commit()
    log.info("registered node %s (%s)", node.id, node.name)
    return node, token, expires


def get(session: Session, node_id: str) -> Node:
    node = session.get(Node, node_id) if is_id(node_id) else None
    if node is None or node.state == NodeState.DELETED:
        raise NotFound(f"node {node_id} does not exist")
    return node


def list_nodes(session: Session, selector: str | None, state: NodeState | None, limit: int, cursor: str | None) -> tuple[list[Node], str | None]:
    requirements = parse_selector_or_400(selector)
    query = select(Node).where(Node.state != NodeState.DELETED.value, *selector_clause(Node.id, requirements))
    if state is not None:
        query = query.where(Node.state == state.value)
    return page(session, query, Node.id, limit, cursor)


def update_node(session: Session, node_id: str, body: NodeUpdate) -> Node:
    return apply_patch(session, get(session, node_id), body)  # type: ignore[no-any-return]


def put_twin(session: Session, node_id: str, body: TwinUpdate) -> Node:
    return twins.put_desired(session, Node, get, node_id, body)  # type: ignore[no-any-return]


def set_admin_state(session: Session, node_id: str, admin_state: AdminState) -> Node:
    node = get(session, node_id)
    if node.admin_state != admin_state.value:
        node.admin_state = admin_state.value
        node.updated_at = now()
        session.add(node)
        session.commit()
        log.info("node %s admin state %s", node_id, admin_state)
    return node


def reissue_bootstrap(session: Session, node_id: str, ttl_s: int, actor: TokenIdentity) -> tuple[str, datetime]:
    """A fresh token for the node (recorded: ``bootstrap_token_issued``); the admin role once it ever enrolled."""
    get(session, node_id)
    return issue_recorded_bootstrap(session, node_id, node_id, ttl_s, actor, "node")


def issue_recorded_bootstrap(session: Session, node_id: str, identity: str, ttl_s: int, actor: TokenIdentity, kind: str) -> tuple[str, datetime]:
    """Issue a token for ``identity`` (the node itself or one of its devices) and record who did, on the node.

    A token for an identity that holds (or held) a certificate lets its bearer act as that node or device: only an
    admin may issue one; an operator may for an identity that never enrolled."""
    enrolled = enrolment.ever_enrolled(session, identity)
    if enrolled and not Role(actor.role).allows(Role.ADMIN):
        raise Forbidden(f"{kind} {identity} has enrolled: a new bootstrap token for it needs the admin role; the token has {actor.role}")
    token, expires = enrolment.issue_bootstrap(session, identity, ttl_s)
    ids = {"device_id": identity} if identity != node_id else {}
    audit.record(session, node_id, "bootstrap_token_issued", actor, f"a bootstrap token for {kind} {identity} was issued",
                 enrolled=enrolled, expires_at=expires.isoformat(), **ids)  # fmt: skip
    session.commit()
    log.info("bootstrap token for %s %s issued by %s (%s)", kind, identity, actor.id, actor.role)
    return token, expires


def revoke_superseded(session: Session, node_id: str, actor: TokenIdentity) -> list[str]:
    """Revoke the node's certificates but its newest (recorded: ``certificates_revoked``); returns their serials."""
    node = get(session, node_id)
    return revoke_recorded(session, node_id, node_id, node.certificate_serial, actor, "node")


def revoke_recorded(session: Session, node_id: str, identity: str, current: str | None, actor: TokenIdentity, kind: str) -> list[str]:
    serials = enrolment.revoke_superseded(session, identity, current, now())
    if serials:
        ids = {"device_id": identity} if identity != node_id else {}
        audit.record(session, node_id, "certificates_revoked", actor, f"superseded certificates of {kind} {identity} revoked",
                     serials=serials, current=current, **ids)  # fmt: skip
        session.commit()
        log.info("revoked %d superseded certificates of %s %s (by %s)", len(serials), kind, identity, actor.id)
    return serials


def enrol(session: Session, ca: CertificateAuthority, node_id: str, body: CertificateRequest, validity: timedelta) -> tuple[Node, Certificate, str]:
    """Check the one-time bootstrap token, sign the CSR, revoke any certificate it supersedes."""
    return enrolment.enrol(session, ca, Node, node_id, body.csr_pem, body.bootstrap_token, validity)  # type: ignore[no-any-return]


def renew(session: Session, ca: CertificateAuthority, node_id: str, body: CertificateRenewal, validity: timedelta) -> tuple[Node, Certificate, str]:
    """A new certificate for the holder of the node's key (:func:`cloud.services.enrolment.renew`)."""
    return enrolment.renew(session, ca, Node, node_id, body, validity)  # type: ignore[no-any-return]


def delete(session: Session, node_id: str) -> Node:
    """Mark the node DELETED, revoke its certificates, delete its devices. Returns the node."""
    node = get(session, node_id)
    transition(session, node, NodeState.DELETED, "deleted by integrator")
    at = now()
    node.deleted_at = at
    enrolment.revoke_all(session, node_id, at)
    for device in session.exec(select(Device).where(Device.node_id == node_id, Device.state != NodeState.DELETED.value)).scalars():  # type: ignore[call-overload]
        device.state = NodeState.DELETED.value
        device.deleted_at = at
        enrolment.revoke_all(session, device.id, at)
        clear_labels(session, device.id)
        session.add(device)
    clear_labels(session, node.id)
    session.add(node)
    session.commit()
    log.info("deleted node %s and revoked its certificates", node_id)
    return node


def events(session: Session, node_id: str, limit: int, cursor: str | None) -> tuple[list[NodeEventRow], str | None]:
    """The node's events (its own, and those the hub recorded about it) in arrival order, a page after ``cursor``."""
    get(session, node_id)
    return page(session, select(NodeEventRow).where(NodeEventRow.node_id == node_id), NodeEventRow.id, limit, cursor, numeric=True)


def history(session: Session, node_id: str, limit: int) -> list[NodeTransitionRow]:
    """The node's first ``limit`` lifecycle transitions, oldest first."""
    get(session, node_id)
    query = select(NodeTransitionRow).where(NodeTransitionRow.node_id == node_id)
    return list(session.exec(query.order_by(NodeTransitionRow.id).limit(limit)).scalars())  # type: ignore[call-overload]
