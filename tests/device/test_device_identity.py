"""The device identity kept in the data directory."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import NameOID

from device.cli import EXIT_STORED_STATE, device
from device.errors import IdentityError, IdentityMismatch
from device.identity import IdentityStore
from tests.device.conftest import NODE_ID

REPO = Path(__file__).resolve().parents[2]


def _public(key: object) -> bytes:
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)  # type: ignore[attr-defined]


def test_csr_subject_is_exactly_the_device_id_and_key_is_private(tmp_path: Path) -> None:
    store = IdentityStore(tmp_path)

    csr = x509.load_pem_x509_csr(store.make_csr("dv-0001").encode())

    assert csr.is_signature_valid
    assert csr.subject == x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "dv-0001")])
    assert stat.S_IMODE(store.key_path.stat().st_mode) == 0o600
    assert _public(csr.public_key()) == _public(store.load_or_create_key().public_key())


def test_enrolment_survives_a_restart(tmp_path: Path, test_ca) -> None:  # type: ignore[no-untyped-def]
    store = IdentityStore(tmp_path)
    issued = test_ca.issue(store.make_csr("dv-0001"), "dv-0001", heartbeat_s=7.5)

    store.save(issued, "https://edge.example:8000")
    restarted = IdentityStore(tmp_path)

    assert restarted.is_enrolled()
    restarted.check_owner("dv-0001")
    restarted.check_complete()
    enrolment = restarted.load_enrolment()
    assert (enrolment.device_id, enrolment.node_id, enrolment.enrol_url, enrolment.heartbeat_interval_s) == (
        "dv-0001",
        NODE_ID,
        "https://edge.example:8000",
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
    assert stat.S_IMODE(restarted.enrolment_path.stat().st_mode) == 0o600


def test_identity_of_another_device_is_refused(tmp_path: Path, test_ca) -> None:  # type: ignore[no-untyped-def]
    store = IdentityStore(tmp_path)
    store.save(test_ca.issue(store.make_csr("dv-0001"), "dv-0001"), "https://edge")

    with pytest.raises(IdentityMismatch, match="dv-0001"):
        store.check_owner("dv-0002")


def test_certificate_for_another_key_is_not_stored(tmp_path: Path, test_ca) -> None:  # type: ignore[no-untyped-def]
    other = IdentityStore(tmp_path / "other")
    store = IdentityStore(tmp_path / "device")
    store.load_or_create_key()

    with pytest.raises(IdentityError, match="does not match"):
        store.save(test_ca.issue(other.make_csr("dv-0001"), "dv-0001"), "https://edge")
    assert not store.is_enrolled()
    assert not store.cert_path.exists()


def test_cli_exits_4_on_identity_mismatch(tmp_path: Path, test_ca) -> None:  # type: ignore[no-untyped-def]
    store = IdentityStore(tmp_path)
    store.save(test_ca.issue(store.make_csr("dv-0001"), "dv-0001"), "https://edge")

    env = {"AISYNERGY_DEVICE_ID": "dv-0002", "AISYNERGY_DATA_DIR": str(tmp_path)}

    result = CliRunner().invoke(device, ["run"], env=env)

    assert result.exit_code == EXIT_STORED_STATE


def test_cli_first_start_without_token_is_a_usage_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        device, ["run", "--enrol-url", "http://127.0.0.1:9", "--device-id", "dv-0001", "--data-dir", str(tmp_path)]
    )

    assert result.exit_code == 2
    assert "bootstrap" in result.output


def test_cli_refuses_a_device_id_that_is_not_a_topic_level(tmp_path: Path) -> None:
    result = CliRunner().invoke(device, ["run", "--device-id", "dv/+", "--data-dir", str(tmp_path)])

    assert result.exit_code == 2
    assert "device id" in result.output


def test_a_certificate_swapped_in_after_enrolment_is_refused(tmp_path: Path, test_ca) -> None:  # type: ignore[no-untyped-def]
    store, other = IdentityStore(tmp_path / "device"), IdentityStore(tmp_path / "other")
    store.save(test_ca.issue(store.make_csr("dv-0001"), "dv-0001"), "https://edge")
    reissued = test_ca.issue(other.make_csr("dv-0001"), "dv-0001")
    foreign = test_ca.issue(other.make_csr("dv-0002"), "dv-0002")

    store.cert_path.write_text(reissued.certificate_pem)
    with pytest.raises(IdentityError, match="not the certificate recorded"):
        store.check_owner("dv-0001")
    store.cert_path.write_text(foreign.certificate_pem)
    with pytest.raises(IdentityMismatch, match="CN=dv-0002"):
        store.check_owner("dv-0001")


def test_a_restart_loads_neither_cryptography_nor_httpx(tmp_path: Path, test_ca) -> None:  # type: ignore[no-untyped-def]
    store = IdentityStore(tmp_path)
    store.save(test_ca.issue(store.make_csr("dv-0001"), "dv-0001"), "https://edge")
    script = (
        "import sys; from device.agent import Device; from device.identity import IdentityStore; "
        f"s = IdentityStore({str(tmp_path)!r}); s.check_owner('dv-0001'); s.check_complete(); s.load_enrolment(); "
        "print(sorted(m for m in ('cryptography', 'httpx', 'cloud', 'edge', 'asyncio') if m in sys.modules))"
    )

    loaded = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=REPO)

    assert loaded.stdout.strip() == "[]"
