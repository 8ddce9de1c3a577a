"""Certificate renewal, for either tier (DESIGN §6): an agent renews its certificate from the identity it holds.

At start and then every :data:`RENEWAL_CHECK_S` (12 hours) the agent reads its record's ``not_after`` (neither
``cryptography`` nor ``httpx`` is needed for that, so an idle agent loads neither). When less than RENEW_BEFORE
(60 days) is left, it posts its certificate and a CSR of the same key to ``.../certificate/renewal`` at the URL it
enrolled with (a device: normally its edge, checked with the stored CA and ``tls_server_name``; a node: the hub,
checked with the stored CA; see :class:`device.enrol.Renewing`) and stores the answer
(:meth:`device.identity.AgentIdentityStore.renewed`); the MQTT session presents the new certificate from its
next connection. A renewal that fails is logged and tried again after :data:`RENEWAL_RETRY_S`; the certificate
held serves meanwhile.

The hub still renews a certificate that expired less than RENEWAL_GRACE (30 days) ago, so an agent that was
offline for a while renews when it is back. Beyond that, :func:`check_renewable` refuses to start with an
:class:`~device.errors.IdentityError`: the identity re-enrols with a new bootstrap token.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import TYPE_CHECKING, TypeVar

from device.errors import EnrolmentError, IdentityError
from device.identity import AgentIdentityStore, EnrolmentRecord
from interfaces.nodes import RENEW_BEFORE, RENEWAL_GRACE

if TYPE_CHECKING:
    import httpx

    from device.enrol import EnrolmentTier, Renewing
    from interfaces.nodes import CertificateIssued, DeviceCertificateIssued

log = logging.getLogger("aisynergy.device")

RENEWAL_CHECK_S = 12 * 3600.0  # how often a running agent looks at how long its certificate has left
RENEWAL_RETRY_S = 3600.0  # the next try after a renewal that failed
START_ATTEMPTS = 2  # at start, an endpoint that cannot be reached does not hold the agent long

R = TypeVar("R", bound=EnrolmentRecord)


def _now() -> datetime:
    return datetime.now(UTC)


def due(enrolment: EnrolmentRecord) -> bool:
    """Whether less than RENEW_BEFORE of the certificate is left."""
    return enrolment.not_after - _now() < RENEW_BEFORE


def check_renewable(store: AgentIdentityStore[R], enrolment: R) -> None:
    """:class:`IdentityError` when the certificate expired longer than RENEWAL_GRACE ago: the hub renews it no more."""
    if enrolment.not_after + RENEWAL_GRACE > _now():
        return
    tier, owner = enrolment.tier, enrolment.owner_id
    raise IdentityError(
        f"the {tier} certificate of {owner} expired on {enrolment.not_after:%Y-%m-%d}, more than {RENEWAL_GRACE.days} days "
        f"ago, and can no longer be renewed: re-enrol with a new bootstrap token (POST /api/v1/{tier}s/{owner}/bootstrap-token): "
        f"remove {store.enrolment_path} and start again with the token"
    )


def _renewing(store: AgentIdentityStore[R], tier: EnrolmentTier, enrolment: R, attempts: int) -> Renewing:  # type: ignore[type-arg]
    from device.enrol import Renewing  # httpx: loaded only when a renewal is due

    owner = enrolment.owner_id
    log.info("the certificate of %s expires on %s: renewing it", owner, enrolment.not_after.isoformat())
    return Renewing(
        tier, getattr(enrolment, enrolment.url_field), owner, store.make_csr(owner), store.cert_path.read_text(),
        store.ca_path.read_text(), attempts=attempts, server_name=getattr(enrolment, "tls_server_name", None),
    )  # fmt: skip


def _stored(store: AgentIdentityStore[R], issued: CertificateIssued | DeviceCertificateIssued, enrolment: R) -> R:
    renewed = store.renewed(issued, enrolment)
    log.info("renewed the certificate of %s: serial %s, valid until %s", renewed.owner_id, renewed.serial, renewed.not_after.isoformat())
    return renewed


def _failed(enrolment: EnrolmentRecord, exc: Exception) -> None:
    log.warning(
        "the renewal of the certificate of %s failed (%s); it serves until %s, and renewal is tried again in %.0f s",
        enrolment.owner_id, exc, enrolment.not_after.isoformat(), RENEWAL_RETRY_S,
    )  # fmt: skip


def renew(store: AgentIdentityStore[R], tier: EnrolmentTier, enrolment: R, *, attempts: int = 3,  # type: ignore[type-arg]
          transport: httpx.BaseTransport | None = None) -> R | None:  # fmt: skip
    """Renew now, blocking (the device): the new record, or ``None`` when the renewal failed (logged)."""
    from device.enrol import enrol

    try:
        return _stored(store, enrol(_renewing(store, tier, enrolment, attempts), transport), enrolment)
    except (EnrolmentError, IdentityError, OSError) as exc:
        _failed(enrolment, exc)
        return None


async def renew_async(store: AgentIdentityStore[R], tier: EnrolmentTier, enrolment: R, *, attempts: int = 3,  # type: ignore[type-arg]
                      transport: httpx.AsyncBaseTransport | None = None) -> R | None:  # fmt: skip
    """:func:`renew` for an event loop (the edge): the requests are awaited, and cancelling stops them."""
    from device.enrol import enrol_async

    try:
        return _stored(store, await enrol_async(_renewing(store, tier, enrolment, attempts), transport), enrolment)
    except (EnrolmentError, IdentityError, OSError) as exc:
        _failed(enrolment, exc)
        return None
