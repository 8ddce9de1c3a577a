"""The hub signs the CRL again before it expires: an expired CRL makes TLS refuse every certificate of the CA."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from sqlmodel import Session

from cloud.pki import CRL_REFRESH_BEFORE, CRL_VALIDITY, CertificateAuthority
from cloud.services import revocation
from tests.hub.conftest import HubUnderTest


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


@pytest.fixture
def ca(tmp_path: Path) -> CertificateAuthority:
    """A CA of the test's own over the hub's database: the hub's housekeeping signs the hub's CRL at start, in its
    own thread, and on a busy machine it could do so between a test backdating that CRL and the call under test."""
    return CertificateAuthority.load_or_create(tmp_path / "ca")


def test_a_crl_signed_31_days_ago_is_signed_again_and_a_fresh_one_is_left_alone(hub: HubUnderTest, ca: CertificateAuthority) -> None:
    # Prepare: a CA with a CRL as if written 31 days ago (expired a day ago)
    ca.write_crl([], now=_now() - dt.timedelta(days=31))
    expired = ca.crl_next_update()
    assert expired is not None and expired < _now()

    # Execute
    with Session(hub.engine) as session:
        signed = revocation.publish_crl(session, ca)
        fresh = ca.crl_next_update()
        again = revocation.publish_crl(session, ca)  # nothing due: the broker need not reload

    # Assert
    assert signed is True and again is False
    assert fresh is not None and abs(fresh - (_now() + CRL_VALIDITY)) < dt.timedelta(minutes=1)


def test_the_crl_is_signed_again_once_less_than_the_margin_is_left(hub: HubUnderTest, ca: CertificateAuthority) -> None:
    # Prepare: a CRL signed now
    ca.write_crl([])
    signed_at = _now()
    just_before = signed_at + CRL_VALIDITY - CRL_REFRESH_BEFORE - dt.timedelta(hours=1)
    just_after = signed_at + CRL_VALIDITY - CRL_REFRESH_BEFORE + dt.timedelta(hours=1)

    # Execute
    with Session(hub.engine) as session:
        early = revocation.publish_crl(session, ca, now=just_before)
        due = revocation.publish_crl(session, ca, now=just_after)
    next_update = ca.crl_next_update()

    # Assert: not re-signed while more than the margin is left, re-signed (valid from then) once less is
    assert early is False and due is True
    assert next_update is not None and abs(next_update - (just_after + CRL_VALIDITY)) < dt.timedelta(minutes=1)
    assert ca.crl_due(now=just_after) is False


def test_revoked_serials_survive_the_re_signing(hub: HubUnderTest, ca: CertificateAuthority) -> None:
    # Prepare: a node enrolled and deleted (its certificate revoked), then the CRL is made to look old
    node = hub.register("gw-revoked")
    node_id = node["node"]["id"]
    assert hub.enrol(node_id, node["bootstrap_token"]).status_code in (200, 201)
    assert hub.request("DELETE", f"/nodes/{node_id}").status_code in (200, 204)
    before = hub.state.ca.revoked_serials()
    assert before  # the node's certificate is revoked
    with Session(hub.engine) as session:
        ca.write_crl([(serial, _now()) for serial in before], now=_now() - dt.timedelta(days=25))

        # Execute
        signed = revocation.publish_crl(session, ca)

    # Assert
    assert signed is True
    assert ca.revoked_serials() == before
