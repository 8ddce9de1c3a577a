"""Build and sign firmware images (the format itself: :mod:`device.ota.firmware_image`, which also reads them).

The build is deterministic: ``firmware.json`` first, then the other members sorted by path, every one with
mtime 0, uid/gid 0, no user or group names, mode 0755 (directories, owner-executable files) or 0644, and a
gzip header without a name or a time. The same source gives the same bytes (with the same zlib), which a
binary delta between two versions needs; for deltas that hold only what changed, build with
``compress_level`` 0 (see :func:`build_image`). The ``firmware.json`` written records the SHA-256 and size
of every other file (``files``), which the device checks before it writes a slot.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import json
import os
import tarfile
from datetime import UTC, datetime
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import ValidationError

from device.ota.firmware_image import FIRMWARE_JSON, FileDigest, FirmwareInfo, ImageContents, ImageError, read_image
from device.ota.verify import sha256_file, verify_content
from interfaces.deployments import ArtifactFormat, ArtifactKind, ArtifactManifest, SignedManifest, manifest_signing_bytes

SKIPPED = frozenset({"__pycache__", ".DS_Store", ".git"})


class BuildError(ValueError):
    """The source directory cannot become an image."""


def build_image(src: Path, out: Path, *, name: str | None = None, version: str | None = None, compress_level: int = 9) -> FirmwareInfo:
    """Pack ``src`` (holding ``firmware.json``) into the image ``out``; ``name``/``version`` override firmware.json.

    The ``files`` of the ``firmware.json`` written are the SHA-256 and size of every file packed (``files`` in
    the source, as in an unpacked slot, is replaced). The image is read back as the device reads it before it
    replaces ``out``: a file that changed while it was packed is a :class:`BuildError`, and no image is left.
    ``compress_level`` 0 stores the tar uncompressed inside the gzip: a larger image, but a binary delta
    between two versions then holds only what changed (a change early in a compressed stream alters all of it).
    """
    try:
        info = FirmwareInfo.model_validate_json((src / FIRMWARE_JSON).read_bytes())
        if name is not None or version is not None:
            info = FirmwareInfo.model_validate({**info.model_dump(), **({"name": name} if name else {}), **({"version": version} if version else {})})
    except OSError as exc:
        raise BuildError(f"cannot read {src / FIRMWARE_JSON}: {exc}") from exc
    except ValidationError as exc:
        raise BuildError(f"{src / FIRMWARE_JSON} is not valid: {exc}") from exc
    paths = _walk(src)
    files = {path.relative_to(src).as_posix(): _digest(path) for path in paths if path.is_file()}
    try:
        info = FirmwareInfo.model_validate({**info.model_dump(exclude={"files"}), "files": files})
    except ValidationError as exc:
        raise BuildError(f"{src} cannot be described in {FIRMWARE_JSON}: {exc}") from exc
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        _pack(src, paths, info, files, tmp, compress_level)
        read_image(tmp)  # what the device will accept, checked here rather than on the device
    except ImageError as exc:
        tmp.unlink(missing_ok=True)
        raise BuildError(f"the image built from {src} does not check out (did a file change while it was packed?): {exc}") from exc
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise BuildError(f"cannot pack {src} into {out}: {exc}") from exc
    os.replace(tmp, out)
    return info


def _pack(src: Path, paths: list[Path], info: FirmwareInfo, files: dict[str, FileDigest], tmp: Path, compress_level: int) -> None:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        header = (json.dumps(info.model_dump(mode="json", exclude_none=True), indent=2, sort_keys=True) + "\n").encode()
        tar.addfile(_tarinfo(FIRMWARE_JSON, tarfile.REGTYPE, len(header), 0o644), io.BytesIO(header))
        for path in paths:
            rel = path.relative_to(src).as_posix()
            if path.is_dir():
                tar.addfile(_tarinfo(rel, tarfile.DIRTYPE, 0, 0o755))
            else:
                mode = 0o755 if path.stat().st_mode & 0o100 else 0o644
                with path.open("rb") as f:
                    tar.addfile(_tarinfo(rel, tarfile.REGTYPE, files[rel].size, mode), f)  # the size that was hashed
    with open(tmp, "wb") as f, gzip.GzipFile(filename="", mode="wb", fileobj=f, compresslevel=compress_level, mtime=0) as gz:
        gz.write(raw.getvalue())


def _digest(path: Path) -> FileDigest:
    try:
        return FileDigest(sha256=sha256_file(path), size=path.stat().st_size)
    except OSError as exc:
        raise BuildError(f"cannot read {path}: {exc}") from exc


def _walk(src: Path) -> list[Path]:
    found: list[Path] = []
    for path in sorted(src.rglob("*"), key=lambda p: p.relative_to(src).as_posix()):
        rel = path.relative_to(src)
        if rel.as_posix() == FIRMWARE_JSON or SKIPPED.intersection(rel.parts) or path.suffix == ".pyc":
            continue
        if path.is_symlink() or not (path.is_dir() or path.is_file()):
            raise BuildError(f"{path} is a link or a special file; an image holds only files and directories")
        found.append(path)
    return found


def _tarinfo(name: str, type: bytes, size: int, mode: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.size, info.mode = type, size, mode
    info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
    return info


# ---- signing ---------------------------------------------------------------------------------------


def generate_key() -> tuple[bytes, bytes]:
    """A new Ed25519 key: (private PKCS8 PEM, public SubjectPublicKeyInfo PEM)."""
    key = Ed25519PrivateKey.generate()
    return _private_pem(key), _public_pem(key.public_key())


def load_private_key(pem: bytes) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"not an unencrypted PKCS8 PEM private key: {exc}") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError("the signing key is not an Ed25519 key")  # noqa: TRY004 - a wrong key is a bad value to the CLI
    return key


def key_id(public_key: Ed25519PublicKey) -> str:
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def sign_image(image: Path, key: Ed25519PrivateKey, *, created_at: datetime | None = None) -> SignedManifest:
    """The signed manifest of ``image`` (kind and format ``firmware``; name and version from firmware.json)."""
    contents = read_image(image)
    manifest = ArtifactManifest(
        name=contents.info.name,
        version=contents.info.version,
        kind=ArtifactKind.FIRMWARE,
        format=ArtifactFormat.FIRMWARE,
        sha256=sha256_file(image),
        size=image.stat().st_size,
        created_at=created_at or datetime.now(UTC).replace(microsecond=0),
    )
    signature = key.sign(manifest_signing_bytes(manifest))
    return SignedManifest(manifest=manifest, signature=base64.b64encode(signature).decode(), key_id=key_id(key.public_key()))


def check_signed_file(image: Path, signed: SignedManifest) -> None:
    """The image file is the one ``signed`` describes (kind, format, size, SHA-256; after its signature was
    verified), or ImageError/VerificationError. What it holds is checked by :func:`read_image` and :func:`check_identity`."""
    manifest = signed.manifest
    if manifest.kind is not ArtifactKind.FIRMWARE or manifest.format is not ArtifactFormat.FIRMWARE:
        raise ImageError(f"the manifest is for a {manifest.kind} in format {manifest.format}")
    verify_content(signed, image)


def check_identity(contents: ImageContents, signed: SignedManifest) -> None:
    """The image's firmware.json names the manifest's name and version, or ImageError."""
    manifest = signed.manifest
    if (contents.info.name, contents.info.version) != (manifest.name, manifest.version):
        raise ImageError(f"the image says {contents.info.name} {contents.info.version}; the manifest {manifest.name} {manifest.version}")


def _private_pem(key: Ed25519PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def _public_pem(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
