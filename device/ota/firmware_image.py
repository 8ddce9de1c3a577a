"""The firmware image format: read, check and unpack (``aisynergy firmware build`` writes it).

An image is a gzip-compressed tar with ``firmware.json`` at its root and the payload beside it::

    firmware.json      {"name": "sensor-fw", "version": "1.1.0", "board": "rpi4",
                        "health": {"argv": ["python3", "health.py"], "timeout_s": 10},
                        "files": {"app/sensor.py": {"sha256": "9f2c...", "size": 1302}, ...}}
    health.py          the health check run in the new slot before it is committed
    app/...            what the agent loads when it boots from the slot

``files`` is written by ``build``: the SHA-256 and size of every regular file of the image but
``firmware.json`` itself (directories and links carry no content of their own).

Reading refuses, before anything is written: absolute member names, ``..``, links that point outside the
image (each followed through the image's other links, as the unpacked tree would resolve it, in whatever
order they come; a loop of links too), members under a link, hard links to a member that is not there,
device files and FIFOs, repeated names, more than ``MAX_MEMBERS`` members, more than ``MAX_UNPACKED_BYTES``
once unpacked, an image file larger than ``MAX_IMAGE_BYTES`` and a ``firmware.json`` that
:class:`FirmwareInfo` does not accept. It also reads the
whole archive, every member to its end and the gzip stream to its trailer, so a corrupt or truncated
stream (a CRC or length error, a deflate error, a short member) is refused, as is anything but zeros after
the tar's end marker (where the reader would otherwise stop early without a word). Then every regular file
must have the size and SHA-256 that ``files`` records, and ``files`` must list exactly the image's regular
files. An image built before per-file digests has no ``files``: it is accepted on the archive check alone
(the gzip CRC-32 covers every byte of the tar), so that a rollback to an older firmware still installs;
:attr:`ImageContents.digests_recorded` says which kind it is. A refused image raises :class:`ImageError`
(a :class:`~device.ota.verify.VerificationError`: the target REJECTS it).
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import tarfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from device.ota.verify import VerificationError
from interfaces.deployments import ArtifactName, Sha256, Version

FIRMWARE_JSON = "firmware.json"
MAX_IMAGE_BYTES = 256 * 1024 * 1024
MAX_UNPACKED_BYTES = 1024 * 1024 * 1024
MAX_MEMBERS = 10_000
MAX_FIRMWARE_JSON_BYTES = 4 * 1024 * 1024  # room for ``files`` of MAX_MEMBERS entries
MAX_PATH_CHARS = 1024
CHUNK = 256 * 1024
DAMAGED = (tarfile.TarError, OSError, EOFError, zlib.error)  # gzip's CRC and length errors are OSErrors


class ImageError(VerificationError):
    """The file is not a valid firmware image, or it holds a member that could escape its slot."""


class HealthCheck(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    argv: list[Annotated[str, Field(min_length=1, max_length=1024)]] = Field(
        min_length=1, max_length=64, description="run in the unpacked slot; exit 0 = healthy. argv[0] python3/python: the agent's interpreter"
    )
    timeout_s: float = Field(default=10, gt=0, le=3600)


class FileDigest(BaseModel):
    """What ``build`` recorded of one regular file of the image."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    sha256: Sha256
    size: int = Field(ge=0, le=MAX_UNPACKED_BYTES)


class FirmwareInfo(BaseModel):
    """``firmware.json``: what the image is, what it holds and how the device checks it after booting it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: ArtifactName
    version: Version
    board: Annotated[str, Field(min_length=1, max_length=128)] | None = None
    health: HealthCheck
    files: dict[Annotated[str, Field(min_length=1, max_length=MAX_PATH_CHARS)], FileDigest] | None = Field(
        default=None, max_length=MAX_MEMBERS, description="member path -> digest of every regular file; written by build; None: an older image"
    )


@dataclass(frozen=True)
class Member:
    name: str
    type: str  # file | dir | symlink | hardlink
    size: int
    mode: int
    link: str | None = None
    sha256: str | None = None  # a regular file's, as read from the image


@dataclass(frozen=True)
class ImageContents:
    info: FirmwareInfo
    members: list[Member]

    @property
    def unpacked_size(self) -> int:
        return sum(m.size for m in self.members)

    @property
    def digests_recorded(self) -> bool:
        """``firmware.json`` lists the files' digests (and they matched); False: an image built before them."""
        return self.info.files is not None


def read_image(path: Path) -> ImageContents:
    """``firmware.json`` and the member list, after every check in the module docstring (the whole image is read)."""
    with _open(path) as tar:
        return _check(tar)


def unpack_image(path: Path, dest: Path) -> FirmwareInfo:
    """Check the whole image, then write its members under ``dest`` (which must not exist yet); files are
    fsynced, and each one's SHA-256 is checked again as it is written (the checked file is what lands)."""
    with _open(path) as tar:
        contents = _check(tar)
        digests = {m.name: m.sha256 for m in contents.members if m.type == "file"}
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
                    written = _copy_stream(source, out)
                    out.flush()
                    os.fsync(out.fileno())
                if written != digests[member.name]:
                    raise ImageError(f"the member {member.name!r} changed between the check and the unpack")
                os.chmod(target, 0o755 if member.mode & 0o100 else 0o644)
        fsync_tree(dest)
        return contents.info


def _copy_stream(source: IO[bytes], out: IO[bytes]) -> str:
    """Copy ``source`` to ``out``; the SHA-256 of what was copied."""
    digest = hashlib.sha256()
    while chunk := source.read(CHUNK):
        digest.update(chunk)
        out.write(chunk)
    return digest.hexdigest()


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
    except DAMAGED as exc:
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
            total += member.size
            if total > MAX_UNPACKED_BYTES:
                raise ImageError(f"the image unpacks to more than {MAX_UNPACKED_BYTES} bytes")
            if member.name == FIRMWARE_JSON:
                info, raw = _firmware_json(tar, tarinfo)
                member = replace(member, sha256=hashlib.sha256(raw).hexdigest())
            elif member.type == "file":
                member = replace(member, sha256=_sha256_member(tar, tarinfo))
            members.append(member)
        _read_to_the_end(tar)
    except DAMAGED as exc:
        raise ImageError(f"the image is damaged (corrupt or truncated): {exc}") from exc
    if info is None:
        raise ImageError(f"the image has no {FIRMWARE_JSON} at its root")
    _check_links(members)
    _check_files(info, members)
    return ImageContents(info, members)


MAX_LINK_HOPS = 40  # as Linux's MAXSYMLINKS


def _check_links(members: list[Member]) -> None:
    """Every symbolic link, followed through the image's other links as the file system would once unpacked
    (whatever their order in the archive), stays inside the image; and no member lies under a link."""
    links = {m.name: m.link or "" for m in members if m.type == "symlink"}
    for m in members:
        parents = m.name.split("/")[:-1]
        if any("/".join(parents[: i + 1]) in links for i in range(len(parents))):
            raise ImageError(f"the member {m.name!r} lies under a symbolic link")
    for name, target in links.items():
        _resolve_link(name, target, links)


def _resolve_link(name: str, target: str, links: dict[str, str]) -> list[str]:
    """The path (components below the image root) that the link ``name -> target`` reaches; ImageError when it
    climbs out of the image on the way or loops."""
    where = name.split("/")[:-1]
    pending = target.split("/")
    hops = 0
    while pending:
        part = pending.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            if not where:
                raise ImageError(f"the link {name!r} points outside the image ({target!r}, followed through the image's links)")
            where.pop()
            continue
        path = "/".join([*where, part])
        if path in links:
            hops += 1
            if hops > MAX_LINK_HOPS:
                raise ImageError(f"the link {name!r} does not resolve (a loop of links)")
            if links[path].startswith("/"):
                raise ImageError(f"the link {name!r} points outside the image (through {path!r})")
            pending = links[path].split("/") + pending
            continue
        where.append(part)
    return where


def _sha256_member(tar: tarfile.TarFile, tarinfo: tarfile.TarInfo) -> str:
    """Read a regular file's content to its end: its SHA-256 (a short or corrupt member raises)."""
    source = tar.extractfile(tarinfo)
    assert source is not None
    digest, size = hashlib.sha256(), 0
    with source:
        while chunk := source.read(CHUNK):
            digest.update(chunk)
            size += len(chunk)
    if size != tarinfo.size:
        raise ImageError(f"the member {tarinfo.name!r} has {size} bytes; its header says {tarinfo.size}")
    return digest.hexdigest()


def _read_to_the_end(tar: tarfile.TarFile) -> None:
    """Decompress what follows the tar's end marker up to the gzip trailer, so that its CRC and length are checked."""
    stream = tar.fileobj
    assert stream is not None
    while chunk := stream.read(CHUNK):
        if chunk.count(0) != len(chunk):
            raise ImageError("the image is damaged: it holds data after the end of its archive (a broken header ends a tar early)")


def _check_files(info: FirmwareInfo, members: list[Member]) -> None:
    """Every regular file has the digest ``firmware.json`` records, and ``files`` lists exactly them."""
    if info.files is None:
        return  # built before per-file digests: the archive check is all there is (module docstring)
    found = {m.name: m for m in members if m.type == "file" and m.name != FIRMWARE_JSON}
    for name, recorded in sorted(info.files.items()):
        member = found.get(name)
        if member is None:
            raise ImageError(f"{FIRMWARE_JSON} lists {name!r}, which is not a regular file of the image")
        if member.size != recorded.size:
            raise ImageError(f"the member {name!r} has {member.size} bytes; {FIRMWARE_JSON} records {recorded.size}")
        if member.sha256 != recorded.sha256:
            raise ImageError(f"the member {name!r} does not match {FIRMWARE_JSON}: SHA-256 {member.sha256} != recorded {recorded.sha256}")
    unlisted = sorted(found.keys() - info.files.keys())
    if unlisted:
        more = f" (and {len(unlisted) - 1} more)" if len(unlisted) > 1 else ""
        raise ImageError(f"the file {unlisted[0]!r}{more} is not listed in the files of {FIRMWARE_JSON}")


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


def _firmware_json(tar: tarfile.TarFile, tarinfo: tarfile.TarInfo) -> tuple[FirmwareInfo, bytes]:
    if not tarinfo.isreg():
        raise ImageError(f"{FIRMWARE_JSON} is not a regular file")
    if tarinfo.size > MAX_FIRMWARE_JSON_BYTES:
        raise ImageError(f"{FIRMWARE_JSON} is larger than {MAX_FIRMWARE_JSON_BYTES} bytes")
    source = tar.extractfile(tarinfo)
    assert source is not None
    with source:
        raw = source.read()
    if len(raw) != tarinfo.size:
        raise ImageError(f"{FIRMWARE_JSON} has {len(raw)} bytes; its header says {tarinfo.size}")
    try:
        return FirmwareInfo.model_validate_json(raw), raw
    except ValidationError as exc:
        raise ImageError(f"{FIRMWARE_JSON} is not valid: {exc}") from exc
