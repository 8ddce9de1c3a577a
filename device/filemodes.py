"""Owner-only modes for an agent's data directory (edge and device): the directory 0700, its key and its
enrolment record 0600. Made so, and narrowed at start when an earlier version left them wider (logged)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("aisynergy.files")

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600


def narrow_mode(path: Path, mode: int) -> bool:
    """Clear every permission bit of ``path`` outside ``mode``; ``True`` when some were set (it is logged)."""
    try:
        current = path.lstat().st_mode & 0o777
    except FileNotFoundError:
        return False
    if not current & ~mode:
        return False
    os.chmod(path, current & mode)
    log.warning("%s was mode %04o, open to other users; now %04o", path, current, current & mode)
    return True


def owner_only_dir(path: Path) -> Path:
    """``path`` as a 0700 directory: made if missing, narrowed if wider."""
    path.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR)
    narrow_mode(path, PRIVATE_DIR)
    return path
