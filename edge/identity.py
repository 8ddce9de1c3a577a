"""The node's identity on disk: its private key, its certificate, the hub CA and the enrolment record.

Layout of the data directory::

    identity/node.key   EC P-256 private key (0600), made once and kept across re-enrolments
    identity/node.crt   the node certificate the hub issued (CN = node id)
    identity/ca.crt     the hub CA, the only authority the agent trusts
    identity/signing.pub  the hub's Ed25519 artefact-signing public key, pinned (manifests, download tokens)
    enrolment.json      node_id, hub_url, mqtt_url, heartbeat_interval_s, serial, not_after

``enrolment.json`` is written last, so its presence means the enrolment completed.

Errors::

    IdentityError             the stored identity is unusable (missing file, key and certificate disagree)
     └── IdentityMismatch     the stored identity belongs to another node id
"""

from __future__ import annotations

import logging
import os
from datetime import datetime
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.x509.oid import NameOID
from pydantic import BaseModel, ValidationError

from device.files import write_atomic
from device.ota.verify import load_public_key
from interfaces.nodes import CertificateIssued

log = logging.getLogger("aisynergy.edge")


class IdentityError(Exception):
    """The stored identity cannot be used."""


class IdentityMismatch(IdentityError):
    """The data directory holds the identity of another node."""


class Enrolment(BaseModel):
    """What the agent keeps from the hub's answer (``enrolment.json``)."""

    node_id: str
    hub_url: str
    mqtt_url: str
    heartbeat_interval_s: float
    serial: str
    not_after: datetime


def _public_der(key: ec.EllipticCurvePublicKey | object) -> bytes:
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)  # type: ignore[attr-defined]


def _common_names(cert: x509.Certificate) -> list[str]:
    return [str(a.value) for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]


def _signing_key(pem: bytes, what: str) -> Ed25519PublicKey:
    try:
        return load_public_key(pem)
    except (ValueError, TypeError) as exc:  # VerificationError included
        raise IdentityError(f"{what} is not a PEM Ed25519 public key: {exc}") from exc


class IdentityStore:
    """Reads and writes the node identity kept in ``data_dir``."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = Path(data_dir)
        self.identity_dir = self.data_dir / "identity"
        self.key_path = self.identity_dir / "node.key"
        self.cert_path = self.identity_dir / "node.crt"
        self.ca_path = self.identity_dir / "ca.crt"
        self.signing_key_path = self.identity_dir / "signing.pub"
        self.enrolment_path = self.data_dir / "enrolment.json"

    def is_enrolled(self) -> bool:
        return self.enrolment_path.exists()

    def check_owner(self, node_id: str) -> None:
        """Raise :class:`IdentityMismatch` when the stored identity is another node's."""
        if self.is_enrolled():
            stored = self.load_enrolment().node_id
            if stored != node_id:
                raise IdentityMismatch(
                    f"{self.data_dir} holds the identity of node {stored!r}, not {node_id!r}; "
                    "use another --data-dir or remove the old identity"
                )
        if self.cert_path.exists():
            cns = _common_names(self._load_cert(self.cert_path))
            if cns != [node_id]:
                raise IdentityMismatch(f"{self.cert_path} is issued to CN={','.join(cns)}, not {node_id!r}")

    # ---- key and CSR --------------------------------------------------------------------------------
    def load_or_create_key(self) -> ec.EllipticCurvePrivateKey:
        """The node's private key; made (EC P-256, mode 0600) on first use."""
        if self.key_path.exists():
            key = serialization.load_pem_private_key(self.key_path.read_bytes(), password=None)
            if not isinstance(key, ec.EllipticCurvePrivateKey):
                raise IdentityError(f"{self.key_path} is not an EC private key")
            return key
        self.identity_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        key = ec.generate_private_key(ec.SECP256R1())
        pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        write_atomic(self.key_path, pem, mode=0o600)
        log.info("generated a new node key in %s", self.key_path)
        return key

    def make_csr(self, node_id: str) -> str:
        """A PEM PKCS#10 request whose subject is exactly ``CN=<node_id>``."""
        csr = (
            x509.CertificateSigningRequestBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id)]))
            .sign(self.load_or_create_key(), hashes.SHA256())
        )
        return csr.public_bytes(serialization.Encoding.PEM).decode()

    # ---- the hub's answer ---------------------------------------------------------------------------
    def save(self, issued: CertificateIssued, hub_url: str) -> Enrolment:
        """Check the issued certificate against our key and CA, then store it; ``enrolment.json`` last."""
        try:
            cert = x509.load_pem_x509_certificate(issued.certificate_pem.encode())
            ca = x509.load_pem_x509_certificate(issued.ca_pem.encode())
        except ValueError as exc:
            raise IdentityError(f"the hub returned an unreadable certificate: {exc}") from exc
        if _common_names(cert) != [issued.node_id]:
            raise IdentityError(f"the issued certificate is not for CN={issued.node_id}")
        if _public_der(cert.public_key()) != _public_der(self.load_or_create_key().public_key()):
            raise IdentityError("the issued certificate does not match the node key")
        try:
            cert.verify_directly_issued_by(ca)
        except (ValueError, TypeError, InvalidSignature) as exc:
            raise IdentityError(f"the issued certificate is not signed by the returned CA: {exc}") from exc
        if issued.signing_key_pem is not None:
            _signing_key(issued.signing_key_pem.encode(), "the hub's signing key")
        enrolment = Enrolment(
            node_id=issued.node_id,
            hub_url=hub_url,
            mqtt_url=issued.mqtt_url,
            heartbeat_interval_s=issued.heartbeat_interval_s,
            serial=issued.serial,
            not_after=issued.not_after,
        )
        write_atomic(self.ca_path, issued.ca_pem.encode())
        write_atomic(self.cert_path, issued.certificate_pem.encode())
        if issued.signing_key_pem is not None:
            write_atomic(self.signing_key_path, issued.signing_key_pem.encode())
        write_atomic(self.enrolment_path, enrolment.model_dump_json(indent=2).encode(), mode=0o600)
        return enrolment

    def load_signing_key(self) -> Ed25519PublicKey | None:
        """The pinned signing key; ``None`` for an identity enrolled before the hub sent one."""
        try:
            pem = self.signing_key_path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise IdentityError(f"cannot read {self.signing_key_path}: {exc}") from exc
        return _signing_key(pem, str(self.signing_key_path))

    def pin_signing_key(self, pem: str) -> None:
        """Keep ``pem`` as the hub's signing key (an older identity fetched it after enrolment)."""
        _signing_key(pem.encode(), "the hub's signing key")
        self.identity_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_atomic(self.signing_key_path, pem.encode())

    def load_enrolment(self) -> Enrolment:
        try:
            return Enrolment.model_validate_json(self.enrolment_path.read_bytes())
        except (OSError, ValidationError) as exc:
            raise IdentityError(f"cannot read {self.enrolment_path}: {exc}") from exc

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
        try:
            return x509.load_pem_x509_certificate(path.read_bytes())
        except ValueError as exc:
            raise IdentityError(f"{path} is not a PEM certificate") from exc
