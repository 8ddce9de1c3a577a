"""An agent's identity on disk, for either tier: its private key, its certificate, the CA and the enrolment record.

An edge is to the hub what a device is to its edge (DESIGN §3), so both keep the same files and make the same
checks; what differs is what the enrolment record holds, and the record type names the tier:
:class:`Enrolment` here for a device, ``edge.identity.Enrolment`` for a node. Layout of the data directory::

    identity/<tier>.key   EC P-256 private key (0600), made once and kept across re-enrolments
    identity/<tier>.crt   the certificate the enrolment issued (CN = the agent's id)
    identity/ca.crt       the CA, the only authority the agent trusts
    identity/signing.pub  the hub's Ed25519 artefact-signing key, pinned: every artefact is verified with it
    enrolment.json        the tier's ids and the URL it enrolled with, then mqtt_url, heartbeat_interval_s,
                          serial, not_after, certificate_sha256

``<tier>`` is ``device`` or ``node``. ``enrolment.json`` is written last, so its presence means the enrolment
completed; a restart then needs neither the bootstrap token nor the enrolment endpoint. It also records the
certificate's SHA-256 fingerprint, so that a restart checks the certificate with the standard library alone:
``cryptography`` (about 8 MiB resident) is loaded only to enrol, to explain a mismatch or to load the signing
key. Errors are :class:`~device.errors.IdentityError` and :class:`~device.errors.IdentityMismatch`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import ssl
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Generic, Self, TypeVar

from pydantic import BaseModel, ValidationError

from device.errors import IdentityError, IdentityMismatch
from device.filemodes import PRIVATE_FILE, narrow_mode, owner_only_dir
from device.files import write_atomic

if TYPE_CHECKING:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    from device.ota.verify import TrustedKeys

    from interfaces.nodes import CertificateIssued, DeviceCertificateIssued

log = logging.getLogger("aisynergy.device")


class EnrolmentRecord(BaseModel):
    """What an agent keeps from the enrolment answer (``enrolment.json``); a tier adds its ids and its URL.

    A subclass names its tier (the key and certificate files, the word in messages), the field that holds
    the agent's own id (its certificate's CN) and the field that holds the URL it enrolled with.
    """

    tier: ClassVar[str]
    owner_field: ClassVar[str]
    url_field: ClassVar[str]

    mqtt_url: str
    heartbeat_interval_s: float
    serial: str
    not_after: datetime
    certificate_sha256: str | None = None  # absent in records written before it was kept: the CN is checked

    @property
    def owner_id(self) -> str:
        return str(getattr(self, self.owner_field))

    @classmethod
    def from_issued(cls, issued: BaseModel, url: str, certificate_sha256: str, **extra: object) -> Self:
        """The record of an enrolment answer: the fields it shares with the answer, the URL it came from and
        ``extra`` fields of the tier's record."""
        shared = issued.model_dump(include=set(cls.model_fields))
        return cls.model_validate({**shared, **extra, cls.url_field: url, "certificate_sha256": certificate_sha256})


class Enrolment(EnrolmentRecord):
    """What a device keeps: its id, its edge's node id and the URL it enrolled with (normally its edge)."""

    tier = "device"
    owner_field = "device_id"
    url_field = "enrol_url"

    device_id: str
    node_id: str
    enrol_url: str
    tls_server_name: str | None = None  # the name in the enrolment server's certificate, when not the URL's host


R = TypeVar("R", bound=EnrolmentRecord)


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


def _trusted_keys(pem: str | bytes, what: str) -> TrustedKeys:
    from device.ota.verify import TrustedKeys

    try:
        return TrustedKeys.from_pem(pem)
    except (ValueError, TypeError) as exc:  # VerificationError included
        raise IdentityError(f"{what} is not a PEM Ed25519 public key: {exc}") from exc


def _signing_key(pem: str | bytes, what: str) -> Ed25519PublicKey:
    return _trusted_keys(pem, what).current


class AgentIdentityStore(Generic[R]):
    """Reads and writes the identity kept in ``data_dir`` by an agent of the tier whose record is ``record``."""

    record: type[R]

    def __init__(self, data_dir: Path) -> None:
        tier = self.record.tier
        self.data_dir = Path(data_dir)
        self.identity_dir = self.data_dir / "identity"
        self.key_path = self.identity_dir / f"{tier}.key"
        self.cert_path = self.identity_dir / f"{tier}.crt"
        self.ca_path = self.identity_dir / "ca.crt"
        self.signing_key_path = self.identity_dir / "signing.pub"
        self.enrolment_path = self.data_dir / "enrolment.json"

    def is_enrolled(self) -> bool:
        return self.enrolment_path.exists()

    def secure(self) -> None:
        """At start: the data directory and the identity directory 0700, the key and ``enrolment.json`` 0600, also
        when an earlier version left them open to other users."""
        owner_only_dir(self.data_dir)
        if self.identity_dir.exists():
            owner_only_dir(self.identity_dir)
        for path in (self.key_path, self.enrolment_path):
            narrow_mode(path, PRIVATE_FILE)

    def check_owner(self, owner_id: str) -> None:
        """Raise :class:`IdentityMismatch` when the stored identity is another agent's."""
        tier = self.record.tier
        enrolment = self.load_enrolment() if self.is_enrolled() else None
        if enrolment is not None and enrolment.owner_id != owner_id:
            raise IdentityMismatch(
                f"{self.data_dir} holds the identity of {tier} {enrolment.owner_id!r}, not {owner_id!r}; "
                "use another data directory or remove the old identity"
            )
        if not self.cert_path.exists():
            return
        pem = self.cert_path.read_text()
        if enrolment is not None and enrolment.certificate_sha256 == fingerprint(pem):
            return  # the certificate issued at enrolment, CN checked then
        cns = _common_names(self._load_cert(self.cert_path))
        if cns != [owner_id]:
            raise IdentityMismatch(f"{self.cert_path} is issued to CN={','.join(cns)}, not {owner_id!r}")
        if enrolment is not None and enrolment.certificate_sha256 is not None:
            raise IdentityError(f"{self.cert_path} is not the certificate recorded in {self.enrolment_path}")

    # ---- key and CSR --------------------------------------------------------------------------------
    def load_or_create_key(self) -> ec.EllipticCurvePrivateKey:
        """The agent's private key; made (EC P-256, mode 0600) on first use."""
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
        log.info("generated a new %s key in %s", self.record.tier, self.key_path)
        return key

    def make_csr(self, owner_id: str) -> str:
        """A PEM PKCS#10 request whose subject is exactly ``CN=<owner_id>``."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.x509.oid import NameOID

        csr = (
            x509.CertificateSigningRequestBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, owner_id)]))
            .sign(self.load_or_create_key(), hashes.SHA256())
        )
        return csr.public_bytes(serialization.Encoding.PEM).decode()

    # ---- the enrolment answer -----------------------------------------------------------------------
    def save(self, issued: CertificateIssued | DeviceCertificateIssued, url: str, **extra: object) -> R:
        """Check the issued certificate against our key and CA, then store it; ``enrolment.json`` last.

        ``url`` is the enrolment endpoint that answered (the hub for a node; normally its edge for a device);
        ``extra``: fields of the tier's record that the answer does not hold.
        """
        enrolment = self.record.from_issued(issued, url, fingerprint(issued.certificate_pem), **extra)
        self._check_issued(issued, enrolment.owner_id)
        if issued.signing_key_pem is not None:
            _signing_key(issued.signing_key_pem, "the enrolment answer's signing key")
        write_atomic(self.ca_path, issued.ca_pem.encode())
        if issued.signing_key_pem is not None:
            write_atomic(self.signing_key_path, issued.signing_key_pem.encode())
        write_atomic(self.cert_path, issued.certificate_pem.encode())
        write_atomic(self.enrolment_path, enrolment.model_dump_json(indent=2).encode(), mode=0o600)
        return enrolment

    def renewed(self, issued: CertificateIssued | DeviceCertificateIssued, enrolment: R) -> R:
        """Check a renewal's certificate as an enrolment's, then store it: the certificate file, then
        ``enrolment.json`` with its serial, not_after and fingerprint (each written atomically, the record last, so a
        restart finds either the old pair or the new one; the old certificate stays valid until it expires). The CA,
        the signing key and the URLs are kept as they are."""
        self._check_issued(issued, enrolment.owner_id)
        if fingerprint(issued.ca_pem) != fingerprint(self.ca_path.read_text()):
            raise IdentityError("the renewed certificate names another CA than the stored one")
        renewed = enrolment.model_copy(
            update={"serial": issued.serial, "not_after": issued.not_after, "certificate_sha256": fingerprint(issued.certificate_pem)}
        )
        write_atomic(self.cert_path, issued.certificate_pem.encode())
        write_atomic(self.enrolment_path, renewed.model_dump_json(indent=2).encode(), mode=0o600)
        return renewed

    def _check_issued(self, issued: CertificateIssued | DeviceCertificateIssued, owner_id: str) -> None:
        """:class:`IdentityError` unless the answer's certificate is for ``owner_id``, of our key, signed by its CA."""
        from cryptography import x509
        from cryptography.exceptions import InvalidSignature

        try:
            cert = x509.load_pem_x509_certificate(issued.certificate_pem.encode())
            ca = x509.load_pem_x509_certificate(issued.ca_pem.encode())
        except ValueError as exc:
            raise IdentityError(f"the enrolment answer holds an unreadable certificate: {exc}") from exc
        if _common_names(cert) != [owner_id]:
            raise IdentityError(f"the issued certificate is not for CN={owner_id}")
        if _public_der(cert.public_key()) != _public_der(self.load_or_create_key().public_key()):
            raise IdentityError(f"the issued certificate does not match the {self.record.tier} key")
        try:
            cert.verify_directly_issued_by(ca)
        except (ValueError, TypeError, InvalidSignature) as exc:
            raise IdentityError(f"the issued certificate is not signed by the returned CA: {exc}") from exc

    def load_enrolment(self) -> R:
        try:
            return self.record.model_validate_json(self.enrolment_path.read_bytes())
        except (OSError, ValidationError) as exc:
            raise IdentityError(f"cannot read {self.enrolment_path}: {exc}") from exc

    # ---- the hub's signing key ----------------------------------------------------------------------
    def signing_key_pem(self) -> str | None:
        """The pinned hub signing key as PEM (no ``cryptography`` needed), or ``None`` (enrolled through an
        endpoint that did not send one)."""
        try:
            return self.signing_key_path.read_text()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise IdentityError(f"cannot read {self.signing_key_path}: {exc}") from exc

    def load_signing_key(self) -> Ed25519PublicKey | None:
        """The newest pinned signing key, checked; ``None`` for an identity enrolled before the hub sent one."""
        pem = self.signing_key_pem()
        return None if pem is None else _signing_key(pem, str(self.signing_key_path))

    def load_trusted_keys(self) -> TrustedKeys | None:
        """Every pinned signing key (newest first: after a rotation of the hub's key, the old ones too)."""
        pem = self.signing_key_pem()
        return None if pem is None else _trusted_keys(pem, str(self.signing_key_path))

    def pin_signing_key(self, pem: str) -> None:
        """Keep ``pem`` (one key, or a bundle newest first) as the hub's signing keys: an older identity fetched
        it after enrolment, or the hub rotated its key and a target followed the transition."""
        _trusted_keys(pem, "the hub's signing key")
        self.identity_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_atomic(self.signing_key_path, pem.encode())

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


class IdentityStore(AgentIdentityStore[Enrolment]):
    """The device's identity kept in ``data_dir`` (``identity/device.key``, ``identity/device.crt``)."""

    record = Enrolment
