"""The node identity kept in the data directory."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from click.testing import CliRunner
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import NameOID

from edge.cli import EXIT_IDENTITY, edge
from edge.identity import IdentityError, IdentityMismatch, IdentityStore


def _public(key: object) -> bytes:
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)  # type: ignore[attr-defined]


def test_csr_subject_is_exactly_the_node_id_and_key_is_private(tmp_path: Path) -> None:
    store = IdentityStore(tmp_path)

    csr = x509.load_pem_x509_csr(store.make_csr("nd-0001").encode())

    assert csr.is_signature_valid
    assert csr.subject == x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "nd-0001")])
    assert stat.S_IMODE(store.key_path.stat().st_mode) == 0o600
    assert _public(csr.public_key()) == _public(store.load_or_create_key().public_key())


def test_enrolment_survives_a_restart(tmp_path: Path, test_ca) -> None:
    store = IdentityStore(tmp_path)
    issued = test_ca.issue(store.make_csr("nd-0001"), "nd-0001", heartbeat_s=7.5)

    store.save(issued, "https://hub.example:8000")
    restarted = IdentityStore(tmp_path)

    assert restarted.is_enrolled()
    restarted.check_owner("nd-0001")
    restarted.check_complete()
    enrolment = restarted.load_enrolment()
    assert (enrolment.node_id, enrolment.hub_url, enrolment.heartbeat_interval_s) == (
        "nd-0001",
        "https://hub.example:8000",
        7.5,
    )
    assert (enrolment.serial, enrolment.not_after, enrolment.mqtt_url) == (
        issued.serial,
        issued.not_after,
        issued.mqtt_url,
    )
    assert restarted.cert_path.read_text() == issued.certificate_pem
    assert restarted.ca_path.read_text() == issued.ca_pem
    assert stat.S_IMODE(restarted.key_path.stat().st_mode) == 0o600


def test_identity_of_another_node_is_refused(tmp_path: Path, test_ca) -> None:
    store = IdentityStore(tmp_path)
    store.save(test_ca.issue(store.make_csr("nd-0001"), "nd-0001"), "https://hub")

    with pytest.raises(IdentityMismatch, match="nd-0001"):
        store.check_owner("nd-0002")


def test_cli_exits_4_on_identity_mismatch(tmp_path: Path, test_ca) -> None:
    store = IdentityStore(tmp_path)
    store.save(test_ca.issue(store.make_csr("nd-0001"), "nd-0001"), "https://hub")

    result = CliRunner().invoke(edge, ["run", "--node-id", "nd-0002", "--data-dir", str(tmp_path)])

    assert result.exit_code == EXIT_IDENTITY


def test_cli_first_start_without_token_is_a_usage_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        edge, ["run", "--hub", "http://127.0.0.1:9", "--node-id", "nd-0001", "--data-dir", str(tmp_path)]
    )

    assert result.exit_code == 2
    assert "bootstrap-token" in result.output


def test_certificate_for_another_key_is_not_stored(tmp_path: Path, test_ca) -> None:
    other = IdentityStore(tmp_path / "other")
    store = IdentityStore(tmp_path / "node")
    store.load_or_create_key()

    with pytest.raises(IdentityError, match="does not match"):
        store.save(test_ca.issue(other.make_csr("nd-0001"), "nd-0001"), "https://hub")
    assert not store.is_enrolled()
    assert not store.cert_path.exists()
