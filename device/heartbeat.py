"""Heartbeats, the same at both tiers: :class:`HeartbeatBuilder` makes the body (a fresh resource reading, health,
uptime, a per-run ``seq``) for a device and for an edge node alike; :class:`Heartbeats` is the device's thread that
sends one every interval while connected, and one at once on each connect (the edge sends from its event loop)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version

import psutil

from device.resources import ResourceSampler
from interfaces.messages import ConnectionState, Health, HeartbeatBody, StateBody
from interfaces.resources import Resources

log = logging.getLogger("aisynergy.device")

try:
    AGENT_VERSION = version("aisynergy")
except PackageNotFoundError:  # pragma: no cover - running from a bare checkout
    AGENT_VERSION = "0+unknown"


def state_body(state: ConnectionState, reason: str | None = None) -> StateBody:
    """The retained ``state`` of an agent (a device or an edge node): online, or offline with why."""
    return StateBody(state=state, agent_version=AGENT_VERSION, reason=reason)


class HeartbeatBuilder:
    """The next heartbeat body of one agent run (not thread-safe: one sender calls it)."""

    def __init__(self, sampler: ResourceSampler, agent_version: str) -> None:
        self._sampler, self._agent_version = sampler, agent_version
        self._started = time.monotonic()
        self._seq = 0  # per run, as HeartbeatBody.seq says
        self._last_resources: Resources | None = None

    def next_body(self) -> HeartbeatBody | None:
        """``None`` until there is a first resource reading (a heartbeat must carry one); a failed reading
        reports ``degraded`` health with the last good one."""
        health, detail = Health.OK, None
        try:
            self._last_resources = self._sampler.read()
        except (OSError, psutil.Error) as exc:
            log.warning("cannot read resources: %s", exc)
            health, detail = Health.DEGRADED, f"resource readings failed: {exc}"[:512]
        if self._last_resources is None:
            return None
        body = HeartbeatBody(
            seq=self._seq,
            health=health,
            health_detail=detail,
            agent_version=self._agent_version,
            uptime_s=time.monotonic() - self._started,
            resources=self._last_resources,
        )
        self._seq += 1
        return body


class Heartbeats:
    def __init__(
        self,
        interval_s: float,
        sampler: ResourceSampler,
        agent_version: str,
        send: Callable[[HeartbeatBody], None],
        connected: threading.Event,
    ) -> None:
        self.interval_s = interval_s
        self._send, self._connected = send, connected
        self._builder = HeartbeatBuilder(sampler, agent_version)
        self._now = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="aisynergy-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def beat_now(self) -> None:
        self._now.set()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopping = True
        self._now.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            self._now.wait(self.interval_s)
            self._now.clear()
            if self._stopping:
                return
            if not self._connected.is_set():
                continue
            try:
                body = self.next_body()
                if body is not None:
                    self._send(body)
                    log.debug("heartbeat %s sent", body.seq)
            except Exception:  # the thread must outlive any one bad reading
                log.exception("heartbeat failed")

    def next_body(self) -> HeartbeatBody | None:
        return self._builder.next_body()
