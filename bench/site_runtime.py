"""The site runtime of users' algorithms (device/algorithm/runtime.py), run by hand:

* ``throughput``: the PyTorch example (examples/algorithms/torch_cnn) trained on scikit-learn's digits for
  ``--steps`` fit calls, directly in this process and inside the runtime (its own limited process); samples/s of the
  fit calls alone, and the worker's start-up time (launch to its first frame, and to its first trained step);
* ``interference`` (standard 7.2 d 5: training must not disturb other applications): a latency-sensitive process
  (an ONNX inference loop at ``--rate`` requests/s on the digits CNN) measured alone, beside an unlimited training
  worker and beside one limited to ``--cpu`` cores; p50/p99 of its request latency in each case.

    .venv/bin/python bench/site_runtime.py throughput --steps 8
    .venv/bin/python bench/site_runtime.py interference --seconds 20 --rate 50 --cpu 1

Prints one JSON document; the figures are in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from device.algorithm.runner import Job
from device.algorithm.runtime import AlgorithmFailed, Limits, limit_support, run_worker

TORCH_CNN = ROOT / "examples" / "algorithms" / "torch_cnn"
ONNX_MODEL = ROOT / "tests" / "fixtures" / "models" / "digits-cnn.onnx"


def _digits(where: Path) -> dict[str, str]:
    import numpy as np
    from sklearn.datasets import load_digits

    digits = load_digits()
    x, y = (digits.data / 16).astype(np.float32).reshape(-1, 1, 8, 8), digits.target.astype(np.int64)
    np.savez(where / "train.npz", x=x[:1437], y=y[:1437])
    np.savez(where / "test.npz", x=x[1437:], y=y[1437:])
    return {"train": str(where / "train.npz"), "test": str(where / "test.npz")}


def throughput(args: argparse.Namespace) -> dict[str, Any]:
    from device.algorithm.client import checked_fit, checked_initial_parameters
    from device.algorithm.loader import load_client

    config = {"epochs": args.epochs, "seed": 0}
    with tempfile.TemporaryDirectory() as scratch:
        datasets = _digits(Path(scratch))
        _, client = load_client(TORCH_CNN, config, {k: Path(v) for k, v in datasets.items()})
        parameters = checked_initial_parameters(client)
        checked_fit(client, parameters, {"round": 0})  # warm-up, as the runtime's first step also is
        started, samples = time.perf_counter(), 0
        for step in range(1, args.steps + 1):
            fitted = checked_fit(client, parameters, {"round": step})
            parameters, samples = fitted.parameters, samples + fitted.num_examples * args.epochs
        direct = samples / (time.perf_counter() - started)

        stamps: list[tuple[float, dict[str, Any]]] = []
        job = Job(package_dir=str(TORCH_CNN), datasets=datasets, config=config, steps=args.steps + 1, checkpoint_every=args.steps + 1)
        launched = time.perf_counter()
        result = run_worker("bench", Path(scratch) / "work", job, Limits(cpu_cores=args.cpu, memory_bytes=2 << 30),
                            on_frame=lambda f: stamps.append((time.perf_counter(), f)))  # fmt: skip
        steps = [(t, f) for t, f in stamps if f["type"] == "step"]
        first_frame = stamps[0][0] - launched
        # step 1 is the warm-up; samples/s over steps 2..n, as the direct run measured
        runtime = sum(f["num_examples"] * args.epochs for _, f in steps[1:]) / (steps[-1][0] - steps[0][0])
    return {
        "machine": _machine(), "limited_by": result.limited_by, "cpu_cores": args.cpu, "steps": args.steps, "epochs_per_step": args.epochs,
        "direct_samples_per_s": round(direct, 1), "runtime_samples_per_s": round(runtime, 1), "ratio": round(runtime / direct, 3),
        "startup_to_first_frame_s": round(first_frame, 3), "startup_to_first_step_s": round(steps[0][0] - launched, 3),
        "accuracy": result.metrics.get("accuracy"),
    }  # fmt: skip


_LOOP = r"""
import json, sys, time
import numpy as np, onnxruntime as ort
options = ort.SessionOptions(); options.intra_op_num_threads = 1; options.inter_op_num_threads = 1
session = ort.InferenceSession(sys.argv[1], options)
name = session.get_inputs()[0].name
x = np.random.default_rng(0).random((1, 1, 8, 8), dtype=np.float32)
rate, seconds = float(sys.argv[2]), float(sys.argv[3])
for _ in range(20): session.run(None, {name: x})
latencies, start = [], time.perf_counter()
n = 0
while time.perf_counter() - start < seconds:
    due = start + n / rate
    pause = due - time.perf_counter()
    if pause > 0: time.sleep(pause)
    t = time.perf_counter(); session.run(None, {name: x}); latencies.append((time.perf_counter() - t) * 1000); n += 1
print(json.dumps(latencies))
"""


def _loop(rate: float, seconds: float) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", _LOOP, str(ONNX_MODEL), str(rate), str(seconds)], check=True, capture_output=True, text=True).stdout
    latencies = sorted(json.loads(out))
    return {"requests": len(latencies), "p50_ms": round(statistics.median(latencies), 3), "p99_ms": round(latencies[int(0.99 * (len(latencies) - 1))], 3)}


def interference(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"machine": _machine(), "limited_by": limit_support(), "rate": args.rate, "seconds": args.seconds, "cpu_cores": args.cpu}
    results["alone"] = _loop(args.rate, args.seconds)
    with tempfile.TemporaryDirectory() as scratch:
        datasets = _digits(Path(scratch))
        for label, limits in (("beside_unlimited", Limits()), ("beside_limited", Limits(cpu_cores=args.cpu, memory_bytes=2 << 30))):
            stop = threading.Event()
            job = Job(package_dir=str(TORCH_CNN), datasets=datasets, config={"epochs": 1, "seed": 0}, steps=100_000, checkpoint_every=100_000)
            steps: list[int] = []

            def train(job: Job = job, limits: Limits = limits, stop: threading.Event = stop, label: str = label, steps: list[int] = steps) -> None:
                try:
                    run_worker(f"bench-{label}", Path(scratch) / label, job, limits, stop=stop,
                               on_frame=lambda f: steps.append(1) if f["type"] == "step" else None)  # fmt: skip
                except AlgorithmFailed as exc:
                    if exc.reason != "stopped":
                        raise

            trainer = threading.Thread(target=train)
            trainer.start()
            while not steps:  # measure while it trains, not while it starts
                time.sleep(0.1)
            results[label] = _loop(args.rate, args.seconds)
            results[label]["training_steps"] = len(steps)
            stop.set()
            trainer.join()
    results["p99_ratio_unlimited"] = round(results["beside_unlimited"]["p99_ms"] / results["alone"]["p99_ms"], 3)
    results["p99_ratio_limited"] = round(results["beside_limited"]["p99_ms"] / results["alone"]["p99_ms"], 3)
    return results


def _machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")), "?")
    return f"{os.cpu_count()} vCPU {model}, Python {sys.version.split()[0]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    t = sub.add_parser("throughput")
    t.add_argument("--steps", type=int, default=8)
    t.add_argument("--epochs", type=int, default=2)
    t.add_argument("--cpu", type=float, default=None, help="the worker's CPU quota (default: none, as the direct run)")
    i = sub.add_parser("interference")
    i.add_argument("--seconds", type=float, default=20)
    i.add_argument("--rate", type=float, default=50)
    i.add_argument("--cpu", type=float, default=1)
    args = parser.parse_args()
    print(json.dumps(throughput(args) if args.what == "throughput" else interference(args), indent=2))


if __name__ == "__main__":
    main()
