"""Checks against the hub's pinned Ed25519 keys: signed manifests, content digests, download tokens.

Nothing is installed unless ``verify_manifest`` and ``verify_content`` both pass; an edge serves a cached
artefact only for a token that ``verify_download_token`` accepts (offline: no call to the hub).

``cryptography`` (about 8 MiB resident) is imported by the functions that use a key, not by this module: a device
boots its firmware slots and checks content digests (``verify_content``, ``sha256_file``) without it.
"""

from __future__ import annotations

import base64
import hashlib
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from interfaces.deployments import (
    MAX_KEY_TRANSITIONS, DownloadGrant, SignedKeyTransition, SignedManifest, decode_download_token,
    download_token_signing_bytes, key_transition_signing_bytes, manifest_signing_bytes,
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


class TrustedKeys:
    """The hub signing keys a target trusts, newest first: the one it pinned at enrolment, the retired ones the
    hub sent with it, and each key it came to trust by a transition signed by a key it already trusted (the
    hub's rotation, ``SignedManifest.key_transitions``). Stored as one PEM bundle (``identity/signing.pub``)."""

    MAX_KEYS = MAX_KEY_TRANSITIONS + 1

    def __init__(self, keys: Sequence[Ed25519PublicKey]) -> None:
        if not keys:
            raise VerificationError("no signing key")
        self.keys: tuple[Ed25519PublicKey, ...] = tuple(keys)[: self.MAX_KEYS]
        self._by_id = {key_id(k): k for k in self.keys}

    @classmethod
    def of(cls, keys: TrustedKeys | Ed25519PublicKey) -> TrustedKeys:
        return keys if isinstance(keys, TrustedKeys) else cls([keys])

    @classmethod
    def from_pem(cls, pem: str | bytes) -> TrustedKeys:
        """Every PUBLIC KEY block of ``pem`` (one or more), newest first."""
        text = pem.decode() if isinstance(pem, bytes) else pem
        blocks = _PEM_BLOCK.findall(text)
        if not blocks:
            raise VerificationError("no PEM public key")
        return cls([load_public_key(b) for b in blocks])

    def to_pem(self) -> str:
        from cryptography.hazmat.primitives import serialization

        return "".join(k.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode() for k in self.keys)

    @property
    def current(self) -> Ed25519PublicKey:
        return self.keys[0]

    def ids(self) -> list[str]:
        return list(self._by_id)

    def get(self, kid: str) -> Ed25519PublicKey | None:
        return self._by_id.get(kid)

    def merged(self, other: TrustedKeys) -> TrustedKeys:
        """These keys, then those of ``other`` not among them."""
        return TrustedKeys([*self.keys, *(k for kid, k in other._by_id.items() if kid not in self._by_id)])

    def following(self, transitions: Sequence[SignedKeyTransition]) -> TrustedKeys:
        """These keys plus each new key of ``transitions`` (oldest first) whose hand-over a trusted key signed;
        a transition from an unknown key is skipped (it names a key this target never trusted), a forged one
        from a trusted key is :class:`VerificationError`. ``self`` when nothing is new."""
        from cryptography.exceptions import InvalidSignature

        keys = self
        for signed in transitions:
            t = signed.transition
            old = keys.get(t.old_key_id)
            if old is None or keys.get(t.new_key_id) is not None:
                continue
            try:
                old.verify(base64.b64decode(signed.signature, validate=True), key_transition_signing_bytes(t))
            except (InvalidSignature, ValueError) as exc:
                raise VerificationError(f"the key transition {t.old_key_id} -> {t.new_key_id} is not signed by {t.old_key_id}") from exc
            new = load_public_key(t.new_public_key_pem)
            if key_id(new) != t.new_key_id:
                raise VerificationError(f"the key transition to {t.new_key_id} carries key {key_id(new)}")
            keys = TrustedKeys([new, *keys.keys])
        return keys


_PEM_BLOCK = re.compile(r"-----BEGIN PUBLIC KEY-----\s+[A-Za-z0-9+/=\s]+?-----END PUBLIC KEY-----\s*")


def verify_manifest(keys: TrustedKeys | Ed25519PublicKey, signed: SignedManifest) -> TrustedKeys:
    """The manifest was signed by a trusted key, or by one the manifest's key transitions lead to from a
    trusted key; else :class:`VerificationError`. Answers the keys trusted now: ``keys`` itself, or more keys,
    which the caller pins (``identity/signing.pub``)."""
    from cryptography.exceptions import InvalidSignature

    ring = TrustedKeys.of(keys)
    if ring.get(signed.key_id) is None and signed.key_transitions:
        ring = ring.following(signed.key_transitions)
    named = ring.get(signed.key_id)
    try:
        signature = base64.b64decode(signed.signature, validate=True)
    except ValueError as exc:
        raise VerificationError("the manifest signature is not base64") from exc
    signed_bytes = manifest_signing_bytes(signed.manifest)
    for key in (named,) if named is not None else ring.keys:  # key_id is a hint: the signature decides
        try:
            key.verify(signature, signed_bytes)
            return ring
        except InvalidSignature:
            continue
    raise VerificationError(f"bad signature on {signed.manifest.name} {signed.manifest.version} (key {signed.key_id}; pinned {', '.join(ring.ids())})")


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


class UnknownSigner(VerificationError):
    """No trusted key signed the download token: forged, or signed by a key the hub rotated to since."""


def signed_by(keys: TrustedKeys | Ed25519PublicKey, signature: bytes, signed: bytes) -> bool:
    """Whether one of ``keys`` made ``signature`` over ``signed``."""
    from cryptography.exceptions import InvalidSignature

    for key in TrustedKeys.of(keys).keys:
        try:
            key.verify(signature, signed)
            return True
        except InvalidSignature:
            continue
    return False


def verify_download_token(keys: TrustedKeys | Ed25519PublicKey, token: str, artifact_id: str, now: float | None = None) -> DownloadGrant:
    """The grant if the hub signed ``token`` (with a trusted key) for ``artifact_id`` and it has not expired."""
    try:
        grant, signature = decode_download_token(token)
    except ValueError as exc:
        raise VerificationError(str(exc)) from exc
    if not signed_by(keys, signature, download_token_signing_bytes(grant)):
        raise UnknownSigner("the download token's signature is not valid")
    if grant.exp < (time.time() if now is None else now):
        raise VerificationError("the download token has expired")
    if grant.artifact_id != artifact_id:
        raise VerificationError("the download token is for another artefact")
    return grant
