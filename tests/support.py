"""Helpers for tests that run the real processes: broker, hub and agents on 127.0.0.1 free ports."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

AISYNERGY = [sys.executable, "-m", "cloud.cli.root"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def logs_on_failure(*logs: Path, chars: int = 4000) -> Iterator[None]:
    """A failed assertion inside carries the end of each log: what the processes said when it failed."""
    try:
        yield
    except AssertionError as exc:
        tails = []
        for log in logs:
            text = log.read_text(errors="replace")[-chars:] if log.exists() else "(no log)"
            tails.append(f"--- {log.name} ---\n{text}")
        raise AssertionError(f"{exc}\n" + "\n".join(tails)) from exc


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


def start_broker(data_dir: Path, port: int | None = None, instance: str = "broker") -> Broker:
    port = port or free_port()
    data_dir.mkdir(parents=True, exist_ok=True)
    proc = start([*AISYNERGY, "broker", "run", "--data-dir", str(data_dir), "--port", str(port), "--instance", instance],
                 data_dir / f"{instance}.log")  # fmt: skip
    wait_for(lambda: port_open(port) or proc.poll() is not None, 20, what="broker port")
    if proc.poll() is not None:
        raise RuntimeError(f"broker exited: {(data_dir / f'{instance}.log').read_text()[-2000:]}")
    return Broker(data_dir, port, proc)


@dataclass
class Hub:
    data_dir: Path
    port: int
    database_url: str
    proc: subprocess.Popen[bytes]
    tokens: dict[str, str] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)  # how it was started (restart_hub)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, role: str = "admin") -> httpx.Client:
        return httpx.Client(base_url=self.url + "/api/v1", headers={"Authorization": f"Bearer {self.tokens[role]}"}, timeout=30)

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
    # plain HTTP on the loopback: what these hubs serve is under test, not TLS (tests/integration/test_https.py
    # and test_up.py run the hub as it runs by default, over HTTPS)
    args = [*AISYNERGY, "hub", "serve", "--port", str(port), "--data-dir", str(data_dir), "--database-url", database_url,
            "--broker-url", broker_url, "--heartbeat-interval", str(heartbeat_interval),
            "--offline-after-missed", str(offline_after_missed), "--no-tls"]  # fmt: skip
    hub = _serve(Hub(data_dir, port, database_url, start(args, data_dir / "hub.log", env=HUB_ENV), args=args), wait_mqtt)
    for role in ("admin", "operator", "viewer"):
        hub.tokens[role] = create_token(data_dir, database_url, role)
    return hub


def restart_hub(hub: Hub, wait_mqtt: bool = True) -> Hub:
    """The same hub (port, data, database, tokens) started again, after its process ended."""
    proc = start(hub.args, hub.data_dir / "hub.log", env=HUB_ENV)
    return _serve(Hub(hub.data_dir, hub.port, hub.database_url, proc, dict(hub.tokens), hub.args), wait_mqtt)


HUB_ENV = {"AISYNERGY_LIVENESS_CHECK_INTERVAL_S": "0.2"}


def _serve(hub: Hub, wait_mqtt: bool) -> Hub:
    proc = hub.proc
    wait_for(lambda: hub.health() or proc.poll() is not None, 30, what="hub health")
    if proc.poll() is not None:
        raise RuntimeError(f"hub exited: {(hub.data_dir / 'hub.log').read_text()[-3000:]}")
    if wait_mqtt:
        wait_for(lambda: (hub.health() or {}).get("mqtt", {}).get("connected"), 30, what="hub connected to broker")
    return hub


# ---- a simulated agent speaking only the documented protocol (for broker-level tests) ----------------
@dataclass
class Identity:
    node_id: str
    directory: Path

    @property
    def cert(self) -> Path:
        return self.directory / "node.crt"

    @property
    def key(self) -> Path:
        return self.directory / "node.key"

    @property
    def ca(self) -> Path:
        return self.directory / "ca.crt"


def enrol(hub: Hub, node_id: str, bootstrap_token: str, directory: Path, kind: str = "nodes") -> Identity:
    """Enrol a node (or, with ``kind="devices"``, a device) at the hub; ``Identity.node_id`` is its id."""
    from cryptography.hazmat.primitives import serialization

    from cloud.pki import make_csr, new_private_key

    key = new_private_key()
    r = httpx.post(f"{hub.url}/api/v1/{kind}/{node_id}/certificate", json={"csr_pem": make_csr(key, node_id), "bootstrap_token": bootstrap_token})
    assert r.status_code == 201, r.text
    body = r.json()
    directory.mkdir(parents=True, exist_ok=True)
    ident = Identity(node_id, directory)
    ident.cert.write_text(body["certificate_pem"])
    ident.ca.write_text(body["ca_pem"])
    ident.key.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return ident


class MqttProbe:
    """A paho MQTT 5 client with one identity, recording connects, acks and messages."""

    def __init__(self, ident: Identity, port: int) -> None:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        self.events: list[tuple[str, object]] = []
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=ident.node_id, protocol=mqtt.MQTTv5)
        self.client.tls_set(ca_certs=str(ident.ca), certfile=str(ident.cert), keyfile=str(ident.key))
        self.client.on_connect = lambda c, u, f, rc, p: self.events.append(("connect", str(rc)))
        self.client.on_disconnect = lambda c, u, f, rc, p: self.events.append(("disconnect", str(rc)))
        self.client.on_publish = lambda c, u, mid, rc, p: self.events.append(("puback", (mid, str(rc))))
        self.client.on_subscribe = lambda c, u, mid, codes, p: self.events.append(("suback", (mid, [str(x) for x in codes])))
        self.client.on_message = lambda c, u, m: self.events.append(("message", (m.topic, m.payload)))
        self.port = port

    def connect(self) -> MqttProbe:
        try:
            self.client.connect("127.0.0.1", self.port, keepalive=30)
        except OSError as exc:  # TLS refusal can surface here
            self.events.append(("refused", str(exc)))
            return self
        self.client.loop_start()
        return self

    def connected(self) -> bool:
        return ("connect", "Success") in self.events

    def publish(self, topic: str, payload: bytes | str, qos: int = 1, retain: bool = False) -> str:
        """Publish and return the broker's PUBACK reason string."""
        info = self.client.publish(topic, payload, qos=qos, retain=retain)
        return self._ack("puback", info.mid)  # type: ignore[return-value]

    def subscribe(self, topic_filter: str, qos: int = 1) -> list[str]:
        """Subscribe and return the broker's SUBACK reason strings (``Not authorized`` for a refused filter)."""
        _, mid = self.client.subscribe(topic_filter, qos=qos)
        return self._ack("suback", mid)  # type: ignore[return-value]

    def _ack(self, kind: str, mid: int) -> object:
        wait_for(lambda: any(e[0] == kind and e[1][0] == mid for e in self.events), 30, what=kind)  # type: ignore[index]
        return next(e[1][1] for e in self.events if e[0] == kind and e[1][0] == mid)  # type: ignore[index]

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()
