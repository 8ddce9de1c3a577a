"""Owner-only modes for what the hub keeps on disk: its data directory, PKI and artefacts 0700, its keys and its
SQLite database (with ``-wal``, ``-shm`` and ``-journal``) 0600.

New directories and files are made with these modes; ones left looser by an earlier version are tightened at
start, and each one tightened is logged. A mode is only ever narrowed: bits the owner lacks are not added.

The one exception: when the embedded broker's directory (``DATA_DIR/broker``) belongs to another account (the
broker drops from root to ``mosquitto``), that account must search the data directory to reach its own files,
so the data directory is ``0711``: searchable, not listable, and everything in it but the broker's own
directory is still owner-only.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("aisynergy.hub.files")

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600
SEARCH_ONLY_DIR = 0o711
SQLITE_SIDE_FILES = ("-wal", "-shm", "-journal")
KEY_SUFFIXES = (".key",)
EMBEDDED_BROKER_DIR = "broker"


def tighten(path: Path, mode: int) -> bool:
    """Narrow ``path``'s permission bits to at most ``mode``; ``True`` when they were wider (and it is logged)."""
    try:
        current = path.lstat().st_mode & 0o777
    except FileNotFoundError:
        return False
    if current & ~mode == 0:
        return False
    os.chmod(path, current & mode)
    log.warning("%s was mode %04o, readable beyond its owner; now %04o", path, current, current & mode)
    return True


def private_dir(path: Path, mode: int = PRIVATE_DIR) -> Path:
    """``path`` as a directory of mode ``mode`` (made if missing, narrowed if wider)."""
    path.mkdir(parents=True, exist_ok=True, mode=mode)
    tighten(path, mode)
    return path


def private_sqlite(database: Path) -> None:
    """The SQLite file made 0600 before SQLite opens it (SQLite gives ``-wal`` and ``-shm`` the database file's
    mode), in a 0700 directory when that has to be made; an existing one and its side files narrowed."""
    if not database.parent.exists():
        private_dir(database.parent)
    try:
        os.close(os.open(database, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE))  # an empty file is an empty database
    except FileExistsError:
        pass
    for path in (database, *(database.with_name(database.name + side) for side in SQLITE_SIDE_FILES)):
        tighten(path, PRIVATE_FILE)


def secure_data_dir(data_dir: Path, pki_dir: Path, blobs_dir: Path) -> None:
    """At the hub's start: the data directory, its PKI (keys 0600) and its artefact store owner-only."""
    broker_dir = data_dir / EMBEDDED_BROKER_DIR
    shared_with_broker = broker_dir.is_dir() and broker_dir.stat().st_uid != os.geteuid()
    private_dir(data_dir, SEARCH_ONLY_DIR if shared_with_broker else PRIVATE_DIR)
    private_dir(pki_dir)
    for path in pki_dir.iterdir():
        if path.is_file() and path.name.endswith(KEY_SUFFIXES):
            tighten(path, PRIVATE_FILE)
    private_dir(blobs_dir)
