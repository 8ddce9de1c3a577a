#!/usr/bin/env python3
"""Heartbeat load benchmark for edge node management (DESIGN §3, §4.1, §4.4).

What runs, each in its own process, all on 127.0.0.1:

* the broker: ``aisynergy broker run`` (Mosquitto, mutual TLS, per-node ACL), as in production;
* the hub: ``aisynergy hub serve`` (FastAPI + SQLite WAL + MQTT bridge with batched status ingest);
* K load-generator processes, each running many simulated edge nodes in one asyncio loop. Every node
  is its own MQTT 5 connection with its own identity: a P-256 key generated here and a certificate
  (CN = node id) obtained through the product's enrolment path, ``POST /api/v1/nodes`` then
  ``POST /api/v1/nodes/{id}/certificate`` with the node's one-time bootstrap token;
* this orchestrator, which enrols the nodes, coordinates the generators, polls the REST API and
  samples CPU / RSS of the hub, the broker and the generators with psutil.

Each node connects with a retained ``offline`` last will, subscribes to its ``desired`` and ``cmd``
topics, publishes a retained ``online`` state and then a heartbeat every ``--interval`` seconds,
phases staggered uniformly over the interval. Every topic comes from :mod:`interfaces.topics` and
every payload from the real models (:func:`interfaces.messages.envelope`, ``HeartbeatBody``).

Measured over the ``--duration`` window (steady heartbeating, every node ONLINE before it starts):

* heartbeat -> status visible through REST: for a sample of nodes, the generator reports each
  heartbeat's ``uptime_s`` (unique per heartbeat) and the wall-clock time just before it published;
  the orchestrator polls ``GET /api/v1/nodes/{id}/status`` every ``--poll-interval`` until that
  ``uptime_s`` shows. Latency = arrival of the first answer that shows it - publish time (so it
  includes one REST round trip and up to one poll interval of quantisation);
* ``GET /api/v1/nodes/{id}`` latency at a fixed open-loop rate (``--rest-rate``) on random nodes;
* CPU (% of one core, averaged over the window) and RSS of the hub, Mosquitto and the generators.

The run "holds" when: every node enrolled, connected and was ONLINE before and after the window,
no node disconnected, the hub received every heartbeat that was sent, no probe timed out, the
generators kept their schedule (p99 lateness < 1 s) and the status p99 is under 1 s.

Usage::

    python bench/heartbeat_load.py --nodes 1000 --duration 60 [--interval 10] [--processes K] [--out results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import math
import multiprocessing as mp
import os
import platform
import queue as queue_mod
import random
import resource
import shutil
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

AISYNERGY = [sys.executable, "-m", "cloud.cli.root"]
AGENT_VERSION = "bench-0.1.0"
GiB = 1024**3


# ---------------------------------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------------------------------
def raise_nofile() -> int:
    """Raise the soft open-files limit to the hard limit (we may not raise the hard one)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            pass
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _child_setup() -> None:
    """preexec_fn of the broker and hub: raise the fd limit (Mosquitto needs one fd per connection)."""
    raise_nofile()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def percentile(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile (p in 0..100); None for no data."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def summary_ms(values_s: list[float]) -> dict[str, Any]:
    ms = [v * 1000 for v in values_s]
    return {
        "count": len(ms),
        "p50_ms": _r(percentile(ms, 50)),
        "p90_ms": _r(percentile(ms, 90)),
        "p99_ms": _r(percentile(ms, 99)),
        "max_ms": _r(max(ms) if ms else None),
        "mean_ms": _r(statistics.fmean(ms) if ms else None),
    }


def _r(v: float | None, nd: int = 1) -> float | None:
    return None if v is None else round(v, nd)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------------
# the simulated node's heartbeat: real models, realistic readings
# ---------------------------------------------------------------------------------------------------
@dataclass
class NodeProfile:
    """Static hardware of a simulated node; the readings move around it on every heartbeat."""

    cores: int
    memory_total: int
    disk_total: int
    accelerators: list[tuple[str, str, int, int]]  # (type, model, count, memory per accelerator)
    sent: int = 0
    received: int = 0

    @classmethod
    def make(cls, rng: random.Random) -> NodeProfile:
        cores = rng.choice([4, 4, 8, 8, 8, 12, 16, 32, 64])
        memory = cores * rng.choice([2, 4, 8]) * GiB
        disk = rng.choice([64, 128, 256, 512, 1024, 2048]) * 10**9
        accel: list[tuple[str, str, int, int]] = []
        roll = rng.random()
        if roll < 0.25:
            accel.append(("gpu", rng.choice(["NVIDIA Jetson AGX Orin", "NVIDIA A2", "NVIDIA T4", "NVIDIA L4"]), rng.choice([1, 1, 2, 4]), rng.choice([16, 24, 32]) * GiB))
        elif roll < 0.35:
            accel.append(("npu", rng.choice(["Ascend 310P", "Hailo-8", "RK3588 NPU"]), 1, rng.choice([4, 8]) * GiB))
        return cls(cores, memory, disk, accel)


def make_heartbeat(node_id: str, seq: int, uptime_s: float, prof: NodeProfile, rng: random.Random) -> bytes:
    """One heartbeat envelope as the agent would publish it (``Envelope[HeartbeatBody]`` JSON)."""
    from interfaces.messages import HeartbeatBody, envelope
    from interfaces.resources import Accelerator, CpuReading, DiskReading, MemoryReading, NetworkReading, Resources

    util = rng.uniform(0.02, 0.95)
    send_rate, recv_rate = rng.uniform(1e3, 5e6), rng.uniform(1e3, 2e7)
    prof.sent += int(send_rate * 10)
    prof.received += int(recv_rate * 10)
    body = HeartbeatBody(
        seq=seq,
        agent_version=AGENT_VERSION,
        uptime_s=uptime_s,
        resources=Resources(
            cpu=CpuReading(cores=prof.cores, utilisation=round(util, 4), load_1m=round(util * prof.cores, 2)),
            memory=MemoryReading(total_bytes=prof.memory_total, available_bytes=int(prof.memory_total * rng.uniform(0.1, 0.9))),
            disk=DiskReading(path="/var/lib/aisynergy", total_bytes=prof.disk_total, free_bytes=int(prof.disk_total * rng.uniform(0.2, 0.8))),
            network=NetworkReading(bytes_sent=prof.sent, bytes_received=prof.received, send_rate_bps=round(send_rate, 1), receive_rate_bps=round(recv_rate, 1)),
            accelerators=[
                Accelerator(type=t, model=m, count=c, memory_bytes=mem, utilisation=round(rng.uniform(0, 1), 3), purpose="inference")
                for t, m, c, mem in prof.accelerators
            ],
        ),
    )
    return envelope(node_id, body).model_dump_json().encode()


# ---------------------------------------------------------------------------------------------------
# load generator process: many paho clients driven by one asyncio loop
# ---------------------------------------------------------------------------------------------------
@dataclass
class GenConfig:
    index: int
    nodes: list[tuple[str, str, str]]  # (node id, cert path, key path)
    ca_path: str
    host: str
    port: int
    probes: set[str]
    interval_s: float
    keepalive_s: int
    connect_threads: int
    connect_timeout_s: float
    seed: int
    epoch: float  # wall clock origin of the heartbeat slots (phase i: epoch + phase_i + k * interval)
    hard_deadline: float  # wall clock: stop whatever happens


class SimNode:
    """One edge node: its own paho MQTT 5 client and TLS identity, on the generator's event loop."""

    def __init__(self, gen: Generator, node_id: str, cert: str, key: str, rng: random.Random) -> None:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        from interfaces.messages import ConnectionState, StateBody, envelope
        from interfaces.topics import NODE_STATE

        self.gen = gen
        self.node_id = node_id
        self.profile = NodeProfile.make(rng)
        self.rng = rng
        self.seq = 0
        self.started = time.monotonic()
        self.connected: asyncio.Future[int] | None = None
        self.pending: dict[int, asyncio.Future[None]] = {}
        self.lost = False
        self.fd = -1
        self.watching_write = False
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # trust only the hub CA, present the node certificate
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_verify_locations(cafile=gen.cfg.ca_path)
        ctx.load_cert_chain(cert, key)
        c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=node_id, protocol=mqtt.MQTTv5)
        c.tls_set_context(ctx)
        will = envelope(node_id, StateBody(state=ConnectionState.OFFLINE, agent_version=AGENT_VERSION, reason="will"))
        c.will_set(NODE_STATE.topic(node_id=node_id), will.model_dump_json(), NODE_STATE.qos, NODE_STATE.retain)
        c.on_connect = self._on_connect
        c.on_disconnect = self._on_disconnect
        c.on_publish = self._on_ack
        c.on_subscribe = self._on_subscribe
        self.client = c

    # -- paho callbacks (all on the loop thread once connected) ----------------------------------
    def _on_connect(self, _c: Any, _u: Any, _flags: Any, reason: Any, _props: Any) -> None:
        if self.connected is not None and not self.connected.done():
            self.connected.set_result(int(reason.value) if hasattr(reason, "value") else int(reason))

    def _on_disconnect(self, _c: Any, _u: Any, _flags: Any, reason: Any, _props: Any) -> None:
        if not self.gen.stopping and not self.lost:
            self.lost = True
            self.gen.stats["unexpected_disconnects"] += 1
            self.gen.disconnect_reasons.append(f"{self.node_id}: {reason}")
        if self.connected is not None and not self.connected.done():
            self.connected.set_exception(ConnectionError(f"disconnected: {reason}"))

    def _on_ack(self, _c: Any, _u: Any, mid: int, _reason: Any, _props: Any) -> None:
        fut = self.pending.pop(mid, None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _on_subscribe(self, _c: Any, _u: Any, mid: int, _codes: Any, _props: Any) -> None:
        self._on_ack(_c, _u, mid, None, None)

    def _on_socket_close(self, _c: Any, _u: Any, _sock: Any) -> None:
        if self.fd >= 0:
            self.gen.loop.remove_reader(self.fd)
            self.gen.loop.remove_writer(self.fd)
            self.watching_write = False
            self.fd = -1

    def _on_register_write(self, _c: Any, _u: Any, _sock: Any) -> None:
        # Write on the next loop turn; watch the socket only if the kernel buffer is full (saves two
        # epoll_ctl calls per publish, which matters with thousands of clients on a shared CPU).
        self.gen.loop.call_soon(self._write_soon)

    def _write_soon(self) -> None:
        if self.fd < 0:
            return
        self._writable()
        if self.fd >= 0 and self.client.want_write() and not self.watching_write:
            self.watching_write = True
            self.gen.loop.add_writer(self.fd, self._writable)

    def _on_unregister_write(self, _c: Any, _u: Any, _sock: Any) -> None:
        if self.fd >= 0 and self.watching_write:
            self.watching_write = False
            self.gen.loop.remove_writer(self.fd)

    def _readable(self) -> None:
        try:
            while True:
                self.client.loop_read()
                sock = self.client.socket()
                if sock is not None and hasattr(sock, "pending") and sock.pending() > 0:  # TLS-buffered bytes
                    continue
                break
        except Exception as exc:  # noqa: BLE001 - a broken connection
            self._broken(exc)

    def _writable(self) -> None:
        try:
            self.client.loop_write()
        except Exception as exc:  # noqa: BLE001
            self._broken(exc)
            return
        if self.watching_write and self.fd >= 0 and not self.client.want_write():
            self.watching_write = False
            self.gen.loop.remove_writer(self.fd)

    def _broken(self, exc: BaseException) -> None:
        if not self.gen.stopping and not self.lost:
            self.lost = True
            self.gen.stats["unexpected_disconnects"] += 1
            self.gen.disconnect_reasons.append(f"{self.node_id}: {exc!r}")
        self._on_socket_close(None, None, None)

    # -- life cycle ---------------------------------------------------------------------------------
    def _blocking_connect(self) -> None:
        """TCP connect + TLS handshake + CONNECT written; runs in a worker thread."""
        self.client.connect(self.gen.cfg.host, self.gen.cfg.port, keepalive=self.gen.cfg.keepalive_s, clean_start=True)

    async def _acked(self, mid: int, timeout: float) -> None:
        fut = self.gen.loop.create_future()
        self.pending[mid] = fut
        await asyncio.wait_for(fut, timeout)

    async def start(self) -> float:
        """Connect, subscribe to desired + cmd, publish the retained online state; returns seconds taken."""
        from paho.mqtt.subscribeoptions import SubscribeOptions

        from interfaces.messages import ConnectionState, StateBody, envelope
        from interfaces.topics import NODE_CMD, NODE_DESIRED, NODE_STATE

        loop = self.gen.loop
        t = time.monotonic()
        self.connected = loop.create_future()
        await loop.run_in_executor(self.gen.pool, self._blocking_connect)
        c = self.client
        c.on_socket_close = self._on_socket_close
        c.on_socket_register_write = self._on_register_write
        c.on_socket_unregister_write = self._on_unregister_write
        self.fd = c.socket().fileno()  # type: ignore[union-attr]
        loop.add_reader(self.fd, self._readable)
        if c.want_write():
            self.watching_write = True
            loop.add_writer(self.fd, self._writable)
        reason = await asyncio.wait_for(self.connected, self.gen.cfg.connect_timeout_s)
        if reason != 0:
            raise ConnectionError(f"CONNACK reason {reason}")
        rc, mid = c.subscribe([(NODE_DESIRED.topic(node_id=self.node_id), SubscribeOptions(qos=NODE_DESIRED.qos)),
                               (NODE_CMD.topic(node_id=self.node_id), SubscribeOptions(qos=NODE_CMD.qos))])  # fmt: skip
        await self._acked(mid, self.gen.cfg.connect_timeout_s)
        online = envelope(self.node_id, StateBody(state=ConnectionState.ONLINE, agent_version=AGENT_VERSION))
        assert isinstance(online, NODE_STATE.payload)
        info = c.publish(NODE_STATE.topic(node_id=self.node_id), online.model_dump_json().encode(), qos=NODE_STATE.qos, retain=NODE_STATE.retain)
        await self._acked(info.mid, self.gen.cfg.connect_timeout_s)
        return time.monotonic() - t

    def heartbeat(self, topic: str) -> tuple[float, float]:
        """Publish one heartbeat; returns (uptime_s sent, wall time just before publishing)."""
        from interfaces.topics import NODE_HEARTBEAT

        uptime = time.monotonic() - self.started
        payload = make_heartbeat(self.node_id, self.seq, uptime, self.profile, self.rng)
        self.seq += 1
        at = time.time()
        info = self.client.publish(topic, payload, qos=NODE_HEARTBEAT.qos, retain=NODE_HEARTBEAT.retain)
        if info.rc != 0:
            self.gen.stats["publish_errors"] += 1
        return uptime, at


class Generator:
    def __init__(self, cfg: GenConfig, out: Any, go: Any, times: Any) -> None:
        self.cfg = cfg
        self.out = out  # mp.Queue to the orchestrator
        self.go = go  # mp.Event: start heartbeating
        self.times = times  # mp.Array('d', [t0, t_end]) wall clock
        self.stopping = False
        self.stats: dict[str, int] = {"unexpected_disconnects": 0, "publish_errors": 0, "heartbeats": 0, "heartbeats_in_window": 0}
        self.disconnect_reasons: list[str] = []
        self.lateness: list[float] = []
        self.nodes: list[SimNode] = []
        self.pool = ThreadPoolExecutor(cfg.connect_threads, thread_name_prefix="connect")
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]

    async def _misc(self) -> None:
        """paho's timers (keepalive PINGREQ) for every client, once a second."""
        while True:
            await asyncio.sleep(1.0)
            for n in self.nodes:
                if n.fd >= 0:
                    try:
                        n.client.loop_misc()
                    except Exception as exc:  # noqa: BLE001
                        n._broken(exc)

    def window(self) -> tuple[float, float]:
        """(t0, t_end) once the orchestrator has set them, else (0, hard deadline)."""
        t0, t_end = self.times[0], self.times[1]
        return (t0, t_end) if t_end > 0 else (0.0, self.cfg.hard_deadline)

    async def beat(self, n: SimNode, topic: str, phase: float) -> None:
        """The agent's heartbeat loop: one right after connecting, then one in the node's slot every interval."""
        cfg = self.cfg
        now = time.time()
        target, scheduled = now, False  # the agent heartbeats as soon as it is online
        next_slot = cfg.epoch + phase + math.ceil((now - cfg.epoch - phase) / cfg.interval_s) * cfg.interval_s
        while not n.lost:  # bounded: slots advance by interval_s, the loop ends at t_end (or the hard deadline)
            t0, t_end = self.window()
            if target >= min(t_end, cfg.hard_deadline):
                return
            delay = target - time.time()
            if delay > 0.002:
                await asyncio.sleep(delay)
                t0, t_end = self.window()
                if target >= t_end:
                    return
            uptime, at = n.heartbeat(topic)
            self.stats["heartbeats"] += 1
            if t0 and t0 <= at < t_end:
                self.stats["heartbeats_in_window"] += 1
                if scheduled:
                    self.lateness.append(max(0.0, at - target))
                if n.node_id in cfg.probes:
                    self.out.put(("probe", n.node_id, uptime, at))
            target, next_slot, scheduled = next_slot, next_slot + cfg.interval_s, True

    async def run(self) -> None:
        from interfaces.topics import NODE_HEARTBEAT

        self.loop = asyncio.get_running_loop()
        cfg = self.cfg
        rng = random.Random(cfg.seed)
        self.nodes = [SimNode(self, nid, crt, key, random.Random(rng.random())) for nid, crt, key in cfg.nodes]
        misc = asyncio.create_task(self._misc())
        sem = asyncio.Semaphore(cfg.connect_threads * 4)
        durations: list[float] = []
        failures: list[str] = []
        beats: list[asyncio.Task[None]] = []

        async def start(n: SimNode) -> None:
            async with sem:
                try:
                    durations.append(await n.start())
                except Exception as exc:  # noqa: BLE001
                    failures.append(f"{n.node_id}: {exc!r}")
                    n.lost = True
                    return
            topic = NODE_HEARTBEAT.topic(node_id=n.node_id)
            beats.append(asyncio.create_task(self.beat(n, topic, rng.uniform(0, cfg.interval_s))))

        t = time.monotonic()
        await asyncio.gather(*(start(n) for n in self.nodes))
        self.out.put(("ready", cfg.index, {
            "connected": len(durations), "failed": len(failures), "failures": failures[:5],
            "connect_wall_s": round(time.monotonic() - t, 2), "connect_each": summary_ms(durations),
        }))  # fmt: skip

        # heartbeats go on while we wait for the window to be set, and stop at its end (bounded)
        remaining = max(1.0, cfg.hard_deadline - time.time())
        await self.loop.run_in_executor(None, self.go.wait, remaining)
        if beats:
            await asyncio.wait(beats, timeout=max(1.0, cfg.hard_deadline - time.time()))
        for task in beats:
            task.cancel()

        # stop: clean DISCONNECT for everyone, bounded
        self.stopping = True
        for n in self.nodes:
            if n.fd >= 0:
                with contextlib.suppress(Exception):
                    n.client.disconnect()
        deadline = time.monotonic() + 5
        while any(n.fd >= 0 for n in self.nodes) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        misc.cancel()
        self.out.put(("done", cfg.index, {
            **self.stats, "states": len(durations), "lateness": summary_ms(self.lateness),
            "disconnect_reasons": self.disconnect_reasons[:5], "lost_nodes": sum(n.lost for n in self.nodes),
        }))  # fmt: skip


def generator_main(cfg: GenConfig, out: Any, go: Any, times: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the orchestrator decides when we stop
    raise_nofile()
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover
        pass
    try:
        asyncio.run(Generator(cfg, out, go, times).run())
    except Exception as exc:  # noqa: BLE001
        out.put(("error", cfg.index, repr(exc)))
    finally:
        out.close()
        out.join_thread()  # flush what we reported before leaving
        os._exit(0)  # do not wait for the connect pool's threads


# ---------------------------------------------------------------------------------------------------
# the system under test: broker and hub processes
# ---------------------------------------------------------------------------------------------------
@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def stop(self, timeout: float = 10) -> None:
        if self.popen.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGTERM)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(5)


def start_proc(name: str, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> Proc:
    fh = log_path.open("ab")
    popen = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, **(env or {})},
                             start_new_session=True, preexec_fn=_child_setup)  # fmt: skip
    return Proc(name, popen, log_path)


def wait_until(pred: Any, timeout: float, what: str, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise RuntimeError(f"timed out after {timeout:g} s waiting for {what}")


class Sampler(threading.Thread):
    """CPU and RSS of a set of processes, once a second (psutil)."""

    def __init__(self, procs: dict[str, list[Any]], interval: float = 1.0) -> None:
        super().__init__(daemon=True, name="sampler")
        self.procs = procs  # name -> [psutil.Process]
        self.interval = interval
        self.samples: dict[str, list[tuple[float, float, int]]] = {k: [] for k in procs}  # (t, cpu s, rss)
        self.system: list[tuple[float, float]] = []  # (t, busy cpu-seconds of the whole machine)
        self._halt = threading.Event()

    def read(self, name: str) -> tuple[float, int]:
        cpu, rss = 0.0, 0
        for p in self.procs[name]:
            try:
                t = p.cpu_times()
                cpu += t.user + t.system
                rss += p.memory_info().rss
            except Exception:  # noqa: BLE001 - a process that ended
                pass
        return cpu, rss

    def run(self) -> None:
        import psutil

        while not self._halt.is_set():
            now = time.time()
            for name in self.procs:
                cpu, rss = self.read(name)
                self.samples[name].append((now, cpu, rss))
            t = psutil.cpu_times()
            self.system.append((now, t.user + t.system + getattr(t, "irq", 0) + getattr(t, "softirq", 0) + getattr(t, "nice", 0)))
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()

    def window(self, name: str, t0: float, t1: float) -> dict[str, Any]:
        s = [x for x in self.samples[name] if t0 - 1.01 <= x[0] <= t1 + 1.01]
        if len(s) < 2:
            return {}
        first = min(s, key=lambda x: abs(x[0] - t0))
        last = min(s, key=lambda x: abs(x[0] - t1))
        wall = last[0] - first[0]
        per_s = [(b[1] - a[1]) / (b[0] - a[0]) * 100 for a, b in zip(s, s[1:]) if t0 <= a[0] and b[0] <= t1 + 0.01 and b[0] > a[0]]
        rss = [x[2] for x in s]
        return {
            "cpu_pct_of_one_core": _r((last[1] - first[1]) / wall * 100 if wall > 0 else None),
            "cpu_pct_max_1s": _r(max(per_s) if per_s else None),
            "rss_mib_end": _r(last[2] / 2**20),
            "rss_mib_max": _r(max(rss) / 2**20),
        }

    def system_window(self, t0: float, t1: float) -> float | None:
        s = [x for x in self.system if t0 - 1.01 <= x[0] <= t1 + 1.01]
        if len(s) < 2:
            return None
        first = min(s, key=lambda x: abs(x[0] - t0))
        last = min(s, key=lambda x: abs(x[0] - t1))
        return _r((last[1] - first[1]) / (last[0] - first[0]) * 100) if last[0] > first[0] else None


# ---------------------------------------------------------------------------------------------------
# the orchestrator
# ---------------------------------------------------------------------------------------------------
@dataclass
class Enrolled:
    node_id: str
    cert: str
    key: str


@dataclass
class Run:
    args: argparse.Namespace
    data_dir: Path
    broker_port: int
    hub_port: int
    procs: list[Proc] = field(default_factory=list)
    gens: list[Any] = field(default_factory=list)
    gen_control: tuple[Any, Any] | None = None  # (go event, times array) of the load generators
    token: str = ""
    results: dict[str, Any] = field(default_factory=dict)

    @property
    def hub_url(self) -> str:
        return f"http://127.0.0.1:{self.hub_port}"

    @property
    def api(self) -> str:
        return self.hub_url + "/api/v1"


def machine_info() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem = 0
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = int(line.split()[1]) * 1024
    return {
        "nproc": os.cpu_count(), "cpu_model": model, "ram_gib": round(mem / GiB, 1),
        "kernel": platform.release(), "python": platform.python_version(),
        "mosquitto": _mosquitto_version(), "nofile_limit": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
    }  # fmt: skip


def code_version() -> dict[str, Any]:
    """Which code ran: the commit and any uncommitted change under the packages the hub and broker run."""
    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        dirty = [line.split(maxsplit=1)[1] for line in git("status", "--porcelain", "--", "cloud", "interfaces", "edge", "device").splitlines() if line.strip()]
        return {"root": str(ROOT), "commit": git("rev-parse", "HEAD"), "subject": git("log", "-1", "--format=%s"), "uncommitted": dirty}
    except (OSError, subprocess.SubprocessError):
        return {"root": str(ROOT)}


def _mosquitto_version() -> str:
    binary = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    try:
        out = subprocess.run([binary, "-h"], capture_output=True, text=True, timeout=5)
        return (out.stdout or out.stderr).splitlines()[0].strip()
    except (OSError, IndexError, subprocess.SubprocessError):
        return "?"


def start_system(run: Run) -> dict[str, Any]:
    """Broker and hub as separate processes; returns the psutil handles to sample."""
    import httpx
    import psutil

    d = run.data_dir
    broker = start_proc("broker", [*AISYNERGY, "broker", "run", "--data-dir", str(d), "--port", str(run.broker_port)], d / "broker.log")
    run.procs.append(broker)
    wait_until(lambda: port_open(run.broker_port) or broker.popen.poll() is not None, 30, "broker port")
    if broker.popen.poll() is not None:
        raise RuntimeError(f"broker exited: {broker.log.read_text()[-2000:]}")
    mosq = wait_until(lambda: [c for c in psutil.Process(broker.popen.pid).children(recursive=True) if "mosquitto" in c.name()], 10, "mosquitto process")
    cli, env = AISYNERGY, None
    if run.args.instrument_hub:  # diagnostics: the same CLI, with the flush and liveness jobs timed
        cli, env = [sys.executable, str(ROOT / "bench" / "_hub_timing.py")], {"AISYNERGY_BENCH_TIMINGS": str(d / "hub-timings.jsonl")}
    hub = start_proc("hub", [*cli, "hub", "serve", "--data-dir", str(d), "--port", str(run.hub_port),
                             "--broker-url", f"mqtts://127.0.0.1:{run.broker_port}",
                             "--heartbeat-interval", str(run.args.interval), "--no-tls"], d / "hub.log", env)  # fmt: skip
    run.procs.append(hub)

    def mqtt_up() -> bool:
        if hub.popen.poll() is not None:
            raise RuntimeError(f"hub exited: {hub.log.read_text()[-3000:]}")
        try:
            r = httpx.get(run.hub_url + "/healthz", timeout=2)
            return r.status_code == 200 and bool(r.json()["mqtt"]["connected"])
        except httpx.HTTPError:
            return False

    wait_until(mqtt_up, 60, "hub healthy and connected to the broker", 0.2)
    out = subprocess.run([*AISYNERGY, "hub", "token", "create", "--role", "admin", "--name", "bench", "--data-dir", str(d)],
                         check=True, capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    run.token = out.stdout.strip().splitlines()[-1]
    return {"hub": [psutil.Process(hub.popen.pid)], "broker": mosq, "broker_pids": [p.pid for p in mosq], "hub_pid": hub.popen.pid}


async def enrol_all(run: Run) -> list[Enrolled]:
    """Register every node and enrol it with its bootstrap token (the product's enrolment path)."""
    import httpx
    from cryptography.hazmat.primitives import serialization

    from cloud.pki import make_csr, new_private_key
    from interfaces.nodes import CertificateIssued, CertificateRequest, NodeCreate, NodeRegistered

    n = run.args.nodes
    node_dir = run.data_dir / "nodes"
    node_dir.mkdir(parents=True, exist_ok=True)
    sem = asyncio.Semaphore(run.args.enrol_concurrency)
    # Certificate requests are serialised by default: concurrent ones race in the hub on fixed temporary
    # file names (pki/crl.pem.tmp, pki/revoked.tmp) and fail with 500 after consuming the token.
    cert_sem = asyncio.Semaphore(run.args.cert_concurrency)
    recovered: list[str] = []
    enrolled: list[Enrolled] = []
    errors: list[str] = []
    latencies: dict[str, list[float]] = {"register": [], "certificate": []}
    limits = httpx.Limits(max_connections=run.args.enrol_concurrency * 2, max_keepalive_connections=run.args.enrol_concurrency * 2)
    admin = httpx.AsyncClient(base_url=run.api, headers={"Authorization": f"Bearer {run.token}"}, timeout=60, limits=limits)
    anonymous = httpx.AsyncClient(base_url=run.api, timeout=60, limits=limits)  # the agent holds no integrator token

    async def post(client: httpx.AsyncClient, what: str, url: str, body: dict[str, Any]) -> httpx.Response:
        for attempt in range(3):
            t = time.perf_counter()
            try:
                r = await client.post(url, json=body)
            except httpx.TransportError:
                if attempt == 2:
                    raise
                await asyncio.sleep(0.5)
                continue
            latencies[what].append(time.perf_counter() - t)
            if r.status_code < 500 or attempt == 2:
                return r
            await asyncio.sleep(0.5)
        raise AssertionError("unreachable")

    async def one(i: int) -> None:
        async with sem:
            try:
                key = new_private_key()
                body = NodeCreate(name=f"bench-node-{i:05d}", labels={"bench": "heartbeat", "zone": f"z{i % 8}"}).model_dump(mode="json")
                r = await post(admin, "register", "/nodes", body)
                if r.status_code != 201:
                    raise RuntimeError(f"register: {r.status_code} {r.text[:200]}")
                reg = NodeRegistered.model_validate_json(r.content)
                node_id = reg.node.id
                csr, token = make_csr(key, node_id), reg.bootstrap_token
                for attempt in range(3):
                    req = CertificateRequest(csr_pem=csr, bootstrap_token=token)
                    async with cert_sem:
                        r = await post(anonymous, "certificate", f"/nodes/{node_id}/certificate", req.model_dump(mode="json"))
                    if r.status_code == 201 or attempt == 2:
                        break
                    # A failure after the token was consumed leaves it spent: recover the way an operator
                    # would, with a fresh bootstrap token (POST /nodes/{id}/bootstrap-token), and count it.
                    recovered.append(f"{node_id}: {r.status_code} {r.text[:160]}")
                    rt = await post(admin, "register", f"/nodes/{node_id}/bootstrap-token", {"ttl_s": 3600})
                    if rt.status_code != 201:
                        break
                    token = rt.json()["bootstrap_token"]
                if r.status_code != 201:
                    raise RuntimeError(f"certificate: {r.status_code} {r.text[:200]}")
                issued = CertificateIssued.model_validate_json(r.content)
                crt, kp = node_dir / f"{node_id}.crt", node_dir / f"{node_id}.key"
                crt.write_text(issued.certificate_pem)
                fd = os.open(kp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "wb") as fh:
                    fh.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
                enrolled.append(Enrolled(node_id, str(crt), str(kp)))
                if len(enrolled) % max(1, n // 10) == 0:
                    log(f"  enrolled {len(enrolled)}/{n}")
            except Exception as exc:  # noqa: BLE001
                errors.append(f"{i}: {exc!r}")

    t = time.monotonic()
    try:
        await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        await admin.aclose()
        await anonymous.aclose()
    wall = time.monotonic() - t
    run.results["enrolment"] = {
        "nodes": len(enrolled), "errors": len(errors), "error_examples": errors[:5], "wall_s": round(wall, 1),
        "certificate_concurrency": run.args.cert_concurrency, "reissued_tokens": len(recovered), "reissue_examples": recovered[:3],
        "nodes_per_s": _r(len(enrolled) / wall if wall else None), "concurrency": run.args.enrol_concurrency,
        "register_latency": summary_ms(latencies["register"]), "certificate_latency": summary_ms(latencies["certificate"]),
    }  # fmt: skip
    if errors:
        raise RuntimeError(f"{len(errors)} enrolments failed, e.g. {errors[:3]}")
    return enrolled


async def interruptible(coro: Any) -> Any:
    """Run ``coro`` so that SIGINT / SIGTERM cancel it cleanly (its ``finally`` blocks run)."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    try:
        return await coro
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
            signal.signal(sig, _on_signal)


def _on_signal(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


async def count_state(client: Any, state: str) -> int:
    """Count nodes in ``state`` through the paginated REST list (MAX_LIMIT pages)."""
    from interfaces.pagination import MAX_LIMIT

    total, cursor, pages = 0, None, 0
    while pages < 10_000:  # bounded
        params: dict[str, Any] = {"state": state, "limit": MAX_LIMIT}
        if cursor:
            params["cursor"] = cursor
        r = await client.get("/nodes", params=params, timeout=60)
        r.raise_for_status()
        page = r.json()
        total += len(page["items"])
        cursor = page.get("next_cursor")
        pages += 1
        if not cursor:
            break
    return total


async def measure(run: Run, enrolled: list[Enrolled], handles: dict[str, Any]) -> None:
    import httpx
    import psutil

    args = run.args
    ctx = mp.get_context("spawn")
    out: Any = ctx.Queue()
    go = ctx.Event()
    times = ctx.Array("d", [0.0, 0.0])
    run.gen_control = (go, times)
    ids = [e.node_id for e in enrolled]
    rng = random.Random(args.seed)
    probes = set(rng.sample(ids, min(args.sample, len(ids))))
    k = args.processes
    slices = [enrolled[i::k] for i in range(k)]
    connect_budget = 120 + len(enrolled) / 20
    online_budget = 60 + len(enrolled) / 100
    epoch = time.time()
    hard_deadline = epoch + connect_budget + online_budget + args.duration + args.probe_timeout + 60
    ca = str(run.data_dir / "pki" / "ca.crt")
    for i, part in enumerate(slices):
        cfg = GenConfig(index=i, nodes=[(e.node_id, e.cert, e.key) for e in part], ca_path=ca, host="127.0.0.1", port=run.broker_port,
                        probes={p for p in probes if p in {e.node_id for e in part}}, interval_s=args.interval,
                        keepalive_s=args.keepalive, connect_threads=args.connect_threads, connect_timeout_s=60, seed=args.seed + i,
                        epoch=epoch, hard_deadline=hard_deadline)  # fmt: skip
        p = ctx.Process(target=generator_main, args=(cfg, out, go, times), name=f"loadgen-{i}", daemon=True)
        p.start()
        run.gens.append(p)
    handles["loadgen"] = [psutil.Process(p.pid) for p in run.gens]
    sampler = Sampler({"hub": handles["hub"], "broker": handles["broker"], "loadgen": handles["loadgen"], "orchestrator": [psutil.Process()]})
    sampler.start()

    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()
    reader_stop = threading.Event()

    def reader() -> None:
        while not reader_stop.is_set():
            try:
                item = out.get(timeout=0.2)
            except queue_mod.Empty:
                continue
            except (EOFError, OSError):
                return
            loop.call_soon_threadsafe(inbox.put_nowait, item)

    threading.Thread(target=reader, daemon=True, name="inbox").start()

    # ---- connect ---------------------------------------------------------------------------------
    log(f"connecting {len(enrolled)} nodes from {k} load-generator processes")
    t_conn = time.monotonic()
    ready: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + connect_budget
    while len(ready) < k:
        try:
            item = await asyncio.wait_for(inbox.get(), max(0.1, deadline - time.monotonic()))
        except TimeoutError:
            raise RuntimeError(f"only {len(ready)}/{k} generators connected in time") from None
        if item[0] == "ready":
            ready[item[1]] = item[2]
        elif item[0] == "error":
            raise RuntimeError(f"generator {item[1]} failed: {item[2]}")
    connected = sum(r["connected"] for r in ready.values())
    connect_wall = time.monotonic() - t_conn
    log(f"connected {connected}/{len(enrolled)} in {connect_wall:.1f} s")

    headers = {"Authorization": f"Bearer {run.token}"}
    http = httpx.AsyncClient(base_url=run.api, headers=headers, timeout=30,
                             limits=httpx.Limits(max_connections=64, max_keepalive_connections=64))  # fmt: skip
    probe_tasks: set[asyncio.Task[None]] = set()
    background: list[asyncio.Task[None]] = []
    try:
        # ---- every node ONLINE before the window ------------------------------------------------
        t_on = time.monotonic()
        online = 0
        while time.monotonic() - t_on < online_budget:
            online = await count_state(http, "ONLINE")
            if online >= connected:
                break
            await asyncio.sleep(1)
        online_wait = time.monotonic() - t_on
        log(f"{online} nodes ONLINE through REST ({online_wait:.1f} s after the last connect)")
        run.results["connect"] = {
            "connected": connected, "failed": sum(r["failed"] for r in ready.values()),
            "failures": [f for r in ready.values() for f in r["failures"]][:5],
            "wall_s": round(connect_wall, 1), "per_generator": ready,
            "online_before_window": online, "online_visible_after_s": round(online_wait, 1),
        }  # fmt: skip

        # ---- the window ---------------------------------------------------------------------------
        hz0 = (await http.get(run.hub_url + "/healthz")).json()
        t0 = time.time() + 0.5
        t_end = t0 + args.duration
        times[0], times[1] = t0, t_end
        go.set()
        log(f"heartbeating every {args.interval:g} s for {args.duration:g} s "
            f"(probing {len(probes)} nodes, GET /nodes/{{id}} at {args.rest_rate:g}/s)")  # fmt: skip
        visible: list[float] = []
        timeline: list[tuple[float, float]] = []  # (publish time into the window s, visible after ms)
        status_get: list[float] = []
        node_get: list[float] = []
        http_errors: dict[str, int] = {}
        probe_timeouts: list[str] = []
        gen_done: dict[int, dict[str, Any]] = {}
        profiler = start_profiler(run, handles, args.duration) if args.profile_hub else None

        async def probe(node_id: str, uptime: float, at: float) -> None:
            give_up = at + args.probe_timeout
            while time.time() < give_up:
                t = time.perf_counter()
                try:
                    r = await http.get(f"/nodes/{node_id}/status")
                except httpx.HTTPError as exc:
                    http_errors[type(exc).__name__] = http_errors.get(type(exc).__name__, 0) + 1
                    await asyncio.sleep(args.poll_interval)
                    continue
                now = time.time()
                status_get.append(time.perf_counter() - t)
                if r.status_code != 200:
                    http_errors[str(r.status_code)] = http_errors.get(str(r.status_code), 0) + 1
                else:
                    shown = r.json().get("uptime_s")
                    if shown is not None and shown >= uptime - 1e-9:
                        visible.append(now - at)
                        timeline.append((round(at - t0, 3), round((now - at) * 1000, 1)))
                        return
                await asyncio.sleep(args.poll_interval)
            probe_timeouts.append(node_id)

        async def rest_load() -> None:
            period = 1.0 / args.rest_rate
            sem = asyncio.Semaphore(32)
            pending: set[asyncio.Task[None]] = set()

            async def one(node_id: str) -> None:
                async with sem:
                    t = time.perf_counter()
                    try:
                        r = await http.get(f"/nodes/{node_id}")
                    except httpx.HTTPError as exc:
                        http_errors[type(exc).__name__] = http_errors.get(type(exc).__name__, 0) + 1
                        return
                    node_get.append(time.perf_counter() - t)
                    if r.status_code != 200:
                        http_errors[str(r.status_code)] = http_errors.get(str(r.status_code), 0) + 1

            i = 0
            while True:  # open loop, fixed rate, stops at t_end
                target = t0 + i * period
                if target >= t_end:
                    break
                await asyncio.sleep(max(0.0, target - time.time()))
                task = asyncio.create_task(one(rng.choice(ids)))
                pending.add(task)
                task.add_done_callback(pending.discard)
                i += 1
            if pending:
                await asyncio.wait(pending, timeout=30)

        load = asyncio.create_task(rest_load())
        background.append(load)
        hard_stop = t_end + args.probe_timeout + 30
        while len(gen_done) < k and time.time() < hard_stop:  # bounded
            try:
                item = await asyncio.wait_for(inbox.get(), 0.5)
            except TimeoutError:
                if all(not p.is_alive() for p in run.gens) and inbox.empty():
                    break
                continue
            if item[0] == "probe":
                task = asyncio.create_task(probe(item[1], item[2], item[3]))
                probe_tasks.add(task)
                task.add_done_callback(probe_tasks.discard)
            elif item[0] == "done":
                gen_done[item[1]] = item[2]
            elif item[0] == "error":
                raise RuntimeError(f"generator {item[1]} failed: {item[2]}")
        # generators stop at t_end and then disconnect; the window's figures were sampled before that
        await load
        if probe_tasks:
            await asyncio.wait(set(probe_tasks), timeout=args.probe_timeout + 5)
        hz1 = (await http.get(run.hub_url + "/healthz")).json()
        online_after = await count_state(http, "ONLINE")
        if profiler is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                profiler.wait(30)
    finally:
        pending = [t for t in (*probe_tasks, *background) if not t.done()]
        for task in pending:  # only when interrupted: normally everything has finished
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await http.aclose()
        sampler.stop()
        reader_stop.set()

    sent = sum(g["heartbeats"] for g in gen_done.values()) + sum(g["states"] for g in gen_done.values())
    received = hz1["mqtt"].get("messages_received", 0)  # since the hub started, before any node existed
    ingest_keys = [key for key, value in hz1.get("ingest", {}).items() if isinstance(value, int) and key != "backlog"]
    run.results["window"] = {
        "duration_s": args.duration, "interval_s": args.interval, "t0": dt.datetime.fromtimestamp(t0, dt.UTC).isoformat(),
        "heartbeats_sent_in_window": sum(g["heartbeats_in_window"] for g in gen_done.values()),
        "heartbeats_per_s": _r(sum(g["heartbeats_in_window"] for g in gen_done.values()) / args.duration),
        "messages_sent_total": sent, "hub_messages_received_total": received,
        "hub_dropped": {key: hz1["mqtt"].get(key, 0) - hz0["mqtt"].get(key, 0) for key in ("dropped_invalid", "dropped_src_mismatch", "dropped_unknown_topic")},
        "hub_ingest": {key: hz1["ingest"].get(key, 0) - hz0["ingest"].get(key, 0) for key in ingest_keys},
        "hub_mqtt_reconnects": hz1["mqtt"].get("connects", 0) - hz0["mqtt"].get("connects", 0),
        "online_after_window": online_after,
        "unexpected_disconnects": sum(g["unexpected_disconnects"] for g in gen_done.values()),
        "publish_errors": sum(g["publish_errors"] for g in gen_done.values()),
        "disconnect_reasons": [r for g in gen_done.values() for r in g["disconnect_reasons"]][:5],
        "generator_lateness": {i: g["lateness"] for i, g in sorted(gen_done.items())},
        "generators_reported": len(gen_done),
    }  # fmt: skip
    run.results["latency"] = {
        "probe_nodes": len(probes), "poll_interval_ms": args.poll_interval * 1000,
        "heartbeat_to_status_visible": summary_ms(visible), "probe_timeouts": len(probe_timeouts),
        "get_node": {**summary_ms(node_get), "rate_per_s": args.rest_rate},
        "get_status_while_polling": {**summary_ms(status_get), "rate_per_s": _r(len(status_get) / args.duration)},
        "http_errors": http_errors,
        "visible_timeline": sorted(timeline),
    }  # fmt: skip
    run.results["resources"] = {
        "hub": sampler.window("hub", t0, t_end), "broker": sampler.window("broker", t0, t_end),
        "loadgen_total": sampler.window("loadgen", t0, t_end), "orchestrator": sampler.window("orchestrator", t0, t_end),
        "machine_busy_pct_of_one_core": sampler.system_window(t0, t_end), "machine_cores": os.cpu_count(),
    }  # fmt: skip
    if args.instrument_hub:
        run.results["hub_jobs"] = hub_job_timings(run.data_dir / "hub-timings.jsonl", t0, t_end)
    ours = sum((run.results["resources"][k] or {}).get("cpu_pct_of_one_core") or 0 for k in ("hub", "broker", "loadgen_total", "orchestrator"))
    busy = run.results["resources"]["machine_busy_pct_of_one_core"]
    run.results["resources"]["other_processes_pct_of_one_core"] = _r(busy - ours) if busy is not None else None


def hub_job_timings(path: Path, t0: float, t1: float) -> dict[str, Any]:
    jobs: dict[str, list[dict[str, Any]]] = {}
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if t0 <= rec["t"] <= t1:
                jobs.setdefault(rec["job"], []).append(rec)
    out: dict[str, Any] = {}
    for job, recs in jobs.items():
        ms = [r["ms"] for r in recs]
        out[job] = {"calls": len(recs), "per_s": _r(len(recs) / (t1 - t0), 2), "p50_ms": _r(percentile(ms, 50)),
                    "p99_ms": _r(percentile(ms, 99)), "max_ms": _r(max(ms)), "busy_pct": _r(sum(ms) / (t1 - t0) / 10)}  # fmt: skip
        rows = [r["rows"] for r in recs if isinstance(r.get("rows"), int)]
        if rows:
            out[job]["rows_mean"] = _r(statistics.fmean(rows))
            out[job]["ms_per_row"] = _r(sum(ms) / max(1, sum(rows)), 3)
    return out


def start_profiler(run: Run, handles: dict[str, Any], duration: float) -> subprocess.Popen[bytes] | None:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not os.access(spy, os.X_OK):
        log("py-spy not found: pip install py-spy (profiling skipped)")
        return None
    out = Path(run.args.profile_hub).resolve()
    fmt = "speedscope" if out.suffix == ".json" else ("flamegraph" if out.suffix == ".svg" else "raw")
    log(f"profiling the hub with py-spy for {duration:g} s -> {out} ({fmt})")
    return subprocess.Popen([spy, "record", "--pid", str(handles["hub_pid"]), "--duration", str(int(duration)), "--rate", "50",
                             "--format", fmt, "--output", str(out), "--threads", "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=(run.data_dir / "py-spy.log").open("ab"), start_new_session=True)  # fmt: skip


def verdict(run: Run) -> tuple[bool, list[str]]:
    r, a = run.results, run.args
    why: list[str] = []
    n = a.nodes
    if r.get("enrolment", {}).get("nodes") != n:
        why.append("not every node enrolled")
    c = r.get("connect", {})
    if c.get("connected") != n:
        why.append(f"{n - c.get('connected', 0)} nodes failed to connect")
    if c.get("online_before_window") != n:
        why.append(f"only {c.get('online_before_window')} nodes ONLINE before the window")
    w = r.get("window", {})
    if w.get("online_after_window") != n:
        why.append(f"only {w.get('online_after_window')} nodes ONLINE after the window")
    if w.get("unexpected_disconnects"):
        why.append(f"{w['unexpected_disconnects']} unexpected disconnects")
    if w.get("hub_messages_received_total", 0) < w.get("messages_sent_total", 0):
        why.append(f"hub received {w.get('hub_messages_received_total')} of {w.get('messages_sent_total')} messages")
    for i, late in (w.get("generator_lateness") or {}).items():
        if (late.get("p99_ms") or 0) > 1000:
            why.append(f"generator {i} fell behind its schedule (p99 lateness {late['p99_ms']} ms)")
    lat = r.get("latency", {})
    if lat.get("probe_timeouts"):
        why.append(f"{lat['probe_timeouts']} heartbeats never became visible within {a.probe_timeout:g} s")
    p99 = (lat.get("heartbeat_to_status_visible") or {}).get("p99_ms")
    if p99 is None or p99 >= 1000:
        why.append(f"status p99 {p99} ms >= 1000 ms")
    return not why, why


def table(run: Run) -> str:
    r = run.results
    lat, res, w = r.get("latency", {}), r.get("resources", {}), r.get("window", {})
    vis, gn = lat.get("heartbeat_to_status_visible", {}), lat.get("get_node", {})
    st = lat.get("get_status_while_polling", {})
    en = r.get("enrolment", {})

    def cr(name: str) -> tuple[str, str]:
        x = res.get(name) or {}
        return (f"{x.get('cpu_pct_of_one_core')} % (max 1 s: {x.get('cpu_pct_max_1s')} %)", f"{x.get('rss_mib_end')} MiB (max {x.get('rss_mib_max')})")

    rows = [
        ("nodes (MQTT connections)", f"{run.args.nodes}  ({run.args.processes} load-generator processes)"),
        ("heartbeat interval / window", f"{run.args.interval:g} s / {run.args.duration:g} s  ({w.get('heartbeats_per_s')} heartbeats/s)"),
        ("messages sent / hub received (whole run)", f"{w.get('messages_sent_total')} / {w.get('hub_messages_received_total')}"),
        ("heartbeat -> status visible p50", f"{vis.get('p50_ms')} ms"),
        ("heartbeat -> status visible p99", f"{vis.get('p99_ms')} ms  (max {vis.get('max_ms')}, n={vis.get('count')}, timeouts {lat.get('probe_timeouts')})"),
        ("GET /nodes/{id} p50 / p99", f"{gn.get('p50_ms')} / {gn.get('p99_ms')} ms  (n={gn.get('count')}, {gn.get('rate_per_s')}/s)"),
        ("GET /nodes/{id}/status p50 / p99", f"{st.get('p50_ms')} / {st.get('p99_ms')} ms  (n={st.get('count')}, {st.get('rate_per_s')}/s)"),
        ("hub CPU (of one core) / RSS", " / ".join(cr("hub"))),
        ("broker CPU (of one core) / RSS", " / ".join(cr("broker"))),
        ("load generators CPU / RSS", " / ".join(cr("loadgen_total"))),
        ("orchestrator (REST poller) CPU", cr("orchestrator")[0]),
        ("whole machine busy", f"{res.get('machine_busy_pct_of_one_core')} % of {res.get('machine_cores')} x 100 %  "
                               f"(other processes: {res.get('other_processes_pct_of_one_core')} %)"),
        ("enrolment (register + certificate)", f"{en.get('nodes')} nodes in {en.get('wall_s')} s = {en.get('nodes_per_s')}/s"),
        ("connect (TLS + CONNECT + online)", f"{r.get('connect', {}).get('connected')} in {r.get('connect', {}).get('wall_s')} s"),
        ("ONLINE before / after window", f"{r.get('connect', {}).get('online_before_window')} / {w.get('online_after_window')}"),
        ("unexpected disconnects", f"{w.get('unexpected_disconnects')}"),
        ("verdict", "HOLDS" if r.get("holds") else "DOES NOT HOLD: " + "; ".join(r.get("why", []) or [r.get("error", "")])),
    ]
    for job, t in (r.get("hub_jobs") or {}).items():
        extra = f", {t['rows_mean']} rows each" if "rows_mean" in t else ""
        rows.insert(-1, (f"hub {job} job (instrumented)", f"{t['per_s']}/s, p50 {t['p50_ms']} / p99 {t['p99_ms']} / max {t['max_ms']} ms{extra}, busy {t['busy_pct']} %"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def main(argv: Iterable[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--nodes", type=int, default=1000, help="simulated edge nodes, one MQTT connection each")
    p.add_argument("--duration", type=float, default=60, help="seconds of steady heartbeating measured")
    p.add_argument("--interval", type=float, default=10, help="heartbeat interval (s); also given to the hub")
    p.add_argument("--processes", type=int, default=0, help="load-generator processes (0: one per 2,500 nodes, at most 4)")
    p.add_argument("--sample", type=int, default=100, help="nodes whose every heartbeat is followed to REST")
    p.add_argument("--poll-interval", type=float, default=0.025, help="status polling period while a probe is pending (s)")
    p.add_argument("--probe-timeout", type=float, default=10, help="a heartbeat not visible after this many seconds counts as lost")
    p.add_argument("--rest-rate", type=float, default=20, help="GET /nodes/{id} per second on random nodes during the window")
    p.add_argument("--enrol-concurrency", type=int, default=16)
    p.add_argument("--cert-concurrency", type=int, default=1,
                   help="certificate requests in flight (>1 trips a hub race on fixed temp-file names, see bench/README.md)")
    p.add_argument("--connect-threads", type=int, default=4, help="threads per generator doing blocking TLS connects")
    p.add_argument("--keepalive", type=int, default=30, help="MQTT keepalive of the simulated agents (the agent's default)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--data-dir", type=Path, default=None, help="work directory (default: a fresh temporary one, removed after)")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, database, identities)")
    p.add_argument("--instrument-hub", action="store_true", help="diagnostics: time the hub's flush and liveness jobs (bench/_hub_timing.py)")
    p.add_argument("--profile-hub", default=None, help="py-spy the hub during the window into this file (.svg, .json = speedscope, else raw)")
    args = p.parse_args(list(argv) if argv is not None else None)
    if args.nodes < 1 or args.duration <= 0 or args.interval <= 0:
        p.error("--nodes, --duration and --interval must be positive")
    if args.processes <= 0:
        args.processes = min(4, max(1, math.ceil(args.nodes / 2500)))
    args.processes = min(args.processes, args.nodes)
    args.sample = min(args.sample, args.nodes)

    nofile = raise_nofile()
    per_gen = math.ceil(args.nodes / args.processes)
    if per_gen + 64 > nofile:
        p.error(f"{per_gen} connections per generator exceed the open-files limit {nofile}: use more --processes")
    if args.nodes + 256 > nofile:
        log(f"warning: {args.nodes} connections may exceed the broker's open-files limit {nofile}")

    made_tmp = args.data_dir is None
    data_dir = Path(tempfile.mkdtemp(prefix="aisynergy-bench-")) if made_tmp else args.data_dir.resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    run = Run(args, data_dir, free_port(), free_port())
    started = dt.datetime.now(dt.UTC)
    run.results = {
        "benchmark": "heartbeat_load", "date": started.isoformat(timespec="seconds"), "machine": machine_info(),
        "command": " ".join(["python", "bench/heartbeat_load.py", *(sys.argv[1:] if argv is None else list(argv))]),
        "note": "broker, hub, load generators and the REST poller all share this machine's cores",
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()], "code": code_version(),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }  # fmt: skip

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _on_signal)
    try:
        log(f"work directory {data_dir}; broker :{run.broker_port}, hub :{run.hub_port}")
        handles = start_system(run)
        log(f"enrolling {args.nodes} nodes (concurrency {args.enrol_concurrency})")
        enrolled = asyncio.run(interruptible(enrol_all(run)))
        e = run.results["enrolment"]
        log(f"enrolled {e['nodes']} nodes in {e['wall_s']} s ({e['nodes_per_s']}/s)")
        asyncio.run(interruptible(measure(run, enrolled, handles)))
        ok, why = verdict(run)
        run.results["holds"], run.results["why"] = ok, why
    except (KeyboardInterrupt, asyncio.CancelledError):
        log("interrupted")
        run.results["error"] = "interrupted"
    except Exception as exc:  # noqa: BLE001
        log(f"FAILED: {exc!r}")
        run.results["error"] = repr(exc)
    finally:
        if run.gen_control is not None:  # tell the generators the window is over (they disconnect and exit)
            go, times = run.gen_control
            now = time.time()
            times[0], times[1] = times[0] or now, min(times[1], now) if times[1] else now
            go.set()
        for g in run.gens:
            g.join(timeout=15)
            if g.is_alive():
                g.kill()
                g.join(5)
        for proc in reversed(run.procs):
            proc.stop()
        for name in ("hub", "broker"):
            with contextlib.suppress(OSError):
                tail = (data_dir / f"{name}.log").read_text(errors="replace").splitlines()
                errors = [line for line in tail if " ERROR " in line or "Traceback" in line]
                run.results.setdefault("logs", {})[name] = {"lines": len(tail), "error_lines": len(errors), "error_examples": errors[:3]}
        if made_tmp and not args.keep:
            shutil.rmtree(data_dir, ignore_errors=True)
        else:
            run.results["data_dir"] = str(data_dir)
    print()
    print(table(run))
    if args.out:
        args.out.write_text(json.dumps(run.results, indent=2, default=str) + "\n")
        log(f"results written to {args.out}")
    if "error" in run.results:
        return 1
    return 0 if run.results.get("holds") else 3


if __name__ == "__main__":
    sys.exit(main())
