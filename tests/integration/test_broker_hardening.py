"""The broker as deployed: its own account and files, only what it needs of the PKI, modern TLS only, bounded
packets, and an open-file limit as high as the system allows (DESIGN §6)."""

from __future__ import annotations

import datetime as dt
import os
import pwd
import resource
import shutil
import socket
import ssl
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509

from cloud.broker.config import DEFAULT_MAX_PACKET_BYTES, TLS_FILES
from cloud.broker.runner import BROKER_ACCOUNT, SHARED_FILES
from cloud.pki import CertificateAuthority, write_public
from interfaces.infer import MAX_FRAME_BYTES
from interfaces.messages import MAX_MESSAGE_BYTES
from tests.support import AISYNERGY, free_port, logs_on_failure, port_open, stop, wait_for

pytestmark = [pytest.mark.broker, pytest.mark.skipif(shutil.which("mosquitto") is None and not os.path.exists("/usr/sbin/mosquitto"),
                                                     reason="needs the mosquitto binary")]  # fmt: skip
LOW_SOFT_NOFILE = 256


@dataclass
class Split:
    """The hub's side (its PKI, ``broker share``) and the broker's (``broker run --pki-dir``), apart."""

    root: Path
    port: int
    share: subprocess.Popen[bytes]
    broker: subprocess.Popen[bytes]

    @property
    def pki(self) -> Path:
        return self.root / "hub" / "pki"

    @property
    def shared(self) -> Path:
        return self.root / "broker-pki"

    @property
    def broker_dir(self) -> Path:
        return self.root / "broker-side" / "broker"

    @property
    def logs(self) -> tuple[Path, Path]:
        return self.root / "share.log", self.root / "broker.log"

    def mosquitto_pid(self) -> int:
        return int((self.broker_dir / "mosquitto.pid").read_text())


def _lower_soft_nofile() -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(LOW_SOFT_NOFILE, hard), hard))


def _spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    # started with a low soft open-file limit, as a login shell's default (1,024) would be
    return subprocess.Popen([*AISYNERGY, *args], stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=_lower_soft_nofile)  # fmt: skip  # noqa: PLW1509


@pytest.fixture(scope="module")
def split() -> Iterator[Split]:
    # a directory the broker's account can reach (pytest's own are closed to other users)
    root = Path(tempfile.mkdtemp(prefix="aisynergy-broker-"))
    os.chmod(root, 0o711)
    port = free_port()
    CertificateAuthority.load_or_create(root / "hub" / "pki")
    (root / "hub" / "pki" / "signing.key").write_bytes(b"the hub's artefact signing key")
    write_public(root / "hub" / "pki" / "revoked.txt", b"")  # the access lists, as the hub writes them
    write_public(root / "hub" / "pki" / "devices.txt", b"n1 d1\n")
    share = _spawn(["broker", "share", "--data-dir", str(root / "hub"), "--to", str(root / "broker-pki"),
                    "--hostname", "broker"], root / "share.log")  # fmt: skip
    broker = _spawn(["broker", "run", "--data-dir", str(root / "broker-side"), "--pki-dir", str(root / "broker-pki"),
                     "--port", str(port)], root / "broker.log")  # fmt: skip
    s = Split(root, port, share, broker)
    try:
        with logs_on_failure(*s.logs):
            wait_for(lambda: port_open(port) or broker.poll() is not None, 30, what="the broker's port")
            assert broker.poll() is None, "the broker exited"
            wait_for(lambda: (s.broker_dir / "mosquitto.pid").exists(), 60, what="the broker's pid file")
        yield s
    finally:
        stop(broker)
        stop(share)
        shutil.rmtree(root, ignore_errors=True)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _context(pki: Path, identity: str = "hub", ciphers: str | None = None, tls12: bool = False) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    ctx.load_cert_chain(str(pki / f"{identity}.crt"), str(pki / f"{identity}.key"))
    if tls12:
        ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    if ciphers:
        ctx.set_ciphers(ciphers)
    return ctx


def _connect(split: Split, ctx: ssl.SSLContext) -> ssl.SSLSocket:
    """An MQTT 3.1.1 session over TLS, CONNACK accepted."""
    raw = socket.create_connection(("127.0.0.1", split.port), timeout=10)
    tls = ctx.wrap_socket(raw, server_hostname="localhost")
    tls.sendall(bytes([0x10, 16, 0, 4]) + b"MQTT" + bytes([4, 2, 0, 30, 0, 4]) + b"test")
    assert _read(tls, 4) == b"\x20\x02\x00\x00"
    return tls


def _read(tls: ssl.SSLSocket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = tls.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def _remaining_length(n: int) -> bytes:
    out = bytearray()
    while True:
        n, digit = divmod(n, 128)
        out.append(digit | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _publish_qos1(tls: ssl.SSLSocket, topic: str, payload: bytes, mid: int) -> None:
    body = len(topic).to_bytes(2, "big") + topic.encode() + mid.to_bytes(2, "big") + payload
    tls.sendall(bytes([0x32]) + _remaining_length(len(body)) + body)


def test_the_broker_runs_as_its_own_account_with_only_its_own_files(split: Split) -> None:
    # Prepare
    with logs_on_failure(*split.logs):
        status = Path(f"/proc/{split.mosquitto_pid()}/status").read_text()
    uid = int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])
    try:
        expected = pwd.getpwnam(BROKER_ACCOUNT).pw_uid if os.geteuid() == 0 else os.geteuid()
    except KeyError:
        expected = os.geteuid()

    # Assert: Mosquitto is not root (when started as root and the account exists) ...
    assert uid == expected
    # ... the hub's side shares only the broker's files, never the CA key or the signing key ...
    assert sorted(p.name for p in split.shared.iterdir()) == sorted(SHARED_FILES)
    assert _mode(split.shared) == 0o700 and {_mode(p) for p in split.shared.iterdir()} == {0o600}
    # ... and the broker reads its own copies: a 0700 directory of 0600 files owned by its account
    tls = split.broker_dir / "tls"
    assert sorted(p.name for p in tls.iterdir()) == sorted(TLS_FILES)
    assert _mode(tls) == 0o700 and {_mode(p) for p in tls.iterdir()} == {0o600}
    assert {p.stat().st_uid for p in (tls, *tls.iterdir(), split.broker_dir / "acl", split.broker_dir / "mosquitto.conf")} == {expected}
    assert (tls / "broker.key").read_bytes() == (split.pki / "broker.key").read_bytes()
    config = (split.broker_dir / "mosquitto.conf").read_text()
    assert "ca.key" not in config and str(split.pki) not in config


def test_the_broker_gets_the_hard_open_file_limit(split: Split) -> None:
    # Prepare: the wrapper was started with a low soft limit
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= LOW_SOFT_NOFILE:
        pytest.skip("the hard open-file limit is no higher than the low soft one")

    # Execute
    limits = Path(f"/proc/{split.mosquitto_pid()}/limits").read_text()

    # Assert: Mosquitto's soft limit is the hard one, and the log says how many connections that allows
    fields = next(line for line in limits.splitlines() if line.startswith("Max open files")).split()
    assert fields[3] == fields[4], limits
    assert int(fields[3]) > LOW_SOFT_NOFILE
    assert "connections" in split.logs[1].read_text()


def test_tls12_with_cbc_and_sha1_suites_is_refused_and_aead_accepted(split: Split) -> None:
    # Execute / Assert: a TLS 1.2 client offering only CBC suites with SHA-1 MACs gets no session
    with pytest.raises(ssl.SSLError):
        _connect(split, _context(split.pki, ciphers="AES128-SHA:ECDHE-ECDSA-AES128-SHA:@SECLEVEL=0", tls12=True))
    # TLS 1.2 with an AEAD ECDHE suite is accepted, and TLS 1.3 is what a default client gets
    with _connect(split, _context(split.pki, ciphers="ECDHE-ECDSA-AES128-GCM-SHA256", tls12=True)) as tls:
        assert tls.version() == "TLSv1.2"
    with _connect(split, _context(split.pki)) as tls:
        assert tls.version() == "TLSv1.3"


def test_a_publish_larger_than_the_packet_limit_disconnects_its_sender(split: Split) -> None:
    # Prepare
    topic = "synergy/v1/nodes/n1/events"
    with _connect(split, _context(split.pki)) as tls:
        # a message of the largest size any channel allows goes through (a split-inference frame)
        _publish_qos1(tls, topic, bytes(MAX_FRAME_BYTES), mid=1)
        assert _read(tls, 4) == b"\x40\x02\x00\x01"  # PUBACK

        # Execute: one over the broker's packet limit (the broker may close the connection while it is sent)
        try:
            _publish_qos1(tls, topic, bytes(DEFAULT_MAX_PACKET_BYTES), mid=2)
            answer = _read(tls, 4)
        except (ConnectionError, ssl.SSLError):
            answer = b""

        # Assert: no PUBACK, the connection is closed
        assert answer == b""
    assert max(MAX_MESSAGE_BYTES, MAX_FRAME_BYTES) < DEFAULT_MAX_PACKET_BYTES <= max(MAX_MESSAGE_BYTES, MAX_FRAME_BYTES) + 64 * 1024


def test_a_crl_signed_again_by_the_hub_reaches_the_broker_which_reloads(split: Split) -> None:
    # Prepare: the hub's CA, and the hub's identity that connects today
    ca = CertificateAuthority.load_or_create(split.pki)
    serial = format(x509.load_pem_x509_certificate((split.pki / "hub.crt").read_bytes()).serial_number, "x")
    _connect(split, _context(split.pki)).close()

    def refused() -> bool:
        try:
            _connect(split, _context(split.pki)).close()
        except (ssl.SSLError, OSError, AssertionError):
            return True
        return False

    with logs_on_failure(*split.logs):
        try:
            # Execute: the hub signs a CRL that revokes it
            ca.write_crl([(serial, dt.datetime.now(dt.UTC))])

            # Assert: the new CRL reaches the broker's own copy, and the reloaded broker refuses the certificate
            wait_for(lambda: (split.broker_dir / "tls" / "crl.pem").read_bytes() == (split.pki / "crl.pem").read_bytes(), 60,
                     what="the broker's copy of the CRL")  # fmt: skip
            wait_for(refused, 60, interval=0.2, what="the revoked certificate refused")
        finally:
            # the CRL signed again without it: accepted again
            ca.write_crl([])
            wait_for(lambda: not refused(), 60, interval=0.2, what="the certificate accepted again")
