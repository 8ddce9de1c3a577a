#!/usr/bin/env python3
"""Task benchmark: scheduling latency and end-to-end batch inference throughput (DESIGN §4.3).

What runs, each in its own process on 127.0.0.1 (the same system as ``bench/command_rtt.py`` and
``bench/rollout.py``, whose helpers this script imports): the broker (``aisynergy broker run``), the hub
(``aisynergy hub serve``, SQLite, default settings: scheduler every 1 s and woken by ``POST /tasks`` and
by worker reports that call for it), one edge agent with its artefact cache and device listener, and
``--workers`` device-host processes running the ``--devices`` devices as real
:class:`device.agent.Device` instances (one MQTT session, OTA updater, ONNX Runtime model host and task
worker host each). Before anything is timed the MLP fixture (``tests/fixtures/models/mlp-1.0.0.onnx``,
input ``x`` [N, 128], output ``probabilities`` [N, 10]) is deployed to every device (``POST
/deployments``, waited for SUCCEEDED), because a task's placement requires the model installed.

Measured:

1. *Scheduling latency*, from the moment ``POST /tasks`` returns to each worker's ``RUNNING`` transition
   in the hub's record (``GET /tasks/{id}/workers``: the time the hub received the worker's first
   RUNNING report); broken down with the worker's QUEUED time (the scheduler tick that placed it) and the
   device's own log line written just before it reported RUNNING (device clock, same machine).
   (a) one ``inference`` task on all ``--devices`` devices (``placement.ids`` = every device,
   ``min_nodes`` = their number): a cold round first (first task the device hosts ever run), then
   ``--rounds`` measured rounds; each task is stopped before the next.
   (b) ``--tasks`` ``inference`` tasks POSTed back to back over ``--task-devices`` devices (spread over
   the device-host processes); ``--many-placement pinned`` (default) pins task i to device i mod K with
   ``placement.ids`` (one worker per task, tasks/K workers per device), ``max1`` lets the scheduler pick one
   of the K (``max_nodes: 1``), ``all`` puts every task on all K (tasks x K workers). Beware: a desired
   document carries at most 64 worker orders (``DesiredBody.tasks``); ``max1`` (which the scheduler
   piles onto one device) and ``all`` with more than 64 tasks go past it (see BENCHMARKS.md).
2. *Batch inference throughput*: a ``--rows`` x 128 float32 dataset artefact (npy) and a
   ``batch_inference`` task with ``chunk_size`` ``--chunk-size`` over the same K devices, from the POST to
   the hub's SUCCEEDED; inputs per second; against ``InferenceSession.run`` of the same model over the
   same inputs in chunks of the same size in this process (1 intra-op thread, and ORT's default), measured
   before the system starts. The gathered outputs (``GET /tasks/{id}/outputs/content``) are compared with
   the direct run (``np.allclose``, rtol 1e-5, atol 1e-6). ``--batch-runs`` tasks one after another: the
   first finds the edge's artefact cache cold (the edge fetches the dataset from the hub), the next warm.
   Each worker's log lines (device clock) split the time: dataset fetched, chunks computed, last output.
3. *CPU*: psutil every ``--sample-interval`` (0.2 s; the scheduling phases last about a second) on the
   hub, Mosquitto, the edge, the device hosts and this orchestrator, per phase, and the machine's busy
   time ("other processes" = what these do not explain); an idle window before the phases, and a
   ``--steady-seconds`` window after phase 1b with every task RUNNING and no requests.

``--instrument-hub`` (diagnostics) runs every child through ``bench/_hub_timing.py``, which times the
hub's scheduler ticks and ingest flushes from the outside; the per-phase figures then carry ``hub_jobs``.

Usage::

    python bench/tasks.py --devices 100 --task-devices 10 --tasks 100 --rows 100000 --chunk-size 256 --out bench/results/tasks-100.json
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import datetime as dt
import io
import json
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for p in (str(ROOT), str(BENCH)):
    if p not in sys.path:  # run as a script from a checkout
        sys.path.insert(0, p)

# the helpers of the other benchmarks, in the project's long-line style (``# fmt: skip``)
# isort: off
import command_rtt  # noqa: E402
from command_rtt import (  # noqa: E402 - after the path set-up above
    Run, api_ok, code_record, device_states, register_device, resources, source_hashes, start_devices, start_edge, start_system, tree_digest,
)  # fmt: skip
from heartbeat_load import Sampler, _r, free_port, hub_job_timings, log, machine_info, percentile, raise_nofile, wait_until  # noqa: E402
from rollout import FINAL as DEPLOYMENT_FINAL  # noqa: E402
from rollout import _edge_fetches, ts  # noqa: E402
# isort: on

MODEL = ROOT / "tests" / "fixtures" / "models" / "mlp-1.0.0.onnx"
MODEL_NAME, MODEL_VERSION, MODEL_INPUT, MODEL_OUTPUT = "mlp", "1.0.0", "x", "probabilities"
TASK_FINAL = {"SUCCEEDED", "FAILED", "CANCELED", "TIMED_OUT"}
CHUNK_LINE = re.compile(r"^chunk (\d+): rows \S+, ([0-9.]+) ms$")


def summary_s(values: list[float], nd: int = 3) -> dict[str, Any]:
    """Nearest-rank percentiles (heartbeat_load.percentile) of durations in seconds."""
    if not values:
        return {"count": 0}
    return {"count": len(values), "min": _r(min(values), nd), "p50": _r(percentile(values, 50), nd), "p90": _r(percentile(values, 90), nd),
            "p99": _r(percentile(values, 99), nd), "max": _r(max(values), nd), "mean": _r(statistics.fmean(values), nd)}  # fmt: skip


def cpu_split(res: dict[str, Any]) -> dict[str, float | None]:
    """The CPU % of one core of each sampled process group, from ``command_rtt.resources``."""
    out = {k: v.get("cpu_pct_of_one_core") for k, v in res.items() if isinstance(v, dict) and k != "hub_jobs"}
    out["machine"] = res.get("machine_busy_pct_of_one_core")
    out["other"] = res.get("other_processes_pct_of_one_core")
    return out


# ---------------------------------------------------------------------------------------------------
# the one-process baseline
# ---------------------------------------------------------------------------------------------------
def make_dataset(rows: int, seed: int) -> tuple[Any, bytes]:
    import numpy as np

    data = np.random.default_rng(seed).standard_normal((rows, 128)).astype(np.float32)
    buf = io.BytesIO()
    np.save(buf, data, allow_pickle=False)
    return data, buf.getvalue()


def direct_baseline(inputs: Any, chunk: int, repeats: int) -> tuple[dict[str, Any], Any]:
    """``InferenceSession.run`` over ``inputs`` in chunks of ``chunk`` rows, 1 intra-op thread and ORT's
    default; returns the figures and the default-threads outputs (the reference for the check)."""
    import numpy as np
    import onnxruntime as ort

    out: dict[str, Any] = {"onnxruntime": ort.__version__, "chunk_size": chunk, "rows": int(inputs.shape[0]), "repeats": repeats}
    reference = None
    for label, threads in (("intra_op_1", 1), ("default_threads", None)):
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
        session = ort.InferenceSession(str(MODEL), options, providers=["CPUExecutionProvider"])
        session.run([MODEL_OUTPUT], {MODEL_INPUT: inputs[:chunk]})  # warm
        walls, cpus = [], []
        result = None
        for _ in range(repeats):
            c0, t0 = time.process_time(), time.perf_counter()
            parts = [session.run([MODEL_OUTPUT], {MODEL_INPUT: inputs[s : s + chunk]})[0] for s in range(0, inputs.shape[0], chunk)]
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
            result = np.concatenate(parts)
        best, median = min(walls), statistics.median(walls)
        out[label] = {
            "intra_op_threads": threads or "default", "wall_s_best": _r(best, 4), "wall_s_median": _r(median, 4),
            "rows_per_s_best": round(inputs.shape[0] / best), "rows_per_s_median": round(inputs.shape[0] / median),
            "cpu_pct_of_one_core": _r(statistics.fmean(c / w for c, w in zip(cpus, walls, strict=True)) * 100),
        }  # fmt: skip
        if reference is None:
            reference = result
        else:
            out["one_thread_vs_default_max_abs_diff"] = float(np.max(np.abs(reference - result)))
            reference = result  # the default-threads run is the reference
    return out, reference


def device_serialisation(outputs: Any, chunk: int, repeats: int = 200) -> dict[str, Any]:
    """What a device does per chunk besides ``run``: safetensors frame, base64, the WorkerOutput model and
    its JSON (as ``device.tasks.batch._frame`` and ``Worker.output``), timed in this process."""
    import numpy as np
    from safetensors.numpy import save

    from interfaces.messages import EventBody, envelope
    from interfaces.tasks import TASK_OUTPUT_EVENT, WorkerOutput

    part = np.ascontiguousarray(outputs[:chunk])
    t0 = time.perf_counter()
    size = 0
    for i in range(repeats):
        frame = save({MODEL_OUTPUT: part})
        doc = WorkerOutput(worker_id="w-bench", task_id="task-bench", chunk=i, items=chunk, data=base64.b64encode(frame).decode("ascii")).model_dump(mode="json")
        size = len(envelope("dev-bench", EventBody(type=TASK_OUTPUT_EVENT, severity="info", data=doc)).model_dump_json())
    per = (time.perf_counter() - t0) / repeats
    return {"ms_per_chunk": _r(per * 1000, 3), "message_bytes_per_chunk": size, "output_bytes_per_chunk": int(part.nbytes)}


# ---------------------------------------------------------------------------------------------------
# REST helpers
# ---------------------------------------------------------------------------------------------------
def deploy_model(api: Any, device_ids: list[str], timeout: float) -> dict[str, Any]:
    files = {"file": ("mlp-1.0.0.onnx", MODEL.read_bytes(), "application/octet-stream")}
    art = api_ok(api.post("/artifacts", data={"kind": "model", "name": MODEL_NAME, "version": MODEL_VERSION, "format": "onnx"}, files=files), "upload the model")
    t0 = time.monotonic()
    dep = api_ok(api.post("/deployments", json={"artifact_id": art["id"], "target": {"ids": device_ids}, "strategy": {"type": "all_at_once"}}), "deploy the model")

    def final() -> dict[str, Any] | None:
        page = api_ok(api.get("/deployments", params={"limit": 100}), "list deployments")
        mine = [d for d in page["items"] if d["id"] == dep["id"]]
        return mine[0] if mine and mine[0]["state"] in DEPLOYMENT_FINAL else None

    last = wait_until(final, timeout, "the model deployment to finish", 0.5)
    if last["state"] != "SUCCEEDED":
        raise RuntimeError(f"the model deployment ended {last['state']}: {last.get('counts')}")
    return {"artifact_id": art["id"], "size": art["size"], "deployment_id": dep["id"], "state": last["state"], "wall_s": _r(time.monotonic() - t0, 2)}


def create_task(api: Any, body: dict[str, Any]) -> tuple[dict[str, Any], float, float]:
    """POST /tasks; the task, the wall-clock time just before the request and just after the answer."""
    t0 = time.time()
    task = api_ok(api.post("/tasks", json=body), f"create a {body['type']} task")
    return task, t0, time.time()


def list_tasks(api: Any, ids: set[str]) -> dict[str, dict[str, Any]]:
    from interfaces.pagination import MAX_LIMIT

    out: dict[str, dict[str, Any]] = {}
    cursor, pages = None, 0
    while pages < 100:
        params: dict[str, Any] = {"limit": MAX_LIMIT}
        if cursor:
            params["cursor"] = cursor
        page = api_ok(api.get("/tasks", params=params), "list tasks")
        out.update((t["id"], t) for t in page["items"] if t["id"] in ids)
        cursor, pages = page.get("next_cursor"), pages + 1
        if not cursor:
            break
    return out


def running(task: dict[str, Any], expected: int) -> bool:
    return int(task["progress"]["workers"].get("RUNNING", 0)) >= expected


def task_logs(api: Any, task_id: str) -> list[dict[str, Any]]:
    from interfaces.pagination import MAX_LIMIT

    lines: list[dict[str, Any]] = []
    after = 0
    for _ in range(1000):
        page = api_ok(api.get(f"/tasks/{task_id}/logs", params={"after": after, "limit": MAX_LIMIT}), "task logs")
        lines += page["items"]
        if not page["items"] or not page.get("next_cursor"):
            break
        after = int(page["next_cursor"])
    return lines


def started_lines(lines: list[dict[str, Any]], prefix: str) -> dict[str, float]:
    """worker id -> time of its first log line starting with ``prefix`` (written on the device)."""
    out: dict[str, float] = {}
    for line in lines:
        if line["worker_id"] and line["text"].startswith(prefix):
            out.setdefault(line["worker_id"], ts(line["ts"]))
    return out


def logs_once_started(api: Any, task_id: str, workers: int, prefix: str, timeout: float = 15) -> list[dict[str, Any]]:
    """The task's log, once every worker's start line has arrived (devices send their lines in batches
    after at most 0.3 s, so they may land after the RUNNING report); whatever is there after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        lines = task_logs(api, task_id)
        if len(started_lines(lines, prefix)) >= workers or time.monotonic() > deadline:
            return lines
        time.sleep(0.25)


def worker_times(api: Any, task_id: str, t_ref: float, lines: list[dict[str, Any]] | None = None, started_prefix: str = "serving ") -> list[dict[str, Any]]:
    """Each worker's QUEUED and RUNNING times (hub) and its device's start line (device clock), relative to ``t_ref``."""
    resp = api.get(f"/tasks/{task_id}/workers")
    if resp.status_code != 200:
        raise RuntimeError(f"task workers: {resp.status_code} {resp.text[:300]}")
    workers = resp.json()
    started = started_lines(lines or [], started_prefix)
    out = []
    for w in workers:
        at = {h["to_state"]: ts(h["at"]) for h in w["history"]}
        out.append({
            "worker_id": w["id"], "target_id": w["target_id"], "state": w["state"], "items_assigned": w["items_assigned"], "items_done": w["items_done"],
            "queued_s": at["QUEUED"] - t_ref if "QUEUED" in at else None, "running_s": at["RUNNING"] - t_ref if "RUNNING" in at else None,
            "device_started_s": started[w["id"]] - t_ref if w["id"] in started else None,
        })  # fmt: skip
    return out


def stop_tasks(api: Any, ids: list[str]) -> None:
    for task_id in ids:
        r = api.post(f"/tasks/{task_id}/stop")
        if r.status_code not in (200, 409):  # 409: it ended already
            raise RuntimeError(f"stop {task_id}: {r.status_code} {r.text[:300]}")


def settle(api: Any, run: Run, expected_online: int, seconds: float) -> None:
    """Between phases: the devices drop the withdrawn workers; every device must still be ONLINE."""
    time.sleep(seconds)
    online = device_states(api, run.node_id).get("ONLINE", 0)
    if online < expected_online:
        raise RuntimeError(f"only {online} of {expected_online} devices ONLINE")


def scheduler_counters(api: Any) -> dict[str, float] | None:
    """``aisynergy_scheduler_*_total`` from the hub's /metrics when it serves one (None otherwise)."""
    with contextlib.suppress(Exception):
        r = api.get(str(api.base_url).rsplit("/api/v1", 1)[0] + "/metrics")
        if r.status_code == 200:
            out = {}
            for line in r.text.splitlines():
                m = re.match(r"^aisynergy_scheduler_(\w+)_total\s+([0-9.eE+-]+)$", line)
                if m:
                    out[m.group(1)] = float(m.group(2))
            return out or None
    return None


SCHEDULED_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO aisynergy\.hub\.tasks: task (\S+): PENDING -> SCHEDULED")


def scheduled_logged(run: Run) -> dict[str, float]:
    """task id -> when the hub logged its PENDING -> SCHEDULED move (``hub.log``, local time, ms). The
    scheduler writes it at the end of the tick that placed the workers, just before the commit; the
    workers' QUEUED time in the database is the tick's start."""
    out: dict[str, float] = {}
    with contextlib.suppress(OSError):
        for line in (run.data_dir / "hub.log").read_text(errors="replace").splitlines():
            if (m := SCHEDULED_LINE.match(line)) is not None:
                stamp, _, ms = m.group(1).partition(",")
                out[m.group(2)] = time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(ms) / 1000
    return out


def spread(device_ids: list[str], per_worker: int, k: int) -> list[str]:
    """``k`` devices taken in turn from each device-host process's share (so they do not share one GIL)."""
    groups = [device_ids[i : i + per_worker] for i in range(0, len(device_ids), per_worker)]
    out: list[str] = []
    for j in range(per_worker):
        for g in groups:
            if j < len(g) and len(out) < k:
                out.append(g[j])
    return out


# ---------------------------------------------------------------------------------------------------
# phases
# ---------------------------------------------------------------------------------------------------
def inference_body(placement: dict[str, Any], name: str) -> dict[str, Any]:
    return {"name": name, "type": "inference", "spec": {"model": {"name": MODEL_NAME}}, "placement": placement}


def phase_one_task(run: Run, api: Any, sampler: Sampler, handles: dict[str, list[Any]], device_ids: list[str], label: str) -> dict[str, Any]:
    """One inference task on every device of ``device_ids``; until every worker is RUNNING."""
    a = run.args
    n = len(device_ids)
    counters0 = scheduler_counters(api)
    task, t_post, t_ref = create_task(api, inference_body({"ids": device_ids, "min_nodes": n}, label))
    wait_until(lambda: running(api_ok(api.get(f"/tasks/{task['id']}"), "read the task"), n), a.phase_timeout, f"{label}: {n} workers RUNNING", a.poll)
    t_seen = time.time()
    counters1 = scheduler_counters(api)
    detail = api_ok(api.get(f"/tasks/{task['id']}"), "read the task")
    workers = worker_times(api, task["id"], t_ref, logs_once_started(api, task["id"], n, "serving "))
    run_s = sorted(w["running_s"] for w in workers if w["running_s"] is not None)
    created = ts(detail["created_at"]) - t_ref
    logged = scheduled_logged(run).get(task["id"])
    out = {
        "task_id": task["id"], "workers": len(workers), "post_ms": _r((t_ref - t_post) * 1000, 1), "created_at_s": _r(created, 3),
        "scheduled_logged_s": _r(logged - t_ref, 3) if logged else None,
        "all_running_s": _r(run_s[-1], 3) if len(run_s) == n else None, "first_running_s": _r(run_s[0], 3) if run_s else None,
        "running_s": summary_s(run_s), "queued_s": summary_s([w["queued_s"] for w in workers if w["queued_s"] is not None]),
        "device_started_s": summary_s([w["device_started_s"] for w in workers if w["device_started_s"] is not None]),
        "running_after_device_start_s": summary_s([w["running_s"] - w["device_started_s"] for w in workers if w["running_s"] is not None and w["device_started_s"] is not None]),
        "poll_saw_all_running_s": _r(t_seen - t_ref, 3),
        "resources": with_timings(run, resources(sampler, handles, t_post, t_ref + (run_s[-1] if run_s else t_seen - t_ref)), t_post, t_ref + (run_s[-1] if run_s else t_seen - t_ref)),
    }  # fmt: skip
    if counters0 and counters1:
        out["scheduler_counters_delta"] = {k: counters1.get(k, 0) - counters0.get(k, 0) for k in counters1}
    stop_tasks(api, [task["id"]])
    return out


def phase_many_tasks(run: Run, api: Any, sampler: Sampler, handles: dict[str, list[Any]], subset: list[str]) -> dict[str, Any]:
    """``--tasks`` inference tasks POSTed back to back over ``subset``; until every worker of every task is RUNNING."""
    a = run.args
    k = len(subset)
    bodies = []
    for i in range(a.tasks):
        if a.many_placement == "pinned":
            placement: dict[str, Any] = {"ids": [subset[i % k]]}
        elif a.many_placement == "max1":
            placement = {"ids": subset, "max_nodes": 1}
        else:
            placement = {"ids": subset, "min_nodes": k}
        bodies.append(inference_body(placement, f"many-{i:04d}"))
    per_task = k if a.many_placement == "all" else 1
    counters0 = scheduler_counters(api)
    created: list[tuple[dict[str, Any], float, float]] = [create_task(api, b) for b in bodies]
    t_burst_end = time.time()
    ids = {t["id"] for t, _, _ in created}
    log(f"{a.tasks} tasks POSTed in {t_burst_end - created[0][1]:.2f} s; waiting for {a.tasks * per_task} workers RUNNING")

    def all_running() -> bool:
        tasks = list_tasks(api, ids)
        return len(tasks) == len(ids) and all(running(t, per_task) for t in tasks.values())

    timed_out = False
    try:
        wait_until(all_running, a.phase_timeout, f"{a.tasks} tasks with every worker RUNNING", a.poll * 2)
    except RuntimeError as exc:  # recorded (where the workers are, what the hub said), not fatal to the other phases
        log(f"{exc}; recording what there is")
        timed_out = True
    t_seen = time.time()
    counters1 = scheduler_counters(api)
    steady = None
    if a.steady_seconds > 0 and not timed_out:  # every task RUNNING, nothing asked of the hub: what they cost at rest
        time.sleep(a.steady_seconds)
        steady = {"active_tasks": a.tasks, "window_s": a.steady_seconds, "resources": with_timings(run, resources(sampler, handles, t_seen, time.time()), t_seen, time.time())}
    t_first = created[0][1]
    logged = scheduled_logged(run)
    placed = [logged[t["id"]] - t_ref for t, _, t_ref in created if t["id"] in logged]
    latency, queued, after_queue, device_start, delivery_back = [], [], [], [], []
    last_running = 0.0
    targets: Counter[str] = Counter()
    worker_states: Counter[str] = Counter()
    incomplete = 0
    for task, _t_post, t_ref in created:
        workers = worker_times(api, task["id"], t_ref, logs_once_started(api, task["id"], per_task, "serving ", 0 if timed_out else 15))
        run_s = [w["running_s"] for w in workers if w["running_s"] is not None]
        for w in workers:
            targets[w["target_id"]] += 1
            worker_states[w["state"]] += 1
            if w["running_s"] is None:
                continue
            queued.append(w["queued_s"])
            after_queue.append(w["running_s"] - w["queued_s"])
            if w["device_started_s"] is not None:
                device_start.append(w["device_started_s"])
                delivery_back.append(w["running_s"] - w["device_started_s"])
        if len(run_s) < per_task:
            incomplete += 1
            continue
        latency.append(max(run_s))
        last_running = max(last_running, t_ref + max(run_s))
    if timed_out:
        last_running = t_seen
    out = {
        "placement": a.many_placement, "tasks": a.tasks, "devices": k, "workers_per_task": per_task,
        "post": summary_s([(t1 - t0) for _, t0, t1 in created]), "burst_s": _r(t_burst_end - t_first, 3),
        "per_task_all_running_s": summary_s(latency),
        "all_tasks_running_after_first_post_s": _r(last_running - t_first, 3) if not timed_out else None,
        "all_tasks_running_after_last_post_s": _r(last_running - created[-1][2], 3) if not timed_out else None,
        "queued_s": summary_s(queued), "scheduled_logged_s": summary_s(placed), "running_after_queued_s": summary_s(after_queue),
        "device_started_s": summary_s(device_start), "running_after_device_start_s": summary_s(delivery_back),
        "workers_per_target": dict(sorted(targets.items())), "worker_states": dict(worker_states), "poll_saw_all_running_s": _r(t_seen - t_first, 3),
        "timed_out": timed_out, "tasks_without_every_worker_running": incomplete,
        "resources": with_timings(run, resources(sampler, handles, t_first, last_running), t_first, last_running),
        "steady": steady,
    }  # fmt: skip
    if counters0 and counters1:
        out["scheduler_counters_delta"] = {kk: counters1.get(kk, 0) - counters0.get(kk, 0) for kk in counters1}
    stop_tasks(api, [t["id"] for t, _, _ in created])
    return out


def phase_batch(run: Run, api: Any, sampler: Sampler, handles: dict[str, list[Any]], subset: list[str], inputs_id: str, reference: Any, label: str) -> dict[str, Any]:
    """One batch_inference task over ``subset``; POST to SUCCEEDED, then the outputs are checked."""
    import numpy as np
    from safetensors.numpy import load

    a = run.args
    body = {"name": label, "type": "batch_inference", "spec": {"model": {"name": MODEL_NAME}, "inputs": inputs_id, "chunk_size": a.chunk_size},
            "placement": {"ids": subset, "min_nodes": len(subset), "capability_weighted": not a.equal_shares}}  # fmt: skip
    counters0 = scheduler_counters(api)
    edge_before = _edge_fetches(run)
    task, t_post, t_ref = create_task(api, body)

    def final() -> dict[str, Any] | None:
        t = api_ok(api.get(f"/tasks/{task['id']}"), "read the task")
        return t if t["state"] in TASK_FINAL else None

    done = wait_until(final, a.phase_timeout, f"{label} to finish", a.poll)
    t_seen = time.time()
    counters1 = scheduler_counters(api)
    ended = next((ts(h["at"]) for h in reversed(done["history"]) if h["to_state"] == done["state"]), t_seen)
    running_at = next((ts(h["at"]) for h in done["history"] if h["to_state"] == "RUNNING"), None)
    e2e = ended - t_ref
    lines, deadline = task_logs(api, task["id"]), time.monotonic() + 15
    while sum(1 for x in lines if x["worker_id"] and CHUNK_LINE.match(x["text"])) < (done["progress"].get("chunks_total") or 0) and time.monotonic() < deadline:
        time.sleep(0.25)  # the devices' last log lines may land after the hub's SUCCEEDED
        lines = task_logs(api, task["id"])
    workers = worker_times(api, task["id"], t_ref, lines, started_prefix="model ")
    per_worker: dict[str, dict[str, Any]] = {}
    for line in lines:
        wid = line["worker_id"]
        if not wid:
            continue
        w = per_worker.setdefault(wid, {"chunks": 0, "compute_ms": 0.0, "first_chunk_s": None, "last_chunk_s": None, "fetched_s": None, "done_s": None})
        at = ts(line["ts"]) - t_ref
        text = line["text"]
        if (m := CHUNK_LINE.match(text)) is not None:
            w["chunks"] += 1
            w["compute_ms"] += float(m.group(2))
            w["first_chunk_s"] = at if w["first_chunk_s"] is None else min(w["first_chunk_s"], at)
            w["last_chunk_s"] = at if w["last_chunk_s"] is None else max(w["last_chunk_s"], at)
        elif text.startswith("inputs "):
            w["fetched_s"] = at
        elif text.startswith("done:"):
            w["done_s"] = at
    for w in workers:
        w.update(per_worker.get(w["worker_id"], {}))
    for w in workers:
        if w.get("fetched_s") is not None and w.get("last_chunk_s") is not None:
            w["processing_s"] = w["last_chunk_s"] - w["fetched_s"]
    fetched = [w["fetched_s"] for w in workers if w.get("fetched_s") is not None]
    last_chunk = [w["last_chunk_s"] for w in workers if w.get("last_chunk_s") is not None]
    first_chunk = [w["first_chunk_s"] for w in workers if w.get("first_chunk_s") is not None]
    compute_s = sum(w.get("compute_ms", 0.0) for w in workers) / 1000
    check: dict[str, Any] = {"state": done["state"]}
    rows = a.rows
    if done["state"] == "SUCCEEDED":
        r = api.get(f"/tasks/{task['id']}/outputs/content")
        if r.status_code != 200:
            raise RuntimeError(f"outputs: {r.status_code} {r.text[:300]}")
        got = load(r.content)[MODEL_OUTPUT]
        check = {
            "state": done["state"], "shape": list(got.shape), "bytes": len(r.content),
            "allclose_rtol_1e-5_atol_1e-6": bool(got.shape == reference.shape and np.allclose(got, reference, rtol=1e-5, atol=1e-6)),
            "max_abs_diff": float(np.max(np.abs(got - reference))) if got.shape == reference.shape else None,
            "bit_identical_rows_percent": _r(float(np.mean(np.all(got == reference, axis=1))) * 100, 2) if got.shape == reference.shape else None,
        }  # fmt: skip
    metrics = api_ok(api.get(f"/tasks/{task['id']}/metrics"), "task metrics")
    out = {
        "task_id": task["id"], "state": done["state"], "reason": done.get("reason"), "rows": rows, "chunk_size": a.chunk_size,
        "chunks": done["progress"].get("chunks_total"), "devices": len(subset), "post_ms": _r((t_ref - t_post) * 1000, 1),
        "post_to_final_s": _r(e2e, 3), "rows_per_s": round(rows / e2e) if e2e > 0 else None,
        "task_running_after_s": _r(running_at - t_ref, 3) if running_at else None,
        "all_workers_running_s": _r(max((w["running_s"] for w in workers if w["running_s"] is not None), default=0), 3),
        "all_fetched_dataset_s": _r(max(fetched), 3) if fetched else None, "first_fetched_dataset_s": _r(min(fetched), 3) if fetched else None,
        "first_chunk_s": _r(min(first_chunk), 3) if first_chunk else None, "last_chunk_computed_s": _r(max(last_chunk), 3) if last_chunk else None,
        "last_chunk_to_final_s": _r(e2e - max(last_chunk), 3) if last_chunk else None,
        "fetched_dataset_s": summary_s(fetched), "processing_after_fetch_s": summary_s([w["processing_s"] for w in workers if "processing_s" in w]),
        "dataset_bytes_edge_to_devices": len(subset) * a.dataset_bytes, "dataset_fetches_hub_to_edge": _edge_fetches(run) - edge_before,
        "device_compute_s_sum": _r(compute_s, 3), "device_compute_rows_per_s_of_busy_time": round(rows / compute_s) if compute_s else None,
        "items_per_worker": sorted((w["items_assigned"] or 0) for w in workers),
        "workers": [{k: (_r(v, 3) if isinstance(v, float) else v) for k, v in w.items()} for w in workers],
        "metrics_totals": metrics.get("totals"), "check": check, "poll_saw_final_s": _r(t_seen - t_ref, 3),
        "resources": with_timings(run, resources(sampler, handles, t_post, ended), t_post, ended),
    }  # fmt: skip
    if counters0 and counters1:
        out["scheduler_counters_delta"] = {k: counters1.get(k, 0) - counters0.get(k, 0) for k in counters1}
    return out


def idle_window(run: Run, sampler: Sampler, handles: dict[str, list[Any]], seconds: float) -> dict[str, Any]:
    t0 = time.time()
    time.sleep(seconds)
    return with_timings(run, resources(sampler, handles, t0, time.time()), t0, time.time())


def with_timings(run: Run, res: dict[str, Any], t0: float, t1: float) -> dict[str, Any]:
    """``--instrument-hub``: add the hub's job timings (scheduler ticks, ingest flushes) in [t0, t1]."""
    if run.args.instrument_hub:
        res["hub_jobs"] = hub_job_timings(run.data_dir / "hub-timings.jsonl", t0, t1)
    return res


# ---------------------------------------------------------------------------------------------------
# the orchestrator
# ---------------------------------------------------------------------------------------------------
def measure(run: Run, handles: dict[str, list[Any]], inputs_npy: bytes, reference: Any) -> None:
    import httpx
    import psutil

    a, r = run.args, run.results
    with httpx.Client(base_url=run.api, headers={"Authorization": f"Bearer {run.token}"}, timeout=120) as api:
        handles["edge"] = start_edge(run, api)
        log(f"edge {run.node_id} ONLINE; registering {a.devices} devices")
        devices = [register_device(api, run.node_id, f"bench-{i:05d}") for i in range(a.devices)]
        handles["device_workers"], r["devices"] = start_devices(run, api, devices)
        device_ids = [d for d, _ in devices]
        subset = spread(device_ids, r["devices"]["per_worker"], a.task_devices)
        r["devices"]["task_devices"] = subset
        handles["orchestrator"] = [psutil.Process()]
        sampler = Sampler(dict(handles), interval=a.sample_interval)
        sampler.start()
        try:
            log(f"all {a.devices} devices ONLINE; deploying {MODEL.name} to them")
            r["model_deployment"] = deploy_model(api, device_ids, a.phase_timeout)
            log(f"model on every device ({r['model_deployment']['wall_s']} s); upload the dataset ({len(inputs_npy)} bytes)")
            t0 = time.monotonic()
            files = {"file": ("inputs.npy", inputs_npy, "application/octet-stream")}
            art = api_ok(api.post("/artifacts", data={"kind": "dataset", "name": "bench-inputs", "version": "1", "format": "npy"}, files=files), "upload the dataset")
            r["dataset"] = {"artifact_id": art["id"], "bytes": art["size"], "rows": a.rows, "upload_s": _r(time.monotonic() - t0, 2)}
            a.dataset_bytes = art["size"]
            settle(api, run, a.devices, 2)
            if a.idle_seconds > 0:
                r["idle"] = idle_window(run, sampler, handles, a.idle_seconds)
                log(f"idle {a.idle_seconds:g} s, CPU % of one core: {cpu_split(r['idle'])}")
            phases = set(a.phases.split(","))
            if "one" in phases:
                rounds = []
                for i in range(a.rounds + 1):
                    label = "cold" if i == 0 else f"round-{i}"
                    res = phase_one_task(run, api, sampler, handles, device_ids, f"one-{label}")
                    res["label"] = label
                    rounds.append(res)
                    log(f"1 task on {a.devices} devices ({label}): all RUNNING after {res['all_running_s']} s (p50 {res['running_s'].get('p50')} s, "
                        f"queued p50 {res['queued_s'].get('p50')} s, device start p50 {res['device_started_s'].get('p50')} s)")  # fmt: skip
                    settle(api, run, a.devices, a.settle)
                warm = [x for x in rounds if x["label"] != "cold"]
                r["one_task"] = {
                    "devices": a.devices, "rounds": rounds,
                    "warm_all_running_s": [x["all_running_s"] for x in warm], "warm_p50_s": [x["running_s"].get("p50") for x in warm],
                    "warm_all_running_median_s": _r(statistics.median(x["all_running_s"] for x in warm if x["all_running_s"] is not None), 3) if warm else None,
                }  # fmt: skip
            if "many" in phases:
                res = phase_many_tasks(run, api, sampler, handles, subset)
                r["many_tasks"] = res
                log(f"{a.tasks} tasks over {len(subset)} devices ({a.many_placement}): per task p50 {res['per_task_all_running_s'].get('p50')} / "
                    f"p99 {res['per_task_all_running_s'].get('p99')} s; all RUNNING {res['all_tasks_running_after_first_post_s']} s after the first POST")  # fmt: skip
                settle(api, run, a.devices, a.settle)
            if "batch" in phases:
                runs = []
                for i in range(a.batch_runs):
                    res = phase_batch(run, api, sampler, handles, subset, art["id"], reference, f"batch-{i + 1}")
                    res["label"] = "edge cache cold" if res["dataset_fetches_hub_to_edge"] else "edge cache warm"
                    runs.append(res)
                    log(f"batch {i + 1}: {res['state']} in {res['post_to_final_s']} s = {res['rows_per_s']} rows/s (all fetched {res['all_fetched_dataset_s']} s, "
                        f"last chunk {res['last_chunk_computed_s']} s); outputs match: {res['check'].get('allclose_rtol_1e-5_atol_1e-6')}")  # fmt: skip
                    settle(api, run, a.devices, a.settle)
                direct = r["direct"]
                ok = [x for x in runs if x["state"] == "SUCCEEDED" and x["rows_per_s"]]
                best = max((x["rows_per_s"] for x in ok), default=None)
                r["batch"] = {
                    "runs": runs,
                    "rows_per_s": [x["rows_per_s"] for x in runs],
                    "ratio_best_to_direct_1_thread": _r(best / direct["intra_op_1"]["rows_per_s_median"], 4) if best else None,
                    "ratio_best_to_direct_default_threads": _r(best / direct["default_threads"]["rows_per_s_median"], 4) if best else None,
                }  # fmt: skip
            r["devices"]["online_at_end"] = device_states(api, run.node_id).get("ONLINE", 0)
        finally:
            sampler.stop()


def verdict(run: Run) -> tuple[bool, list[str]]:
    r, a = run.results, run.args
    why: list[str] = []
    for x in (r.get("one_task") or {}).get("rounds", []):
        if x["all_running_s"] is None:
            why.append(f"one task ({x['label']}): not every worker RUNNING")
    many = r.get("many_tasks")
    if many and many["tasks_without_every_worker_running"]:
        why.append(f"{many['tasks_without_every_worker_running']} of {many['tasks']} tasks did not get every worker RUNNING within {a.phase_timeout:g} s "
                   f"(workers per target {many['workers_per_target']}, states {many['worker_states']})")
    for x in (r.get("batch") or {}).get("runs", []):
        if x["state"] != "SUCCEEDED":
            why.append(f"{x['task_id']}: {x['state']} ({x.get('reason')})")
        elif not x["check"].get("allclose_rtol_1e-5_atol_1e-6"):
            why.append(f"{x['task_id']}: the gathered outputs differ from the direct run (max abs diff {x['check'].get('max_abs_diff')})")
    if r.get("devices", {}).get("online_at_end") != a.devices:
        why.append(f"{r.get('devices', {}).get('online_at_end')} of {a.devices} devices ONLINE at the end")
    return not why, why


def table(run: Run) -> str:
    r, a = run.results, run.args
    rows: list[tuple[str, str]] = []
    one = r.get("one_task") or {}
    for x in one.get("rounds", []):
        rows.append((f"1 task on {a.devices} devices, {x['label']}",
                     f"all RUNNING {x['all_running_s']} s, p50 {x['running_s'].get('p50')} s (queued p50 {x['queued_s'].get('p50')} s, "
                     f"device start p50 {x['device_started_s'].get('p50')} s); CPU {cpu_split(x['resources'])}"))  # fmt: skip
    many = r.get("many_tasks")
    if many:
        rows.append((f"{many['tasks']} tasks over {many['devices']} devices ({many['placement']})",
                     f"per task p50 {many['per_task_all_running_s'].get('p50')} / p99 {many['per_task_all_running_s'].get('p99')} / max "
                     f"{many['per_task_all_running_s'].get('max')} s (placed p50 {many['scheduled_logged_s'].get('p50')} s, device start p50 "
                     f"{many['device_started_s'].get('p50')} s); all RUNNING {many['all_tasks_running_after_first_post_s']} s after the first POST "
                     f"(burst {many['burst_s']} s); CPU {cpu_split(many['resources'])}"))  # fmt: skip
    d = r.get("direct") or {}
    if d:
        rows.append(("one process, ORT, chunks of %d" % a.chunk_size,
                     f"1 thread {d['intra_op_1']['rows_per_s_median']} rows/s, default threads {d['default_threads']['rows_per_s_median']} rows/s"))  # fmt: skip
    for x in (r.get("batch") or {}).get("runs", []):
        rows.append((f"batch_inference ({x.get('label')})",
                     f"{x['state']} in {x['post_to_final_s']} s = {x['rows_per_s']} rows/s; all fetched {x['all_fetched_dataset_s']} s, last chunk "
                     f"{x['last_chunk_computed_s']} s; outputs allclose {x['check'].get('allclose_rtol_1e-5_atol_1e-6')}; CPU {cpu_split(x['resources'])}"))  # fmt: skip
    b = r.get("batch") or {}
    if b:
        rows.append(("distributed / one process", f"{b.get('ratio_best_to_direct_1_thread')} (1 thread), {b.get('ratio_best_to_direct_default_threads')} (default)"))
    rows.append(("load average at start", str(r.get("loadavg_at_start"))))
    rows.append(("verdict", "HOLDS" if r.get("holds") else "DOES NOT HOLD: " + "; ".join(r.get("why", []) or [r.get("error", "")])))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def main(argv: Iterable[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--devices", type=int, default=100, help="devices behind the edge; phase 1a places one task on all of them")
    p.add_argument("--task-devices", type=int, default=10, help="devices of phases 1b and 2 (spread over the device-host processes)")
    p.add_argument("--workers", type=int, default=4, help="device-host processes")
    p.add_argument("--phases", default="one,many,batch", help="which of one (1a), many (1b), batch (2) to run")
    p.add_argument("--rounds", type=int, default=3, help="measured rounds of phase 1a (after one cold round)")
    p.add_argument("--tasks", type=int, default=100, help="tasks of phase 1b")
    p.add_argument("--many-placement", choices=["pinned", "max1", "all"], default="pinned",
                   help="1b: pinned = task i on device i mod K (ids), max1 = the scheduler picks one of the K, all = every task on all K")  # fmt: skip
    p.add_argument("--rows", type=int, default=100_000, help="rows of the batch dataset (x 128 float32)")
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--batch-runs", type=int, default=2, help="batch_inference tasks, one after another")
    p.add_argument("--equal-shares", action="store_true", help="batch: capability_weighted=false (equal shares instead of the heartbeat's free CPU)")
    p.add_argument("--direct-repeats", type=int, default=5, help="repeats of the one-process run (median reported)")
    p.add_argument("--idle-seconds", type=float, default=10, help="an idle window before the phases (CPU of the system at rest)")
    p.add_argument("--settle", type=float, default=3, help="seconds between phases")
    p.add_argument("--steady-seconds", type=float, default=5, help="1b: a window with every task RUNNING and no requests (their cost at rest)")
    p.add_argument("--instrument-hub", action="store_true", help="diagnostics: time the hub's scheduler ticks and ingest flushes (bench/_hub_timing.py)")
    p.add_argument("--sample-interval", type=float, default=0.2, help="psutil sampling interval (the scheduling phases last about a second)")
    p.add_argument("--poll", type=float, default=0.25, help="REST poll interval while waiting (the figures come from the hub's records)")
    p.add_argument("--phase-timeout", type=float, default=300)
    p.add_argument("--device-log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument("--max-runtime", type=float, default=1800, help="device workers stop by themselves after this many seconds")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--data-dir", type=Path, default=None)
    p.add_argument("--keep", action="store_true")
    args = p.parse_args(argv)
    if args.task_devices > args.devices or min(args.devices, args.task_devices, args.tasks, args.rows, args.chunk_size) < 1:
        p.error("need 1 <= --task-devices <= --devices and positive --tasks, --rows, --chunk-size")
    args.downstream_broker, args.tcp_nodelay = False, False  # the command benchmark's helpers read these
    raise_nofile()

    made_tmp = args.data_dir is None
    data_dir = Path(tempfile.mkdtemp(prefix="aisynergy-tasks-")) if made_tmp else args.data_dir.resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    run = Run(args, data_dir, free_port(), free_port(), free_port())
    sources = source_hashes()
    run.results = {
        "benchmark": "tasks", "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "machine": machine_info(),
        "command": " ".join(["python", "bench/tasks.py", *argv]), "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
        "code": {**code_record(), "tree_digest_start": tree_digest(sources)},
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "model": {"path": str(MODEL.relative_to(ROOT)), "name": MODEL_NAME, "version": MODEL_VERSION, "input": f"{MODEL_INPUT} [N, 128] float32", "output": f"{MODEL_OUTPUT} [N, 10]"},
        "note": "broker, hub, edge, the device workers and this orchestrator share this machine's cores",
    }  # fmt: skip
    signal.signal(signal.SIGTERM, lambda signum, _f: (_ for _ in ()).throw(KeyboardInterrupt(f"signal {signum}")))
    try:
        inputs, inputs_npy = make_dataset(args.rows, args.seed)
        log(f"one-process baseline: {args.rows} rows in chunks of {args.chunk_size}, {args.direct_repeats} repeats")
        run.results["direct"], reference = direct_baseline(inputs, args.chunk_size, args.direct_repeats)
        run.results["direct"]["device_serialisation"] = device_serialisation(reference, args.chunk_size)
        d = run.results["direct"]
        log(f"direct: 1 thread {d['intra_op_1']['rows_per_s_median']} rows/s, default {d['default_threads']['rows_per_s_median']} rows/s; "
            f"per-chunk serialisation {d['device_serialisation']}")  # fmt: skip
        log(f"work directory {data_dir}; load {os.getloadavg()}")
        if args.instrument_hub:  # the same CLI for every child (only the hub runs the timed jobs)
            command_rtt.AISYNERGY = [sys.executable, str(BENCH / "_hub_timing.py")]
            run.env["AISYNERGY_BENCH_TIMINGS"] = str(data_dir / "hub-timings.jsonl")
            run.results["instrumented"] = "diagnostic: the hub's scheduler ticks and ingest flushes timed by bench/_hub_timing.py"
        handles = start_system(run)
        measure(run, handles, inputs_npy, reference)
        ok, why = verdict(run)
        run.results["holds"], run.results["why"] = ok, why
    except KeyboardInterrupt:
        run.results["error"] = "interrupted"
    except Exception as exc:  # noqa: BLE001
        log(f"FAILED: {exc!r}")
        run.results["error"] = repr(exc)
    finally:
        for w in run.workers:  # devices first (they publish offline), then edge, hub, broker
            with contextlib.suppress(ProcessLookupError):
                os.killpg(w.popen.pid, signal.SIGTERM)
        for w in run.workers:
            w.stop(timeout=30)
        for proc in reversed(run.procs):
            proc.stop()
        logs: dict[str, Any] = {}
        for path in sorted(data_dir.glob("*.log")):
            with contextlib.suppress(OSError):
                lines = path.read_text(errors="replace").splitlines()
                errors = [line for line in lines if " ERROR " in line or "Traceback" in line]
                raised = Counter(" ".join([line, *(x.strip() for x in lines[i + 1 : i + 3])]) for i, line in enumerate(lines)
                                 if re.match(r"^[\w.]+(Error|Exception)\b", line))  # fmt: skip
                logs[path.stem] = {"lines": len(lines), "error_lines": len(errors), "error_examples": errors[:3], "exceptions": dict(raised.most_common(5))}
        run.results["logs"] = logs
        sources_end = source_hashes()
        run.results["code"]["tree_digest_end"] = tree_digest(sources_end)
        changed = sorted(k for k in sources.keys() | sources_end.keys() if sources.get(k) != sources_end.get(k))
        if changed:
            log(f"warning: sources changed during the run: {', '.join(changed)}")
            run.results["code"]["changed_during_run"] = changed
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
    return 1 if "error" in run.results else (0 if run.results.get("holds") else 3)


if __name__ == "__main__":
    sys.exit(main())
