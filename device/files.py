"""Crash-safe writes into the agent's data directory."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write ``data`` to ``path`` so that a reader sees the old file or the new one, never a torn one."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)  # O_CREAT's mode is filtered by the umask and ignored for an existing file
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself must survive a power cut
    finally:
        os.close(dir_fd)


MAX_SECRET_BYTES = 4096


def read_secret(path: Path, what: str) -> str:
    """A secret kept in a file (a bootstrap token: a command line is visible to every user of the machine), its
    surrounding whitespace stripped; ``ValueError`` when it is empty, too long or not text."""
    data = Path(path).read_bytes()[: MAX_SECRET_BYTES + 1]
    if len(data) > MAX_SECRET_BYTES:
        raise ValueError(f"{what} {path}: more than {MAX_SECRET_BYTES} bytes")
    try:
        secret = data.decode("ascii").strip()
    except UnicodeDecodeError:
        raise ValueError(f"{what} {path}: not ASCII text") from None
    if not secret or any(c.isspace() for c in secret):
        raise ValueError(f"{what} {path}: holds no token (one line, no spaces)")
    return secret
