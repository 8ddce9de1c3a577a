"""The identity store's contract, written once and bound to each tier (``TestDeviceIdentity``, ``TestNodeIdentity``).

A tier's test class names its store, two ids of that tier and what its record holds besides the common
fields; the ``test_ca`` fixture of its folder issues what that tier's enrolment endpoint answers.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any, ClassVar

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.x509.oid import NameOID

from device.errors import IdentityError, IdentityMismatch
from device.identity import AgentIdentityStore

COMMON_FIELDS = {"mqtt_url", "heartbeat_interval_s", "serial", "not_after", "certificate_sha256"}


def _public(key: object) -> bytes:
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)  # type: ignore[attr-defined]


def _public_pem(key: object) -> str:
    return key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()  # type: ignore[attr-defined]


class IdentityContract:
    store: ClassVar[type[AgentIdentityStore[Any]]]
    owner: ClassVar[str]  # the id the tests enrol
    other: ClassVar[str]  # another agent's id of the same tier
    ids: ClassVar[dict[str, str]]  # the ids the tier's record holds (the owner's among them)
    url_field: ClassVar[str]  # the record's field for the URL it enrolled through

    def _enrolled(self, data_dir: Path, test_ca: Any, url: str = "https://enrol.example") -> AgentIdentityStore[Any]:
        store = self.store(data_dir)
        store.save(test_ca.issue(store.make_csr(self.owner), self.owner), url)
        return store

    def test_csr_subject_is_exactly_the_owner_id_and_key_is_private(self, tmp_path: Path) -> None:
        store = self.store(tmp_path)

        csr = x509.load_pem_x509_csr(store.make_csr(self.owner).encode())

        assert csr.is_signature_valid
        assert csr.subject == x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, self.owner)])
        assert stat.S_IMODE(store.key_path.stat().st_mode) == 0o600
        assert _public(csr.public_key()) == _public(store.load_or_create_key().public_key())

    def test_enrolment_survives_a_restart(self, tmp_path: Path, test_ca: Any) -> None:
        store = self.store(tmp_path)
        issued = test_ca.issue(store.make_csr(self.owner), self.owner, heartbeat_s=7.5)

        store.save(issued, "https://enrol.example:8000")
        restarted = self.store(tmp_path)

        assert restarted.is_enrolled()
        restarted.check_owner(self.owner)
        restarted.check_complete()
        enrolment = restarted.load_enrolment()
        assert enrolment.model_dump(exclude=COMMON_FIELDS, exclude_none=True) == {**self.ids, self.url_field: "https://enrol.example:8000"}
        assert (enrolment.heartbeat_interval_s, enrolment.serial, enrolment.not_after, enrolment.mqtt_url) == (
            7.5,
            issued.serial,
            issued.not_after,
            issued.mqtt_url,
        )
        assert restarted.cert_path.read_text() == issued.certificate_pem
        assert restarted.ca_path.read_text() == issued.ca_pem
        assert stat.S_IMODE(restarted.key_path.stat().st_mode) == 0o600
        assert stat.S_IMODE(restarted.enrolment_path.stat().st_mode) == 0o600

    def test_secure_makes_a_new_data_directory_owner_only(self, tmp_path: Path) -> None:
        # Prepare
        store = self.store(tmp_path / "new" / "data")

        # Execute
        store.secure()
        store.make_csr(self.owner)

        # Assert
        assert stat.S_IMODE(store.data_dir.stat().st_mode) == 0o700
        assert stat.S_IMODE(store.identity_dir.stat().st_mode) == 0o700
        assert stat.S_IMODE(store.key_path.stat().st_mode) == 0o600

    def test_secure_narrows_what_an_earlier_version_left_open(self, tmp_path: Path, test_ca: Any, caplog: pytest.LogCaptureFixture) -> None:
        # Prepare: an identity whose directories and files other users may read
        store = self._enrolled(tmp_path / "data", test_ca)
        for path, mode in ((store.data_dir, 0o755), (store.identity_dir, 0o755), (store.key_path, 0o644), (store.enrolment_path, 0o664)):
            path.chmod(mode)

        # Execute
        with caplog.at_level("WARNING"):
            self.store(store.data_dir).secure()

        # Assert
        assert stat.S_IMODE(store.data_dir.stat().st_mode) == 0o700
        assert stat.S_IMODE(store.identity_dir.stat().st_mode) == 0o700
        assert stat.S_IMODE(store.key_path.stat().st_mode) == 0o600
        assert stat.S_IMODE(store.enrolment_path.stat().st_mode) == 0o600
        assert sum("open to other users" in r.getMessage() for r in caplog.records) == 4
        self.store(store.data_dir).check_complete()

    def test_identity_of_another_owner_is_refused(self, tmp_path: Path, test_ca: Any) -> None:
        store = self._enrolled(tmp_path, test_ca)

        with pytest.raises(IdentityMismatch, match=self.owner):
            store.check_owner(self.other)

    def test_certificate_for_another_key_is_not_stored(self, tmp_path: Path, test_ca: Any) -> None:
        other = self.store(tmp_path / "other")
        store = self.store(tmp_path / "mine")
        store.load_or_create_key()

        with pytest.raises(IdentityError, match="does not match"):
            store.save(test_ca.issue(other.make_csr(self.owner), self.owner), "https://enrol.example")
        assert not store.is_enrolled()
        assert not store.cert_path.exists()

    def test_a_certificate_swapped_in_after_enrolment_is_refused(self, tmp_path: Path, test_ca: Any) -> None:
        store, other = self._enrolled(tmp_path / "mine", test_ca), self.store(tmp_path / "other")
        reissued = test_ca.issue(other.make_csr(self.owner), self.owner)
        foreign = test_ca.issue(other.make_csr(self.other), self.other)

        store.cert_path.write_text(reissued.certificate_pem)
        with pytest.raises(IdentityError, match="not the certificate recorded"):
            store.check_owner(self.owner)
        store.cert_path.write_text(foreign.certificate_pem)
        with pytest.raises(IdentityMismatch, match=f"CN={self.other}"):
            store.check_owner(self.owner)

    def test_a_record_without_a_fingerprint_has_its_cn_checked(self, tmp_path: Path, test_ca: Any) -> None:
        store, other = self._enrolled(tmp_path / "mine", test_ca), self.store(tmp_path / "other")
        record = json.loads(store.enrolment_path.read_text())
        del record["certificate_sha256"]  # as written before the fingerprint was kept
        store.enrolment_path.write_text(json.dumps(record))

        store.check_owner(self.owner)
        store.cert_path.write_text(test_ca.issue(other.make_csr(self.owner), self.owner).certificate_pem)
        store.check_owner(self.owner)  # another certificate for us: nothing recorded to compare it with
        store.cert_path.write_text(test_ca.issue(other.make_csr(self.other), self.other).certificate_pem)
        with pytest.raises(IdentityMismatch, match=f"CN={self.other}"):
            store.check_owner(self.owner)

    def test_an_unreadable_key_is_an_identity_error(self, tmp_path: Path) -> None:
        store = self.store(tmp_path)
        store.identity_dir.mkdir(parents=True)
        store.key_path.write_text("not a key")

        with pytest.raises(IdentityError, match="not a readable private key"):
            store.make_csr(self.owner)

    def test_the_enrolment_answer_s_signing_key_is_pinned(self, tmp_path: Path, test_ca: Any) -> None:
        store = self.store(tmp_path)
        signing = Ed25519PrivateKey.generate().public_key()
        issued = test_ca.issue(store.make_csr(self.owner), self.owner)

        store.save(issued.model_copy(update={"signing_key_pem": _public_pem(signing)}), "https://enrol.example")

        assert store.signing_key_pem() == _public_pem(signing)
        loaded = store.load_signing_key()
        assert loaded is not None and loaded.public_bytes_raw() == signing.public_bytes_raw()

    def test_an_answer_with_an_unusable_signing_key_is_not_stored(self, tmp_path: Path, test_ca: Any) -> None:
        store = self.store(tmp_path)
        issued = test_ca.issue(store.make_csr(self.owner), self.owner)
        not_ed25519 = _public_pem(ec.generate_private_key(ec.SECP256R1()).public_key())

        with pytest.raises(IdentityError, match="not a PEM Ed25519 public key"):
            store.save(issued.model_copy(update={"signing_key_pem": not_ed25519}), "https://enrol.example")
        assert not store.is_enrolled()
        assert not store.signing_key_path.exists()

    def test_a_signing_key_is_pinned_after_enrolment_only_if_it_is_ed25519(self, tmp_path: Path, test_ca: Any) -> None:
        store = self._enrolled(tmp_path, test_ca)
        signing = Ed25519PrivateKey.generate().public_key()
        assert (store.signing_key_pem(), store.load_signing_key()) == (None, None)

        with pytest.raises(IdentityError, match="not a PEM Ed25519 public key"):
            store.pin_signing_key(_public_pem(ec.generate_private_key(ec.SECP256R1()).public_key()))
        store.pin_signing_key(_public_pem(signing))

        loaded = self.store(tmp_path).load_signing_key()
        assert loaded is not None and loaded.public_bytes_raw() == signing.public_bytes_raw()
