"""An algorithm's package as one file: a zip of its sources with ``algorithm.json`` at the root.

``build`` is deterministic (entries sorted, every timestamp 1980-01-01, fixed permissions, no ``__pycache__``, ``dist``,
``*.pyc`` or hidden files), so the same sources give the same bytes and the same SHA-256; it refuses a folder
whose manifest does not validate. ``unpack`` refuses what could write outside its destination: absolute names,
``..``, symbolic links, and names that repeat.
"""

from __future__ import annotations

import stat
import zipfile
from pathlib import Path, PurePosixPath

from device.algorithm.client import AlgorithmError
from device.algorithm.loader import read_manifest
from interfaces.algorithms import MANIFEST_NAME, leaves_package

_EPOCH = (1980, 1, 1, 0, 0, 0)
_SKIPPED_DIRS = {"__pycache__", "dist", ".git", ".mypy_cache", ".pytest_cache"}
MAX_UNPACKED_BYTES = 1 << 30


def _sources(source_dir: Path) -> list[Path]:
    found = []
    for path in sorted(source_dir.rglob("*")):
        parts = path.relative_to(source_dir).parts
        if any(p in _SKIPPED_DIRS or p.startswith(".") for p in parts) or path.suffix in {".pyc", ".pyo"}:
            continue
        if path.is_symlink():
            raise AlgorithmError(f"{path} is a symbolic link; a package holds plain files only")
        if path.is_file():
            found.append(path)
    return found


def build(source_dir: Path, out_dir: Path) -> Path:
    """Writes ``<name>-<version>.zip`` into ``out_dir`` and returns its path."""
    source_dir = Path(source_dir)
    manifest = read_manifest(source_dir)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"{manifest.name}-{manifest.version}.zip"
    resolved_target = target.resolve()
    with zipfile.ZipFile(target, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for path in _sources(source_dir):
            if path.resolve() == resolved_target:
                continue
            info = zipfile.ZipInfo(path.relative_to(source_dir).as_posix(), date_time=_EPOCH)
            info.external_attr = (stat.S_IFREG | 0o644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, path.read_bytes())
    return target


def _checked_name(info: zipfile.ZipInfo) -> PurePosixPath:
    name = PurePosixPath(info.filename)
    if leaves_package(info.filename):
        raise AlgorithmError(f"the package entry {info.filename!r} points outside the package")
    if stat.S_ISLNK(info.external_attr >> 16):
        raise AlgorithmError(f"the package entry {info.filename!r} is a symbolic link")
    return name


def unpack(zip_path: Path, dest: Path) -> Path:
    """Extracts the package into ``dest`` (which must not exist or be empty) and returns ``dest``."""
    dest = Path(dest)
    try:
        archive = zipfile.ZipFile(zip_path)
    except (zipfile.BadZipFile, OSError) as exc:
        raise AlgorithmError(f"{zip_path} is not a zip package: {exc}") from None
    with archive:
        infos = archive.infolist()
        names = [_checked_name(info) for info in infos]
        if len(set(names)) != len(names):
            raise AlgorithmError(f"{zip_path} names one entry twice")
        if PurePosixPath(MANIFEST_NAME) not in names:
            raise AlgorithmError(f"{zip_path} has no {MANIFEST_NAME} at its root")
        if sum(info.file_size for info in infos) > MAX_UNPACKED_BYTES:
            raise AlgorithmError(f"{zip_path} unpacks to more than {MAX_UNPACKED_BYTES} bytes")
        dest.mkdir(parents=True, exist_ok=True)
        if any(dest.iterdir()):
            raise AlgorithmError(f"{dest} is not empty")
        for info, name in zip(infos, names, strict=True):
            target = dest.joinpath(*name.parts)
            if info.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(info) as source, open(target, "xb") as out:
                while chunk := source.read(1 << 20):
                    out.write(chunk)
    return dest
