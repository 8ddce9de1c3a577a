"""Helpers for tests that run the real processes: broker, hub and agents on 127.0.0.1 free ports."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

AISYNERGY = [sys.executable, "-m", "cloud.cli.root"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(predicate: Callable[[], object], timeout: float, interval: float = 0.05, what: str = "condition") -> object:
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def start(args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start a child in its own process group, output to ``log``."""
    fh = log.open("ab")
    return subprocess.Popen(
        args, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, start_new_session=True
    )


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 10) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


@dataclass
class Broker:
    data_dir: Path
    port: int
    proc: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"mqtts://127.0.0.1:{self.port}"


def start_broker(data_dir: Path, port: int | None = None) -> Broker:
    port = port or free_port()
    data_dir.mkdir(parents=True, exist_ok=True)
    proc = start([*AISYNERGY, "broker", "run", "--data-dir", str(data_dir), "--port", str(port)], data_dir / "broker.log")
    wait_for(lambda: port_open(port) or proc.poll() is not None, 20, what="broker port")
    if proc.poll() is not None:
        raise RuntimeError(f"broker exited: {(data_dir / 'broker.log').read_text()[-2000:]}")
    return Broker(data_dir, port, proc)


@dataclass
class Hub:
    data_dir: Path
    port: int
    database_url: str
    proc: subprocess.Popen[bytes]
    tokens: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, role: str = "admin") -> httpx.Client:
        return httpx.Client(base_url=self.url + "/api/v1", headers={"Authorization": f"Bearer {self.tokens[role]}"}, timeout=10)

    def health(self) -> dict | None:
        try:
            r = httpx.get(self.url + "/healthz", timeout=1)
            return r.json() if r.status_code == 200 else None
        except httpx.HTTPError:
            return None


def create_token(data_dir: Path, database_url: str, role: str) -> str:
    out = subprocess.run(
        [*AISYNERGY, "hub", "token", "create", "--role", role, "--data-dir", str(data_dir), "--database-url", database_url],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return out.stdout.strip().splitlines()[-1]


def start_hub(data_dir: Path, database_url: str, broker_url: str, heartbeat_interval: float = 0.5,
              offline_after_missed: int = 3, wait_mqtt: bool = True, port: int | None = None) -> Hub:  # fmt: skip
    port = port or free_port()
    data_dir.mkdir(parents=True, exist_ok=True)
    args = [*AISYNERGY, "hub", "serve", "--port", str(port), "--data-dir", str(data_dir), "--database-url", database_url,
            "--broker-url", broker_url, "--heartbeat-interval", str(heartbeat_interval),
            "--offline-after-missed", str(offline_after_missed)]  # fmt: skip
    proc = start(args, data_dir / "hub.log", env={"AISYNERGY_LIVENESS_CHECK_INTERVAL_S": "0.2"})
    hub = Hub(data_dir, port, database_url, proc)
    wait_for(lambda: hub.health() or proc.poll() is not None, 30, what="hub health")
    if proc.poll() is not None:
        raise RuntimeError(f"hub exited: {(data_dir / 'hub.log').read_text()[-3000:]}")
    if wait_mqtt:
        wait_for(lambda: (hub.health() or {}).get("mqtt", {}).get("connected"), 30, what="hub connected to broker")
    for role in ("admin", "operator", "viewer"):
        hub.tokens[role] = create_token(data_dir, database_url, role)
    return hub
