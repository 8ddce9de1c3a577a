"""Heartbeats: a thread that sends one every interval while connected, and one at once on each connect."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import psutil

from device.resources import ResourceSampler
from interfaces.messages import Health, HeartbeatBody
from interfaces.resources import Resources

log = logging.getLogger("aisynergy.device")


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
        self._sampler, self._agent_version, self._send, self._connected = sampler, agent_version, send, connected
        self._started = time.monotonic()
        self._seq = 0  # per run, as HeartbeatBody.seq says
        self._last_resources: Resources | None = None
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
        """``None`` until there is a first resource reading (a heartbeat must carry one)."""
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
