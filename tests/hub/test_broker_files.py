"""The broker's files: private keys stay private, Mosquitto gets its own copies and nothing else (DESIGN §6)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from cloud.pki import CertificateAuthority


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_broker_key_is_written_private(tmp_path: Path) -> None:
    # Execute
    CertificateAuthority.load_or_create(tmp_path / "pki", broker_hosts=("broker",))

    # Assert: every key of the PKI, the broker's included, is 0600
    keys = sorted((tmp_path / "pki").glob("*.key"))
    assert {k.name for k in keys} >= {"ca.key", "broker.key", "hub.key"}
    assert {k.name: _mode(k) for k in keys} == {k.name: 0o600 for k in keys}


def test_an_older_readable_broker_key_is_made_private(tmp_path: Path) -> None:
    # Prepare: a PKI whose broker key an earlier version left 0644
    CertificateAuthority.load_or_create(tmp_path / "pki")
    key = tmp_path / "pki" / "broker.key"
    os.chmod(key, 0o644)
    before = key.read_bytes()

    # Execute
    CertificateAuthority.load_or_create(tmp_path / "pki")

    # Assert: the same key, now 0600
    assert key.read_bytes() == before
    assert _mode(key) == 0o600


def test_the_generated_config_bounds_packets_and_queues_and_allows_only_modern_tls(tmp_path: Path) -> None:
    from cloud.broker.config import BrokerLayout, render_config
    from interfaces.infer import MAX_FRAME_BYTES
    from interfaces.messages import MAX_MESSAGE_BYTES

    # Execute
    layout = BrokerLayout(tmp_path)
    lines = render_config(layout, "127.0.0.1", 8883, user="mosquitto").splitlines()
    settings = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in lines if line and not line.startswith("#")}

    # Assert: a packet holds the largest message of any channel (a split-inference frame) and its topic and
    # properties, no more
    largest = max(MAX_MESSAGE_BYTES, MAX_FRAME_BYTES)
    assert largest < int(settings["max_packet_size"]) <= largest + 64 * 1024
    # a client's queue is bounded in messages and in bytes
    assert int(settings["max_queued_messages"]) > 0
    assert 0 < int(settings["max_queued_bytes"]) <= 1024 * 1024 * 1024
    # TLS 1.2 at least; for 1.2 forward-secret AEAD suites only; the TLS 1.3 suites named
    assert settings["tls_version"].split()[0] == "tlsv1.2"
    suites = settings["ciphers"].split(":")
    assert suites and all(s.startswith("ECDHE-") and ("GCM" in s or "CHACHA20-POLY1305" in s) for s in suites)
    assert set(settings["ciphers_tls1.3"].split(":")) <= {"TLS_AES_256_GCM_SHA384", "TLS_CHACHA20_POLY1305_SHA256", "TLS_AES_128_GCM_SHA256"}
    # the broker runs as its own account and reads its own copies of its files, never the PKI directory
    assert settings["user"] == "mosquitto"
    for key in ("cafile", "certfile", "keyfile", "crlfile"):
        assert Path(settings[key]).parent == layout.tls_dir


def test_the_broker_account_is_its_own_unless_a_parent_is_closed_to_it(tmp_path: Path) -> None:
    import pwd
    import shutil
    import tempfile

    import pytest

    from cloud.broker.config import BrokerLayout
    from cloud.broker.runner import BROKER_ACCOUNT, broker_account

    if os.geteuid() != 0:
        assert broker_account(BrokerLayout(tmp_path)) is None  # a non-root user stays itself
        return
    try:
        account = pwd.getpwnam(BROKER_ACCOUNT)
    except KeyError:
        pytest.skip(f"no {BROKER_ACCOUNT} account")
    # Prepare: a data directory the account can reach (pytest's own are closed to other users), one below a closed one
    open_root = Path(tempfile.mkdtemp(prefix="aisynergy-broker-"))
    try:
        os.chmod(open_root, 0o711)
        (open_root / "closed").mkdir(mode=0o700)

        # Execute / Assert
        got = broker_account(BrokerLayout(open_root / "data"))
        assert got is not None and got.pw_uid == account.pw_uid != 0
        assert broker_account(BrokerLayout(open_root / "closed" / "data")) is None
    finally:
        shutil.rmtree(open_root)
