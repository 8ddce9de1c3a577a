"""Applications: ``<root>/<name>/<version>/`` holds each unpacked version, ``<root>/<name>/current`` the
symlink to the one that runs, switched atomically (a new link renamed over the old one).

A tar.gz or zip archive is unpacked (members with absolute paths, ``..``, links or devices, more than
``MAX_APP_MEMBERS`` members or more than ``MAX_APP_UNPACKED_BYTES`` once unpacked are refused before
anything is written; a refused or failed unpack leaves nothing behind); any other format is kept as one
file in the version directory. The current and the previous version are kept, older ones removed.
"""

from __future__ import annotations

import logging
import os
import shutil
import tarfile
import zipfile
import zlib
from pathlib import Path, PurePosixPath

from interfaces.deployments import ArtifactFormat

log = logging.getLogger("aisynergy.device.ota")

MAX_APP_MEMBERS = 10_000
MAX_APP_UNPACKED_BYTES = 1024 * 1024 * 1024


class AppInstallError(Exception):
    """The archive is unsafe or cannot be unpacked (the execution is FAILED; the current version stays)."""


def _check_member(name: str) -> None:
    path = PurePosixPath(name.replace("\\", "/"))
    if path.is_absolute() or ".." in path.parts or (path.parts and ":" in path.parts[0]):
        raise AppInstallError(f"unsafe archive member {name!r}")


class _Budget:
    """Counts members and unpacked bytes against the limits."""

    def __init__(self, max_members: int, max_bytes: int) -> None:
        self.max_members, self.max_bytes = max_members, max_bytes
        self.members = self.bytes = 0

    def add(self, name: str, size: int) -> None:
        self.members += 1
        self.bytes += max(0, size)
        if self.members > self.max_members:
            raise AppInstallError(f"the archive has more than {self.max_members} members")
        if self.bytes > self.max_bytes:
            raise AppInstallError(f"the archive unpacks to more than {self.max_bytes} bytes (at {name!r})")


def _unpack(archive: Path, fmt: ArtifactFormat, into: Path, file_name: str, max_members: int, max_bytes: int) -> None:
    budget = _Budget(max_members, max_bytes)
    if fmt is ArtifactFormat.TAR_GZ:
        with tarfile.open(archive, "r:gz") as tar:
            members = []
            for m in tar:  # one header at a time: a count over the limit stops the reading there
                _check_member(m.name)
                if not (m.isfile() or m.isdir()):
                    raise AppInstallError(f"archive member {m.name!r} is not a plain file or directory")
                budget.add(m.name, m.size if m.isfile() else 0)
                members.append(m)
            tar.extractall(into, members=members, filter="data")
    elif fmt is ArtifactFormat.ZIP:
        with zipfile.ZipFile(archive) as zf:
            for info in zf.infolist():
                _check_member(info.filename)
                budget.add(info.filename, info.file_size)  # zipfile stops each member at its stated size
            zf.extractall(into)
    else:
        shutil.copyfile(archive, into / file_name)


def current_version(root: Path, name: str) -> str | None:
    link = root / name / "current"
    return os.readlink(link) if link.is_symlink() else None


def install_app(
    root: Path, name: str, version: str, fmt: ArtifactFormat, archive: Path,
    max_members: int = MAX_APP_MEMBERS, max_bytes: int = MAX_APP_UNPACKED_BYTES,
) -> Path:  # fmt: skip
    """Unpack ``archive`` as ``<root>/<name>/<version>`` and point ``current`` at it; returns the directory."""
    app_dir = root / name
    app_dir.mkdir(parents=True, exist_ok=True)
    staging = app_dir / f".{version}.staging"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        _unpack(archive, fmt, staging, f"{name}.{fmt.value}", max_members, max_bytes)
    except BaseException as exc:  # nothing half-unpacked stays, whatever stopped it
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(exc, AppInstallError) or not isinstance(exc, (tarfile.TarError, zipfile.BadZipFile, OSError, ValueError, EOFError, zlib.error)):
            raise
        raise AppInstallError(f"cannot unpack {archive.name}: {exc}") from exc
    previous = current_version(root, name)
    target = app_dir / version
    if target.exists():  # the same version again (a reinstall): replace it, the link is switched below
        shutil.rmtree(target)
    os.rename(staging, target)
    link_tmp = app_dir / ".current.tmp"
    link_tmp.unlink(missing_ok=True)
    os.symlink(version, link_tmp)
    os.replace(link_tmp, app_dir / "current")
    for old in app_dir.iterdir():
        if old.is_dir() and not old.is_symlink() and old.name not in (version, previous) and not old.name.startswith("."):
            shutil.rmtree(old, ignore_errors=True)
    log.info("application %s %s installed (was %s)", name, version, previous or "none")
    return target
