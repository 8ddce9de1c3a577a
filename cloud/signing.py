"""The hub's Ed25519 signing key: artefact manifests and download tokens (DESIGN §4.2, §6).

The private key lives in ``<pki_dir>/signing.key`` (0600) and never leaves the hub; targets pin the
public key from their enrolment answer (``signing_key_pem``) and verify every manifest before install.
Download tokens are signed by the same key under a different domain tag, so an edge can check them
offline, without asking the hub.
"""

from __future__ import annotations

import base64
import hashlib
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from interfaces.deployments import (
    ArtifactManifest, DownloadGrant, SignedManifest, decode_download_token, download_token_signing_bytes,
    encode_download_token, manifest_signing_bytes,
)  # fmt: skip

KEY_FILE = "signing.key"
PUBLIC_FILE = "signing.pub"


class TokenRejected(ValueError):
    """A download token that is malformed, forged, expired or for something else."""


def key_id(public_key: Ed25519PublicKey) -> str:
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


@dataclass(frozen=True)
class SigningKey:
    private_key: Ed25519PrivateKey

    @classmethod
    def load_or_create(cls, pki_dir: Path) -> SigningKey:
        pki_dir.mkdir(parents=True, exist_ok=True)
        path = pki_dir / KEY_FILE
        if path.exists():
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
            if not isinstance(key, Ed25519PrivateKey):
                raise ValueError(f"{path} is not an Ed25519 private key")
        else:
            key = Ed25519PrivateKey.generate()
            pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
            _write_atomic(path, pem, 0o600, exclusive=True)
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)  # another process may have won
            assert isinstance(key, Ed25519PrivateKey)
        signing = cls(key)
        public = pki_dir / PUBLIC_FILE
        if not public.exists() or public.read_text() != signing.public_pem:
            _write_atomic(public, signing.public_pem.encode(), 0o644)
        return signing

    @property
    def public_key(self) -> Ed25519PublicKey:
        return self.private_key.public_key()

    @property
    def public_pem(self) -> str:
        return self.public_key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()

    @property
    def key_id(self) -> str:
        return key_id(self.public_key)

    def sign_manifest(self, manifest: ArtifactManifest) -> SignedManifest:
        signature = self.private_key.sign(manifest_signing_bytes(manifest))
        return SignedManifest(manifest=manifest, signature=base64.b64encode(signature).decode(), key_id=self.key_id)

    def issue_download_token(self, artifact_id: str, sha256: str, target_id: str, ttl_s: int, base_sha256: str | None = None) -> str:
        """A token for the artefact's content and, with ``base_sha256`` (what the target runs), the delta from it."""
        grant = DownloadGrant(artifact_id=artifact_id, sha256=sha256, target_id=target_id, exp=int(time.time()) + ttl_s, base_sha256=base_sha256)
        return encode_download_token(grant, self.private_key.sign(download_token_signing_bytes(grant)))

    def verify_download_token(self, token: str, artifact_id: str) -> DownloadGrant:
        """The grant if ``token`` is ours, unexpired and for ``artifact_id``; else :class:`TokenRejected`."""
        try:
            grant, signature = decode_download_token(token)
        except ValueError as exc:
            raise TokenRejected(str(exc)) from exc
        try:
            self.public_key.verify(signature, download_token_signing_bytes(grant))
        except InvalidSignature as exc:
            raise TokenRejected("the download token's signature is not valid") from exc
        if grant.exp < time.time():
            raise TokenRejected("the download token has expired")
        if grant.artifact_id != artifact_id:
            raise TokenRejected("the download token is for another artefact")
        return grant


def _write_atomic(path: Path, data: bytes, mode: int, exclusive: bool = False) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        os.write(fd, data)
        os.fsync(fd)
        os.close(fd)
        if exclusive:
            try:
                os.link(tmp, path)  # fails if another process created the key first: keep theirs
            except FileExistsError:
                pass
            os.unlink(tmp)
        else:
            os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
