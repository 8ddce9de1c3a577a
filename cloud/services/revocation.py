"""Publish the broker's access data: the CA's CRL, the revoked identities, and which devices each edge serves.

The broker process (``aisynergy broker run``) watches these files, rewrites its ACL (a deny-all entry for
each revoked identity, each edge's device subtrees) and reloads, so a deleted node is cut off at once
and cannot reconnect, and an edge reaches exactly its own devices.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
from pathlib import Path

from sqlalchemy import select
from sqlmodel import Session

from cloud.convert import utc
from cloud.pki import CertificateAuthority, write_public
from cloud.tables import Certificate, Device, Node
from interfaces.lifecycle import NodeState

REVOKED_FILE = "revoked.txt"
DEVICES_FILE = "devices.txt"


log = logging.getLogger("aisynergy.hub")
_lock = threading.Lock()
_published_serials: dict[Path, frozenset[str]] = {}


def publish(session: Session, ca: CertificateAuthority) -> None:
    """Rewrite what changed (the broker reloads on every change, so an unchanged file stays untouched); the CRL
    also when it is due to be signed again (see :data:`cloud.pki.CRL_REFRESH_BEFORE`)."""
    publish_crl(session, ca)
    deleted = sorted(
        [*session.execute(select(Node.id).where(Node.state == NodeState.DELETED.value)).scalars(),
         *session.execute(select(Device.id).where(Device.state == NodeState.DELETED.value)).scalars()]
    )  # fmt: skip
    _write(ca.directory / REVOKED_FILE, "".join(f"{identity}\n" for identity in deleted))
    publish_devices(session, ca)


def publish_crl(session: Session, ca: CertificateAuthority, now: dt.datetime | None = None) -> bool:
    """Sign the CRL again when the revoked serials changed or it is due; ``True`` when it was written."""
    revoked = session.execute(select(Certificate.serial, Certificate.revoked_at).where(Certificate.revoked_at.is_not(None))).all()  # type: ignore[union-attr]
    serials = frozenset(serial for serial, _at in revoked)
    with _lock:
        if ca.directory not in _published_serials:
            _published_serials[ca.directory] = ca.revoked_serials()
        if _published_serials[ca.directory] == serials and not ca.crl_due(now):
            return False
        ca.write_crl([(serial, utc(at)) for serial, at in revoked], now)  # type: ignore[misc]
        _published_serials[ca.directory] = serials
    log.info("CRL signed (%s revoked certificates), valid until %s", len(serials), ca.crl_next_update())
    return True


def publish_devices(session: Session, ca: CertificateAuthority) -> None:
    """``devices.txt``: one ``<node id> <device id>`` line per live device."""
    pairs = session.execute(
        select(Device.node_id, Device.id).where(Device.state != NodeState.DELETED.value).order_by(Device.node_id, Device.id)
    ).all()
    _write(ca.directory / DEVICES_FILE, "".join(f"{node} {device}\n" for node, device in pairs))


def _write(path: Path, text: str) -> None:
    with _lock:
        if path.exists() and path.read_text() == text:
            return  # unchanged: the broker need not reload
        write_public(path, text.encode())
