"""The edge's artefact cache: devices download their deployments from the edge, which may be all they can reach.

Routes on the device listener (``edge.enrol_proxy``), the very same paths and token as the hub's (DESIGN §4.2)::

    GET|HEAD /api/v1/artifacts/{id}/content              X-Download-Token: <token>
    GET|HEAD /api/v1/artifacts/{id}/delta?from=<sha256>  X-Download-Token: <token>

The token is checked offline against the hub's pinned signing key (401 ``invalid_download_token``); its
``sha256`` names the blob. A cached blob is served from disk (one byte range: 206, 416; ``Accept-Ranges``,
``ETag: "<sha256>"``). A miss is fetched from the hub with the device's token into ``<sha256>.part``,
resumed with ``Range: bytes=<have>-`` after an interruption (a 206 must start there; a 200 starts over),
and moved into the cache only when its SHA-256 is the grant's (a delta's: the hub's ETag, or the order's
offer). Concurrent requests for one blob share one upstream download. The hub's refusals (404 unknown
artefact or delta, 401, 503 ``busy`` with its ``Retry-After``, ...) pass through; the hub unreachable and the
blob not cached: 503 ``hub_unreachable``; the hub sent other bytes than it signed: 502 ``invalid_response``,
nothing kept. A delta is served only from the base the token names (its order's), cached or not: 403 else.

Layout under ``<data dir>/artifacts/``::

    <sha256>                a verified blob (content or delta)
    <sha256>.part           a download in progress or interrupted
    deltas/<base>-<target>  the SHA-256 of the delta from ``base`` to ``target``

Blobs and leftover partial downloads stay within a size budget (default 2 GiB): the least recently used
go first, never one being served or written. A blob's mtime is its LRU stamp, so the order survives a
restart. ``prefetch`` fetches an ordered artefact in the background, so that devices find it here even
when the hub is gone by the time they ask.

Integrity. A cached blob is checked before it is served: its SHA-256 against its name, which is the digest
the hub signed (the token's grant, the manifest's ``sha256``; a delta's: the digest it was verified against
when fetched), and first its size against the size it had when those bytes verified (a device's request
carries the token, not the manifest; the digest fixes the size). A blob that fails (flipped bits, a
truncated or unreadable file) is dropped, counted (``corrupt_dropped``), logged, and fetched again from
the hub: the request that found it waits for that download and gets the good bytes, or, with the hub
unreachable, 503 ``hub_unreachable``, which the device retries. Hashing a large blob on every Range
request would cost a full read each time, so the cache keeps, in memory, the stamp of each blob as last
verified: device, inode, size, mtime_ns and ctime_ns. The full check (``integrity_checks``) runs only
when the stamp differs: once per change of the file, and once per blob after a restart. A download,
hashed before it is moved into the cache, is recorded then (no second read); the LRU touch moves the
record along under the cache's lock. Its limit: a change that keeps the stamp goes
unseen until the edge restarts: bits that rot below the file system, a write within the file system's
timestamp granularity of the last check, or one between that check and the touch (microseconds). The
device still refuses such bytes (SHA-256 + Ed25519), so nothing wrong is installed.

One concern a module: :mod:`~edge.artifacts.answers` (the routes, problem documents, byte ranges),
:mod:`~edge.artifacts.store` (the blobs on disk: pins, integrity, budget and eviction), :mod:`~edge.artifacts.fetch`
(downloads from the hub, resumed), :mod:`~edge.artifacts.keys` (the hub's signing keys: pinning and catching up with
a rotation), and :mod:`~edge.artifacts.cache`, the :class:`ArtifactCache` that puts them together.
"""

from edge.artifacts.answers import Answer, Refused, problem
from edge.artifacts.cache import ArtifactCache
from edge.artifacts.fetch import Downloader
from edge.artifacts.keys import HubSigningKeys
from edge.artifacts.store import DEFAULT_BUDGET_BYTES, BlobStore, parse_size

__all__ = ["DEFAULT_BUDGET_BYTES", "Answer", "ArtifactCache", "BlobStore", "Downloader", "HubSigningKeys", "Refused", "parse_size", "problem"]
