"""The hub's certificate authority: node identities for mutual TLS (DESIGN §6).

Layout of a PKI directory (created on first use, private keys 0600):

    ca.crt  ca.key        the hub CA (EC P-256), signs everything below
    broker.crt broker.key the broker's server certificate (SAN: localhost, 127.0.0.1, extra names)
    hub.crt  hub.key      the hub's own client identity (CN = hub)
    crl.pem               certificate revocation list, rewritten on every revocation
"""

from __future__ import annotations

import contextlib
import datetime as dt
import ipaddress
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

HUB_IDENTITY = "hub"
CA_VALIDITY = dt.timedelta(days=3650)
LEAF_VALIDITY = dt.timedelta(days=365)
# A CRL is valid until its next update; past it, TLS refuses every certificate of the CA (an expired CRL is no
# CRL). The hub signs it again when less than CRL_REFRESH_BEFORE is left: on start and hourly (housekeeping), so
# a CRL is at most ten days old, and a hub away for up to twenty days leaves a fleet that still connects.
CRL_VALIDITY = dt.timedelta(days=30)
CRL_REFRESH_BEFORE = dt.timedelta(days=20)


class CsrError(ValueError):
    """The CSR cannot be signed: unparseable, bad signature, wrong subject or weak key."""


class CsrKeyMismatch(CsrError):
    """A renewal's CSR holds another public key than the certificate it renews."""


class CertificateError(ValueError):
    """A certificate presented for renewal is unreadable (``readable`` False), or not one this CA issued to the name."""

    def __init__(self, message: str, readable: bool = True) -> None:
        super().__init__(message)
        self.readable = readable


@dataclass(frozen=True)
class Presented:
    """A certificate this CA issued, as presented for renewal."""

    serial: str
    not_after: dt.datetime
    public_key_der: bytes


@dataclass(frozen=True)
class Issued:
    certificate_pem: str
    serial: str
    not_after: dt.datetime


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _write_atomic(path: Path, data: bytes, mode: int) -> None:
    """Write through a uniquely named temporary file, so concurrent writers never share one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _write_private(path: Path, data: bytes) -> None:
    _write_atomic(path, data, 0o600)


def write_public(path: Path, data: bytes) -> None:
    _write_atomic(path, data, 0o644)




def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def _public_der(public_key: object) -> bytes:
    return public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)  # type: ignore[attr-defined,no-any-return]


def _host_names(hosts: list[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def key_matches_certificate(cert_path: Path, key_path: Path) -> bool:
    """Whether the private key in ``key_path`` is the one ``cert_path`` certifies (False when either is missing,
    unreadable or half written): a server must never be handed a mismatched pair."""
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError):
        return False
    return _public_der(cert.public_key()) == _public_der(key.public_key())


def new_private_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def make_csr(key: ec.EllipticCurvePrivateKey, common_name: str) -> str:
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .sign(key, hashes.SHA256())
    )
    return csr.public_bytes(serialization.Encoding.PEM).decode()


class CertificateAuthority:
    def __init__(self, directory: Path, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
        self.directory = directory
        self._key = key
        self.cert = cert

    # ---- creation -------------------------------------------------------------------------------
    @classmethod
    def load_or_create(cls, directory: Path | str, broker_hosts: tuple[str, ...] = ()) -> CertificateAuthority:
        """Open the CA in ``directory``, creating the CA, broker and hub identities if missing."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        ca_key_path, ca_crt_path = directory / "ca.key", directory / "ca.crt"
        if ca_key_path.exists() and ca_crt_path.exists():
            key = serialization.load_pem_private_key(ca_key_path.read_bytes(), password=None)
            cert = x509.load_pem_x509_certificate(ca_crt_path.read_bytes())
            assert isinstance(key, ec.EllipticCurvePrivateKey)
            ca = cls(directory, key, cert)
        else:
            key = new_private_key()
            name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "AISynergy hub CA")])
            now = _now()
            cert = (
                x509.CertificateBuilder()
                .subject_name(name)
                .issuer_name(name)
                .public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - dt.timedelta(minutes=5))
                .not_valid_after(now + CA_VALIDITY)
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(
                    x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
                )
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
                .sign(key, hashes.SHA256())
            )
            _write_private(ca_key_path, _key_pem(key))
            write_public(ca_crt_path, cert.public_bytes(serialization.Encoding.PEM))
            ca = cls(directory, key, cert)
        if not (directory / "crl.pem").exists():
            ca.write_crl([])
        ca.ensure_broker_identity(broker_hosts)
        ca.ensure_client_identity(HUB_IDENTITY)
        return ca

    @property
    def ca_pem(self) -> str:
        return self.cert.public_bytes(serialization.Encoding.PEM).decode()

    @property
    def fingerprint(self) -> str:
        """``sha256:<hex>`` of the CA certificate's DER: what an agent pins before it enrols (``--ca-sha256``)."""
        return "sha256:" + self.cert.fingerprint(hashes.SHA256()).hex()

    def _builder(self, subject_cn: str, public_key: object, validity: dt.timedelta) -> x509.CertificateBuilder:
        now = _now()
        return (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject_cn)]))
            .issuer_name(self.cert.subject)
            .public_key(public_key)  # type: ignore[arg-type]
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + validity)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()), critical=False
            )
        )

    def ensure_broker_identity(self, extra_hosts: tuple[str, ...] = ()) -> None:
        self.ensure_server_identity("broker", "aisynergy-broker", extra_hosts)

    def ensure_server_identity(self, name: str, common_name: str, extra_hosts: tuple[str, ...] = ()) -> tuple[Path, Path]:
        """``<name>.crt`` and ``<name>.key``: a TLS server certificate for localhost, 127.0.0.1, ::1 and
        ``extra_hosts`` (made again when a host is missing from the one there); the broker's, the hub's HTTPS."""
        crt, key_path = self.directory / f"{name}.crt", self.directory / f"{name}.key"
        hosts = sorted({"localhost", "127.0.0.1", "::1", *extra_hosts})
        if crt.exists() and key_path.exists():
            existing = x509.load_pem_x509_certificate(crt.read_bytes())
            san = existing.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            have = {str(v) for v in san.get_values_for_type(x509.DNSName)} | {
                str(v) for v in san.get_values_for_type(x509.IPAddress)
            }
            if set(hosts) <= have:
                if key_path.stat().st_mode & 0o077:  # an older PKI left it readable to the broker's account
                    with contextlib.suppress(PermissionError):
                        os.chmod(key_path, 0o600)
                return crt, key_path
        key = new_private_key()
        cert = (
            self._builder(common_name, key.public_key(), LEAF_VALIDITY)
            .add_extension(x509.SubjectAlternativeName(_host_names(hosts)), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        # private like every key: the broker reads its own copy (cloud.broker.runner hands it to its account)
        _write_private(key_path, _key_pem(key))
        write_public(crt, cert.public_bytes(serialization.Encoding.PEM))
        return crt, key_path

    def rotate_server_identity(self, name: str, common_name: str, extra_hosts: tuple[str, ...] = ()) -> x509.Certificate:
        """A new key and certificate for ``<name>``, for the host names of the one there and ``extra_hosts``
        (``aisynergy hub rotate broker-certificate``). Agents check the server by this CA, so none needs telling;
        the broker takes it at its next reload (its runner copies it when the key and certificate match)."""
        crt, key_path = self.directory / f"{name}.crt", self.directory / f"{name}.key"
        hosts = {"localhost", "127.0.0.1", "::1", *extra_hosts}
        if crt.exists():
            san = x509.load_pem_x509_certificate(crt.read_bytes()).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            hosts |= {str(v) for v in san.get_values_for_type(x509.DNSName)} | {str(v) for v in san.get_values_for_type(x509.IPAddress)}
        key = new_private_key()
        cert = (
            self._builder(common_name, key.public_key(), LEAF_VALIDITY)
            .add_extension(x509.SubjectAlternativeName(_host_names(sorted(hosts))), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        _write_private(key_path, _key_pem(key))
        write_public(crt, cert.public_bytes(serialization.Encoding.PEM))
        return cert

    def ensure_client_identity(self, common_name: str) -> tuple[Path, Path]:
        crt, key_path = self.directory / f"{common_name}.crt", self.directory / f"{common_name}.key"
        if not (crt.exists() and key_path.exists()):
            key = new_private_key()
            cert = self._client_cert(common_name, key.public_key(), LEAF_VALIDITY)
            _write_private(key_path, _key_pem(key))
            write_public(crt, cert.public_bytes(serialization.Encoding.PEM))
        return crt, key_path

    def _client_cert(self, common_name: str, public_key: object, validity: dt.timedelta, server: bool = False) -> x509.Certificate:
        """A client certificate; ``server``: also a TLS server's, named ``common_name`` (an edge's listener serves
        its devices with its node certificate, and they check that name: ``tls_server_name``)."""
        usages = [ExtendedKeyUsageOID.CLIENT_AUTH, *([ExtendedKeyUsageOID.SERVER_AUTH] if server else [])]
        builder = self._builder(common_name, public_key, validity).add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        if server:
            builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(common_name)]), critical=False)
        return builder.add_extension(
            x509.KeyUsage(True, False, True, False, False, False, False, False, False), critical=True
        ).sign(self._key, hashes.SHA256())

    # ---- node identities ----------------------------------------------------------------------------
    def check_issued(self, certificate_pem: str, expected_cn: str) -> Presented:
        """A certificate this CA signed for exactly ``CN=<expected_cn>`` (expired or not: the caller judges when);
        :class:`CertificateError` otherwise."""
        try:
            cert = x509.load_pem_x509_certificate(certificate_pem.encode())
        except ValueError as exc:
            raise CertificateError("not a PEM X.509 certificate", readable=False) from exc
        try:
            cert.verify_directly_issued_by(self.cert)
        except (ValueError, TypeError, InvalidSignature) as exc:
            raise CertificateError("the certificate was not issued by this hub's CA") from exc
        cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        if len(cns) != 1 or cns[0].value != expected_cn or len(cert.subject) != 1:
            raise CertificateError(f"the certificate is not issued to CN={expected_cn}")
        return Presented(format(cert.serial_number, "x"), cert.not_valid_after_utc, _public_der(cert.public_key()))

    def sign_csr(self, csr_pem: str, expected_cn: str, validity: dt.timedelta = LEAF_VALIDITY, server: bool = False,
                 same_key_as: bytes | None = None) -> Issued:  # fmt: skip
        """Sign an agent's CSR. The subject must be exactly ``CN=<expected_cn>``; RSA < 2048 refused. ``server``:
        the certificate may also serve TLS under that name (a node's: see :meth:`_client_cert`). ``same_key_as``:
        the DER public key the CSR must hold (a renewal keeps its key: :class:`CsrKeyMismatch` otherwise)."""
        try:
            csr = x509.load_pem_x509_csr(csr_pem.encode())
        except (ValueError, TypeError) as exc:
            raise CsrError("not a PEM PKCS#10 certificate signing request") from exc
        try:
            if not csr.is_signature_valid:
                raise CsrError("the CSR's signature does not verify")
        except InvalidSignature as exc:  # pragma: no cover - older cryptography
            raise CsrError("the CSR's signature does not verify") from exc
        cns = csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        if len(cns) != 1 or cns[0].value != expected_cn or len(csr.subject) != 1:
            raise CsrError(f"the CSR's subject must be exactly CN={expected_cn}")
        public_key = csr.public_key()
        if same_key_as is not None and _public_der(public_key) != same_key_as:
            raise CsrKeyMismatch("the CSR's public key is not the certificate's: a renewal keeps its key")
        if isinstance(public_key, rsa.RSAPublicKey):
            if public_key.key_size < 2048:
                raise CsrError("RSA keys shorter than 2048 bits are refused")
        elif isinstance(public_key, ec.EllipticCurvePublicKey):
            if public_key.curve.key_size < 256:
                raise CsrError("EC keys smaller than 256 bits are refused")
        elif not isinstance(public_key, ed25519.Ed25519PublicKey):
            raise CsrError("unsupported key type: use EC P-256, Ed25519 or RSA >= 2048")
        cert = self._client_cert(expected_cn, public_key, validity, server=server)
        return Issued(
            certificate_pem=cert.public_bytes(serialization.Encoding.PEM).decode(),
            serial=format(cert.serial_number, "x"),
            not_after=cert.not_valid_after_utc,
        )

    def revoked_serials(self) -> frozenset[str]:
        """The (hex) serials in the current ``crl.pem``."""
        path = self.directory / "crl.pem"
        if not path.exists():
            return frozenset()
        crl = x509.load_pem_x509_crl(path.read_bytes())
        return frozenset(format(entry.serial_number, "x") for entry in crl)

    def crl_next_update(self) -> dt.datetime | None:
        """When the current ``crl.pem`` stops being valid (``None``: there is none, or it is unreadable)."""
        path = self.directory / "crl.pem"
        try:
            crl = x509.load_pem_x509_crl(path.read_bytes())
        except (OSError, ValueError):
            return None
        return crl.next_update_utc

    def crl_due(self, now: dt.datetime | None = None) -> bool:
        """Whether the CRL must be signed again now (missing, unreadable, or less than CRL_REFRESH_BEFORE left)."""
        next_update = self.crl_next_update()
        return next_update is None or next_update - (now or _now()) < CRL_REFRESH_BEFORE

    def write_crl(self, revoked: list[tuple[str, dt.datetime]], now: dt.datetime | None = None) -> Path:
        """Rewrite ``crl.pem`` with the given (hex serial, revoked at) pairs, valid for CRL_VALIDITY from ``now``."""
        now = now or _now()
        builder = (
            x509.CertificateRevocationListBuilder()
            .issuer_name(self.cert.subject)
            .last_update(now - dt.timedelta(minutes=5))
            .next_update(now + CRL_VALIDITY)
        )
        for serial_hex, at in revoked:
            builder = builder.add_revoked_certificate(
                x509.RevokedCertificateBuilder().serial_number(int(serial_hex, 16)).revocation_date(at).build()
            )
        crl = builder.sign(self._key, hashes.SHA256())
        path = self.directory / "crl.pem"
        write_public(path, crl.public_bytes(serialization.Encoding.PEM))
        return path
