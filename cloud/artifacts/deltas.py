"""Binary deltas between stored artefacts (DESIGN §4.2): bsdiff4 patches from one artefact's bytes to another's,
blobs too, recorded once per (base, target) pair in ``ArtifactDelta``, computed at most once per process and at most
``MAX_CONCURRENT_DELTAS`` at a time."""

from __future__ import annotations

import hashlib
import logging
import threading
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import bsdiff4
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session

from cloud.artifacts.blobs import SHA256, BlobStore, read_blob
from cloud.artifacts.records import delta_path, find_by_sha256, is_delta_blob
from cloud.tables import Artifact, ArtifactDelta
from interfaces.deployments import DeltaOffer

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

log = logging.getLogger("aisynergy.hub.artifacts")

MAX_DELTA_INPUT_BYTES = 64 * 1024 * 1024
"""bsdiff4 holds both versions in memory (and several times that while it works): no deltas above this size."""
MAX_CONCURRENT_DELTAS = 2
"""bsdiff4 runs per process at most this many times at once (each holds a CPU and up to ~10x its inputs in memory)."""
DELTA_RETRY_AFTER_S = 10
_DELTA_LOCKS: dict[tuple[str, str], threading.Lock] = {}
_DELTA_LOCKS_GUARD = threading.Lock()
_DELTA_SLOTS = threading.BoundedSemaphore(MAX_CONCURRENT_DELTAS)
_COMPUTED: dict[tuple[str, str], tuple[str, int]] = {}
_COMPUTED_KEPT = 256


class DeltaBusy(Exception):
    """Every delta slot is computing: the caller asked not to wait (a download request: it may retry, or fetch
    the full artefact)."""


def _delta_lock(base_sha256: str, target_sha256: str) -> threading.Lock:
    with _DELTA_LOCKS_GUARD:
        return _DELTA_LOCKS.setdefault((base_sha256, target_sha256), threading.Lock())


def _offer(row: ArtifactDelta, target: Artifact, blobs: BlobStore) -> DeltaOffer | None:
    if row.size >= target.size or not blobs.exists(row.sha256):
        return None
    return DeltaOffer(base_sha256=row.base_sha256, sha256=row.sha256, size=row.size, path=delta_path(target.id, row.base_sha256))


def _recorded(session: Session, base_sha256: str, target_sha256: str) -> ArtifactDelta | None:
    query = select(ArtifactDelta).where(ArtifactDelta.base_sha256 == base_sha256, ArtifactDelta.target_sha256 == target_sha256)
    return session.execute(query).scalars().first()


def offer_delta(session: Session, blobs: BlobStore, base_sha256: str, target: Artifact, wait: bool = True) -> DeltaOffer | None:
    """A bsdiff4 patch from the bytes ``base_sha256`` (what the target runs) to ``target``, or None when the
    base is not stored, either side is larger than ``MAX_DELTA_INPUT_BYTES``, or the patch is not smaller than
    the full artefact.

    The patch is computed once per (base, target) pair and recorded as an ``ArtifactDelta`` row (also when it
    is not worth it, so it is not computed again); the row is added in a savepoint of ``session`` and becomes
    durable when the caller commits. Concurrent callers compute it at most once per process and never record
    two rows for a pair (the unique constraint decides; the loser's patch blob, if different, is removed).
    At most ``MAX_CONCURRENT_DELTAS`` patches are computed at once: a caller that finds every slot busy waits
    for one, or with ``wait=False`` gets :class:`DeltaBusy` (a recorded patch never waits).
    """
    if not SHA256.match(base_sha256) or base_sha256 == target.sha256:
        return None
    row = _recorded(session, base_sha256, target.sha256)
    if row is not None and (row.size >= target.size or blobs.exists(row.sha256)):
        return _offer(row, target, blobs)
    if not blobs.exists(base_sha256) or not blobs.exists(target.sha256):
        return None
    if max(blobs.size(base_sha256), target.size) > MAX_DELTA_INPUT_BYTES:
        return None
    pair = (base_sha256, target.sha256)
    with _delta_lock(*pair):
        row = _recorded(session, base_sha256, target.sha256)
        if row is not None and (row.size >= target.size or blobs.exists(row.sha256)):
            return _offer(row, target, blobs)
        computed = _computed(pair, target, blobs)
        if computed is None:
            if not _DELTA_SLOTS.acquire(blocking=wait):
                raise DeltaBusy(f"{MAX_CONCURRENT_DELTAS} deltas are being computed")
            try:
                patch = bsdiff4.diff(read_blob(blobs, base_sha256), read_blob(blobs, target.sha256))
            finally:
                _DELTA_SLOTS.release()
            computed = blobs.put_bytes(patch) if len(patch) < target.size else (hashlib.sha256(patch).hexdigest(), len(patch))
            with _DELTA_LOCKS_GUARD:
                _COMPUTED[pair] = computed
                while len(_COMPUTED) > _COMPUTED_KEPT:
                    _COMPUTED.pop(next(iter(_COMPUTED)))
    # Recorded outside the pair's lock: a caller whose transaction already writes (the rollout's, on SQLite) may
    # wait here for the pair; it takes the patch from _COMPUTED instead of waiting for this transaction.
    sha256, size = computed
    worth_it = size < target.size
    if row is not None:  # recorded, but its blob was lost: it is back now
        row.sha256, row.size = sha256, size
        session.add(row)
        return _offer(row, target, blobs)
    fresh = ArtifactDelta(base_sha256=base_sha256, target_sha256=target.sha256, sha256=sha256, size=size, created_at=datetime.now(UTC))
    try:
        with session.begin_nested():
            session.add(fresh)
    except IntegrityError:
        winner = _recorded(session, base_sha256, target.sha256)
        if winner is None:
            raise
        if worth_it and winner.sha256 != sha256 and find_by_sha256(session, sha256) is None and not is_delta_blob(session, sha256):
            blobs.delete(sha256)
        return _offer(winner, target, blobs)
    log.info("delta %s -> %s: %d bytes (full %d)%s", base_sha256[:12], target.sha256[:12], size, target.size, "" if worth_it else ", not offered")
    return _offer(fresh, target, blobs)


def _computed(pair: tuple[str, str], target: Artifact, blobs: BlobStore) -> tuple[str, int] | None:
    """The patch this process computed for ``pair`` lately (its SHA-256 and size), if its blob is still here."""
    with _DELTA_LOCKS_GUARD:
        computed = _COMPUTED.get(pair)
    if computed is None or (computed[1] < target.size and not blobs.exists(computed[0])):
        return None
    return computed


def prepare_deltas(engine: Engine, blobs: BlobStore, artifact_id: str, bases: list[str]) -> int:
    """Compute and record the deltas to ``artifact_id`` from each of ``bases`` (the versions a deployment's targets
    run) ahead of their downloads, one at a time; how many are offered. Errors are logged: a delta is an
    optimisation, the full artefact always works."""
    offered = 0
    for base in dict.fromkeys(bases):
        try:
            with Session(engine, expire_on_commit=False) as session:
                target = session.get(Artifact, artifact_id)
                if target is None:
                    return offered
                offered += offer_delta(session, blobs, base, target) is not None
                session.commit()
        except Exception:  # noqa: BLE001 - see above
            log.exception("no delta from %s to artefact %s", base[:12], artifact_id)
    return offered


def prepare_deltas_in_background(engine: Engine, blobs: BlobStore, artifact_id: str, bases: list[str]) -> threading.Thread | None:
    """:func:`prepare_deltas` in a daemon thread (never in a request); None when there is nothing to compute."""
    bases = [b for b in dict.fromkeys(bases) if SHA256.match(b)]
    if not bases:
        return None
    thread = threading.Thread(target=prepare_deltas, args=(engine, blobs, artifact_id, bases), name=f"deltas-{artifact_id}", daemon=True)
    thread.start()
    return thread
