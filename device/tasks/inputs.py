"""Fetching a task's artefacts the way an update is fetched (DESIGN §4.2, §6): datasets (npy, safetensors)
the frozen bodies of training tasks (ONNX models), and the packages of users' algorithms (zip).

The manifest's Ed25519 signature is checked against the hub key pinned at enrolment before a byte is
fetched; the content's size and SHA-256 before it is used. Either failing REJECTS the worker with the
reason. The bytes come through the :class:`~device.ota.download.Downloader` the updater uses (a device:
its edge's artefact cache; an edge: the hub), with the order's download token and Range resume, and are
kept as ``<dir>/<sha256>.<format>``: a dataset already here (and still intact) is not fetched again.
Files no current order names are removed when the orders change (:meth:`InputFetcher.prune`).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from device.ota.download import OversizedContent
from device.tasks.worker import Rejected
from interfaces.deployments import ArtifactFormat, ArtifactKind, SignedManifest
from interfaces.tasks import InputRef

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    from device.ota.download import Downloader
    from device.ota.updater import Updater
    from device.ota.verify import TrustedKeys

log = logging.getLogger("aisynergy.device.tasks")

FORMATS = {
    ArtifactKind.DATASET: frozenset({ArtifactFormat.NPY, ArtifactFormat.SAFETENSORS}),
    ArtifactKind.MODEL: frozenset({ArtifactFormat.ONNX, ArtifactFormat.SAFETENSORS}),  # a model file; a federated round's global layer
    ArtifactKind.ALGORITHM: frozenset({ArtifactFormat.ZIP}),  # a training task's package
}
"""what a task may fetch: kind -> formats"""


class InputFetcher:
    """``fetch_inputs`` for a :class:`~device.tasks.host.WorkerHost`; see the module docstring.

    ``signing_key`` answers the pinned hub key (``None``: none pinned; may raise ``ValueError``);
    ``downloader`` answers the downloader over the artefact source. Both are asked at each fetch.
    """

    def __init__(self, root: Path, signing_key: Callable[[], TrustedKeys | Ed25519PublicKey | None], downloader: Callable[[], Downloader],
                 check: Callable[[SignedManifest], None] | None = None) -> None:  # fmt: skip
        self.root = Path(root)
        self._signing_key, self._downloader = signing_key, downloader
        self._check = check  # the updater's check, which also pins a key the hub rotated to
        self._locks: dict[str, threading.Lock] = {}
        self._locks_lock = threading.Lock()

    @classmethod
    def through(cls, root: Path, updater: Callable[[], Updater | None]) -> InputFetcher:
        """A fetcher using the key and downloader of the updater ``updater()`` returns (made at start)."""

        def key() -> TrustedKeys | None:
            u = updater()
            return u.signing_key() if u is not None else None

        def check(signed: SignedManifest) -> None:
            u = updater()
            if u is None:
                raise ValueError("the agent has not started; no signing key yet")
            u.verify_manifest(signed)

        def downloader() -> Downloader:
            u = updater()
            if u is None:
                raise RuntimeError("the agent has not started; no artefact source yet")
            return u.downloader()

        return cls(root, key, downloader, check)

    def __call__(self, ref: InputRef) -> Path:
        """The verified local file of ``ref``: :class:`Rejected` when it is not what the hub signed,
        :class:`~device.ota.download.DownloadError` when it cannot be fetched."""
        from device.ota.verify import VerificationError, verify_content, verify_manifest

        signed = ref.signed_manifest
        m = signed.manifest
        try:
            key = self._signing_key()
            if key is None:
                raise Rejected("no hub signing key is pinned on this target (enrolled before signing keys; re-enrol)")
            if self._check is not None:
                self._check(signed)
            else:
                verify_manifest(key, signed)
        except (VerificationError, ValueError) as exc:
            raise Rejected(f"inputs {ref.artifact_id}: {exc}") from exc
        if m.format not in FORMATS.get(m.kind, ()):
            raise Rejected(f"inputs {ref.artifact_id} are a {m.kind.value} in format {m.format.value}, not a dataset (npy, safetensors), a model (onnx, safetensors) or an algorithm (zip)")
        target = self.root / f"{m.sha256}.{m.format.value}"
        with self._lock_for(m.sha256):
            if target.exists():
                try:
                    verify_content(signed, target)
                    return target
                except VerificationError as exc:
                    log.warning("kept inputs %s are damaged (%s); fetching them again", target.name, exc)
                    target.unlink(missing_ok=True)
            downloader = self._downloader()
            if not downloader.base_url:
                raise RuntimeError("no artefact source known (no enrolment URL on a device, no hub URL on an edge)")
            try:
                part = downloader.fetch(ref.path, ref.token, m.sha256, m.size)
            except OversizedContent as exc:
                raise Rejected(f"inputs {ref.artifact_id} do not verify: {exc}") from exc
            try:
                verify_content(signed, part)
            except VerificationError as exc:
                part.unlink(missing_ok=True)
                raise Rejected(f"inputs {ref.artifact_id}: {exc}") from exc
            self.root.mkdir(parents=True, exist_ok=True)
            staged = target.with_name(f".{target.name}.tmp")
            shutil.move(part, staged)
            os.replace(staged, target)
        log.info("inputs %s (%s %s, %s bytes) fetched", ref.artifact_id, m.name, m.version, m.size)
        return target

    def prune(self, keep: Iterable[str]) -> None:
        """Remove kept datasets whose SHA-256 is not in ``keep``."""
        wanted = set(keep)
        if not self.root.is_dir():
            return
        for f in self.root.iterdir():
            sha = f.name.split(".", 1)[0]
            if f.is_file() and not f.name.startswith(".") and sha not in wanted:
                with self._lock_for(sha):
                    f.unlink(missing_ok=True)
                log.info("removed inputs %s (no order names them)", f.name)

    def _lock_for(self, sha256: str) -> threading.Lock:
        with self._locks_lock:
            return self._locks.setdefault(sha256, threading.Lock())
