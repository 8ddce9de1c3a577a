"""Checks against the hub's pinned Ed25519 key: signed manifests, content digests, download tokens.

Nothing is installed unless ``verify_manifest`` and ``verify_content`` both pass; an edge serves a cached
artefact only for a token that ``verify_download_token`` accepts (offline: no call to the hub).

``cryptography`` (about 8 MiB resident) is imported by the functions that use a key, not by this module: a device
boots its firmware slots and checks content digests (``verify_content``, ``sha256_file``) without it.
"""

from __future__ import annotations

import base64
import hashlib
import time
from pathlib import Path
from typing import TYPE_CHECKING

from interfaces.deployments import (
    DownloadGrant, SignedManifest, decode_download_token, download_token_signing_bytes, manifest_signing_bytes,
)  # fmt: skip

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

CHUNK = 1024 * 1024


class VerificationError(ValueError):
    """The artefact, manifest or token is not what the hub signed (the target REJECTS it)."""


def load_public_key(pem: str | bytes) -> Ed25519PublicKey:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    key = serialization.load_pem_public_key(pem.encode() if isinstance(pem, str) else pem)
    if not isinstance(key, Ed25519PublicKey):
        raise VerificationError("the pinned signing key is not an Ed25519 public key")
    return key


def key_id(key: Ed25519PublicKey) -> str:
    from cryptography.hazmat.primitives import serialization

    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def verify_manifest(key: Ed25519PublicKey, signed: SignedManifest) -> None:
    """The manifest was signed by the pinned key, or :class:`VerificationError`."""
    from cryptography.exceptions import InvalidSignature

    try:
        signature = base64.b64decode(signed.signature, validate=True)
    except ValueError as exc:
        raise VerificationError("the manifest signature is not base64") from exc
    try:
        key.verify(signature, manifest_signing_bytes(signed.manifest))
    except InvalidSignature as exc:
        raise VerificationError(f"bad signature on {signed.manifest.name} {signed.manifest.version} (key {signed.key_id}; pinned {key_id(key)})") from exc


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def verify_content(signed: SignedManifest, path: Path) -> None:
    """The file has the manifest's size and SHA-256, or :class:`VerificationError`."""
    size = path.stat().st_size
    if size != signed.manifest.size:
        raise VerificationError(f"size {size} != manifest size {signed.manifest.size}")
    digest = sha256_file(path)
    if digest != signed.manifest.sha256:
        raise VerificationError(f"SHA-256 {digest} != manifest {signed.manifest.sha256}")


def verify_download_token(key: Ed25519PublicKey, token: str, artifact_id: str, now: float | None = None) -> DownloadGrant:
    """The grant if the hub signed ``token`` for ``artifact_id`` and it has not expired."""
    from cryptography.exceptions import InvalidSignature

    try:
        grant, signature = decode_download_token(token)
    except ValueError as exc:
        raise VerificationError(str(exc)) from exc
    try:
        key.verify(signature, download_token_signing_bytes(grant))
    except InvalidSignature as exc:
        raise VerificationError("the download token's signature is not valid") from exc
    if grant.exp < (time.time() if now is None else now):
        raise VerificationError("the download token has expired")
    if grant.artifact_id != artifact_id:
        raise VerificationError("the download token is for another artefact")
    return grant
