"""The hub's signing keys the edge checks devices' download tokens with: pinned at enrolment (or, for an older
enrolment, fetched once from the hub and pinned), and followed through the hub's signed hand-overs when it rotates
its key, so a token signed by the new key is trusted before a device shows one."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import httpx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from device.ota.verify import TrustedKeys, UnknownSigner, VerificationError, load_public_key, verify_download_token
from interfaces import API_PREFIX
from interfaces.deployments import DownloadGrant, KeyTransitions, SignedKeyTransition

log = logging.getLogger("aisynergy.edge.artifacts")

SIGNING_KEY_PATH = f"{API_PREFIX}/signing-key.pub"
KEY_TRANSITIONS_PATH = f"{API_PREFIX}/signing-key/transitions"
KEY_RETRY_S = 5.0  # after a failed fetch of the signing key, ask the hub again at most this often


class HubSigningKeys:
    """The keys trusted for the hub's signatures. ``client`` opens a connection to the hub, ``submit`` runs a call in
    the background (nothing once the cache is closed); ``pin`` stores the keys (PEM) with the node's identity,
    ``source`` reads the pinned keys back (the node's updater may have extended them). Thread-safe."""

    def __init__(
        self,
        hub_url: str,
        client: Callable[[], httpx.Client],
        submit: Callable[..., object],
        *,
        keys: TrustedKeys | Ed25519PublicKey | None = None,
        pin: Callable[[str], object] | None = None,
        source: Callable[[], TrustedKeys | None] | None = None,
    ) -> None:
        self.hub_url = hub_url
        self._client = client
        self._submit = submit
        self._key = None if keys is None else TrustedKeys.of(keys)
        self._pin_key = pin
        self._key_source = source
        self._lock = threading.Lock()
        self._key_failed_at = -KEY_RETRY_S
        self._caught_up_at = -KEY_RETRY_S
        self._announced: str | None = None  # the key id the hub's retained state names

    @property
    def pinned(self) -> TrustedKeys | None:
        """The keys trusted now, without asking the hub."""
        return self._key

    def ensure(self) -> TrustedKeys | None:
        """The pinned keys; without one, fetch ``GET /signing-key.pub`` from the hub once and pin it."""
        with self._lock:
            if self._key is not None:
                return self._key
            if time.monotonic() - self._key_failed_at < KEY_RETRY_S:
                return None
            url = self.hub_url + SIGNING_KEY_PATH
            try:
                with self._client() as client:
                    response = client.get(url)
                response.raise_for_status()
                key = TrustedKeys([load_public_key(response.content)])
            except (httpx.HTTPError, VerificationError, ValueError) as exc:
                self._key_failed_at = time.monotonic()
                log.warning("no pinned signing key and cannot fetch it from %s: %s", url, exc)
                return None
            self._pin(key)
            self._key = key
            log.warning("the stored identity has no signing key: pinned key %s fetched from %s", key.ids()[0], url)
            return key

    def follow(self, transitions: list[SignedKeyTransition]) -> TrustedKeys | None:
        """Trust the keys ``transitions`` lead to from a pinned key (a device order's manifest after the hub
        rotated its key); :class:`VerificationError` for a forged hand-over."""
        keys = self.ensure()
        if keys is None or not transitions:
            return keys
        with self._lock:
            keys = self._key or keys
            ahead = keys.following(transitions)
            if ahead is not keys:
                self._key = ahead
                self._pin(ahead)
                log.warning("the hub's signing key is %s now (a transition signed by a pinned key leads to it): pinned", ahead.ids()[0])
            return ahead

    def announce(self, announced: str) -> None:
        """The hub announced the key it signs with (its retained state); not one pinned here: fetch the hand-over
        in the background, so the new key is trusted before a device shows a token it signed."""
        self._announced = announced
        keys = self._key
        if keys is not None and keys.get(announced) is None:
            self._submit(self._catch_up, keys)

    def _catch_up(self, keys: TrustedKeys) -> TrustedKeys | None:
        """More keys than ``keys``, from the pinned file or, when the hub announced a key not pinned here, from
        its transitions; ``None`` when there are none. A token signed by an unknown key makes no request to the
        hub unless the hub said it signs with a key the edge lacks (and then at most every ``KEY_RETRY_S``)."""
        if self._key_source is not None:
            try:
                pinned = self._key_source()
            except (OSError, ValueError) as exc:
                log.error("cannot read the pinned signing keys: %s", exc)
                pinned = None
            if pinned is not None and set(pinned.ids()) - set(keys.ids()):
                with self._lock:
                    self._key = pinned.merged(keys)
                return self._key
        with self._lock:
            announced, current = self._announced, self._key or keys
            if announced is None or current.get(announced) is not None:
                return current if current is not keys else None
            if time.monotonic() - self._caught_up_at < KEY_RETRY_S:
                return None
            self._caught_up_at = time.monotonic()
        url = self.hub_url + KEY_TRANSITIONS_PATH
        try:
            with self._client() as client:
                response = client.get(url)
            response.raise_for_status()
            transitions = KeyTransitions.model_validate_json(response.content).transitions
            ahead = self.follow(transitions)
        except (httpx.HTTPError, ValueError) as exc:  # VerificationError and pydantic's ValidationError included
            log.warning("cannot fetch the hub's key transitions from %s: %s", url, exc)
            return None
        return ahead if ahead is not None and ahead is not keys else None

    def verify_token(self, token: str, artifact_id: str) -> DownloadGrant:
        """The grant of a device's token, checked offline with the pinned keys; a token signed by a key the hub
        rotated to since makes the edge follow the hub's transitions first. :class:`VerificationError` else;
        ``LookupError`` when no key is pinned and the hub is unreachable."""
        keys = self.ensure()
        if keys is None:
            raise LookupError("no signing key is pinned")
        try:
            return verify_download_token(keys, token, artifact_id)
        except UnknownSigner:
            ahead = self._catch_up(keys)
            if ahead is None:
                raise
            return verify_download_token(ahead, token, artifact_id)

    def _pin(self, keys: TrustedKeys) -> None:
        if self._pin_key is not None:
            try:
                self._pin_key(keys.to_pem())
            except Exception as exc:  # noqa: BLE001 - kept in memory; fetched again after a restart
                log.error("cannot store the hub's signing key: %s", exc)
