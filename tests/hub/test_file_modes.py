"""What the hub keeps on disk is its own: the data directory, PKI and artefacts 0700, keys and the SQLite
database with its ``-wal`` and ``-shm`` 0600, also when an earlier version left them open to other users."""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from cloud.filemodes import secure_data_dir
from tests.hub.conftest import hub_settings, running_hub
from tests.support import wait_for


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def open_umask() -> Iterator[None]:
    """The umask most systems start processes with: new files 0644, new directories 0755."""
    previous = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(previous)


def _private_paths(data_dir: Path) -> dict[Path, int]:
    pki = data_dir / "pki"
    keys = sorted(pki.glob("*.key"))
    assert {p.name for p in keys} >= {"ca.key", "signing.key"}
    db = data_dir / "hub.db"
    return {data_dir: 0o700, pki: 0o700, data_dir / "artifacts": 0o700, db: 0o600,
            db.with_name("hub.db-wal"): 0o600, db.with_name("hub.db-shm"): 0o600, **{k: 0o600 for k in keys}}  # fmt: skip


def test_a_new_hub_keeps_its_files_to_itself(tmp_path: Path, open_umask: None) -> None:
    # Prepare
    data_dir = tmp_path / "hub"
    settings = hub_settings(data_dir, f"sqlite:///{data_dir / 'hub.db'}")

    # Execute: the engine is open, so SQLite's -wal and -shm exist
    for _hub in running_hub(settings):
        modes = {path: _mode(path) for path in _private_paths(data_dir)}

    # Assert
    assert modes == _private_paths(data_dir)


def test_modes_an_earlier_version_left_open_are_narrowed_at_start(tmp_path: Path, open_umask: None, caplog: pytest.LogCaptureFixture) -> None:
    # Prepare: a data directory as an earlier version left it, everything readable by every user
    data_dir = tmp_path / "hub"
    settings = hub_settings(data_dir, f"sqlite:///{data_dir / 'hub.db'}")
    for _hub in running_hub(settings):
        pass
    # the last connection to close removes -wal and -shm (SQLite): once they are gone no connection of that hub
    # is left to remove the ones made below while the next one starts
    wait_for(lambda: not (data_dir / "hub.db-wal").exists() and not (data_dir / "hub.db-shm").exists(), 60, what="the first hub's connections closed")
    (data_dir / "hub.db-wal").touch()
    (data_dir / "hub.db-shm").touch()
    expected = _private_paths(data_dir)
    for path in expected:
        path.chmod(0o755 if path.is_dir() else 0o644)

    # Execute
    with caplog.at_level(logging.WARNING, logger="aisynergy.hub.files"):
        for _hub in running_hub(settings):
            modes = {path: _mode(path) for path in expected}

    # Assert
    assert modes == expected
    narrowed = {r.getMessage().split(" was mode ")[0] for r in caplog.records if " was mode " in r.getMessage()}
    assert narrowed == {str(p) for p in expected}


def test_a_database_outside_the_data_directory_is_made_0600_in_a_new_0700_directory(tmp_path: Path, open_umask: None) -> None:
    # Prepare
    db = tmp_path / "elsewhere" / "db" / "hub.db"
    settings = hub_settings(tmp_path / "hub", f"sqlite:///{db}")

    # Execute
    for _hub in running_hub(settings):
        modes = (_mode(db.parent), _mode(db), _mode(db.with_name("hub.db-wal")))

    # Assert
    assert modes == (0o700, 0o600, 0o600)


@pytest.mark.skipif(os.geteuid() != 0, reason="handing the broker's directory to another account needs root")
def test_a_data_directory_shared_with_the_embedded_broker_stays_searchable_for_it(tmp_path: Path, open_umask: None) -> None:
    # Prepare: `aisynergy up` as root: the broker's directory belongs to the broker's account
    data_dir = tmp_path / "hub"
    (data_dir / "broker").mkdir(parents=True)
    os.chown(data_dir / "broker", 65534, 65534)
    (data_dir / "pki").mkdir(mode=0o755)

    # Execute
    secure_data_dir(data_dir, data_dir / "pki", data_dir / "artifacts")

    # Assert: the broker's account can reach its directory, and list nothing
    assert _mode(data_dir) == 0o711
    assert (_mode(data_dir / "pki"), _mode(data_dir / "artifacts")) == (0o700, 0o700)
