"""Delta updates: rebuild the ordered artefact from the one the target runs and a bsdiff4 patch.

Used only when the order offers a delta and the base file is here with the offered SHA-256. The patch is
checked against the offer (size, SHA-256), applied, and the result must then pass the same checks as a
full download (the manifest's size and SHA-256; the caller also checked the signature). Any failure
raises :class:`DeltaError` and the caller falls back to the full download.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from device.ota.download import DownloadCanceled, Downloader
from device.ota.verify import sha256_file, verify_content
from interfaces.deployments import DeltaOffer, SignedManifest

log = logging.getLogger("aisynergy.device.ota")


class DeltaError(Exception):
    """The delta could not be used; fall back to the full download."""


def rebuild_from_delta(downloader: Downloader, offer: DeltaOffer, token: str, base: Path | None, signed: SignedManifest) -> Path:
    """The rebuilt, verified artefact as ``<partial dir>/<sha256>.part``; :class:`DeltaError` otherwise
    (:class:`~device.ota.download.DownloadCanceled` passes through: the agent is stopping)."""
    import bsdiff4  # only a device that receives deltas loads it

    if base is None or not base.exists():
        raise DeltaError("the delta's base is not on this device")
    try:
        if sha256_file(base) != offer.base_sha256:
            raise DeltaError(f"the local base {base.name} does not have the offered SHA-256 {offer.base_sha256}")
        patch_path = downloader.fetch(offer.path, token, offer.sha256, offer.size)
        patch = patch_path.read_bytes()
        patch_path.unlink(missing_ok=True)
        if len(patch) != offer.size or hashlib.sha256(patch).hexdigest() != offer.sha256:
            raise DeltaError("the patch does not match the offer's size and SHA-256")
        rebuilt = bsdiff4.patch(base.read_bytes(), patch)
    except (DeltaError, DownloadCanceled):
        raise
    except Exception as exc:
        raise DeltaError(f"{type(exc).__name__}: {exc}") from exc
    target = downloader.part_path(signed.manifest.sha256)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(rebuilt)
    try:
        verify_content(signed, target)
    except ValueError as exc:
        target.unlink(missing_ok=True)
        raise DeltaError(f"the rebuilt file fails verification: {exc}") from exc
    log.info("rebuilt %s %s from a %s byte delta", signed.manifest.name, signed.manifest.version, offer.size)
    return target
