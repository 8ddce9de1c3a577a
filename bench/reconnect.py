#!/usr/bin/env python3
"""Broker restart under a fleet: N devices behind one edge, the broker killed with SIGKILL and started again.

What runs, each in its own process on 127.0.0.1 (the system of ``bench/command_rtt.py``, whose helpers this
script imports): one broker (``aisynergy broker run``) for the hub, the edge and the devices, as ``aisynergy
up`` runs it; the hub (``aisynergy hub serve``, SQLite, default settings); one edge agent; ``--workers``
device-host processes running the ``--devices`` devices as real :class:`device.agent.Device` instances, every
one enrolled through the edge. Each device emits a ``bench.tick`` event every ``--emit-min``..``--emit-max``
seconds (uniform, its own thread; ``emit()`` returns once the event is in the device's outbox) and each
worker records every seq that ``emit()`` returned and when, and when each device lost and regained its
connection (its ``connected`` flag, sampled every 50 ms).

The run, every step bounded in time:

1. every device ONLINE at the hub; the devices emit for ``--warm-s`` seconds;
2. the broker's process group (the runner and Mosquitto) gets SIGKILL; ``--outage-s`` seconds later the same
   command starts it again on the same port with the same data directory (its persistence, its PKI);
3. *back online*: from the moment the broker accepts connections again, the orchestrator polls
   ``GET /nodes/{edge}/status`` and ``GET /devices/{id}/status`` until the edge and every device are ONLINE
   with a contact recorded after that moment (``last_heartbeat_at``: the hub's receipt of the agent's
   ``online`` state or of a heartbeat). That recorded time is what is reported (the poll only finds it), so
   polling does not quantise the figure; the poll's own finding time is reported beside it;
4. *device reconnect*: on the devices' side, the time from the broker's return to each device's
   reconnection (the workers' records);
5. the devices emit for ``--after-s`` more seconds and stop; *nothing lost*: every seq that ``emit()``
   returned must be at the hub exactly once (``GET /devices/{id}/events``, every page), and no seq the
   hub holds may be unknown to the device; *drained*: from the broker's return until the hub had received
   every event emitted before it (and every event at all), from the events' ``received_at``.

Usage::

    python bench/reconnect.py --devices 1000 --out bench/results/reconnect-1000.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for p in (str(ROOT), str(BENCH)):
    if p not in sys.path:  # run as a script from a checkout
        sys.path.insert(0, p)

from command_rtt import (  # noqa: E402 - after the path set-up above
    Run, api_ok, code_record, device_states, register_device, resources, source_hashes, start_devices, start_edge,
    start_system, tree_digest,
)  # fmt: skip
from heartbeat_load import AISYNERGY, Sampler, _r, log, machine_info, port_open, raise_nofile, start_proc, summary_ms, wait_until  # noqa: E402

TICK = "bench.tick"
GO, STOP_EMITTING = "emit.go", "emit.stop"  # files in the work directory: the orchestrator's signals to the workers


def records_path(status_path: Path) -> Path:
    """Where a worker writes its records: beside its status file (``worker-N.status.json``)."""
    return status_path.with_name(status_path.name.replace(".status.json", ".records.json"))


# ---------------------------------------------------------------------------------------------------
# device-host worker
# ---------------------------------------------------------------------------------------------------
def worker_main(spec_path: Path) -> int:
    """Start the spec's devices (enrolling each through the edge), emit once ``GO`` exists, stop emitting and
    write the records once ``STOP_EMITTING`` exists; stop at SIGTERM, the orchestrator's exit or the deadline."""
    import logging

    spec = json.loads(spec_path.read_text())
    if spec.get("nice"):  # --device-nice: the simulated fleet yields the CPU to the system under test
        os.nice(spec["nice"])
    logging.basicConfig(level=spec.get("log_level", "INFO"), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from device.agent import Device
    from device.errors import NotRunning, OutboxFull

    work, status_path = Path(spec["work"]), Path(spec["status"])
    lo, hi = spec["emit_min_s"], spec["emit_max_s"]
    parent, deadline = os.getppid(), time.monotonic() + spec["max_lifetime_s"]
    stop, go, stop_emitting = threading.Event(), threading.Event(), threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    devices: list[Any] = []
    status: dict[str, Any] = {"pid": os.getpid(), "enrolled": 0, "errors": [], "start_ms": [], "enrolling_done": False}
    emitted: dict[str, list[tuple[int, float]]] = {}  # device id -> (seq, wall time emit() returned)
    refused: Counter[str] = Counter()  # device id -> emit() raised OutboxFull
    failed: Counter[str] = Counter()  # ... any other error
    links: dict[str, list[tuple[float, bool]]] = {}  # device id -> (wall time, connected) at each change

    def write() -> None:
        status["connected"] = sum(1 for d in devices if d.connected)
        tmp = status_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(status))
        os.replace(tmp, status_path)

    def emitter(dev: Any) -> None:
        rng = random.Random(dev.device_id)
        mine = emitted[dev.device_id]
        go.wait()
        if stop_emitting.wait(rng.uniform(0, hi)):  # a random phase
            return
        n = 0
        while True:
            try:
                seq = dev.emit(TICK, {"n": n})
            except OutboxFull:
                refused[dev.device_id] += 1
            except NotRunning:
                return
            except Exception:  # noqa: BLE001 - counted; the run says it did not hold
                failed[dev.device_id] += 1
            else:
                mine.append((seq, time.time()))
            n += 1
            if stop_emitting.wait(rng.uniform(lo, hi)):
                return

    def watch() -> None:
        last = {d.device_id: d.connected for d in devices}
        while not stop.is_set():
            now = time.time()
            for d in devices:
                c = d.connected
                if c != last[d.device_id]:
                    last[d.device_id] = c
                    links[d.device_id].append((now, c))
            stop.wait(0.05)

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
        emitted[dev.device_id], links[dev.device_id] = [], []
        write()
    emitters = [threading.Thread(target=emitter, args=(d,), name=f"emit-{d.device_id}", daemon=True) for d in devices]
    for t in emitters:
        t.start()
    watcher = threading.Thread(target=watch, name="watch", daemon=True)
    watcher.start()
    status["enrolling_done"] = True
    write()
    records_written = False
    while not stop.wait(0.2):
        if os.getppid() != parent or time.monotonic() > deadline:
            break
        if not go.is_set() and (work / GO).exists():
            go.set()
        if not records_written and (work / STOP_EMITTING).exists():
            stop_emitting.set()
            for t in emitters:
                t.join(30)  # an emit() in progress finishes (durable: its commit)
            records = {
                "emitted": emitted, "refused": dict(refused), "failed": dict(failed), "links": links,
                "emitters_still_running": sum(t.is_alive() for t in emitters),
            }  # fmt: skip
            out = records_path(status_path)
            out.with_suffix(".tmp").write_text(json.dumps(records))
            os.replace(out.with_suffix(".tmp"), out)
            records_written = True
        write()
    stop.set()
    stop_emitting.set()
    for dev in devices:
        with contextlib.suppress(Exception):
            dev.stop(timeout_s=2)
    status["stopped"] = True
    write()
    logging.shutdown()
    os._exit(0)  # daemon threads of stopped devices need no joining


# ---------------------------------------------------------------------------------------------------
# the orchestrator
# ---------------------------------------------------------------------------------------------------
def ts(text: str | None) -> float | None:
    if not text:
        return None
    t = dt.datetime.fromisoformat(text)
    return (t if t.tzinfo else t.replace(tzinfo=dt.UTC)).timestamp()


def listen_counters() -> dict[str, int]:
    """The kernel's count of connections refused at a full listen queue (all sockets; this machine's since boot)."""
    out: dict[str, int] = {}
    with contextlib.suppress(OSError, ValueError):
        lines = Path("/proc/net/netstat").read_text().splitlines()
        for names, values in zip(lines[::2], lines[1::2], strict=False):
            if names.startswith("TcpExt:"):
                table = dict(zip(names.split()[1:], (int(v) for v in values.split()[1:]), strict=False))
                out = {k: table[k] for k in ("ListenOverflows", "ListenDrops", "TCPReqQFullDoCookies") if k in table}
    return out


def kill_broker(run: Run) -> float:
    """SIGKILL to the broker's process group (the runner and Mosquitto); the wall time it was sent."""
    proc = next(p for p in run.procs if p.name == "broker")
    t = time.time()
    os.killpg(proc.popen.pid, signal.SIGKILL)
    proc.popen.wait(10)
    run.procs.remove(proc)
    return t


def restart_broker(run: Run, handles: dict[str, list[Any]]) -> tuple[float, float]:
    """The same ``aisynergy broker run`` on the same port and data directory; (started, accepting) wall times."""
    import psutil

    args = [*AISYNERGY, "broker", "run", "--data-dir", str(run.data_dir), "--port", str(run.broker_port), "--instance", "broker"]
    t_start = time.time()
    proc = start_proc("broker", args, run.data_dir / "broker.log", run.env)
    run.procs.insert(0, proc)  # stopped last
    deadline = time.monotonic() + 30
    while not port_open(run.broker_port):
        if proc.popen.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the broker did not come back on port {run.broker_port}: {proc.log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.01)
    t_back = time.time()
    with contextlib.suppress(psutil.Error):
        handles["broker"][:] = [c for c in psutil.Process(proc.popen.pid).children(recursive=True) if "mosquitto" in c.name()]
    return t_start, t_back


def poll_back_online(run: Run, api: Any, device_ids: list[str], since: float) -> dict[str, Any]:
    """Poll until the edge and every device are ONLINE with a contact the hub recorded after ``since``."""
    a = run.args
    pending = set(device_ids)
    found: dict[str, tuple[float, float]] = {}  # id -> (hub's recorded contact, when the poll found it)
    edge: tuple[float, float] | None = None
    hub_connected: float | None = None
    sweeps, requests = 0, 0
    deadline = time.monotonic() + a.recover_deadline

    def status(device_id: str) -> tuple[str, dict[str, Any] | None]:
        r = api.get(f"/devices/{device_id}/status")
        return device_id, (r.json() if r.status_code == 200 else None)

    with ThreadPoolExecutor(a.poll_threads, thread_name_prefix="poll") as pool:
        while (pending or edge is None) and time.monotonic() < deadline:
            sweeps += 1
            if hub_connected is None:
                with contextlib.suppress(Exception):
                    if api.get(run.hub_url + "/healthz").json()["mqtt"]["connected"]:
                        hub_connected = time.time()
            if edge is None:
                st = api.get(f"/nodes/{run.node_id}/status").json()
                at = ts(st.get("last_heartbeat_at"))
                requests += 1
                if st.get("state") == "ONLINE" and at is not None and at >= since:
                    edge = (at, time.time())
            for device_id, st in pool.map(status, sorted(pending)):
                requests += 1
                at = ts(st.get("last_heartbeat_at")) if st else None
                if st and st.get("state") == "ONLINE" and at is not None and at >= since:
                    found[device_id] = (at, time.time())
                    pending.discard(device_id)
            time.sleep(a.poll_pause)
    devices_at = sorted(at - since for at, _ in found.values())
    seen_at = sorted(seen - since for _, seen in found.values())
    everyone = [*devices_at, *([edge[0] - since] if edge else [])]
    return {
        "all_back": not pending and edge is not None,
        "not_back": sorted(pending)[:20], "not_back_count": len(pending),
        "all_back_s": _r(max(everyone), 2) if not pending and edge is not None else None,
        "edge_back_s": _r(edge[0] - since, 2) if edge else None,
        "hub_bridge_connected_by_s": _r(hub_connected - since, 2) if hub_connected else None,
        "devices_back": summary_ms([x for x in devices_at]) | {"count": len(devices_at)},
        "devices_found_by_poll": summary_ms(seen_at),
        "poll": {"sweeps": sweeps, "requests": requests, "threads": a.poll_threads},
        "_devices_back_s": [round(x, 3) for x in devices_at],
    }


def device_reconnects(records: dict[str, Any], t_kill: float, t_back: float) -> dict[str, Any]:
    """From the workers' records: when each device noticed the loss, and when it was connected again."""
    lost, back, never, flaps = [], [], [], 0
    for device_id, changes in records["links"].items():
        down = [t for t, c in changes if not c and t >= t_kill - 1]
        up = [t for t, c in changes if c and t >= t_back - 0.1]
        if down:
            lost.append(down[0] - t_kill)
        if up:
            back.append(up[0] - t_back)
        else:
            never.append(device_id)
        flaps += max(0, sum(1 for t, c in changes if c and t >= t_back - 0.1) - 1)
    return {
        "noticed_loss_after_kill": summary_ms(lost),
        "reconnected_after_broker_back": summary_ms(back),
        "never_reconnected": len(never), "never_reconnected_examples": never[:10],
        "extra_reconnects": flaps,
        "histogram_s": _histogram(back, 0.5),
    }  # fmt: skip


def _histogram(values: list[float], width: float) -> dict[str, int]:
    counts: Counter[float] = Counter(width * int(v // width) for v in values if v >= 0)
    return {f"{k:.1f}-{k + width:.1f}": counts[k] for k in sorted(counts)}


def hub_events(api: Any, device_ids: list[str], threads: int) -> dict[str, list[dict[str, Any]]]:
    """Every ``TICK`` event the hub holds, per device (every page)."""

    def read(device_id: str) -> tuple[str, list[dict[str, Any]]]:
        items: list[dict[str, Any]] = []
        cursor: str | None = None
        for _ in range(1000):  # bounded
            params: dict[str, Any] = {"limit": 500, **({"cursor": cursor} if cursor else {})}
            page = api_ok(api.get(f"/devices/{device_id}/events", params=params), f"events of {device_id}")
            items += [e for e in page["items"] if e["type"] == TICK]
            cursor = page.get("next_cursor")
            if not cursor:
                break
        return device_id, items

    with ThreadPoolExecutor(threads, thread_name_prefix="events") as pool:
        return dict(pool.map(read, device_ids))


def check_delivery(records: dict[str, Any], held: dict[str, list[dict[str, Any]]], t_kill: float, t_back: float) -> dict[str, Any]:
    lost: dict[str, list[int]] = {}
    duplicates, unknown, out_of_order = 0, 0, 0
    promised_total = 0
    before_back: list[float] = []  # received_at of events emitted before the broker was back
    steady: list[float] = []  # delivery (received_at - ts) of events emitted before the kill
    backlog: list[float] = []  # ... emitted during the outage
    after: list[float] = []  # ... emitted after the broker was back
    last_received = 0.0
    for device_id, emitted in records["emitted"].items():
        promised = {seq: t for seq, t in emitted}
        promised_total += len(promised)
        events = held.get(device_id, [])
        seqs = [e["seq"] for e in events]
        counts = Counter(seqs)
        duplicates += sum(n - 1 for n in counts.values() if n > 1)
        unknown += sum(1 for s in counts if s not in promised)
        out_of_order += sum(1 for x, y in zip(seqs, seqs[1:]) if y is not None and x is not None and y < x)
        missing = sorted(set(promised) - set(counts))
        if missing:
            lost[device_id] = missing
        for e in events:
            if e["seq"] not in promised:
                continue
            rx, sent = ts(e["received_at"]), ts(e["ts"])
            assert rx is not None and sent is not None
            last_received = max(last_received, rx)
            emitted_at = promised[e["seq"]]
            if emitted_at < t_back:
                before_back.append(rx)
            (steady if sent < t_kill else backlog if sent < t_back else after).append(rx - sent)
    n_lost = sum(len(v) for v in lost.values())
    return {
        "promised": promised_total, "lost": n_lost, "devices_with_losses": len(lost),
        "lost_examples": {k: v[:10] for k, v in list(lost.items())[:5]},
        "duplicates": duplicates, "unknown_seqs": unknown, "out_of_order": out_of_order,
        "emitted_before_back_all_at_hub_s": _r(max(before_back) - t_back, 2) if before_back and not n_lost else None,
        "every_event_at_hub_after_back_s": _r(last_received - t_back, 2) if last_received and not n_lost else None,
        "delivery_emitted_before_kill": summary_ms(steady),
        "delivery_emitted_during_outage": summary_ms(backlog),
        "delivery_emitted_after_back": summary_ms(after),
    }  # fmt: skip


def hub_counters(run: Run, api: Any) -> dict[str, Any]:
    with contextlib.suppress(Exception):
        return dict(api.get(run.hub_url + "/healthz").json())
    return {}


def measure(run: Run, api: Any, handles: dict[str, list[Any]]) -> None:
    a, r = run.args, run.results
    handles["edge"] = start_edge(run, api)
    log(f"edge {run.node_id} ONLINE; registering {a.devices} devices")
    devices = [register_device(api, run.node_id, f"bench-{i:05d}") for i in range(a.devices)]
    device_ids = [d for d, _ in devices]
    extra = {"work": str(run.data_dir), "emit_min_s": a.emit_min, "emit_max_s": a.emit_max}
    handles["device_workers"], r["devices"] = start_devices(run, api, devices, script=Path(__file__), extra=extra)
    records_paths = [records_path(Path(w["status"])) for w in _specs(run)]
    log(f"all {a.devices} devices ONLINE ({r['devices']['all_online_after_s']} s after the first worker started)")
    sampler = Sampler(handles)
    sampler.start()
    phases: dict[str, tuple[float, float]] = {}
    try:
        (run.data_dir / GO).touch()
        t0 = time.time()
        log(f"devices emitting every {a.emit_min:g}-{a.emit_max:g} s; {a.warm_s:g} s before the broker is killed")
        time.sleep(a.warm_s)
        states = device_states(api, run.node_id)
        if states.get("ONLINE", 0) != a.devices:
            raise RuntimeError(f"not every device ONLINE before the kill: {dict(states)}")
        r["hub_before_kill"] = hub_counters(run, api)
        phases["steady"] = (t0, time.time())

        listen_before = listen_counters()
        t_kill = kill_broker(run)
        log(f"broker killed (SIGKILL); starting it again in {a.outage_s:g} s")
        time.sleep(max(0.0, t_kill + a.outage_s - 2 - time.time()))
        states = device_states(api, run.node_id)  # what the hub shows near the end of the outage
        r["hub_states_during_outage"] = dict(states)
        r["edge_state_during_outage"] = api.get(f"/nodes/{run.node_id}/status").json().get("state")
        time.sleep(max(0.0, t_kill + a.outage_s - time.time()))
        t_start, t_back = restart_broker(run, handles)
        phases["outage"] = (t_kill, t_back)
        log(f"broker accepting connections again ({t_back - t_start:.2f} s after its start, {t_back - t_kill:.1f} s after the kill)")
        back = poll_back_online(run, api, device_ids, t_back)
        t_all = time.time()
        listen_after = listen_counters()
        r["listen_queue_overflows_during_recovery"] = {k: listen_after[k] - v for k, v in listen_before.items() if k in listen_after}
        with contextlib.suppress(OSError, ValueError):
            r["somaxconn"] = int(Path("/proc/sys/net/core/somaxconn").read_text())
        phases["recovery"] = (t_back, t_all)
        log(f"back online at the hub: edge {back['edge_back_s']} s, every device {back['all_back_s']} s "
            f"(p50 {back['devices_back']['p50_ms']} ms, p99 {back['devices_back']['p99_ms']} ms); not back: {back['not_back_count']}")  # fmt: skip
        time.sleep(a.after_s)
        (run.data_dir / STOP_EMITTING).touch()
        t_stop = time.time()
        phases["after"] = (t_all, t_stop)
        wait_until(lambda: all(p.exists() for p in records_paths), 90, "the workers' records")
        records = _merge([json.loads(p.read_text()) for p in records_paths])
        promised = sum(len(v) for v in records["emitted"].values())
        log(f"{promised} events emitted ({sum(records['refused'].values())} refused: outbox full); waiting for the hub to hold them")
        base = (r["hub_before_kill"].get("ingest") or {}).get("events_stored", 0)

        def drained() -> bool:
            return (hub_counters(run, api).get("ingest") or {}).get("events_stored", 0) >= promised

        with contextlib.suppress(RuntimeError):  # not all there: the check below counts what is missing
            wait_until(drained, a.drain_deadline, "every event at the hub", 1.0)
        t_drained = time.time()
        phases["drain"] = (t_stop, t_drained)
        r["hub_after"] = hub_counters(run, api)
        held = hub_events(api, device_ids, a.poll_threads)
        r["timeline"] = {
            "kill_wall": t_kill, "restart_wall": t_start, "broker_back_wall": t_back,
            "outage_s": _r(t_back - t_kill, 2), "broker_start_to_accepting_s": _r(t_back - t_start, 2),
            "events_stored_at_hub_before_kill": base,
        }  # fmt: skip
        r["back_online"] = {k: v for k, v in back.items() if not k.startswith("_")}
        r["back_online_samples_s"] = back["_devices_back_s"]
        r["device_reconnect"] = device_reconnects(records, t_kill, t_back)
        r["delivery"] = check_delivery(records, held, t_kill, t_back)
        r["delivery"]["refused_outbox_full"] = sum(records["refused"].values())
        r["delivery"]["emit_failed"] = sum(records["failed"].values())
        r["delivery"]["emitters_still_running"] = records["emitters_still_running"]
        r["edge_log"] = _edge_log(run)
    finally:
        sampler.stop()
        r["resources"] = {name: resources(sampler, handles, t0_, t1_) for name, (t0_, t1_) in phases.items()}
        outage = r["resources"].get("outage")
        if outage:  # the broker's CPU counter restarts with its new process: no figure across the restart
            outage["broker"] = {"note": "killed, then started again: no figure across the restart"}
            known = sum((v.get("cpu_pct_of_one_core") or 0) for k, v in outage.items() if isinstance(v, dict) and k != "broker")
            busy = outage.get("machine_busy_pct_of_one_core")
            outage["other_processes_pct_of_one_core"] = _r(busy - known) if busy is not None else None


def _specs(run: Run) -> list[dict[str, Any]]:
    """The specs ``start_devices`` wrote for the workers it started."""
    return [json.loads((run.data_dir / f"{w.name}.json").read_text()) for w in run.workers]


def _merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"emitted": {}, "refused": {}, "failed": {}, "links": {}, "emitters_still_running": 0}
    for part in parts:
        for key in ("emitted", "refused", "failed", "links"):
            out[key].update(part[key])
        out["emitters_still_running"] += part["emitters_still_running"]
    return out


def outbox_leftovers(run: Run) -> dict[str, int]:
    """After every process stopped: the events still kept in the devices' outboxes and the messages in the edge's
    (an event missing at the hub but kept there is late, not lost)."""
    import sqlite3

    out = {"device_outbox_events": 0, "edge_outbox_messages": 0}
    for path in (run.data_dir / "devices").glob("*/outbox.db"):
        with contextlib.suppress(sqlite3.Error), contextlib.closing(sqlite3.connect(path)) as db:
            out["device_outbox_events"] += db.execute("SELECT COUNT(*) FROM events").fetchone()[0]
    with contextlib.suppress(sqlite3.Error), contextlib.closing(sqlite3.connect(run.data_dir / "edge" / "edge.db")) as db:
        out["edge_outbox_messages"] = db.execute("SELECT COUNT(*) FROM outbox").fetchone()[0]
    return out


def _edge_log(run: Run) -> dict[str, Any]:
    """What the edge said about the outage (its resends of what the broker had acknowledged just before)."""
    lines: list[str] = []
    with contextlib.suppress(OSError):
        lines = (run.data_dir / "edge.log").read_text(errors="replace").splitlines()
    again = [line for line in lines if "delivered just before the last session ended again" in line]
    lost = [line for line in lines if "aisynergy.edge: upstream: connection to" in line]
    broker: list[str] = []
    with contextlib.suppress(OSError):
        broker = (run.data_dir / "broker.log").read_text(errors="replace").splitlines()
    return {"resend_lines": again[-3:], "error_lines": sum(" ERROR " in line for line in lines),
            "upstream_failures": len(lost), "upstream_failure_examples": lost[-3:],
            "broker_dropping_for_a_client": sum("Outgoing messages are being dropped" in line for line in broker),
            "broker_out_of_memory_disconnects": sum("disconnected due to out of memory" in line for line in broker)}  # fmt: skip


def verdict(run: Run) -> tuple[bool, list[str]]:
    r, a = run.results, run.args
    why: list[str] = []
    back, d = r.get("back_online") or {}, r.get("delivery") or {}
    if not back.get("all_back"):
        why.append(f"{back.get('not_back_count')} agents not back online within {a.recover_deadline:g} s")
    elif back["all_back_s"] > a.target_s:
        why.append(f"every agent back online after {back['all_back_s']} s > {a.target_s:g} s")
    if d.get("lost") != 0:
        why.append(f"{d.get('lost')} events lost")
    if d.get("duplicates"):
        why.append(f"{d['duplicates']} events held twice")
    if d.get("unknown_seqs"):
        why.append(f"{d['unknown_seqs']} seqs at the hub that emit() never returned")
    if d.get("emit_failed"):
        why.append(f"{d['emit_failed']} emit() calls failed")
    return not why, why


def main(argv: Iterable[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_worker"]:  # internal: a device-host process
        return worker_main(Path(argv[1]))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--devices", type=int, default=1000)
    p.add_argument("--workers", type=int, default=4, help="device-host processes")
    p.add_argument("--device-nice", type=int, default=0, choices=range(0, 20), metavar="0..19",
                   help="run the device-host processes at this nice level: a real fleet brings its own CPUs, so the "
                        "simulated one should not take the broker's, the hub's and the edge's")
    p.add_argument("--emit-min", type=float, default=2.0, help="seconds between a device's events: at least")
    p.add_argument("--emit-max", type=float, default=5.0, help="... at most (uniform)")
    p.add_argument("--warm-s", type=float, default=20, help="seconds of emitting before the kill")
    p.add_argument("--outage-s", type=float, default=10, help="seconds from the kill to the broker's restart")
    p.add_argument("--after-s", type=float, default=10, help="seconds of emitting after everyone is back")
    p.add_argument("--target-s", type=float, default=10, help="every agent back online at the hub within this")
    p.add_argument("--recover-deadline", type=float, default=120, help="stop waiting for agents to come back")
    p.add_argument("--drain-deadline", type=float, default=120, help="stop waiting for the events to reach the hub")
    p.add_argument("--poll-threads", type=int, default=4, help="REST requests in flight while polling the hub")
    p.add_argument("--poll-pause", type=float, default=0.2, help="seconds between two sweeps of the status poll")
    p.add_argument("--what-if", default="", help="diagnostic: changes of the edge to measure (bench/_trace.py: link-drain, inflight=N)")
    p.add_argument("--device-log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument("--max-runtime", type=float, default=1200, help="device workers stop by themselves after this")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--data-dir", type=Path, default=None)
    p.add_argument("--keep", action="store_true")
    args = p.parse_args(argv)
    if args.devices < 1 or args.workers < 1 or not 0 < args.emit_min <= args.emit_max:
        p.error("--devices and --workers must be positive, 0 < --emit-min <= --emit-max")
    args.downstream_broker, args.tcp_nodelay = False, False  # the command benchmark's helpers read these
    raise_nofile()
    import httpx

    from heartbeat_load import free_port

    made_tmp = args.data_dir is None
    data_dir = Path(tempfile.mkdtemp(prefix="aisynergy-reconnect-")) if made_tmp else args.data_dir.resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    run = Run(args, data_dir, free_port(), free_port(), free_port())
    if args.what_if:  # diagnostic: the edge runs under bench/_trace.py, which applies the changes
        run.env["AISYNERGY_BENCH_WHAT_IF"] = args.what_if
        run.cli["edge"] = [sys.executable, str(BENCH / "_trace.py")]
    sources = source_hashes()
    uptime = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        uptime = subprocess.run(["uptime"], check=False, capture_output=True, text=True, timeout=5).stdout.strip()
    run.results = {
        "benchmark": "reconnect", "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "machine": machine_info(),
        "command": " ".join(["python", "bench/reconnect.py", *argv]), "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
        "uptime_at_start": uptime, "code": {**code_record(), "tree_digest_start": tree_digest(sources)},
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "topology": "one broker for the hub, the edge and the devices (as aisynergy up)",
        "note": "broker, hub, edge, the device workers and this orchestrator share this machine's cores",
    }  # fmt: skip
    signal.signal(signal.SIGTERM, lambda signum, _f: (_ for _ in ()).throw(KeyboardInterrupt(f"signal {signum}")))
    try:
        handles = start_system(run)
        with httpx.Client(base_url=run.api, headers={"Authorization": f"Bearer {run.token}"}, timeout=30) as api:
            measure(run, api, handles)
        ok, why = verdict(run)
        run.results["holds"], run.results["why"] = ok, why
    except KeyboardInterrupt:
        run.results["error"] = "interrupted"
    except Exception as exc:  # noqa: BLE001
        log(f"FAILED: {exc!r}")
        run.results["error"] = repr(exc)
    finally:
        for w in run.workers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(w.popen.pid, signal.SIGTERM)
        for w in run.workers:
            w.stop(timeout=30)
        for proc in reversed(run.procs):
            proc.stop()
        if run.results.get("delivery", {}).get("lost"):
            run.results["delivery"]["still_waiting"] = outbox_leftovers(run)
        sources_end = source_hashes()
        run.results["code"]["tree_digest_end"] = tree_digest(sources_end)
        changed = sorted(k for k in sources.keys() | sources_end.keys() if sources.get(k) != sources_end.get(k))
        if changed:
            run.results["code"]["changed_during_run"] = changed
        if made_tmp and not args.keep:
            shutil.rmtree(data_dir, ignore_errors=True)
        else:
            run.results["data_dir"] = str(data_dir)
    keys = ("timeline", "listen_queue_overflows_during_recovery", "hub_states_during_outage", "edge_state_during_outage", "back_online", "device_reconnect", "delivery", "edge_log", "holds", "why", "error")
    print(json.dumps({k: run.results.get(k) for k in keys}, indent=2, default=str))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(run.results, indent=2, default=str) + "\n")
        log(f"results written to {args.out}")
    return 1 if "error" in run.results else (0 if run.results.get("holds") else 3)


if __name__ == "__main__":
    sys.exit(main())
