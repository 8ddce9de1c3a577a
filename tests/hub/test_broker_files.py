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
