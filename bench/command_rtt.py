#!/usr/bin/env python3
"""Command round trip benchmark: REST -> hub -> edge -> device -> back (DESIGN §4.1, §4.4).

What runs, each in its own process, all on 127.0.0.1:

* the broker: ``aisynergy broker run`` (Mosquitto, mutual TLS, per-identity ACL), as in production;
  with ``--downstream-broker`` a second instance (``--instance devices-broker``, same data directory and
  PKI) serves the devices, as in ``tests/integration/devstack.py``;
* the hub: ``aisynergy hub serve`` (FastAPI + SQLite WAL + MQTT bridge), default settings;
* one edge agent: ``aisynergy edge run ... --device-listen 127.0.0.1:P`` (enrolled with its bootstrap
  token, like any edge);
* ``--workers`` device-host processes, each running its share of the ``--devices`` devices as real
  :class:`device.agent.Device` instances (the SDK that ``aisynergy device run`` wraps), one MQTT session
  each. Every device is registered with ``POST /api/v1/devices``, gets a one-time token from
  ``POST /api/v1/devices/{id}/bootstrap-token`` and enrols through the edge's ``--device-listen`` proxy
  (HTTPS, checked against the CA fingerprint and the server name that answer carries);
* this orchestrator: registration, the REST load, the raw MQTT baseline, psutil sampling.

Measured:

1. *REST command round trip*: ``POST /api/v1/devices/{id}/commands {"name": "ping"}`` through one
   persistent ``httpx.Client`` (admin token), devices chosen round-robin, ``--commands`` requests
   sequentially, then the same number with ``--concurrency`` in flight. Client-side latency from just
   before the request to the parsed answer; every answer must be ``200`` with ``ok: true``.
2. *Raw MQTT baseline* through the same broker: two paho MQTT 5 clients with certificates from the hub
   CA (an edge-like requester and a device-like responder, see "identities" below). The requester
   publishes (QoS 1, like the hub and the edge) with ``ResponseTopic`` + ``CorrelationData``; the
   responder answers on the response topic with the correlation data echoed. Same count, same
   concurrencies, same payload sizes.
3. The ratios REST / raw for p50 and p99 (target: p99 ratio <= 5).
4. *Idle device agent*: one ``aisynergy device run`` process, connected, with the default heartbeat
   interval (the hub's, 10 s): RSS, USS and CPU % over ``--idle-seconds`` (psutil).

Identities of the raw baseline: the hub's own identity (``pki/hub.crt``) cannot be used while the hub
runs: the broker takes the certificate's CN as client id, so a second ``hub`` session would take over
the hub's. The baseline registers a node and a device under it through REST (so the broker's ACL gives
the node the device's subtree, exactly as for the real edge) and signs a certificate for each with
``CertificateAuthority.sign_csr``; the requester then sits where the edge sits, the responder where the
device sits, on the same topics (``synergy/v1/devices/{id}/cmd`` and ``.../cmd/reply``).

Usage::

    python bench/command_rtt.py --devices 100 --commands 1000 [--concurrency 8] [--out bench/results/command-rtt-100.json]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import itertools
import json
import math
import os
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for p in (str(ROOT), str(BENCH)):
    if p not in sys.path:  # run as a script from a checkout
        sys.path.insert(0, p)

# the same helpers (and so the same percentile definition, machine and code records) as heartbeat_load
from heartbeat_load import (
    AISYNERGY,
    Proc,
    Sampler,
    _r,
    code_version,
    free_port,
    log,
    machine_info,
    port_open,
    raise_nofile,
    start_proc,
    summary_ms,
    wait_until,
)  # fmt: skip

PING = {"name": "ping", "args": {}}

# --tcp-nodelay (diagnostic): up to commit 83f9f43 neither Mosquitto's configuration nor the MQTT clients
# (paho, and aiomqtt on top of it) set TCP_NODELAY, so small MQTT packets met Nagle's algorithm and the
# peer's delayed ACK (about 40 ms on Linux) at every hop of the path; bfe65e4 sets it everywhere. The
# switch forces TCP_NODELAY on everywhere without touching the product (for commits before that one):
# a sitecustomize module (put on PYTHONPATH of every Python process this script starts, and executed in
# this one) sets it on every TCP socket before it connects, and a ``mosquitto`` shim first on the
# brokers' PATH appends ``set_tcp_nodelay true`` to the generated configuration unless it is there.
NODELAY_SITECUSTOMIZE = """\
# written by bench/command_rtt.py --tcp-nodelay: TCP_NODELAY on every TCP socket of this process
import socket as _socket

_connect = _socket.socket.connect


def _nodelay_connect(self, address, _connect=_connect):
    if self.family in (_socket.AF_INET, _socket.AF_INET6) and self.type == _socket.SOCK_STREAM:
        try:
            self.setsockopt(_socket.IPPROTO_TCP, _socket.TCP_NODELAY, 1)
        except OSError:
            pass
    return _connect(self, address)


_socket.socket.connect = _nodelay_connect
"""
NODELAY_MOSQUITTO_SHIM = """\
#!/bin/sh
# written by bench/command_rtt.py --tcp-nodelay: mosquitto -c CONF with set_tcp_nodelay true
for conf; do :; done
grep -q '^set_tcp_nodelay' "$conf" 2>/dev/null || printf '\\nset_tcp_nodelay true\\n' >> "$conf"
exec {binary} "$@"
"""


def nodelay_env(work: Path) -> dict[str, str]:
    """Write the --tcp-nodelay shims under ``work`` and return the environment that applies them."""
    from cloud.broker.runner import find_mosquitto

    binary = find_mosquitto()
    if binary is None:
        raise RuntimeError("mosquitto not found")
    site, bindir = work / "nodelay-site", work / "nodelay-bin"
    site.mkdir(parents=True, exist_ok=True)
    bindir.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(NODELAY_SITECUSTOMIZE)
    shim = bindir / "mosquitto"
    shim.write_text(NODELAY_MOSQUITTO_SHIM.replace("{binary}", binary))
    shim.chmod(0o755)
    runpy.run_path(str(site / "sitecustomize.py"))  # this process too
    pythonpath = os.pathsep.join(x for x in (str(site), os.environ.get("PYTHONPATH", "")) if x)
    return {"PYTHONPATH": pythonpath, "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"}


# ---------------------------------------------------------------------------------------------------
# device-host worker: many device.agent.Device instances in one process
# ---------------------------------------------------------------------------------------------------
def worker_main(spec_path: Path) -> int:
    """Start every device of the spec (enrolling each through the edge), keep them up until SIGTERM,
    the orchestrator's exit or the spec's deadline, then stop them (each publishes ``offline``)."""
    import logging

    spec = json.loads(spec_path.read_text())
    if spec.get("nice"):  # --device-nice: the simulated fleet yields the CPU to the system under test
        os.nice(spec["nice"])
    logging.basicConfig(level=spec.get("log_level", "INFO"), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if os.environ.get("AISYNERGY_BENCH_TRACE"):  # diagnostics (rollout.py --trace)
        import _trace

        _trace.install_device()
    from device.agent import Device

    status_path = Path(spec["status"])
    parent, deadline = os.getppid(), time.monotonic() + spec["max_lifetime_s"]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    devices: list[Any] = []
    status: dict[str, Any] = {"pid": os.getpid(), "enrolled": 0, "errors": [], "start_ms": [], "enrolling_done": False}

    def write() -> None:
        status["connected"] = sum(1 for d in devices if d.connected)
        tmp = status_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(status))
        os.replace(tmp, status_path)

    for d in spec["devices"]:
        if stop.is_set() or time.monotonic() > deadline:
            break
        t0 = time.perf_counter()
        dev = Device(d["id"], d["dir"], enrol_url=spec["enrol_url"], bootstrap_token=d["token"],
                     ca_sha256=d["ca_sha256"], tls_server_name=d["tls_server_name"])  # fmt: skip
        try:
            dev.start()  # enrols (CSR -> edge proxy -> hub), then connects in the background
        except Exception as exc:  # noqa: BLE001 - reported to the orchestrator
            status["errors"].append(f"{d['id']}: {type(exc).__name__}: {exc}")
            continue
        status["start_ms"].append(round((time.perf_counter() - t0) * 1000, 1))
        status["enrolled"] += 1
        devices.append(dev)
        write()
    status["enrolling_done"] = True
    write()
    while not stop.wait(1.0):
        if os.getppid() != parent or time.monotonic() > deadline:
            break
        write()
    for dev in devices:
        with contextlib.suppress(Exception):
            dev.stop(timeout_s=2)
    status["stopped"] = True
    write()
    logging.shutdown()
    os._exit(0)  # daemon threads of stopped devices need no joining


# ---------------------------------------------------------------------------------------------------
# the raw MQTT request/response baseline
# ---------------------------------------------------------------------------------------------------
class RawPair:
    """An edge-like requester and a device-like responder, paho MQTT 5 with threaded network loops and
    TCP_NODELAY set on connect (as the device SDK does), talking over ``synergy/v1/devices/{device}/cmd``
    and ``.../cmd/reply``."""

    def __init__(self, pki_dir: Path, work: Path, node_id: str, device_id: str, port: int) -> None:
        import uuid

        import paho.mqtt.client as mqtt
        from cryptography.hazmat.primitives import serialization
        from paho.mqtt.enums import CallbackAPIVersion
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        from interfaces.messages import HUB_SRC
        from cloud.pki import CertificateAuthority, make_csr, new_private_key
        from interfaces.messages import CommandBody, CommandResultBody, envelope
        from interfaces.topics import DEVICE_CMD, DEVICE_CMD_REPLY

        self._uuid, self._Properties, self._PUBLISH = uuid, Properties, PacketTypes.PUBLISH
        ca = CertificateAuthority.load_or_create(pki_dir)
        work.mkdir(parents=True, exist_ok=True)
        (work / "ca.crt").write_text(ca.ca_pem)
        paths: dict[str, tuple[Path, Path]] = {}
        for cn in (node_id, device_id):
            key = new_private_key()
            crt_path, key_path = work / f"{cn}.crt", work / f"{cn}.key"
            crt_path.write_text(ca.sign_csr(make_csr(key, cn), cn).certificate_pem)
            key_path.write_bytes(
                key.private_bytes(
                    serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
                )
            )
            key_path.chmod(0o600)
            paths[cn] = (crt_path, key_path)
        self.cmd_topic = DEVICE_CMD.topic(device_id=device_id)
        self.reply_topic = DEVICE_CMD_REPLY.topic(device_id=device_id)
        # the same bytes as the real path carries: the hub's command envelope, the device's ping answer
        self.request_payload = (
            envelope(HUB_SRC, CommandBody(name="ping", args={}, timeout_s=5)).model_dump_json().encode()
        )
        self.reply_payload = (
            envelope(device_id, CommandResultBody(ok=True, result={"pong": True})).model_dump_json().encode()
        )
        self._pending: dict[bytes, threading.Event] = {}
        self._lock = threading.Lock()
        self.unmatched = 0
        self._subacks: dict[str, threading.Event] = {}
        self.clients: dict[str, Any] = {}
        for role, cn in (("responder", device_id), ("requester", node_id)):
            c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=cn, protocol=mqtt.MQTTv5)
            c.tls_set(ca_certs=str(work / "ca.crt"), certfile=str(paths[cn][0]), keyfile=str(paths[cn][1]))
            c.max_inflight_messages_set(100)
            self._subacks[role] = threading.Event()
            c.on_subscribe = lambda _c, _u, _mid, codes, _p, role=role: (
                self._subacks[role].set() if not any(rc.is_failure for rc in codes) else None
            )
            c.on_message = self._answer if role == "responder" else self._reply
            self.clients[role] = c
        self.port = port

    def start(self, timeout: float = 15) -> None:
        for role, topic in (("responder", self.cmd_topic), ("requester", self.reply_topic)):
            c = self.clients[role]
            connected = threading.Event()

            def on_connect(client: Any, _u: Any, _f: Any, rc: Any, _p: Any, ev: threading.Event = connected) -> None:
                if rc.is_failure:
                    return
                sock = client.socket()
                if sock is not None:  # as the product's clients do (device SDK, hub and edge since bfe65e4)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                ev.set()

            c.on_connect = on_connect
            c.connect("127.0.0.1", self.port, keepalive=30)
            c.loop_start()
            if not connected.wait(timeout):
                raise RuntimeError(f"raw {role} did not connect")
            c.subscribe(topic, qos=1)
            if not self._subacks[role].wait(timeout):
                raise RuntimeError(f"raw {role} subscription to {topic} refused or unanswered")

    def _answer(self, client: Any, _u: Any, msg: Any) -> None:
        props = self._Properties(self._PUBLISH)
        corr = getattr(msg.properties, "CorrelationData", None)
        if corr is not None:
            props.CorrelationData = corr
        client.publish(
            getattr(msg.properties, "ResponseTopic", None) or self.reply_topic,
            self.reply_payload,
            qos=1,
            properties=props,
        )

    def _reply(self, _c: Any, _u: Any, msg: Any) -> None:
        corr = getattr(msg.properties, "CorrelationData", None)
        with self._lock:
            ev = self._pending.pop(bytes(corr), None) if corr is not None else None
            if ev is None:
                self.unmatched += 1
        if ev is not None:
            ev.set()

    def call(self, timeout: float) -> bool:
        corr = self._uuid.uuid4().bytes
        ev = threading.Event()
        with self._lock:
            self._pending[corr] = ev
        props = self._Properties(self._PUBLISH)
        props.ResponseTopic = self.reply_topic
        props.CorrelationData = corr
        self.clients["requester"].publish(self.cmd_topic, self.request_payload, qos=1, properties=props)
        if ev.wait(timeout):
            return True
        with self._lock:
            self._pending.pop(corr, None)
        return False

    def close(self) -> None:
        for c in self.clients.values():
            with contextlib.suppress(Exception):
                c.disconnect()
                c.loop_stop()


# ---------------------------------------------------------------------------------------------------
# the load phases
# ---------------------------------------------------------------------------------------------------
def run_phase(
    n: int, concurrency: int, call: Callable[[int], tuple[bool, str, float | None]], deadline_s: float
) -> dict[str, Any]:
    """``call(i)`` -> (ok, outcome, server_ms) for request i; ``n`` of them, ``concurrency`` in flight,
    none started after ``deadline_s``. Latency is client-side, from just before the call to its return."""
    latencies: list[float] = [0.0] * n
    done = [False] * n
    server: list[float] = []
    outcomes: Counter[str] = Counter()
    lock = threading.Lock()
    counter = itertools.count()
    t_start = time.perf_counter()
    stop_at = t_start + deadline_s

    def loop() -> None:
        while True:
            i = next(counter)
            if i >= n or time.perf_counter() > stop_at:
                return
            t0 = time.perf_counter()
            _ok, outcome, server_ms = call(i)
            elapsed = time.perf_counter() - t0
            with lock:
                latencies[i], done[i] = elapsed, True
                outcomes[outcome] += 1
                if server_ms is not None:
                    server.append(server_ms / 1000)

    if concurrency <= 1:
        loop()
    else:
        with ThreadPoolExecutor(concurrency, thread_name_prefix="load") as pool:
            for f in [pool.submit(loop) for _ in range(concurrency)]:
                f.result()
    wall = time.perf_counter() - t_start
    lat = [x for x, d in zip(latencies, done, strict=True) if d]
    out = summary_ms(lat)
    out.update({
        "concurrency": concurrency, "requested": n, "completed": len(lat), "wall_s": _r(wall, 2),
        "throughput_per_s": _r(len(lat) / wall if wall > 0 else None), "outcomes": dict(outcomes),
        "errors": sum(v for k, v in outcomes.items() if k != "ok"),
        "samples_ms": [round(x * 1000, 2) for x in lat],
    })  # fmt: skip
    if server:
        out["hub_duration"] = {k: v for k, v in summary_ms(server).items()}
    return out


def rest_caller(
    client: Any, device_ids: list[str], timeout_s: float
) -> Callable[[int], tuple[bool, str, float | None]]:
    import httpx

    body = {**PING, "timeout_s": timeout_s}

    def call(i: int) -> tuple[bool, str, float | None]:
        try:
            r = client.post(f"/devices/{device_ids[i % len(device_ids)]}/commands", json=body)
        except httpx.HTTPError as exc:
            return False, f"http_error:{type(exc).__name__}", None
        if r.status_code != 200:
            code = ""
            with contextlib.suppress(ValueError, AttributeError):
                code = r.json().get("code", "")
            return False, f"status_{r.status_code}:{code}", None
        answer = r.json()
        return (
            bool(answer.get("ok")),
            "ok" if answer.get("ok") else f"not_ok:{answer.get('error_code')}",
            answer.get("duration_ms"),
        )

    return call


def raw_caller(pair: RawPair, timeout_s: float) -> Callable[[int], tuple[bool, str, float | None]]:
    def call(_i: int) -> tuple[bool, str, float | None]:
        ok = pair.call(timeout_s)
        return ok, "ok" if ok else "timeout", None

    return call


# ---------------------------------------------------------------------------------------------------
# the orchestrator
# ---------------------------------------------------------------------------------------------------
@dataclass
class Run:
    args: argparse.Namespace
    data_dir: Path
    broker_port: int
    hub_port: int
    enrol_port: int
    devices_broker_port: int | None = None
    procs: list[Proc] = field(default_factory=list)
    workers: list[Proc] = field(default_factory=list)
    token: str = ""
    node_id: str = ""
    env: dict[str, str] = field(default_factory=dict)  # extra environment of every child (--tcp-nodelay)
    cli: dict[str, list[str]] = field(default_factory=dict)  # "hub" / "edge": another command for that child (tracing)
    results: dict[str, Any] = field(default_factory=dict)

    @property
    def hub_url(self) -> str:
        return f"http://127.0.0.1:{self.hub_port}"

    @property
    def api(self) -> str:
        return self.hub_url + "/api/v1"

    @property
    def enrol_url(self) -> str:
        return f"https://127.0.0.1:{self.enrol_port}"  # the edge's device listener speaks HTTPS only


def code_record() -> dict[str, Any]:
    """``heartbeat_load.code_version`` with the uncommitted paths read without stripping the first
    line's leading status column (its ``git().strip()`` cuts the first path's first letter)."""
    code = code_version()
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "cloud", "interfaces", "edge", "device"],
                             check=False, capture_output=True, text=True, timeout=10).stdout  # fmt: skip
        code["uncommitted"] = [line[3:] for line in out.splitlines() if line.strip()]
    return code


def source_hashes() -> dict[str, str]:
    """SHA-256 of every Python source the processes run (the working tree may hold uncommitted work that
    others edit meanwhile): taken at start and end, a difference flags the run."""
    import hashlib

    out: dict[str, str] = {}
    for pkg in ("cloud", "interfaces", "edge", "device"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            with contextlib.suppress(OSError):
                out[str(path.relative_to(ROOT))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def tree_digest(hashes: dict[str, str]) -> str:
    import hashlib

    return hashlib.sha256("".join(f"{k} {v}\n" for k, v in sorted(hashes.items())).encode()).hexdigest()[:16]


def aisynergy_cli() -> list[str]:
    """The installed ``aisynergy`` console script when there is one (the measured device runs as exactly
    ``aisynergy device run``), else the same entry point through ``python -m``."""
    script = Path(sys.executable).parent / "aisynergy"
    return [str(script)] if script.exists() else list(AISYNERGY)


PORT_ATTEMPTS = 3  # the machine may run other tests that pick free ports too


def start_listening(run: Run, name: str, make_args: Callable[[int], list[str]], port: int, ready: Callable[[Proc, int], bool],
                    timeout: float, what: str) -> tuple[Proc, int]:  # fmt: skip
    """Start ``make_args(port)``; if it exits because the port was taken meanwhile, retry on a fresh one.
    ``ready(proc, port)`` raises for a child that exited, and says whether it is up."""
    log_path = run.data_dir / f"{name}.log"
    for attempt in range(PORT_ATTEMPTS):
        offset = log_path.stat().st_size if log_path.exists() else 0
        proc = start_proc(name, make_args(port), log_path, run.env)
        run.procs.append(proc)
        try:
            wait_until(lambda proc=proc, port=port: ready(proc, port), timeout, what, 0.2)
            return proc, port
        except RuntimeError:
            with log_path.open("rb") as fh:
                fh.seek(offset)
                tail = fh.read().decode(errors="replace").lower()
            proc.stop()
            run.procs.remove(proc)
            if "in use" not in tail or attempt == PORT_ATTEMPTS - 1:
                raise
            log(f"{name}: port {port} was taken meanwhile; retrying on another")
            port = free_port()
    raise AssertionError("unreachable")


def exited(proc: Proc) -> None:
    if proc.popen.poll() is not None:
        raise RuntimeError(f"{proc.name} exited: {proc.log.read_text(errors='replace')[-3000:]}")


def listens(proc: Proc, port: int) -> bool:
    """Whether ``proc`` or one of its children (Mosquitto under the broker runner) listens on ``port``
    (``port_open`` alone would also be true for another process that took the port)."""
    import psutil

    try:
        root = psutil.Process(proc.popen.pid)
        for p in [root, *root.children(recursive=True)]:
            for c in p.net_connections(kind="tcp"):
                if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port:
                    return True
    except psutil.Error:
        pass
    return False


def start_broker(run: Run, port: int, instance: str) -> tuple[list[Any], int]:
    import psutil

    d = run.data_dir

    def args(port: int) -> list[str]:
        return [*AISYNERGY, "broker", "run", "--data-dir", str(d), "--port", str(port), "--instance", instance]

    def ready(proc: Proc, port: int) -> bool:
        exited(proc)
        return listens(proc, port) and port_open(port)

    proc, port = start_listening(run, instance, args, port, ready, 30, f"{instance} port")
    return list(
        wait_until(
            lambda: [c for c in psutil.Process(proc.popen.pid).children(recursive=True) if "mosquitto" in c.name()],
            10,
            "mosquitto process",
        )
    ), port


def start_system(run: Run) -> dict[str, list[Any]]:
    """Broker(s), hub, admin token; returns the psutil handles to sample."""
    import httpx
    import psutil

    d = run.data_dir
    handles: dict[str, list[Any]] = {}
    handles["broker"], run.broker_port = start_broker(run, run.broker_port, "broker")
    if run.devices_broker_port:
        handles["devices_broker"], run.devices_broker_port = start_broker(
            run, run.devices_broker_port, "devices-broker"
        )

    def args(port: int) -> list[str]:
        return [*run.cli.get("hub", AISYNERGY), "hub", "serve", "--data-dir", str(d), "--port", str(port),
                "--broker-url", f"mqtts://127.0.0.1:{run.broker_port}", "--no-tls"]  # fmt: skip  (HTTP on the loopback, as measured before)

    def mqtt_up(proc: Proc, port: int) -> bool:
        exited(proc)
        if not listens(proc, port):
            return False
        try:
            r = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
            return r.status_code == 200 and bool(r.json()["mqtt"]["connected"])
        except httpx.HTTPError:
            return False

    hub, run.hub_port = start_listening(
        run, "hub", args, run.hub_port, mqtt_up, 60, "hub healthy and connected to the broker"
    )
    out = subprocess.run([*AISYNERGY, "hub", "token", "create", "--role", "admin", "--name", "bench", "--data-dir", str(d)],
                         check=True, capture_output=True, text=True, cwd=ROOT, env={**os.environ, **run.env})  # fmt: skip
    run.token = out.stdout.strip().splitlines()[-1]
    handles["hub"] = [psutil.Process(hub.popen.pid)]
    return handles


def api_ok(r: Any, what: str) -> dict[str, Any]:
    if r.status_code not in (200, 201):
        raise RuntimeError(f"{what}: {r.status_code} {r.text[:500]}")
    return dict(r.json())


def start_edge(run: Run, api: Any) -> list[Any]:
    import psutil

    reg = api_ok(
        api.post("/nodes", json={"name": "bench-edge", "labels": {"bench": "command-rtt"}}), "register the edge"
    )
    run.node_id = reg["node"]["id"]

    def args(port: int) -> list[str]:
        # a retry finds the identity of the first attempt in --data-dir and needs no token
        a = [*run.cli.get("edge", AISYNERGY), "edge", "run", "--hub", run.hub_url, "--node-id", run.node_id, "--bootstrap-token", reg["bootstrap_token"],
             "--ca-sha256", reg["ca_sha256"], "--data-dir", str(run.data_dir / "edge"),
             "--device-listen", f"127.0.0.1:{port}"]  # fmt: skip
        if run.devices_broker_port:
            a += ["--downstream-mqtt-url", f"mqtts://127.0.0.1:{run.devices_broker_port}"]
        return a

    def up(proc: Proc, port: int) -> bool:
        exited(proc)
        return listens(proc, port) and api.get(f"/nodes/{run.node_id}/status").json().get("state") == "ONLINE"

    edge, run.enrol_port = start_listening(
        run, "edge", args, run.enrol_port, up, 60, "edge ONLINE and its enrolment proxy listening"
    )
    return [psutil.Process(edge.popen.pid)]


def register_device(api: Any, node_id: str, name: str, model: str = "bench-board") -> tuple[str, dict[str, str]]:
    """(device id, the bootstrap-token answer: ``bootstrap_token``, ``ca_sha256``, ``tls_server_name``)."""
    device_id = api_ok(
        api.post("/devices", json={"node_id": node_id, "name": name, "model": model}), f"register {name}"
    )["id"]
    issued = api_ok(api.post(f"/devices/{device_id}/bootstrap-token", json={}), f"token for {name}")
    return device_id, {key: issued[key] for key in ("bootstrap_token", "ca_sha256", "tls_server_name")}


def device_states(api: Any, node_id: str) -> Counter[str]:
    from interfaces.pagination import MAX_LIMIT

    states: Counter[str] = Counter()
    cursor, pages = None, 0
    while pages < 1000:  # bounded
        params: dict[str, Any] = {"node_id": node_id, "limit": MAX_LIMIT}
        if cursor:
            params["cursor"] = cursor
        page = api_ok(api.get("/devices", params=params), "list devices")
        states.update(item["state"] for item in page["items"])
        cursor, pages = page.get("next_cursor"), pages + 1
        if not cursor:
            break
    return states


def start_devices(run: Run, api: Any, devices: list[tuple[str, dict[str, str]]], script: Path | None = None,
                  extra: dict[str, Any] | None = None) -> tuple[list[Any], dict[str, Any]]:  # fmt: skip
    """Device-host workers, started one after another: enrolment is serialised (one certificate request
    at a time reaches the hub; see the caveat on concurrent certificate requests in bench/README.md).
    ``script``: the benchmark whose ``_worker`` entry hosts the devices (this one's by default); ``extra``:
    more fields for each worker's spec."""
    import psutil

    a = run.args
    k = max(1, min(a.workers, len(devices)))
    per = math.ceil(len(devices) / k)
    handles: list[Any] = []
    started = time.perf_counter()
    start_ms: list[float] = []
    errors: list[str] = []
    for w in range(k):
        share = devices[w * per : (w + 1) * per]
        if not share:
            break
        spec_path, status_path = run.data_dir / f"worker-{w}.json", run.data_dir / f"worker-{w}.status.json"
        spec = {
            "enrol_url": run.enrol_url, "status": str(status_path), "max_lifetime_s": a.max_runtime,
            "log_level": a.device_log_level, "nice": getattr(a, "device_nice", 0),
            "devices": [{"id": i, "dir": str(run.data_dir / "devices" / i), "token": t["bootstrap_token"],
                         "ca_sha256": t["ca_sha256"], "tls_server_name": t["tls_server_name"]} for i, t in share],
            **(extra or {}),
        }  # fmt: skip
        spec_path.write_text(json.dumps(spec))
        proc = start_proc(
            f"worker-{w}",
            [sys.executable, str((script or Path(__file__)).resolve()), "_worker", str(spec_path)],
            run.data_dir / f"worker-{w}.log",
            run.env,
        )
        run.workers.append(proc)

        def enrolled(proc: Proc = proc, status_path: Path = status_path) -> dict[str, Any] | None:
            if proc.popen.poll() is not None:
                raise RuntimeError(f"{proc.name} exited: {proc.log.read_text()[-3000:]}")
            with contextlib.suppress(OSError, ValueError):
                st = json.loads(status_path.read_text())
                return st if st.get("enrolling_done") else None
            return None

        st = wait_until(enrolled, 30 + 5 * len(share), f"{proc.name} to enrol {len(share)} devices", 0.2)
        start_ms += st["start_ms"]
        errors += st["errors"]
        handles.append(psutil.Process(proc.popen.pid))
        log(f"worker {w}: {st['enrolled']}/{len(share)} devices enrolled and started")
    enrol_wall = time.perf_counter() - started
    if errors:
        raise RuntimeError(f"{len(errors)} devices failed to start: {errors[:3]}")

    def all_online() -> bool:
        return device_states(api, run.node_id).get("ONLINE", 0) >= len(devices)

    wait_until(all_online, 60, f"all {len(devices)} devices ONLINE", 0.5)
    online_wall = time.perf_counter() - started
    return handles, {
        "devices": len(devices),
        "workers": len(handles),
        "per_worker": per,
        "enrol_and_start_wall_s": _r(enrol_wall, 2),
        "all_online_after_s": _r(online_wall, 2),
        "device_start": summary_ms([x / 1000 for x in start_ms]),
    }


def raw_ready(pair: RawPair, timeout: float) -> None:
    """The broker reloads its ACL when devices.txt changes: wait until a round trip goes through."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pair.call(1.0):
            return
    raise RuntimeError("raw baseline: no round trip through the broker (ACL not reloaded?)")


def measure_idle_device(run: Run, api: Any, device_id: str, issued: dict[str, str]) -> dict[str, Any]:
    """One ``aisynergy device run`` process, connected and idle with the default heartbeat interval."""
    import psutil

    a = run.args
    data = run.data_dir / "idle-device"
    cmd = [*aisynergy_cli(), "device", "run", "--device-id", device_id, "--data-dir", str(data),
           "--enrol-url", run.enrol_url, "--bootstrap-token", issued["bootstrap_token"],
           "--ca-sha256", issued["ca_sha256"], "--tls-server-name", issued["tls_server_name"]]  # fmt: skip
    proc = start_proc("idle-device", cmd, run.data_dir / "idle-device.log", run.env)
    run.procs.append(proc)
    t_launch = time.perf_counter()

    def online() -> bool:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"idle device exited: {proc.log.read_text()[-3000:]}")
        return api.get(f"/devices/{device_id}/status").json().get("state") == "ONLINE"

    wait_until(online, 60, "idle device ONLINE", 0.2)
    online_after = time.perf_counter() - t_launch
    time.sleep(a.idle_settle)
    p = psutil.Process(proc.popen.pid)
    if p.children(recursive=True):
        log("warning: the device process has children; only the process itself is measured")
    status_before = api.get(f"/devices/{device_id}/status").json()
    enrolment = {}
    with contextlib.suppress(OSError, ValueError):
        enrolment = json.loads((data / "enrolment.json").read_text())
    samples: list[tuple[float, float, int]] = []
    uss: list[int] = []
    t_end = time.monotonic() + a.idle_seconds
    k = 0
    while True:
        now = time.monotonic()
        t = p.cpu_times()
        samples.append((now, t.user + t.system, p.memory_info().rss))
        if k % 10 == 0:
            uss.append(p.memory_full_info().uss)
        k += 1
        if now >= t_end or proc.popen.poll() is not None:
            break
        time.sleep(min(1.0, max(0.0, t_end - time.monotonic())))
    uss.append(p.memory_full_info().uss)
    status_after = api.get(f"/devices/{device_id}/status").json()
    (t0, c0, _), (t1, c1, _) = samples[0], samples[-1]
    per_s = [(b[1] - a_[1]) / (b[0] - a_[0]) * 100 for a_, b in itertools.pairwise(samples) if b[0] > a_[0]]
    rss = [s[2] for s in samples]
    return {
        "command": " ".join(["aisynergy", *cmd[len(aisynergy_cli()):]]).replace(str(run.data_dir), "$WORK")
                   .replace(issued["bootstrap_token"], "$BOOTSTRAP_TOKEN"),
        "online_after_launch_s": _r(online_after, 2), "settle_s": a.idle_settle, "window_s": _r(t1 - t0, 1),
        "heartbeat_interval_s": enrolment.get("heartbeat_interval_s") or status_before.get("heartbeat_interval_s"),
        "cpu_s": round(c1 - c0, 3), "cpu_pct_of_one_core": _r((c1 - c0) / (t1 - t0) * 100 if t1 > t0 else None, 3),
        "cpu_pct_max_1s": _r(max(per_s) if per_s else None, 2),
        "rss_mib_start": _r(rss[0] / 2**20), "rss_mib_end": _r(rss[-1] / 2**20), "rss_mib_max": _r(max(rss) / 2**20),
        "uss_mib_start": _r(uss[0] / 2**20), "uss_mib_end": _r(uss[-1] / 2**20),
        "threads": p.num_threads(), "state_after": status_after.get("state"),
        "last_heartbeat_before": status_before.get("last_heartbeat_at"), "last_heartbeat_after": status_after.get("last_heartbeat_at"),
        "uptime_s_after": status_after.get("uptime_s"),
    }  # fmt: skip


def ratios(rest: dict[str, Any], raw: dict[str, Any]) -> dict[str, Any]:
    def ratio(k: str) -> float | None:
        return _r(rest[k] / raw[k], 2) if rest.get(k) and raw.get(k) else None

    return {"p50": ratio("p50_ms"), "p90": ratio("p90_ms"), "p99": ratio("p99_ms")}


def measure(run: Run, handles: dict[str, list[Any]]) -> None:
    import httpx
    import psutil

    a = run.args
    r = run.results
    limits = httpx.Limits(
        max_connections=max(4, a.concurrency * 2), max_keepalive_connections=max(4, a.concurrency * 2)
    )
    with httpx.Client(
        base_url=run.api, headers={"Authorization": f"Bearer {run.token}"}, timeout=a.timeout + 15, limits=limits
    ) as api:
        handles["edge"] = start_edge(run, api)
        log(f"edge {run.node_id} ONLINE; device enrolment at {run.enrol_url}")
        # every registration up front: each rewrites devices.txt, and the broker reloads its ACL (SIGHUP)
        raw_node = api_ok(api.post("/nodes", json={"name": "bench-raw-requester"}), "register the raw requester")[
            "node"
        ]["id"]
        raw_device, _ = register_device(api, raw_node, "bench-raw-responder", "raw")
        idle_id, idle_issued = register_device(api, run.node_id, "bench-idle-device")
        t0 = time.perf_counter()
        devices = [register_device(api, run.node_id, f"bench-dev-{i:05d}") for i in range(a.devices)]
        register_wall = time.perf_counter() - t0
        log(f"registered {a.devices} devices in {register_wall:.1f} s; starting {a.workers} device-host workers")
        handles["device_workers"], r["devices"] = start_devices(run, api, devices)
        r["devices"]["register_wall_s"] = _r(register_wall, 2)
        log(f"all {a.devices} devices ONLINE ({r['devices']['all_online_after_s']} s after the first worker started)")
        device_ids = [d for d, _ in devices]
        handles["orchestrator"] = [psutil.Process()]
        sampler = Sampler(handles)
        sampler.start()

        pair = RawPair(run.data_dir / "pki", run.data_dir / "raw", raw_node, raw_device, run.broker_port)
        pair.start()
        raw_ready(pair, 30)

        phases: list[tuple[str, Callable[[int], tuple[bool, str, float | None]], int]] = []
        rest_call, raw_call = rest_caller(api, device_ids, a.timeout), raw_caller(pair, a.timeout)
        phases += [("rest_sequential", rest_call, 1), ("raw_sequential", raw_call, 1)]
        if a.concurrency > 1:
            phases += [
                (f"rest_concurrent_{a.concurrency}", rest_call, a.concurrency),
                (f"raw_concurrent_{a.concurrency}", raw_call, a.concurrency),
            ]
        # warm-up: every device once (TLS sessions, HTTP keep-alive, paho and pydantic first-call costs)
        warm = run_phase(max(a.warmup, 0), 1, rest_call, a.phase_deadline)
        warm_raw = run_phase(max(a.warmup, 0), 1, raw_call, a.phase_deadline)
        r["warmup"] = {
            "rest": {k: v for k, v in warm.items() if k != "samples_ms"},
            "raw": {k: v for k, v in warm_raw.items() if k != "samples_ms"},
        }
        r["phases"], r["resources"] = {}, {}
        for name, call, conc in phases:
            time.sleep(1.0)  # a clean second between phases for the resource windows
            t_a = time.time()
            res = run_phase(a.commands, conc, call, a.phase_deadline)
            t_b = time.time()
            r["phases"][name] = res
            r["resources"][name] = resources(sampler, handles, t_a, t_b)
            log(f"{name}: n={res['completed']} p50 {res['p50_ms']} / p90 {res['p90_ms']} / p99 {res['p99_ms']} / max {res['max_ms']} ms, "
                f"{res['throughput_per_s']}/s, errors {res['errors']}")  # fmt: skip
        r["raw_unmatched_replies"] = pair.unmatched
        pair.close()
        ph = r["phases"]
        r["ratios"] = {"sequential": ratios(ph["rest_sequential"], ph["raw_sequential"])}
        if a.concurrency > 1:
            r["ratios"][f"concurrent_{a.concurrency}"] = ratios(
                ph[f"rest_concurrent_{a.concurrency}"], ph[f"raw_concurrent_{a.concurrency}"]
            )
        r["devices"]["online_after_phases"] = device_states(api, run.node_id).get("ONLINE", 0)
        sampler.stop()
        # let it end and drop it before the next fork: Sampler's ``_stop`` event shadows ``Thread._stop``,
        # which ``join()`` and a forked child's clean-up call on every thread object still referenced
        time.sleep(sampler.interval + 0.5)
        del sampler

        if a.idle_seconds > 0:
            log(f"idle device agent: {a.idle_seconds:g} s connected (settle {a.idle_settle:g} s)")
            r["idle_device"] = measure_idle_device(run, api, idle_id, idle_issued)
            i = r["idle_device"]
            log(
                f"idle device: CPU {i['cpu_pct_of_one_core']} % of one core, RSS {i['rss_mib_end']} MiB, USS {i['uss_mib_end']} MiB"
            )


def resources(sampler: Sampler, handles: dict[str, list[Any]], t0: float, t1: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    total = 0.0
    for name in handles:
        w = sampler.window(name, t0, t1)
        out[name] = w
        total += w.get("cpu_pct_of_one_core") or 0
    busy = sampler.system_window(t0, t1)
    out["machine_busy_pct_of_one_core"] = busy
    out["other_processes_pct_of_one_core"] = _r(busy - total) if busy is not None else None
    return out


def verdict(run: Run) -> tuple[bool, list[str]]:
    r, a = run.results, run.args
    why: list[str] = []
    if r.get("devices", {}).get("online_after_phases") != a.devices:
        why.append(
            f"only {r.get('devices', {}).get('online_after_phases')} of {a.devices} devices ONLINE after the phases"
        )
    for name, ph in r.get("phases", {}).items():
        if ph["completed"] != a.commands:
            why.append(f"{name}: {ph['completed']} of {a.commands} completed before the phase deadline")
        if ph["errors"]:
            why.append(f"{name}: {ph['errors']} failed ({ph['outcomes']})")
    raw_p50 = (r.get("phases", {}).get("raw_sequential") or {}).get("p50_ms")
    if raw_p50 and raw_p50 >= 30 and not a.tcp_nodelay:
        r["diagnosis"] = (
            f"a raw MQTT round trip on 127.0.0.1 takes {raw_p50} ms: small packets wait for the peer's delayed ACK "
            "(Nagle's algorithm: the broker or the product's clients do not set TCP_NODELAY). Compare --tcp-nodelay."
        )
    p99 = r.get("ratios", {}).get("sequential", {}).get("p99")
    if p99 is None or p99 > a.target_ratio:
        why.append(f"sequential REST/raw p99 ratio {p99} > {a.target_ratio:g}")
    return not why, why


def table(run: Run) -> str:
    r, a = run.results, run.args
    ph, rat, res = r.get("phases", {}), r.get("ratios", {}), r.get("resources", {})

    def lat(name: str) -> str:
        x = ph.get(name) or {}
        return (f"p50 {x.get('p50_ms')} / p90 {x.get('p90_ms')} / p99 {x.get('p99_ms')} / max {x.get('max_ms')} ms"
                f"  ({x.get('throughput_per_s')}/s, errors {x.get('errors')})")  # fmt: skip

    c = a.concurrency
    rows = [("devices behind one edge", f"{a.devices} in {r.get('devices', {}).get('workers')} worker processes"),
            ("TCP_NODELAY", "forced on everywhere (diagnostic)" if a.tcp_nodelay else "as the product sets it"),
            ("REST command, sequential", lat("rest_sequential")),
            ("raw MQTT ping-pong, sequential", lat("raw_sequential")),
            ("ratio REST/raw sequential", f"p50 {rat.get('sequential', {}).get('p50')}x, p99 {rat.get('sequential', {}).get('p99')}x (target p99 <= {a.target_ratio:g}x)")]  # fmt: skip
    if c > 1:
        rows += [(f"REST command, {c} in flight", lat(f"rest_concurrent_{c}")),
                 (f"raw MQTT ping-pong, {c} in flight", lat(f"raw_concurrent_{c}")),
                 (f"ratio REST/raw {c} in flight", f"p50 {rat.get(f'concurrent_{c}', {}).get('p50')}x, p99 {rat.get(f'concurrent_{c}', {}).get('p99')}x")]  # fmt: skip
    hub_seq = (ph.get("rest_sequential") or {}).get("hub_duration") or {}
    rows.append(
        (
            "hub-side duration_ms, sequential",
            f"p50 {hub_seq.get('p50_ms')} / p99 {hub_seq.get('p99_ms')} ms (hub publish -> answer)",
        )
    )
    for name in ("rest_sequential", f"rest_concurrent_{c}"):
        x = res.get(name)
        if x:
            parts = [f"{k} {v.get('cpu_pct_of_one_core')}" for k, v in x.items() if isinstance(v, dict) and v]
            rows.append(
                (
                    f"CPU % of one core ({name})",
                    ", ".join(parts)
                    + f"; machine {x.get('machine_busy_pct_of_one_core')}, other {x.get('other_processes_pct_of_one_core')}",
                )
            )
    i = r.get("idle_device") or {}
    if i:
        cpu = f"CPU {i.get('cpu_pct_of_one_core')} % of one core over {i.get('window_s')} s (max 1 s {i.get('cpu_pct_max_1s')} %)"
        mem = f"RSS {i.get('rss_mib_end')} MiB (max {i.get('rss_mib_max')}), USS {i.get('uss_mib_end')} MiB"
        rows.append(("idle `aisynergy device run`", f"{cpu}, {mem}, heartbeat {i.get('heartbeat_interval_s')} s"))
    if r.get("diagnosis"):
        rows.append(("diagnosis", r["diagnosis"]))
    rows.append(("load average at start", str(r.get("loadavg_at_start"))))
    rows.append(
        (
            "verdict",
            "HOLDS" if r.get("holds") else "DOES NOT HOLD: " + "; ".join(r.get("why", []) or [r.get("error", "")]),
        )
    )
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def main(argv: Iterable[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_worker"]:  # internal: a device-host process
        return worker_main(Path(argv[1]))
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--devices", type=int, default=100, help="devices behind the edge, each its own MQTT session")
    p.add_argument("--commands", type=int, default=1000, help="ping commands per phase (and raw round trips)")
    p.add_argument("--concurrency", type=int, default=8, help="in flight in the concurrent phases (1: sequential only)")
    p.add_argument(
        "--workers", type=int, default=4, help="device-host processes (devices run as device.agent.Device in them)"
    )
    p.add_argument(
        "--warmup", type=int, default=0, help="unrecorded round trips of each kind first (0: one per device)"
    )
    p.add_argument("--timeout", type=float, default=5, help="timeout_s of every command (and of a raw round trip)")
    p.add_argument(
        "--target-ratio", type=float, default=5, help="the sequential REST/raw p99 ratio the run must stay under"
    )
    p.add_argument("--idle-seconds", type=float, default=60, help="idle device agent window (0: skip)")
    p.add_argument("--idle-settle", type=float, default=5, help="seconds between the idle device ONLINE and its window")
    p.add_argument(
        "--downstream-broker",
        action="store_true",
        help="the devices use a second broker instance (--instance devices-broker)",
    )
    p.add_argument(
        "--tcp-nodelay",
        action="store_true",
        help="diagnostic, not the product's behaviour: TCP_NODELAY on every MQTT socket (brokers and all Python processes)",
    )
    p.add_argument(
        "--device-log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log level of the device workers",
    )
    p.add_argument(
        "--phase-deadline", type=float, default=600, help="no request of a phase starts after this many seconds"
    )
    p.add_argument(
        "--max-runtime", type=float, default=3600, help="device workers stop by themselves after this many seconds"
    )
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument(
        "--data-dir", type=Path, default=None, help="work directory (default: a fresh temporary one, removed after)"
    )
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, database, identities)")
    args = p.parse_args(argv)
    if args.devices < 1 or args.commands < 1 or args.concurrency < 1 or args.workers < 1:
        p.error("--devices, --commands, --concurrency and --workers must be positive")
    if args.warmup <= 0:
        args.warmup = args.devices
    raise_nofile()

    made_tmp = args.data_dir is None
    data_dir = Path(tempfile.mkdtemp(prefix="aisynergy-cmdrtt-")) if made_tmp else args.data_dir.resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    run = Run(args, data_dir, free_port(), free_port(), free_port(), free_port() if args.downstream_broker else None)
    uptime = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        uptime = subprocess.run(["uptime"], check=False, capture_output=True, text=True, timeout=5).stdout.strip()
    sources = source_hashes()
    run.results = {
        "benchmark": "command_rtt", "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "machine": machine_info(),
        "command": " ".join(["python", "bench/command_rtt.py", *argv]),
        "note": "broker, hub, edge, the device workers and this load generator all share this machine's cores",
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()], "uptime_at_start": uptime, "code": {**code_record(), "tree_digest_start": tree_digest(sources)},
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "topology": "one broker for hub and devices" if not args.downstream_broker else "hub broker + devices broker (same PKI)",
        "tcp_nodelay": "diagnostic: TCP_NODELAY on every MQTT socket (not the product's configuration)" if args.tcp_nodelay
                       else "as shipped: the broker's and the clients' own socket options",
        "raw_clients": "paho MQTT 5, threaded loops, TCP_NODELAY set on connect (as the device SDK since bfe65e4)",
    }  # fmt: skip
    if args.tcp_nodelay:
        run.env = nodelay_env(data_dir)

    def on_signal(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    try:
        log(
            f"work directory {data_dir}; broker :{run.broker_port}, hub :{run.hub_port}, edge enrolment :{run.enrol_port}; load {os.getloadavg()}"
        )
        handles = start_system(run)
        measure(run, handles)
        ok, why = verdict(run)
        run.results["holds"], run.results["why"] = ok, why
    except KeyboardInterrupt:
        log("interrupted")
        run.results["error"] = "interrupted"
    except Exception as exc:  # noqa: BLE001
        log(f"FAILED: {exc!r}")
        run.results["error"] = repr(exc)
    finally:
        for w in run.workers:  # devices first (they publish offline), then edge, hub, brokers
            with contextlib.suppress(ProcessLookupError):
                os.killpg(w.popen.pid, signal.SIGTERM)
        for w in run.workers:
            w.stop(timeout=20)
        for proc in reversed(run.procs):
            proc.stop()
        logs: dict[str, Any] = {}
        for path in sorted(data_dir.glob("*.log")):
            with contextlib.suppress(OSError):
                lines = path.read_text(errors="replace").splitlines()
                errors = [line for line in lines if " ERROR " in line or "Traceback" in line]
                logs[path.stem] = {"lines": len(lines), "error_lines": len(errors), "error_examples": errors[:3]}
        run.results["logs"] = logs
        code = run.results["code"]
        sources_end = source_hashes()
        code["tree_digest_end"] = tree_digest(sources_end)
        changed = sorted(k for k in sources.keys() | sources_end.keys() if sources.get(k) != sources_end.get(k))
        if changed:
            log(f"warning: sources changed during the run: {', '.join(changed)}")
            code["changed_during_run"] = changed
        if made_tmp and not args.keep:
            shutil.rmtree(data_dir, ignore_errors=True)
        else:
            run.results["data_dir"] = str(data_dir)
    print()
    print(table(run))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(run.results, indent=2, default=str) + "\n")
        log(f"results written to {args.out}")
    if "error" in run.results:
        return 1
    return 0 if run.results.get("holds") else 3


if __name__ == "__main__":
    sys.exit(main())
