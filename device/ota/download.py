"""Resumable artefact downloads from the device's artefact source (its edge, or the hub).

``GET <base>/<path>`` with the order's download token in ``X-Download-Token``, into
``<partial dir>/<sha256>.part``. After an interruption the next attempt asks for the rest with
``Range: bytes=<have>-`` and keeps the bytes only from a ``206`` whose ``Content-Range`` starts where
the file ends; a ``200`` restarts from zero. Connection errors, short bodies and 5xx answers are retried
with jittered back-off (``attempts`` in all); 4xx answers are not. The file never grows beyond the size
the signed manifest states.
"""

from __future__ import annotations

import logging
import random
import re
import ssl
import threading
from collections.abc import Callable
from pathlib import Path

import httpx

from device.tls import server_name_extension, tls_verify
from interfaces.deployments import DOWNLOAD_TOKEN_HEADER

log = logging.getLogger("aisynergy.device.ota")

CHUNK = 64 * 1024
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


class DownloadError(Exception):
    """The file could not be fetched (after the retries, or refused outright)."""


class OversizedContent(DownloadError):
    """The source sent more bytes than the signed manifest states: not the artefact that was signed."""


class DownloadCanceled(DownloadError):
    """The agent is stopping; the partial file stays for the next attempt."""


class Downloader:
    def __init__(
        self,
        base_url: str,
        partial_dir: Path,
        *,
        attempts: int = 5,
        max_delay_s: float = 30.0,
        timeout_s: float = 30.0,
        transport: httpx.BaseTransport | None = None,
        verify: ssl.SSLContext | str | bool = True,
        server_name: str | None = None,
        canceled: threading.Event | None = None,
    ) -> None:
        """``server_name``: the name in the server's certificate when it is not the URL's host (see :mod:`device.tls`)."""
        self.base_url = base_url.rstrip("/")
        self.partial_dir = Path(partial_dir)
        self._attempts, self._max_delay_s, self._timeout_s = attempts, max_delay_s, timeout_s
        self._transport, self._verify, self._server_name = transport, verify, server_name
        self._canceled = canceled or threading.Event()

    def url(self, path: str) -> str:
        """Only paths below the base: the token never travels anywhere else."""
        return self.base_url + ("" if path.startswith("/") else "/") + path

    def part_path(self, sha256: str) -> Path:
        return self.partial_dir / f"{sha256}.part"

    def fetch(self, path: str, token: str, sha256: str, size: int, on_progress: Callable[[int], None] | None = None) -> Path:
        """The complete ``<sha256>.part`` (exactly ``size`` bytes; the caller verifies the content)."""
        self.partial_dir.mkdir(parents=True, exist_ok=True)
        part, url = self.part_path(sha256), self.url(path)
        last = "no attempt made"
        with httpx.Client(transport=self._transport, verify=tls_verify(self._verify), timeout=self._timeout_s) as client:
            for attempt in range(1, self._attempts + 1):
                if self._canceled.is_set():
                    raise DownloadCanceled("the agent is stopping")
                have = part.stat().st_size if part.exists() else 0
                if have > size:
                    part.unlink()
                    have = 0
                if have == size:
                    return part
                try:
                    self._get(client, url, token, part, have, size, on_progress)
                except httpx.TransportError as exc:
                    last = f"{type(exc).__name__}: {exc}"
                except _Retry as exc:
                    last = str(exc)
                else:
                    if part.stat().st_size == size:
                        return part
                    last = f"the body ended after {part.stat().st_size} of {size} bytes"
                if attempt < self._attempts:
                    delay = random.uniform(0, min(self._max_delay_s, 0.2 * 2**attempt))
                    log.warning("download of %s interrupted (%s); retrying in %.1f s", url, last, delay)
                    if self._canceled.wait(delay):
                        raise DownloadCanceled("the agent is stopping")
        raise DownloadError(f"{url}: {last} ({self._attempts} attempts)")

    def _get(
        self, client: httpx.Client, url: str, token: str, part: Path, have: int, size: int, on_progress: Callable[[int], None] | None
    ) -> None:
        headers = {DOWNLOAD_TOKEN_HEADER: token}
        if have:
            headers["Range"] = f"bytes={have}-"
        log.info("GET %s (from byte %s of %s)", url, have, size)
        with client.stream("GET", url, headers=headers, extensions=server_name_extension(self._server_name)) as response:
            status = response.status_code
            if status == 416 and have:
                part.unlink(missing_ok=True)  # the server has less than we kept: start again
                raise _Retry("416 range not satisfiable; restarting from zero")
            if status >= 500 or status == 429:
                raise _Retry(f"HTTP {status}")
            if status >= 400 or status not in (200, 206):
                raise DownloadError(f"{url}: HTTP {status} {response.reason_phrase}")
            if status == 206:
                match = _CONTENT_RANGE.match(response.headers.get("content-range", ""))
                if not have or match is None or int(match.group(1)) != have:
                    part.unlink(missing_ok=True)
                    raise _Retry(f"206 with Content-Range {response.headers.get('content-range')!r} for a request from byte {have}")
                mode = "ab"
            else:
                mode, have = "wb", 0  # a full answer: start again from zero
            with part.open(mode) as f:
                for chunk in response.iter_bytes(CHUNK):
                    if have + len(chunk) > size:
                        f.truncate(0)
                        raise OversizedContent(f"{url}: more than the {size} bytes the manifest states")
                    f.write(chunk)
                    have += len(chunk)
                    if on_progress is not None:
                        on_progress(have)
                    if self._canceled.is_set():
                        raise DownloadCanceled("the agent is stopping")


class _Retry(Exception):
    """A transient answer: try again."""

