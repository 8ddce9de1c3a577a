"""A throwaway certificate authority for the edge tests (the hub's own CA is not needed here)."""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from interfaces.nodes import CertificateIssued


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


@dataclass
class ThrowawayCA:
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @classmethod
    def create(cls) -> ThrowawayCA:
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        cert = (
            x509.CertificateBuilder().subject_name(_name("test CA")).issuer_name(_name("test CA"))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(key, hashes.SHA256())
        )  # fmt: skip
        return cls(key, cert)

    @property
    def pem(self) -> str:
        return self.cert.public_bytes(serialization.Encoding.PEM).decode()

    def _leaf(
        self, cn: str, public_key: object, usage: x509.ObjectIdentifier, hosts: tuple[str, ...] = ()
    ) -> x509.Certificate:
        now = dt.datetime.now(dt.UTC)
        builder = (
            x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(self.cert.subject)
            .public_key(public_key).serial_number(x509.random_serial_number())  # type: ignore[arg-type]
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )  # fmt: skip
        if hosts:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(h)) for h in hosts]), critical=False
            )
        return builder.sign(self.key, hashes.SHA256())

    def issue(
        self, csr_pem: str, node_id: str, mqtt_url: str = "mqtts://127.0.0.1:8883", heartbeat_s: float = 5.0
    ) -> CertificateIssued:
        """What the hub answers to a CSR."""
        csr = x509.load_pem_x509_csr(csr_pem.encode())
        cert = self._leaf(node_id, csr.public_key(), ExtendedKeyUsageOID.CLIENT_AUTH)
        return CertificateIssued(
            node_id=node_id,
            certificate_pem=cert.public_bytes(serialization.Encoding.PEM).decode(),
            ca_pem=self.pem,
            serial=format(cert.serial_number, "x"),
            not_after=cert.not_valid_after_utc,
            mqtt_url=mqtt_url,
            heartbeat_interval_s=heartbeat_s,
        )

    def write_identity(self, directory: Path, cn: str, server: bool = False) -> tuple[Path, Path]:
        """A key pair and certificate in ``directory`` (a broker's when ``server``); returns (crt, key)."""
        key = ec.generate_private_key(ec.SECP256R1())
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        cert = self._leaf(cn, key.public_key(), usage, ("127.0.0.1",) if server else ())
        crt_path, key_path = directory / f"{cn}.crt", directory / f"{cn}.key"
        crt_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        return crt_path, key_path


@pytest.fixture(scope="session")
def test_ca() -> ThrowawayCA:
    return ThrowawayCA.create()
