"""The edge's artefact cache: the store of blobs, the hub's signing keys and the downloads from the hub put
together, answering devices (:mod:`edge.artifacts.answers`) and prefetching what deployments order."""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from device.files import write_atomic
from device.ota.verify import TrustedKeys, VerificationError
from edge.artifacts import answers
from edge.artifacts.answers import Answer, Refused
from edge.artifacts.fetch import Downloader
from edge.artifacts.keys import HubSigningKeys
from edge.artifacts.store import DEFAULT_BUDGET_BYTES, Blob, BlobStore
from interfaces import API_PREFIX
from interfaces.deployments import DeploymentOrder, DownloadGrant, SignedKeyTransition

log = logging.getLogger("aisynergy.edge.artifacts")


class ArtifactCache:
    """Content-addressed artefact cache in ``root``; see the package docstring. Thread-safe.

    ``store`` holds the blobs (and counts hits and integrity checks), ``keys`` the hub's signing keys, ``downloads``
    fetches from the hub (and counts the requests it sends)."""

    def __init__(
        self,
        root: Path,
        *,
        hub_url: str,
        signing_key: TrustedKeys | Ed25519PublicKey | None = None,
        pin_signing_key: Callable[[str], object] | None = None,
        signing_key_source: Callable[[], TrustedKeys | None] | None = None,
        budget_bytes: int = DEFAULT_BUDGET_BYTES,
        verify: ssl.SSLContext | bool | str = True,
        timeout_s: float = 30.0,
        attempts: int = 5,
        prefetch_workers: int = 2,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.store = BlobStore(root, budget_bytes)
        self.root = self.store.root
        self.hub_url = hub_url.rstrip("/")
        self.downloads = Downloader(self.store, verify=verify, timeout_s=timeout_s, attempts=attempts, transport=transport)
        self.keys = HubSigningKeys(self.hub_url, self.downloads.client, self._submit, keys=signing_key, pin=pin_signing_key,
                                   source=signing_key_source)  # fmt: skip
        self._executor = ThreadPoolExecutor(max_workers=prefetch_workers, thread_name_prefix="artifact-prefetch")
        self._closed = False

    # ---- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        """Pin the hub's signing key in the background if the identity has none (an older enrolment)."""
        if self.keys.pinned is None:
            self._executor.submit(self.keys.ensure)

    def close(self) -> None:
        self._closed = True
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any] | None:
        """Run ``fn(*args)`` in the background; nothing once closed."""
        if self._closed:
            return None
        try:
            return self._executor.submit(fn, *args)
        except RuntimeError:  # shut down meanwhile
            return None

    # ---- the hub's signing key ----------------------------------------------------------------------
    def ensure_signing_key(self) -> TrustedKeys | None:
        """The pinned keys; without one, fetch ``GET /signing-key.pub`` from the hub once and pin it."""
        return self.keys.ensure()

    def follow(self, transitions: list[SignedKeyTransition]) -> TrustedKeys | None:
        """Trust the keys ``transitions`` lead to from a pinned key; :class:`VerificationError` for a forged hand-over."""
        return self.keys.follow(transitions)

    def hub_signing_key(self, announced: str) -> None:
        """The hub announced the key it signs with (its retained state): catch up in the background if it is new."""
        self.keys.announce(announced)

    def verify_token(self, token: str, artifact_id: str) -> DownloadGrant:
        """The grant of a device's token, checked offline with the pinned keys (:meth:`HubSigningKeys.verify_token`)."""
        return self.keys.verify_token(token, artifact_id)

    # ---- queries ------------------------------------------------------------------------------------
    def blob_path(self, sha256: str) -> Path:
        return self.store.blob_path(sha256)

    def contains(self, sha256: str) -> bool:
        return self.store.contains(sha256)

    def usage(self) -> int:
        """Bytes held: blobs and partial downloads."""
        return self.store.usage()

    # ---- HTTP ---------------------------------------------------------------------------------------
    @staticmethod
    def handles(path: str) -> bool:
        return answers.handles(path)

    def answer(self, method: str, target: str, headers: Mapping[str, str]) -> Answer:
        """Answer one device request (``target``: path and query). The caller sends the answer, then
        calls its ``release``."""
        return answers.answer(self, method, target, headers)

    # ---- blobs --------------------------------------------------------------------------------------
    def acquire_content(self, artifact_id: str, token: str, sha256: str) -> Blob:
        """The artefact's blob, pinned: from the cache, else downloaded from the hub (raises ``Refused``)."""
        url = f"{self.hub_url}{API_PREFIX}/artifacts/{artifact_id}/content"
        return self.store.acquire(sha256, lambda: sha256, lambda: self.downloads.download(url, token, sha256))

    def acquire_delta(self, artifact_id: str, token: str, base: str, target: str, expected: str | None = None) -> Blob:
        """The delta from ``base`` to ``target``, pinned; ``expected``: its SHA-256 when known (an order's offer)."""
        index = self.root / "deltas" / f"{base}-{target}"
        url = f"{self.hub_url}{API_PREFIX}/artifacts/{artifact_id}/delta"

        def lookup() -> str | None:
            try:
                return index.read_text().strip() or None
            except OSError:
                return None

        def fetch() -> str:
            sha = self.downloads.download(url, token, expected, params={"from": base})
            try:
                write_atomic(index, sha.encode())
            except BaseException:
                self.store.unpin(sha)
                raise
            return sha

        return self.store.acquire(f"delta:{base}-{target}", lookup, fetch)

    # ---- prefetch -----------------------------------------------------------------------------------
    def prefetch(self, order: DeploymentOrder) -> Future[None] | None:
        """Fetch an ordered artefact (and its delta) in the background, best effort."""
        return self._submit(self._prefetch, order)

    def _prefetch(self, order: DeploymentOrder) -> None:
        try:
            self.follow(order.signed_manifest.key_transitions)  # the device's manifest may lead to a new hub key
            grant = self.verify_token(order.token, order.artifact_id)
        except LookupError:
            return
        except VerificationError as exc:
            log.warning("not prefetching %s for execution %s: %s", order.artifact_id, order.execution_id, exc)
            return
        if grant.sha256 != order.signed_manifest.manifest.sha256:
            log.warning("not prefetching %s: the token and the manifest name different blobs", order.artifact_id)
            return
        wanted: list[Callable[[], Blob]] = []
        if order.delta is not None:
            delta = order.delta
            wanted.append(lambda: self.acquire_delta(order.artifact_id, order.token, delta.base_sha256, grant.sha256, delta.sha256))
        wanted.append(lambda: self.acquire_content(order.artifact_id, order.token, grant.sha256))
        for acquire in wanted:
            if self._closed:
                return
            try:
                acquire().release()
            except Refused as exc:
                log.info("prefetch of %s for execution %s failed: %s", order.artifact_id, order.execution_id, exc.answer.status)
        log.info("prefetched %s for execution %s", order.artifact_id, order.execution_id)
