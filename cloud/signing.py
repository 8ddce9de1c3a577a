"""The hub's Ed25519 signing key: artefact manifests and download tokens (DESIGN §4.2, §6).

The private key lives in ``<pki_dir>/signing.key`` (0600) and never leaves the hub; targets pin the
public key from their enrolment answer (``signing_key_pem``) and verify every manifest before install.
Download tokens are signed by the same key under a different domain tag, so an edge can check them
offline, without asking the hub.

Rotation (``aisynergy hub rotate signing-key``, :func:`rotate`): the old key signs a transition to a new one;
every manifest signed afterwards carries the chain of transitions, so a target that pins an older key checks
each hand-over with the key it trusts and pins the new key too. Retired public keys stay in
``signing-keyring.json``: targets enrolled later pin them as well (artefacts signed before a rotation keep
verifying), and the hub keeps accepting the download tokens they signed until those expire.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import fcntl
import hashlib
import logging
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from interfaces.uploads import PublishClaims, decode_publish_token, encode_publish_token, publish_signing_bytes
from interfaces.deployments import (
    MAX_KEY_TRANSITIONS, ArtifactManifest, DownloadGrant, KeyTransition, SignedKeyTransition, SignedManifest,
    decode_download_token, download_token_signing_bytes, encode_download_token, key_transition_signing_bytes,
    manifest_signing_bytes,
)  # fmt: skip

log = logging.getLogger(__name__)

KEY_FILE = "signing.key"
PUBLIC_FILE = "signing.pub"
NEXT_KEY_FILE = "signing.key.next"  # the key a rotation hands over to, until the hand-over is recorded
KEYRING_FILE = "signing-keyring.json"  # the retired public keys and the transitions between keys
LOCK_FILE = "signing.lock"  # held while the keys are read or rotated (kept: it is the lock, not a temporary file)


class TokenRejected(ValueError):
    """A download token that is malformed, forged, expired or for something else."""


class KeyringError(ValueError):
    """The signing keyring on disk does not agree with the signing key (a hand-edited or damaged PKI)."""


def key_id(public_key: Ed25519PublicKey) -> str:
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def _public_pem(public_key: Ed25519PublicKey) -> str:
    return public_key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()


class RetiredKey(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    key_id: str
    public_key_pem: str
    retired_at: dt.datetime


class Keyring(BaseModel):
    """``signing-keyring.json``: the keys the hub signed with before its current one (oldest first) and the
    transitions from each to the next, the last of which names the current key."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    retired: list[RetiredKey] = Field(default_factory=list, max_length=MAX_KEY_TRANSITIONS)
    transitions: list[SignedKeyTransition] = Field(default_factory=list, max_length=MAX_KEY_TRANSITIONS)


@dataclass(frozen=True)
class _Keys:
    private_key: Ed25519PrivateKey
    retired: tuple[Ed25519PublicKey, ...]
    transitions: tuple[SignedKeyTransition, ...]
    stamp: tuple[int, ...]


class SigningKey:
    """The hub's current signing key, the public keys it retired and the chain of transitions between them.

    Loaded from a PKI directory, it follows the files: after ``aisynergy hub rotate signing-key`` a running hub
    signs with the new key from its next signature on (a ``stat`` per use), and still accepts the download
    tokens the retired keys signed until they expire.
    """

    def __init__(self, private_key: Ed25519PrivateKey, pki_dir: Path | None = None) -> None:
        self._pki_dir = pki_dir
        self._lock = threading.Lock()
        self._keys = _Keys(private_key, (), (), ())

    @classmethod
    def load_or_create(cls, pki_dir: Path) -> SigningKey:
        pki_dir.mkdir(parents=True, exist_ok=True)
        path = pki_dir / KEY_FILE
        if not path.exists():
            key = Ed25519PrivateKey.generate()
            _write_atomic(path, _private_pem(key), 0o600, exclusive=True)  # another process may win: keep theirs
        with _locked(pki_dir):
            keys = _load(pki_dir)
        signing = cls(keys.private_key, pki_dir)
        signing._keys = keys
        public = pki_dir / PUBLIC_FILE
        if not public.exists() or public.read_text() != signing.public_pem:
            _write_atomic(public, signing.public_pem.encode(), 0o644)
        return signing

    def _current(self) -> _Keys:
        keys = self._keys
        if self._pki_dir is None:
            return keys
        stamp = _stamp(self._pki_dir)
        if stamp == keys.stamp:
            return keys
        with self._lock:
            if self._keys.stamp != stamp:
                try:
                    with _locked(self._pki_dir):
                        self._keys = _load(self._pki_dir)
                except (OSError, ValueError) as exc:  # keep signing with what was loaded; say why every time
                    log.error("cannot reload the signing key from %s: %s", self._pki_dir, exc)
                    return self._keys
                log.info("signing with key %s now", key_id(self._keys.private_key.public_key()))
            return self._keys

    @property
    def private_key(self) -> Ed25519PrivateKey:
        return self._current().private_key

    @property
    def public_key(self) -> Ed25519PublicKey:
        return self.private_key.public_key()

    @property
    def public_pem(self) -> str:
        return _public_pem(self.public_key)

    @property
    def key_id(self) -> str:
        return key_id(self.public_key)

    @property
    def transitions(self) -> tuple[SignedKeyTransition, ...]:
        """Every recorded hand-over, oldest first; the last one's ``new_key_id`` is the current key."""
        return self._current().transitions

    @property
    def keys_pem(self) -> str:
        """The current public key and the retired ones, newest first, as one PEM bundle: what a target pins at
        enrolment, so it verifies artefacts signed before the last rotation as well."""
        keys = self._current()
        return "".join(_public_pem(k) for k in (keys.private_key.public_key(), *reversed(keys.retired)))

    def transitions_to(self, target_key_id: str) -> list[SignedKeyTransition]:
        """The chain of hand-overs that ends at ``target_key_id`` (empty for the first key or an unknown one)."""
        chain = list(self.transitions)
        for i in range(len(chain) - 1, -1, -1):
            if chain[i].transition.new_key_id == target_key_id:
                return chain[: i + 1]
        return []

    def sign_manifest(self, manifest: ArtifactManifest) -> SignedManifest:
        keys = self._current()
        signature = keys.private_key.sign(manifest_signing_bytes(manifest))
        return SignedManifest(
            manifest=manifest, signature=base64.b64encode(signature).decode(), key_id=key_id(keys.private_key.public_key()),
            key_transitions=list(keys.transitions),
        )  # fmt: skip

    def issue_download_token(self, artifact_id: str, sha256: str, target_id: str, ttl_s: int, base_sha256: str | None = None) -> str:
        """A token for the artefact's content and, with ``base_sha256`` (what the target runs), the delta from it."""
        grant = DownloadGrant(artifact_id=artifact_id, sha256=sha256, target_id=target_id, exp=int(time.time()) + ttl_s, base_sha256=base_sha256)
        return encode_download_token(grant, self.private_key.sign(download_token_signing_bytes(grant)))

    def verify_download_token(self, token: str, artifact_id: str) -> DownloadGrant:
        """The grant if ``token`` is ours (the current key's or a retired one's), unexpired and for
        ``artifact_id``; else :class:`TokenRejected`."""
        try:
            grant, signature = decode_download_token(token)
        except ValueError as exc:
            raise TokenRejected(str(exc)) from exc
        self._check_signature(signature, download_token_signing_bytes(grant), "download token")
        if grant.exp < time.time():
            raise TokenRejected("the download token has expired")
        if grant.artifact_id != artifact_id:
            raise TokenRejected("the download token is for another artefact")
        return grant

    def issue_publish_token(self, claims: PublishClaims) -> str:
        """A publish grant (``interfaces.uploads``): the chunked upload of ``claims.names`` at ``claims.version`` only."""
        return encode_publish_token(claims, self.private_key.sign(publish_signing_bytes(claims)))

    def verify_publish_token(self, token: str) -> PublishClaims:
        """The claims if ``token`` is a publish grant of ours (the current key's or a retired one's), unexpired; else
        :class:`TokenRejected`."""
        try:
            claims, signature = decode_publish_token(token)
        except ValueError as exc:
            raise TokenRejected(str(exc)) from exc
        self._check_signature(signature, publish_signing_bytes(claims), "publish grant")
        if claims.exp < time.time():
            raise TokenRejected("the publish grant has expired")
        return claims

    def _check_signature(self, signature: bytes, signed: bytes, what: str) -> None:
        keys = self._current()
        for public in (keys.private_key.public_key(), *reversed(keys.retired)):
            try:
                public.verify(signature, signed)
                return
            except InvalidSignature:
                continue
        raise TokenRejected(f"the {what}'s signature is not valid")


@dataclass(frozen=True)
class Rotation:
    old_key_id: str
    new_key_id: str
    transition: SignedKeyTransition
    dropped: tuple[str, ...]  # retired keys forgotten to stay within MAX_KEY_TRANSITIONS


def rotate(pki_dir: Path, now: dt.datetime | None = None) -> Rotation:
    """Hand the signing key over to a new one: the old key signs a :class:`KeyTransition` to the new, the old
    public key is kept (download tokens it signed stay valid until they expire; targets that pin it follow the
    transition), and the new private key replaces ``signing.key``. Safe against a crash at any step (the next
    load or rotation completes it) and against concurrent rotations (a lock file)."""
    SigningKey.load_or_create(pki_dir)  # a PKI without a key gets one first
    with _locked(pki_dir):
        keys = _load(pki_dir)
        old = keys.private_key
        next_path = pki_dir / NEXT_KEY_FILE
        new = _read_private(next_path) if next_path.exists() else None
        if new is None:
            new = Ed25519PrivateKey.generate()
            _write_atomic(next_path, _private_pem(new), 0o600)
        when = (now or dt.datetime.now(dt.UTC)).replace(microsecond=0)
        transition = KeyTransition(
            old_key_id=key_id(old.public_key()), new_key_id=key_id(new.public_key()),
            new_public_key_pem=_public_pem(new.public_key()), issued_at=when,
        )  # fmt: skip
        signed = SignedKeyTransition(
            transition=transition, signature=base64.b64encode(old.sign(key_transition_signing_bytes(transition))).decode()
        )
        ring = _read_keyring(pki_dir)
        retired = [*ring.retired, RetiredKey(key_id=transition.old_key_id, public_key_pem=_public_pem(old.public_key()), retired_at=when)]
        transitions = [*ring.transitions, signed]
        dropped = tuple(k.key_id for k in retired[: max(0, len(retired) - MAX_KEY_TRANSITIONS)])
        ring = Keyring(retired=retired[-MAX_KEY_TRANSITIONS:], transitions=transitions[-MAX_KEY_TRANSITIONS:])
        _write_atomic(pki_dir / KEYRING_FILE, ring.model_dump_json(indent=1).encode(), 0o644)  # the hand-over is decided
        _complete(pki_dir, ring)
        return Rotation(transition.old_key_id, transition.new_key_id, signed, dropped)


def _private_pem(key: Ed25519PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def _read_private(path: Path) -> Ed25519PrivateKey:
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyringError(f"{path} is not an Ed25519 private key")
    return key


def _read_keyring(pki_dir: Path) -> Keyring:
    path = pki_dir / KEYRING_FILE
    try:
        return Keyring.model_validate_json(path.read_bytes())
    except FileNotFoundError:
        return Keyring()
    except ValidationError as exc:
        raise KeyringError(f"{path} is not a signing keyring: {exc}") from exc


def _complete(pki_dir: Path, ring: Keyring) -> None:
    """Finish a recorded hand-over whose new key still waits in ``signing.key.next``."""
    if not ring.transitions:
        return
    wanted = ring.transitions[-1].transition.new_key_id
    current = _read_private(pki_dir / KEY_FILE)
    if key_id(current.public_key()) == wanted:
        return
    next_path = pki_dir / NEXT_KEY_FILE
    if not next_path.exists() or key_id(_read_private(next_path).public_key()) != wanted:
        raise KeyringError(f"{pki_dir / KEYRING_FILE} hands over to key {wanted}, which is neither {KEY_FILE} nor {NEXT_KEY_FILE}")
    os.replace(next_path, pki_dir / KEY_FILE)
    _write_atomic(pki_dir / PUBLIC_FILE, _public_pem(_read_private(pki_dir / KEY_FILE).public_key()).encode(), 0o644)


def _load(pki_dir: Path) -> _Keys:
    """The keys as the files say, checked: each transition signed by the key before it, the last naming the
    current key (the caller holds the lock)."""
    ring = _read_keyring(pki_dir)
    _complete(pki_dir, ring)
    private = _read_private(pki_dir / KEY_FILE)
    retired = tuple(serialization.load_pem_public_key(k.public_key_pem.encode()) for k in ring.retired)
    if not all(isinstance(k, Ed25519PublicKey) for k in retired):
        raise KeyringError(f"{pki_dir / KEYRING_FILE} holds a key that is not Ed25519")
    by_id = {key_id(k): k for k in retired if isinstance(k, Ed25519PublicKey)}
    for t in ring.transitions:
        old = by_id.get(t.transition.old_key_id)
        if old is None:
            continue  # the oldest transitions may name a key dropped since
        try:
            old.verify(base64.b64decode(t.signature), key_transition_signing_bytes(t.transition))
        except (InvalidSignature, ValueError) as exc:
            raise KeyringError(f"the transition {t.transition.old_key_id} -> {t.transition.new_key_id} is not signed by its old key") from exc
    return _Keys(private, tuple(k for k in retired if isinstance(k, Ed25519PublicKey)), tuple(ring.transitions), _stamp(pki_dir))


def _stamp(pki_dir: Path) -> tuple[int, ...]:
    out: list[int] = []
    for name in (KEY_FILE, KEYRING_FILE):
        try:
            st = (pki_dir / name).stat()
            out += [st.st_ino, st.st_mtime_ns, st.st_size]
        except FileNotFoundError:
            out += [0, 0, 0]
    return tuple(out)


@contextlib.contextmanager
def _locked(pki_dir: Path) -> Iterator[None]:
    fd = os.open(pki_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


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
