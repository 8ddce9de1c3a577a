"""Publish revocations to the broker: the CA's CRL and the list of revoked identities.

The broker process (``aisynergy broker run``) watches both files, rewrites its ACL with a deny-all entry
for each revoked identity and reloads, so a deleted node is cut off at once and cannot reconnect.
"""

from __future__ import annotations

import os
from pathlib import Path

from sqlalchemy import select
from sqlmodel import Session

from cloud.convert import utc
from cloud.pki import CertificateAuthority
from cloud.tables import Certificate, Node
from interfaces.lifecycle import NodeState

REVOKED_FILE = "revoked.txt"


def publish(session: Session, ca: CertificateAuthority) -> None:
    revoked = session.execute(select(Certificate.serial, Certificate.revoked_at).where(Certificate.revoked_at.is_not(None))).all()  # type: ignore[union-attr]
    ca.write_crl([(serial, utc(at)) for serial, at in revoked])  # type: ignore[misc]
    deleted = sorted(session.execute(select(Node.id).where(Node.state == NodeState.DELETED.value)).scalars())
    path: Path = ca.directory / REVOKED_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(f"{identity}\n" for identity in deleted))
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
