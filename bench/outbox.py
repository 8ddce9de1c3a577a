#!/usr/bin/env python3
"""Device outbox benchmark: what store-and-forward (:mod:`device.outbox`) costs a device per event.

Two parts, each a few seconds a run:

1. *The store alone*: :class:`device.outbox.Outbox` on a file in ``--dir`` (default: a temporary directory),
   1 or ``--threads`` emitters calling :meth:`~device.outbox.Outbox.append` as fast as they can with the
   envelope of a small event (what ``emit`` stores, 231 bytes), and one consumer thread that takes
   :meth:`~device.outbox.Outbox.sendable` and acknowledges it at once (an edge with no latency). Measured:
   appends per second, wall time of each ``append()`` (mean, p50, p99), the process's CPU time per event
   (emitters, committer and consumer together: the store's whole cost), commits (each one fsync in durable
   mode) per second and events per commit.
2. *End to end*: one real :class:`device.agent.Device` (mutual TLS) emitting to a real Mosquitto, and a real
   edge agent (``python -m edge.cli run``) that stores each event in its own SQLite outbox and acknowledges
   it on ``events/ack`` after its commit. No hub is connected: the edge keeps what it stored for the hub (the
   hub's side is not what is measured here). The emitters call :meth:`~device.agent.Device.emit` as fast as
   they can for ``--seconds``; ``OutboxFull`` (the edge's acknowledgements lag) is counted and retried after
   1 ms. Measured: emits per second, the *sustained* rate (every event emitted, acknowledged by the edge,
   over the time until the last acknowledgement), the wall time of ``emit()``, the device process's CPU time
   per event (this script's process holds only the device) and the edge process's, both also as % of one
   core until the last acknowledgement, and the device outbox's commits per second (counted through
   ``Outbox``'s ``on_committed`` hook).

Both parts run in durable mode (``append``/``emit`` return after the fsync) with 1 and ``--threads``
emitters, and in fast mode (50 ms group commit) with one. Needs ``mosquitto`` on the PATH for part 2.

Usage::

    python bench/outbox.py [--seconds 3] [--threads 4] [--dir /var/tmp/x] [--out bench/results/outbox.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402 - after the path set-up above

import device.agent  # noqa: E402
from device.errors import OutboxFull  # noqa: E402
from device.identity import IdentityStore  # noqa: E402
from device.outbox import Outbox  # noqa: E402
from interfaces.messages import EventBody, envelope  # noqa: E402
from tests.edge.support import Mosquitto, Pki, ThrowawayCA, edge_acl, enrol_node, start_edge, stop_edge  # noqa: E402

NODE, DEVICE = "nd-bench-outbox", "dv-bench-outbox"
PAYLOAD = envelope(DEVICE, EventBody(seq=0, prev_seq=0, type="bench.tick", data={"n": 0})).model_dump_json().encode()


def _summary(samples_s: list[float]) -> dict[str, float]:
    """Mean, p50 and p99 of per-call wall times, in µs."""
    ordered = sorted(samples_s)
    return {
        "mean_us": round(statistics.fmean(ordered) * 1e6, 1),
        "p50_us": round(ordered[len(ordered) // 2] * 1e6, 1),
        "p99_us": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e6, 1),
    }


def _emit_for(seconds: float, threads: int, emit: Callable[[int], object]) -> tuple[list[float], int, float]:
    """``threads`` emitters calling ``emit`` for ``seconds``; (wall time of each call, refusals, elapsed)."""
    walls: list[list[float]] = [[] for _ in range(threads)]
    refused = [0] * threads
    start = time.perf_counter()
    deadline = start + seconds

    def run(k: int) -> None:
        n, mine = 0, walls[k]
        while (t0 := time.perf_counter()) < deadline:
            try:
                emit(n)
            except OutboxFull:
                refused[k] += 1
                time.sleep(0.001)
                continue
            mine.append(time.perf_counter() - t0)
            n += 1

    emitters = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
    for t in emitters:
        t.start()
    for t in emitters:
        t.join()
    return [w for per in walls for w in per], sum(refused), time.perf_counter() - start


# ---- 1. the store alone -------------------------------------------------------------------------------
def bench_store(directory: Path, seconds: float, threads: int, durable: bool) -> dict[str, Any]:
    commits = [0]
    path = directory / f"store-{'durable' if durable else 'fast'}-{threads}.db"
    outbox = Outbox(path, durable=durable, on_committed=lambda: commits.__setitem__(0, commits[0] + 1))
    done = threading.Event()

    def consume() -> None:  # an edge that acknowledges at once
        while not done.is_set():
            rows = outbox.sendable(True)
            if rows:
                outbox.acknowledge(rows[-1][0])
            else:
                outbox.wait(0.05)

    consumer = threading.Thread(target=consume)
    consumer.start()
    cpu0 = time.process_time()
    walls, refused, elapsed = _emit_for(seconds, threads, lambda n: outbox.append(lambda seq, prev: PAYLOAD))
    cpu = time.process_time() - cpu0
    done.set()
    consumer.join()
    outbox.close()
    events = len(walls)
    return {
        "part": "store", "mode": "durable" if durable else "fast", "emitters": threads, "events": events,
        "refused": refused, "seconds": round(elapsed, 2), "events_per_s": round(events / elapsed),
        "append_wall": _summary(walls), "cpu_us_per_event": round(cpu / events * 1e6, 1),
        "commits_per_s": round(commits[0] / elapsed), "events_per_commit": round(events / max(1, commits[0]), 1),
    }  # fmt: skip


# ---- 2. end to end: Device -> Mosquitto -> edge -> events/ack -----------------------------------------
class Stack:
    """One Mosquitto for the edge and the device, the edge agent, and the device's identity."""

    def __init__(self, directory: Path) -> None:
        ca = ThrowawayCA.create()
        pki = Pki(directory / "pki", ca)
        self.broker = Mosquitto(directory / "broker", pki, edge_acl(NODE, [DEVICE])).start()
        self.node_dir = enrol_node(directory / "node", ca, NODE, self.broker.url).data_dir
        self.edge: subprocess.Popen[bytes] = start_edge(self.node_dir, NODE, "--device-listen", "off")
        self.device_dir = directory / "device"
        identity = IdentityStore(self.device_dir)
        identity.save(ca.issue_device(identity.make_csr(DEVICE), DEVICE, NODE, self.broker.url), "http://edge.invalid")

    def close(self) -> None:
        stop_edge(self.edge)
        self.broker.stop()


def _wait(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} within {timeout_s} s")
        time.sleep(0.01)


def bench_device(stack: Stack, seconds: float, threads: int, durable: bool) -> dict[str, Any]:
    commits = [0]
    counted = functools.partial(Outbox, on_committed=lambda: commits.__setitem__(0, commits[0] + 1))
    device.agent.Outbox = counted  # type: ignore[attr-defined,misc]  # the agent's own Outbox, counting commits
    dev = device.agent.Device(DEVICE, stack.device_dir, durable_events=durable)
    dev.start()
    try:
        dev.emit("warm_up")  # the edge is subscribed and acknowledging before the clock starts
        _wait(lambda: dev.stats().events_waiting == 0, 60, "acknowledgement of the warm-up event")
        commits[0] = 0
        edge = psutil.Process(stack.edge.pid)
        edge0 = sum(edge.cpu_times()[:2])
        cpu0, start = time.process_time(), time.perf_counter()
        walls, refused, elapsed = _emit_for(seconds, threads, lambda n: dev.emit("bench.tick", {"n": n}))
        _wait(lambda: dev.stats().events_waiting == 0, 120, "acknowledgement of every event")
        until_acked = time.perf_counter() - start  # (the last poll adds up to 10 ms)
        cpu = time.process_time() - cpu0
        edge_cpu = sum(edge.cpu_times()[:2]) - edge0
    finally:
        dev.stop()
        device.agent.Outbox = Outbox  # type: ignore[attr-defined,misc]
    events = len(walls)
    return {
        "part": "device", "mode": "durable" if durable else "fast", "emitters": threads, "events": events,
        "refused": refused, "seconds": round(elapsed, 2), "emits_per_s": round(events / elapsed),
        "emit_wall": _summary(walls), "cpu_us_per_event": round(cpu / events * 1e6, 1),
        "edge_cpu_us_per_event": round(edge_cpu / events * 1e6, 1), "edge_cpu_pct": round(edge_cpu / until_acked * 100),
        "cpu_pct": round(cpu / until_acked * 100), "commits": commits[0], "commits_per_s": round(commits[0] / elapsed),
        "events_per_commit": round(events / max(1, commits[0]), 1),
        "all_acked_after_s": round(until_acked, 2), "sustained_per_s": round(events / until_acked),
    }  # fmt: skip


def machine() -> dict[str, str | int]:
    lines = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    models = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    model = models[0] if models else platform.processor()
    return {"cpu": model, "cpus": os.cpu_count() or 0, "python": platform.python_version()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="length of each run")
    parser.add_argument("--threads", type=int, default=4, help="emitters of the concurrent durable runs")
    parser.add_argument("--dir", type=Path, help="where the SQLite files go (default: a temporary directory)")
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    parser.add_argument("--store-only", action="store_true", help="skip the end-to-end part (no broker)")
    args = parser.parse_args()
    runs = [(True, 1), (True, args.threads), (False, 1)]
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-outbox-", dir=args.dir) as tmp:
        work = Path(tmp)
        for durable, threads in runs:
            results.append(bench_store(work, args.seconds, threads, durable))
            print(json.dumps(results[-1]), flush=True)
        if not args.store_only:
            stack = Stack(work / "stack")
            try:
                for durable, threads in runs:
                    results.append(bench_device(stack, args.seconds, threads, durable))
                    print(json.dumps(results[-1]), flush=True)
            finally:
                stack.close()
    report = {"machine": machine(), "seconds": args.seconds, "results": results}
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
