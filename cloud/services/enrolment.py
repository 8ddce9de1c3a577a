"""Identities for nodes and devices alike: one-time bootstrap tokens, CSR signing and renewal."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import select, update
from sqlmodel import Session

from cloud.auth import hash_secret, new_secret
from cloud.convert import utc
from cloud.errors import BadRequest, Conflict, Forbidden, NotFound
from cloud.pki import CertificateAuthority, CertificateError, CsrError, CsrKeyMismatch, Issued
from cloud.services import audit
from cloud.tables import BootstrapToken, Certificate, Device
from interfaces.errors import ErrorCode
from interfaces.ids import is_id
from interfaces.lifecycle import NodeState
from interfaces.nodes import RENEWAL_GRACE, CertificateRenewal

log = logging.getLogger("aisynergy.hub.enrolment")
BOOTSTRAP_PREFIX = "bst_"


def issue_bootstrap(session: Session, owner_id: str, ttl_s: int) -> tuple[str, datetime]:
    """Add a one-time bootstrap token for ``owner_id`` (not committed); returns it and its expiry. A token
    issued earlier and not used yet expires now: reissuing is how a leaked or lost token is replaced."""
    secret = new_secret(BOOTSTRAP_PREFIX)
    at = datetime.now(UTC)
    session.execute(
        update(BootstrapToken)
        .where(BootstrapToken.owner_id == owner_id, BootstrapToken.used_at.is_(None), BootstrapToken.expires_at > at)  # type: ignore[union-attr,arg-type]
        .values(expires_at=at)
    )
    expires = at + timedelta(seconds=ttl_s)
    session.add(BootstrapToken(token_hash=hash_secret(secret), owner_id=owner_id, created_at=at, expires_at=expires))
    return secret, expires


def revoke_all(session: Session, identity: str, at: datetime) -> int:
    """Revoke every valid certificate of ``identity`` (not committed); returns how many."""
    result = session.execute(
        update(Certificate).where(Certificate.identity == identity, Certificate.revoked_at.is_(None)).values(revoked_at=at)  # type: ignore[union-attr]
    )
    return result.rowcount  # type: ignore[attr-defined,no-any-return]


def revoke_superseded(session: Session, identity: str, current: str | None, at: datetime) -> list[str]:
    """Revoke every valid certificate of ``identity`` but ``current`` (not committed); returns their serials."""
    serials = list(session.execute(
        select(Certificate.serial).where(Certificate.identity == identity, Certificate.revoked_at.is_(None), Certificate.serial != current)  # type: ignore[union-attr,arg-type]
    ).scalars())  # fmt: skip
    if serials:
        session.execute(update(Certificate).where(Certificate.serial.in_(serials)).values(revoked_at=at))  # type: ignore[attr-defined]
    return serials


def ever_enrolled(session: Session, identity: str) -> bool:
    """Whether the hub ever issued ``identity`` a certificate (revoked or not)."""
    return session.execute(select(Certificate.serial).where(Certificate.identity == identity).limit(1)).first() is not None


def valid_serials(session: Session, identity: str) -> list[str]:
    return list(session.execute(select(Certificate.serial).where(Certificate.identity == identity, Certificate.revoked_at.is_(None))).scalars())  # type: ignore[union-attr]


def _record(session: Session, row: Any, issued: Issued, at: datetime) -> Certificate:
    """Record the issued certificate for ``row`` (a Node or Device) and commit."""
    cert = Certificate(serial=issued.serial, identity=row.id, issued_at=at, not_after=issued.not_after)
    session.add(cert)
    row.certificate_serial = issued.serial
    row.certificate_not_after = issued.not_after
    row.updated_at = at
    session.add(row)
    session.commit()
    return cert


def enrol(session: Session, ca: CertificateAuthority, owner: type[Any], owner_id: str, csr_pem: str, token_secret: str,
          validity: timedelta) -> tuple[Any, Certificate, str]:  # fmt: skip
    """Check the one-time token and sign the CSR (CN = ``owner_id``).

    A new certificate revokes none: an identity re-enrolled with a reissued token keeps working with its earlier
    certificates until an admin revokes the superseded ones (:func:`revoke_superseded`), so a token that reached
    the wrong party cannot cut the real node off. A re-enrolment is recorded (``certificate_issued`` on the node,
    with the serials still valid). ``owner`` is the table (Node or Device) whose row gets the serial.
    """
    kind = owner.__name__.lower()
    if not is_id(owner_id):
        raise NotFound(f"{kind} {owner_id} does not exist")
    token = session.get(BootstrapToken, hash_secret(token_secret), with_for_update=True)
    if token is None or token.owner_id != owner_id:
        raise Forbidden(f"bootstrap token is not valid for this {kind}", code=ErrorCode.BOOTSTRAP_TOKEN_INVALID)
    row = session.get(owner, owner_id)
    if row is None:
        raise NotFound(f"{kind} {owner_id} does not exist")
    if row.state == NodeState.DELETED:
        raise Conflict(f"{kind} {owner_id} was deleted", code=ErrorCode.NODE_DELETED)
    if token.used_at is not None:
        raise Conflict("bootstrap token was already used", code=ErrorCode.BOOTSTRAP_TOKEN_USED)
    if utc(token.expires_at) <= datetime.now(UTC):  # type: ignore[operator]
        raise Forbidden("bootstrap token has expired", code=ErrorCode.BOOTSTRAP_TOKEN_EXPIRED)
    try:
        # a node's certificate also serves its devices over TLS (the edge's listener), named by the node id
        issued = ca.sign_csr(csr_pem, expected_cn=owner_id, validity=validity, server=kind == "node")
    except CsrError as exc:
        raise BadRequest(str(exc), code=ErrorCode.CSR_INVALID, status=422) from exc
    # Consume the token with a guarded UPDATE so that two concurrent enrolments cannot both win.
    consumed = session.execute(
        update(BootstrapToken)
        .where(BootstrapToken.token_hash == token.token_hash, BootstrapToken.used_at.is_(None))  # type: ignore[union-attr]
        .values(used_at=datetime.now(UTC))
    )
    if consumed.rowcount != 1:  # type: ignore[attr-defined]
        session.rollback()
        raise Conflict("bootstrap token was already used", code=ErrorCode.BOOTSTRAP_TOKEN_USED)
    at = datetime.now(UTC)
    still_valid = valid_serials(session, owner_id)
    if ever_enrolled(session, owner_id):
        ids = {"device_id": owner_id} if owner is Device else {}
        audit.record(session, row.node_id if owner is Device else owner_id, "certificate_issued", None,
                     f"{kind} {owner_id} enrolled again; its earlier certificates stay valid until an admin revokes them",
                     serial=issued.serial, still_valid=still_valid, **ids)  # fmt: skip
    cert = _record(session, row, issued, at)
    log.info("issued certificate %s to %s %s (%d earlier ones still valid)", issued.serial, kind, owner_id, len(still_valid))
    return row, cert, issued.certificate_pem


def renew(session: Session, ca: CertificateAuthority, owner: type[Any], owner_id: str, body: CertificateRenewal,
          validity: timedelta) -> tuple[Any, Certificate, str]:  # fmt: skip
    """Sign a new certificate for the holder of ``owner_id``'s key: proof of possession, no token.

    The presented certificate must be one this CA issued to ``owner_id``, recorded for it and not revoked, and not
    expired longer than RENEWAL_GRACE ago; the CSR must hold its public key (only the key's holder renews). The old
    certificate stays valid until it expires. Recorded as ``certificate_renewed`` on the node.
    """
    kind = owner.__name__.lower()
    if not is_id(owner_id):
        raise NotFound(f"{kind} {owner_id} does not exist")
    try:
        presented = ca.check_issued(body.certificate_pem, owner_id)
    except CertificateError as exc:
        if not exc.readable:
            raise BadRequest(str(exc), code=ErrorCode.CERTIFICATE_INVALID, status=422) from exc
        raise Forbidden(str(exc), code=ErrorCode.CERTIFICATE_UNKNOWN) from exc
    recorded = session.get(Certificate, presented.serial)
    if recorded is None or recorded.identity != owner_id:
        raise Forbidden(f"certificate {presented.serial} is not recorded for {kind} {owner_id}", code=ErrorCode.CERTIFICATE_UNKNOWN)
    if recorded.revoked_at is not None:
        raise Forbidden(f"certificate {presented.serial} was revoked", code=ErrorCode.CERTIFICATE_REVOKED)
    at = datetime.now(UTC)
    if presented.not_after + RENEWAL_GRACE <= at:
        raise Forbidden(
            f"certificate {presented.serial} expired on {presented.not_after:%Y-%m-%d}, more than {RENEWAL_GRACE.days} days ago: "
            "re-enrol with a new bootstrap token",
            code=ErrorCode.CERTIFICATE_EXPIRED_BEYOND_GRACE,
        )
    row = session.get(owner, owner_id)
    if row is None:
        raise NotFound(f"{kind} {owner_id} does not exist")
    if row.state == NodeState.DELETED:
        raise Conflict(f"{kind} {owner_id} was deleted", code=ErrorCode.NODE_DELETED)
    try:
        issued = ca.sign_csr(body.csr_pem, expected_cn=owner_id, validity=validity, server=kind == "node", same_key_as=presented.public_key_der)
    except CsrKeyMismatch as exc:
        raise Forbidden(str(exc), code=ErrorCode.CSR_KEY_MISMATCH) from exc
    except CsrError as exc:
        raise BadRequest(str(exc), code=ErrorCode.CSR_INVALID, status=422) from exc
    ids = {"device_id": owner_id} if owner is Device else {}
    audit.record(session, row.node_id if owner is Device else owner_id, "certificate_renewed", None,
                 f"{kind} {owner_id} renewed its certificate {presented.serial}; it stays valid until it expires",
                 serial=issued.serial, renewed=presented.serial, **ids)  # fmt: skip
    cert = _record(session, row, issued, at)
    log.info("renewed certificate %s of %s %s as %s", presented.serial, kind, owner_id, issued.serial)
    return row, cert, issued.certificate_pem
