"""The firmware image format: read, check and unpack (``aisynergy firmware build`` writes it).

An image is a gzip-compressed tar with ``firmware.json`` at its root and the payload beside it::

    firmware.json      {"name": "sensor-fw", "version": "1.1.0", "board": "rpi4",
                        "health": {"argv": ["python3", "health.py"], "timeout_s": 10}}
    health.py          the health check run in the new slot before it is committed
    app/...            what the agent loads when it boots from the slot

Reading refuses, before anything is written: absolute member names, ``..``, links that point outside the
image (or hard links to a member that is not there), device files and FIFOs, repeated names, more than
``MAX_MEMBERS`` members, more than ``MAX_UNPACKED_BYTES`` once unpacked, an image file larger than
``MAX_IMAGE_BYTES`` and a ``firmware.json`` that :class:`FirmwareInfo` does not accept. A refused image
raises :class:`ImageError` (a :class:`~device.ota.verify.VerificationError`: the target REJECTS it).
"""

from __future__ import annotations

import os
import posixpath
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from device.ota.verify import VerificationError
from interfaces.deployments import ArtifactName, Version

FIRMWARE_JSON = "firmware.json"
MAX_IMAGE_BYTES = 256 * 1024 * 1024
MAX_UNPACKED_BYTES = 1024 * 1024 * 1024
MAX_MEMBERS = 10_000
MAX_FIRMWARE_JSON_BYTES = 64 * 1024
CHUNK = 256 * 1024


class ImageError(VerificationError):
    """The file is not a valid firmware image, or it holds a member that could escape its slot."""


class HealthCheck(BaseModel):
    model_config = ConfigDict(extra="forbid")

    argv: list[Annotated[str, Field(min_length=1, max_length=1024)]] = Field(
        min_length=1, max_length=64, description="run in the unpacked slot; exit 0 = healthy. argv[0] python3/python: the agent's interpreter"
    )
    timeout_s: float = Field(default=10, gt=0, le=3600)


class FirmwareInfo(BaseModel):
    """``firmware.json``: what the image is and how the device checks it after booting it."""

    model_config = ConfigDict(extra="forbid")

    name: ArtifactName
    version: Version
    board: Annotated[str, Field(min_length=1, max_length=128)] | None = None
    health: HealthCheck


@dataclass(frozen=True)
class Member:
    name: str
    type: str  # file | dir | symlink | hardlink
    size: int
    mode: int
    link: str | None = None


@dataclass(frozen=True)
class ImageContents:
    info: FirmwareInfo
    members: list[Member]

    @property
    def unpacked_size(self) -> int:
        return sum(m.size for m in self.members)


def read_image(path: Path) -> ImageContents:
    """``firmware.json`` and the member list, after every check in the module docstring."""
    with _open(path) as tar:
        return _check(tar)


def unpack_image(path: Path, dest: Path) -> FirmwareInfo:
    """Check the image, then write its members under ``dest`` (which must not exist yet); files are fsynced."""
    with _open(path) as tar:
        contents = _check(tar)
        dest.mkdir(parents=True)
        for tarinfo in tar:  # a second pass over the same archive; gzip rewinds
            member = _member(tarinfo)
            target = dest / member.name
            if not target.parent.resolve().is_relative_to(dest.resolve()):
                raise ImageError(f"the member {member.name!r} would be written outside the slot")
            if member.type == "dir":
                target.mkdir(parents=True, exist_ok=True)
                os.chmod(target, 0o755)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            if member.type == "symlink":
                assert member.link is not None
                os.symlink(member.link, target)
            elif member.type == "hardlink":
                assert member.link is not None
                os.link(dest / member.link, target)
            else:
                source = tar.extractfile(tarinfo)
                assert source is not None
                with source, open(target, "xb") as out:
                    _copy_stream(source, out)
                    out.flush()
                    os.fsync(out.fileno())
                os.chmod(target, 0o755 if member.mode & 0o100 else 0o644)
        fsync_tree(dest)
        return contents.info


def _copy_stream(source: IO[bytes], out: IO[bytes]) -> None:
    while chunk := source.read(CHUNK):
        out.write(chunk)


def fsync_tree(root: Path) -> None:
    """fsync every directory under ``root`` (and ``root``), so the names written survive a power cut."""
    for directory, _, _ in os.walk(root):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _open(path: Path) -> tarfile.TarFile:
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise ImageError(f"cannot read the image {path}: {exc}") from exc
    if size > MAX_IMAGE_BYTES:
        raise ImageError(f"the image is {size} bytes; at most {MAX_IMAGE_BYTES} are accepted")
    try:
        return tarfile.open(path, mode="r:gz")
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise ImageError(f"not a gzip tar: {exc}") from exc


def _check(tar: tarfile.TarFile) -> ImageContents:
    members: list[Member] = []
    types: dict[str, str] = {}
    total = 0
    info: FirmwareInfo | None = None
    try:
        for tarinfo in _iterate(tar):
            member = _member(tarinfo)
            if member.name in types:
                raise ImageError(f"the member {member.name!r} appears twice")
            parents = member.name.split("/")[:-1]
            if any(types.get("/".join(parents[: i + 1])) == "symlink" for i in range(len(parents))):
                raise ImageError(f"the member {member.name!r} lies under a symbolic link")
            if member.type == "hardlink" and types.get(member.link or "") != "file":
                raise ImageError(f"the hard link {member.name!r} points at {member.link!r}, which is not an earlier regular file")
            types[member.name] = member.type
            members.append(member)
            total += member.size
            if total > MAX_UNPACKED_BYTES:
                raise ImageError(f"the image unpacks to more than {MAX_UNPACKED_BYTES} bytes")
            if member.name == FIRMWARE_JSON:
                info = _firmware_json(tar, tarinfo)
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise ImageError(f"the image is damaged: {exc}") from exc
    if info is None:
        raise ImageError(f"the image has no {FIRMWARE_JSON} at its root")
    return ImageContents(info, members)


def _iterate(tar: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    for count, tarinfo in enumerate(tar, start=1):
        if count > MAX_MEMBERS:
            raise ImageError(f"the image has more than {MAX_MEMBERS} members")
        yield tarinfo


def _member(tarinfo: tarfile.TarInfo) -> Member:
    name = _safe_name(tarinfo.name)
    if tarinfo.isdir():
        return Member(name, "dir", 0, tarinfo.mode)
    if tarinfo.isreg():
        return Member(name, "file", tarinfo.size, tarinfo.mode)
    if tarinfo.issym():
        target = tarinfo.linkname
        if not target or target.startswith("/") or "\\" in target:
            raise ImageError(f"the link {name!r} points outside the image ({target!r})")
        resolved = posixpath.normpath(posixpath.join(posixpath.dirname(name), target))
        if resolved == ".." or resolved.startswith("../"):
            raise ImageError(f"the link {name!r} points outside the image ({target!r})")
        return Member(name, "symlink", 0, tarinfo.mode, target)
    if tarinfo.islnk():
        return Member(name, "hardlink", 0, tarinfo.mode, _safe_name(tarinfo.linkname))
    raise ImageError(f"the member {name!r} is not a file, directory or link (device, FIFO, ...)")


def _safe_name(raw: str) -> str:
    if not raw or raw.startswith("/") or "\\" in raw or "\x00" in raw:
        raise ImageError(f"the member name {raw!r} is absolute or not a plain relative path")
    parts = [p for p in raw.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        raise ImageError(f"the member name {raw!r} is empty or climbs out of the image with '..'")
    return "/".join(parts)


def _firmware_json(tar: tarfile.TarFile, tarinfo: tarfile.TarInfo) -> FirmwareInfo:
    if not tarinfo.isreg():
        raise ImageError(f"{FIRMWARE_JSON} is not a regular file")
    if tarinfo.size > MAX_FIRMWARE_JSON_BYTES:
        raise ImageError(f"{FIRMWARE_JSON} is larger than {MAX_FIRMWARE_JSON_BYTES} bytes")
    source = tar.extractfile(tarinfo)
    assert source is not None
    with source:
        raw = source.read()
    try:
        return FirmwareInfo.model_validate_json(raw)
    except ValidationError as exc:
        raise ImageError(f"{FIRMWARE_JSON} is not valid: {exc}") from exc
