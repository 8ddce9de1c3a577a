#!/usr/bin/env python3
"""Rollout benchmark: a signed 1 MiB model to N devices behind one edge (DESIGN §4.2).

What runs, each in its own process on 127.0.0.1 (the same system as ``bench/command_rtt.py``, whose
helpers this script imports): the broker (``aisynergy broker run``), the hub (``aisynergy hub serve``,
SQLite), one edge agent with its artefact cache and device listener, and ``--workers`` device-host
processes running the ``--devices`` devices as real :class:`device.agent.Device` instances (one MQTT
session, one OTA updater, one ONNX Runtime model host each).

Measured:
1. *Rollout*: a ``--model-mib`` ONNX model (a dense layer, float32) is uploaded (``POST /artifacts``),
   then ``POST /deployments`` targets every device, ``all_at_once`` (or ``--strategy``). Each device
   receives its order in its desired document, downloads the artefact from the edge's cache (the edge
   fetches it from the hub once), verifies size, SHA-256 and the Ed25519 signature, loads the model
   (a warm run), swaps it in and reports ACTIVE. Timed from the POST to the deployment SUCCEEDED
   (target <= 30 s), with the time to first/50 %/all ACTIVE from the executions' histories.
2. *Bytes moved*: hub -> edge (artefact bytes the edge fetched: its cache's upstream requests times the
   size), edge -> devices (the sizes the devices report downloading), and the MQTT bytes of the orders
   and progress events (counted from the payload sizes the hub stores and sends).
3. *Delta size vs full* (target <= 20 %): bsdiff4 patches as the hub makes them, for a fine-tuned model
   (same first layer, the last layer changed) and for the sample firmware images 1.0.0 -> 1.1.0.
4. *Signature verifications per second on the device side*: ``device.ota.verify.verify_manifest`` in a
   loop in one process (one core), and the SHA-256 rate of ``verify_content`` over the model file.

Usage::

    python bench/rollout.py --devices 1000 --out bench/results/rollout-1000.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for p in (str(ROOT), str(BENCH)):
    if p not in sys.path:  # run as a script from a checkout
        sys.path.insert(0, p)

from command_rtt import (  # noqa: E402 - after the path set-up above
    Run, api_ok, code_record, register_device, resources, source_hashes, start_devices, start_edge, start_system, tree_digest,
)  # fmt: skip
from heartbeat_load import Sampler, _r, free_port, log, machine_info, raise_nofile, wait_until  # noqa: E402

FINAL = {"SUCCEEDED", "FAILED", "CANCELED", "ROLLED_BACK"}
SAMPLES = ROOT / "firmware_images" / "samples"


def dense_model(mib: float, seed: int, tune_seed: int | None = None) -> bytes:
    """An ONNX model of about ``mib`` MiB: y = softmax(relu(x W1 + b1) W2 + b2); ``tune_seed`` changes only W2, b2."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    width = max(16, int((mib * 1024 * 1024 / 4) ** 0.5))
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
    b1 = np.zeros(width, np.float32)
    w2 = (rng.standard_normal((width, 10)) / np.sqrt(width)).astype(np.float32)
    b2 = np.zeros(10, np.float32)
    if tune_seed is not None:
        tune = np.random.default_rng(tune_seed)
        w2 = (w2 + tune.standard_normal(w2.shape) * 0.05).astype(np.float32)
        b2 = (b2 + tune.standard_normal(b2.shape) * 0.1).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h0"]), helper.make_node("Add", ["h0", "b1"], ["h1"]),
         helper.make_node("Relu", ["h1"], ["h"]), helper.make_node("MatMul", ["h", "w2"], ["l0"]),
         helper.make_node("Add", ["l0", "b2"], ["logits"]), helper.make_node("Softmax", ["logits"], ["y"], axis=-1)],
        "bench", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 10])],
        [numpy_helper.from_array(a, n) for a, n in ((w1, "w1"), (b1, "b1"), (w2, "w2"), (b2, "b2"))],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


def strategy(text: str) -> dict[str, Any]:
    if text == "all_at_once":
        return {"type": "all_at_once"}
    kind, _, n = text.partition(":")
    if kind == "rolling":
        return {"type": "rolling", "batch_size": int(n)}
    if kind == "canary":
        return {"type": "canary", "percent": float(n)}
    raise argparse.ArgumentTypeError(f"strategy: all_at_once, rolling:N or canary:P, not {text!r}")


def ts(text: str) -> float:
    return dt.datetime.fromisoformat(text).timestamp()


def measure_rollout(run: Run, api: Any, sampler: Sampler, handles: dict[str, list[Any]], model: bytes, device_ids: list[str]) -> list[dict[str, Any]]:
    """Deploy, wait for the end, record the figures; returns the sampled devices' execution events."""
    a, r = run.args, run.results
    files = {"file": ("bench.onnx", model, "application/octet-stream")}
    art = api_ok(api.post("/artifacts", data={"kind": "model", "name": "bench", "version": "1.0.0", "format": "onnx"}, files=files), "upload")
    r["artifact"] = {"id": art["id"], "size": art["size"], "sha256": art["sha256"]}
    log(f"uploaded {art['size']} bytes as {art['id']}; deploying to {a.devices} devices ({a.strategy})")
    edge_before = _edge_fetches(run)
    body = {"artifact_id": art["id"], "target": {"ids": device_ids}, "strategy": strategy(a.strategy), "timeout_s": int(a.timeout)}
    spy = _profile_edge(run, handles) if a.profile_edge else None
    t0 = time.time()
    t0_mono = time.monotonic()
    dep = api_ok(api.post("/deployments", json=body), "create the deployment")

    def final() -> bool:
        # the summary (state and counts), not the detail with every execution's history: a poll must not
        # load the hub it measures
        page = api_ok(api.get("/deployments", params={"limit": 100}), "list deployments")
        mine = [d for d in page["items"] if d["id"] == dep["id"]]
        return bool(mine) and mine[0]["state"] in FINAL

    wait_until(final, a.timeout + 60, "the deployment to finish", 0.25)
    wall = time.monotonic() - t0_mono
    if spy is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            spy.wait(a.profile_seconds + 30)
    t1 = time.time()
    last = api_ok(api.get(f"/deployments/{dep['id']}"), "read the deployment")
    executions = last["executions"]
    active_at = sorted(ts(e["history"][-1]["at"]) - ts(last["created_at"]) for e in executions if e["state"] == "ACTIVE")
    sample = [_progress(api, e) for e in executions[: a.progress_sample]]
    downloaded = sum(_downloaded(events) for events in sample)
    # on the device's clock (the same machine): when each step happened, and how long its report took to land
    device_side: dict[str, list[float]] = {}
    delivery: list[float] = []
    for events in sample:
        for e in events:
            device_side.setdefault(e["data"]["state"], []).append(ts(e["ts"]) - ts(last["created_at"]))
            delivery.append(ts(e["received_at"]) - ts(e["ts"]))
    r["device_clock_sample"] = {
        state: {"first_s": _r(min(v), 2), "p50_s": _r(sorted(v)[len(v) // 2], 2), "last_s": _r(max(v), 2)} for state, v in device_side.items()
    }
    delivery.sort()
    r["event_delivery_s"] = {"p50": _r(delivery[len(delivery) // 2], 3), "p99": _r(delivery[int(len(delivery) * 0.99)], 3), "max": _r(delivery[-1], 3)} if delivery else None
    timeline: dict[str, dict[str, float | None]] = {}
    for state in ("QUEUED", "DOWNLOADING", "DOWNLOADED", "VERIFYING", "INSTALLING", "ACTIVE"):
        at = sorted(ts(t["at"]) - ts(last["created_at"]) for e in executions for t in e["history"] if t["to_state"] == state)
        if at:
            timeline[state] = {"first_s": _r(at[0], 2), "p50_s": _r(at[len(at) // 2], 2), "last_s": _r(at[-1], 2), "count": len(at)}
    r["rollout"] = {
        "deployment_id": dep["id"], "state": last["state"], "counts": {k: v for k, v in last["counts"].items() if v},
        "post_to_final_s": _r(wall, 2),
        "first_active_s": _r(active_at[0], 2) if active_at else None,
        "half_active_s": _r(active_at[len(active_at) // 2], 2) if active_at else None,
        "all_active_s": _r(active_at[-1], 2) if len(active_at) == len(executions) else None,
        "active": len(active_at), "targets": len(executions),
        "entered_state_after_create": timeline,
        "resources": resources(sampler, handles, t0, t1),
    }  # fmt: skip
    edge_after = _edge_fetches(run)
    per_device = downloaded / max(1, min(a.progress_sample, len(executions)))
    r["bytes"] = {
        "artifact_size": art["size"],
        "hub_to_edge_blobs_cached": edge_after - edge_before,
        "hub_to_edge_bytes": (edge_after - edge_before) * art["size"],
        "edge_to_devices_reported": int(per_device * len(executions)),
        "edge_to_devices_per_device": int(per_device),
        "progress_sample": min(a.progress_sample, len(executions)),
    }
    return [e for events in sample for e in events]


def _profile_edge(run: Run, handles: dict[str, list[Any]]) -> subprocess.Popen[bytes] | None:
    """py-spy on the edge from the deployment's creation (diagnostic): with ``--gil``, what holds the GIL."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not os.access(spy, os.X_OK):
        log("py-spy not found: pip install py-spy (profiling skipped)")
        return None
    out = Path(run.args.profile_edge).resolve()
    fmt = "speedscope" if out.suffix == ".json" else ("flamegraph" if out.suffix == ".svg" else "raw")
    gil = ["--gil"] if run.args.profile_gil else []
    return subprocess.Popen([spy, "record", "--pid", str(handles["edge"][0].pid), "--duration", str(int(run.args.profile_seconds)),
                             "--rate", "100", "--format", fmt, "--output", str(out), "--threads", "--nonblocking", *gil],
                            stdout=subprocess.DEVNULL, stderr=(run.data_dir / "py-spy.log").open("ab"), start_new_session=True)  # fmt: skip


def _progress(api: Any, execution: dict[str, Any]) -> list[dict[str, Any]]:
    page = api_ok(api.get(f"/devices/{execution['target_id']}/events", params={"limit": 500}), "device events")
    return [e for e in page["items"] if e["type"] == "deployment.execution" and e["data"].get("execution_id") == execution["id"]]


def _downloaded(events: list[dict[str, Any]]) -> int:
    """The bytes a device reports downloading (its DOWNLOADED progress)."""
    return max((e["data"].get("bytes_downloaded") or 0 for e in events if e["data"].get("state") == "DOWNLOADED"), default=0)


def _edge_fetches(run: Run) -> int:
    """Blobs the edge fetched from the hub and cached (it logs ``cached <sha256> (<n> bytes)`` for each)."""
    with contextlib.suppress(OSError):
        return sum(1 for line in (run.data_dir / "edge.log").read_text(errors="replace").splitlines() if "aisynergy.edge.artifacts" in line and " cached " in line)
    return 0


def measure_deltas(model_mib: float) -> dict[str, Any]:
    import bsdiff4

    base, tuned = dense_model(model_mib, seed=1), dense_model(model_mib, seed=1, tune_seed=2)
    fw_old, fw_new = (SAMPLES / "sensor-fw-1.0.0.fw").read_bytes(), (SAMPLES / "sensor-fw-1.1.0.fw").read_bytes()
    out: dict[str, Any] = {}
    for name, old, new in (("fine_tuned_model", base, tuned), ("firmware_sample_1.0.0_to_1.1.0", fw_old, fw_new)):
        t0 = time.perf_counter()
        patch = bsdiff4.diff(old, new)
        diff_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        assert bsdiff4.patch(old, patch) == new
        out[name] = {"full": len(new), "delta": len(patch), "ratio_percent": _r(100 * len(patch) / len(new), 2),
                     "diff_s": _r(diff_s, 3), "patch_s": _r(time.perf_counter() - t0, 4)}  # fmt: skip
    return out


def measure_verification(model: bytes, seconds: float) -> dict[str, Any]:
    """What a device spends on checks: Ed25519 manifest signatures per second, SHA-256 MiB/s."""
    from cloud.signing import SigningKey
    from device.ota.verify import load_public_key, verify_content, verify_manifest
    from interfaces.deployments import ArtifactFormat, ArtifactKind, ArtifactManifest

    with tempfile.TemporaryDirectory() as tmp:
        key = SigningKey.load_or_create(Path(tmp))
        path = Path(tmp) / "model.onnx"
        path.write_bytes(model)
        manifest = ArtifactManifest(name="bench", version="1.0.0", kind=ArtifactKind.MODEL, format=ArtifactFormat.ONNX,
                                    sha256=hashlib.sha256(model).hexdigest(), size=len(model), created_at=dt.datetime.now(dt.UTC))  # fmt: skip
        signed = key.sign_manifest(manifest)
        public = load_public_key(key.public_pem)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            verify_manifest(public, signed)
            n += 1
        per_s = n / (time.perf_counter() - t0)
        m, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            verify_content(signed, path)
            m += 1
        mib_s = m * len(model) / (1024 * 1024) / (time.perf_counter() - t0)
    return {"ed25519_manifest_verifications_per_s": round(per_s), "sha256_content_check_mib_per_s": _r(mib_s, 1),
            "full_check_of_one_artifact_ms": _r(1000 / per_s + len(model) / (1024 * 1024) / mib_s * 1000, 3)}  # fmt: skip


def main(argv: Iterable[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--devices", type=int, default=1000)
    p.add_argument("--workers", type=int, default=4, help="device-host processes")
    p.add_argument("--device-nice", type=int, default=0, choices=range(0, 20), metavar="0..19",
                   help="run the device-host processes at this nice level: a real fleet brings its own CPUs, so the "
                        "simulated one should not take the broker's, the hub's and the edge's")
    p.add_argument("--model-mib", type=float, default=1.0)
    p.add_argument("--strategy", default="all_at_once", help="all_at_once, rolling:N or canary:P")
    p.add_argument("--timeout", type=float, default=300, help="the deployment's per-target timeout_s and the wait")
    p.add_argument("--target-s", type=float, default=30, help="time to all ACTIVE the run must stay under")
    p.add_argument("--progress-sample", type=int, default=50, help="devices whose reported download size is read back")
    p.add_argument("--verify-seconds", type=float, default=3)
    p.add_argument("--device-log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument("--max-runtime", type=float, default=3600)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--data-dir", type=Path, default=None)
    p.add_argument("--keep", action="store_true")
    p.add_argument("--trace", action="store_true", help="diagnostic: time each sampled event's stages (bench/_trace.py)")
    p.add_argument("--profile-edge", default=None, help="diagnostic: py-spy the edge during the rollout into this file")
    p.add_argument("--profile-seconds", type=float, default=40)
    p.add_argument("--profile-gil", action="store_true", help="with --profile-edge: sample only the thread holding the GIL")
    p.add_argument("--what-if", default="", help="diagnostic: changes of the edge to measure, comma-separated (bench/_trace.py: desired-async, link-drain, inflight=N)")
    args = p.parse_args(argv)
    # the command benchmark's helpers read these
    args.downstream_broker, args.tcp_nodelay = False, False
    raise_nofile()
    import httpx

    made_tmp = args.data_dir is None
    data_dir = Path(tempfile.mkdtemp(prefix="aisynergy-rollout-")) if made_tmp else args.data_dir.resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    run = Run(args, data_dir, free_port(), free_port(), free_port())
    sources = source_hashes()
    run.results = {
        "benchmark": "rollout", "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "machine": machine_info(),
        "command": " ".join(["python", "bench/rollout.py", *argv]), "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
        "code": {**code_record(), "tree_digest_start": tree_digest(sources)},
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "note": "broker, hub, edge, the device workers and this orchestrator share this machine's cores",
    }  # fmt: skip
    signal.signal(signal.SIGTERM, lambda signum, _f: (_ for _ in ()).throw(KeyboardInterrupt(f"signal {signum}")))
    if args.trace:  # the hub and the edge run under the tracing wrapper, the workers install it themselves
        trace_dir = data_dir / "trace"
        trace_dir.mkdir(exist_ok=True)
        run.env["AISYNERGY_BENCH_TRACE"] = str(trace_dir)
        run.cli = {role: [sys.executable, str(BENCH / "_trace.py")] for role in ("hub", "edge")}
    if args.what_if:
        run.env["AISYNERGY_BENCH_WHAT_IF"] = args.what_if
        run.cli["edge"] = [sys.executable, str(BENCH / "_trace.py")]
    model = dense_model(args.model_mib, seed=1)
    try:
        run.results["verification"] = measure_verification(model, args.verify_seconds)
        run.results["deltas"] = measure_deltas(args.model_mib)
        log(f"device-side checks: {run.results['verification']}; deltas: {run.results['deltas']}")
        handles = start_system(run)
        with httpx.Client(base_url=run.api, headers={"Authorization": f"Bearer {run.token}"}, timeout=60) as api:
            handles["edge"] = start_edge(run, api)
            devices = [register_device(api, run.node_id, f"bench-{i:05d}") for i in range(args.devices)]
            handles["device_workers"], run.results["devices"] = start_devices(run, api, devices)
            sampler = Sampler(dict(handles))
            sampler.start()
            try:
                events = measure_rollout(run, api, sampler, handles, model, [d for d, _ in devices])
            finally:
                sampler.stop()
            if args.trace:
                import _trace

                time.sleep(2.5)  # the tracers write once a second
                run.results["trace"] = _trace.analyse(data_dir / "trace", events, ts)
        ro = run.results["rollout"]
        run.results["holds"] = ro["state"] == "SUCCEEDED" and ro["all_active_s"] is not None and ro["all_active_s"] <= args.target_s
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
        sources_end = source_hashes()
        run.results["code"]["tree_digest_end"] = tree_digest(sources_end)
        changed = sorted(k for k in sources.keys() | sources_end.keys() if sources.get(k) != sources_end.get(k))
        if changed:
            run.results["code"]["changed_during_run"] = changed
        if made_tmp and not args.keep:
            shutil.rmtree(data_dir, ignore_errors=True)
        else:
            run.results["data_dir"] = str(data_dir)
    print(json.dumps({k: run.results.get(k) for k in ("rollout", "device_clock_sample", "event_delivery_s", "bytes", "deltas", "verification", "trace", "holds", "error")}, indent=2, default=str))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(run.results, indent=2, default=str) + "\n")
        log(f"results written to {args.out}")
    return 1 if "error" in run.results else (0 if run.results.get("holds") else 3)


if __name__ == "__main__":
    sys.exit(main())
