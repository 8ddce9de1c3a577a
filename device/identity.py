"""The device's identity on disk: its private key, its certificate, the CA and the enrolment record.

Layout of the data directory::

    identity/device.key   EC P-256 private key (0600), made once and kept across re-enrolments
    identity/device.crt   the device certificate (CN = device id)
    identity/ca.crt       the CA, the only authority the device trusts
    identity/signing.pub  the hub's Ed25519 artefact-signing key, pinned: every update is verified with it
    enrolment.json        device_id, node_id, enrol_url, mqtt_url, heartbeat_interval_s, serial, not_after,
                          certificate_sha256

``enrolment.json`` is written last, so its presence means the enrolment completed; a restart then
needs neither the bootstrap token nor the enrolment endpoint. It also records the certificate's SHA-256
fingerprint, so that a restart checks the certificate with the standard library alone: ``cryptography``
(about 8 MiB resident) is loaded only to enrol or to explain a mismatch.
"""

from __future__ import annotations

import hashlib
import logging
import os
import ssl
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ValidationError

from device.errors import IdentityError, IdentityMismatch
from device.files import write_atomic
from interfaces.nodes import DeviceCertificateIssued

if TYPE_CHECKING:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

log = logging.getLogger("aisynergy.device")


class Enrolment(BaseModel):
    """What the device keeps from the enrolment answer (``enrolment.json``)."""

    device_id: str
    node_id: str
    enrol_url: str
    mqtt_url: str
    heartbeat_interval_s: float
    serial: str
    not_after: datetime
    certificate_sha256: str | None = None


def fingerprint(certificate_pem: str) -> str:
    """SHA-256 of the certificate's DER encoding, in hex."""
    try:
        return hashlib.sha256(ssl.PEM_cert_to_DER_cert(certificate_pem.strip())).hexdigest()
    except ValueError as exc:
        raise IdentityError(f"not a PEM certificate: {exc}") from exc


def _public_der(key: object) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)  # type: ignore[attr-defined]


def _common_names(cert: x509.Certificate) -> list[str]:
    from cryptography.x509.oid import NameOID

    return [str(a.value) for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]


class IdentityStore:
    """Reads and writes the device identity kept in ``data_dir``."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = Path(data_dir)
        self.identity_dir = self.data_dir / "identity"
        self.key_path = self.identity_dir / "device.key"
        self.cert_path = self.identity_dir / "device.crt"
        self.ca_path = self.identity_dir / "ca.crt"
        self.signing_key_path = self.identity_dir / "signing.pub"
        self.enrolment_path = self.data_dir / "enrolment.json"

    def is_enrolled(self) -> bool:
        return self.enrolment_path.exists()

    def check_owner(self, device_id: str) -> None:
        """Raise :class:`IdentityMismatch` when the stored identity is another device's."""
        enrolment = self.load_enrolment() if self.is_enrolled() else None
        if enrolment is not None and enrolment.device_id != device_id:
            raise IdentityMismatch(
                f"{self.data_dir} holds the identity of device {enrolment.device_id!r}, not {device_id!r}; "
                "use another data directory or remove the old identity"
            )
        if not self.cert_path.exists():
            return
        pem = self.cert_path.read_text()
        if enrolment is not None and enrolment.certificate_sha256 == fingerprint(pem):
            return  # the certificate issued at enrolment, CN checked then
        cns = _common_names(self._load_cert(self.cert_path))
        if cns != [device_id]:
            raise IdentityMismatch(f"{self.cert_path} is issued to CN={','.join(cns)}, not {device_id!r}")
        if enrolment is not None and enrolment.certificate_sha256 is not None:
            raise IdentityError(f"{self.cert_path} is not the certificate recorded in {self.enrolment_path}")

    # ---- key and CSR --------------------------------------------------------------------------------
    def load_or_create_key(self) -> ec.EllipticCurvePrivateKey:
        """The device's private key; made (EC P-256, mode 0600) on first use."""
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ec

        if self.key_path.exists():
            try:
                key = serialization.load_pem_private_key(self.key_path.read_bytes(), password=None)
            except ValueError as exc:
                raise IdentityError(f"{self.key_path} is not a readable private key: {exc}") from exc
            if not isinstance(key, ec.EllipticCurvePrivateKey):
                raise IdentityError(f"{self.key_path} is not an EC private key")
            return key
        self.identity_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        key = ec.generate_private_key(ec.SECP256R1())
        pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        write_atomic(self.key_path, pem, mode=0o600)
        log.info("generated a new device key in %s", self.key_path)
        return key

    def make_csr(self, device_id: str) -> str:
        """A PEM PKCS#10 request whose subject is exactly ``CN=<device_id>``."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.x509.oid import NameOID

        csr = (
            x509.CertificateSigningRequestBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, device_id)]))
            .sign(self.load_or_create_key(), hashes.SHA256())
        )
        return csr.public_bytes(serialization.Encoding.PEM).decode()

    # ---- the enrolment answer -----------------------------------------------------------------------
    def save(self, issued: DeviceCertificateIssued, enrol_url: str) -> Enrolment:
        """Check the issued certificate against our key and CA, then store it; ``enrolment.json`` last."""
        from cryptography import x509
        from cryptography.exceptions import InvalidSignature

        try:
            cert = x509.load_pem_x509_certificate(issued.certificate_pem.encode())
            ca = x509.load_pem_x509_certificate(issued.ca_pem.encode())
        except ValueError as exc:
            raise IdentityError(f"the enrolment answer holds an unreadable certificate: {exc}") from exc
        if _common_names(cert) != [issued.device_id]:
            raise IdentityError(f"the issued certificate is not for CN={issued.device_id}")
        if _public_der(cert.public_key()) != _public_der(self.load_or_create_key().public_key()):
            raise IdentityError("the issued certificate does not match the device key")
        try:
            cert.verify_directly_issued_by(ca)
        except (ValueError, TypeError, InvalidSignature) as exc:
            raise IdentityError(f"the issued certificate is not signed by the returned CA: {exc}") from exc
        if issued.signing_key_pem is not None:
            from device.ota.verify import load_public_key

            try:
                load_public_key(issued.signing_key_pem)
            except ValueError as exc:
                raise IdentityError(f"the enrolment answer holds an unusable signing key: {exc}") from exc
        enrolment = Enrolment(
            device_id=issued.device_id,
            node_id=issued.node_id,
            enrol_url=enrol_url,
            mqtt_url=issued.mqtt_url,
            heartbeat_interval_s=issued.heartbeat_interval_s,
            serial=issued.serial,
            not_after=issued.not_after,
            certificate_sha256=fingerprint(issued.certificate_pem),
        )
        write_atomic(self.ca_path, issued.ca_pem.encode())
        if issued.signing_key_pem is not None:
            write_atomic(self.signing_key_path, issued.signing_key_pem.encode())
        write_atomic(self.cert_path, issued.certificate_pem.encode())
        write_atomic(self.enrolment_path, enrolment.model_dump_json(indent=2).encode(), mode=0o600)
        return enrolment

    def load_enrolment(self) -> Enrolment:
        try:
            return Enrolment.model_validate_json(self.enrolment_path.read_bytes())
        except (OSError, ValidationError) as exc:
            raise IdentityError(f"cannot read {self.enrolment_path}: {exc}") from exc

    def signing_key_pem(self) -> str | None:
        """The pinned hub signing key, or ``None`` (enrolled through an endpoint that did not send one)."""
        try:
            return self.signing_key_path.read_text()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise IdentityError(f"cannot read {self.signing_key_path}: {exc}") from exc

    def check_complete(self) -> None:
        """Raise :class:`IdentityError` unless key, certificate and CA are all present."""
        missing = [p.name for p in (self.key_path, self.cert_path, self.ca_path) if not p.exists()]
        if missing:
            raise IdentityError(
                f"{self.identity_dir} lacks {', '.join(missing)}; remove {self.enrolment_path} to re-enrol"
            )
        if os.stat(self.key_path).st_mode & 0o077:
            log.warning("%s is readable by other users; it should be mode 0600", self.key_path)

    @staticmethod
    def _load_cert(path: Path) -> x509.Certificate:
        from cryptography import x509

        try:
            return x509.load_pem_x509_certificate(path.read_bytes())
        except ValueError as exc:
            raise IdentityError(f"{path} is not a PEM certificate") from exc
