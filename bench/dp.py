"""DP incremental training on the device (DESIGN §5): DP-SGD step time against a non-private step, and the peak
memory of a training run.

1. *Step time*, numpy only, one thread or the BLAS default: one step of the last-layer trainer
   (``device.training.dpsgd``) on a fixed batch, private (closed-form per-example norms, clipping, Gaussian
   noise on every coordinate, divided by the expected batch size, update) against non-private (mean gradient,
   update) on the same batch, for layer shapes from the digits model (32 -> 10) to a MobileNet-sized head
   (1280 -> 1000). Also what the private step would cost with materialised per-example gradients (what a
   framework without the closed form does), and the Poisson sampling of a batch from the whole dataset
   (part of a private step, not of the comparison: a non-private step draws its batch too).
   Median of ``--repeats`` timings of ``--iterations`` steps each. The target: private ≤ 1.6 × non-private.
   The noise is drawn as the trainer draws it: ahead, on a thread, when there is more than one core
   (``--noise inline``: on the step's own thread, as on a one-core board).
2. *Peak RSS of a training run*: a fresh Python process does what the ``incremental_training`` worker does
   (load the local dataset, run the frozen body in ONNX Runtime over it, ``--steps`` DP-SGD steps) and reports
   its peak resident set (``VmHWM``; not ``ru_maxrss``, which a child inherits from the process that forked it), against the same process after its imports (Python, numpy, ONNX Runtime, safetensors) and
   after loading the data. Two models: the digits MLP of the tests (64 -> 64 -> 32 -> 10, 700 rows) and the
   MLP test fixture (128 -> 384 -> 10, ``--rows`` rows).

    python bench/dp.py [--repeats 7] [--iterations 200] [--steps 300] [--rows 20000] [--noise auto|inline] [--out bench/results/dp.json]

Needs the project's virtualenv (torch and scikit-learn for the digits model, as in the tests). Exit status 0
when every shape meets the target, 3 when one does not.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from device.training.dpsgd import DTYPE, GaussianNoise, augment, clip_per_example, per_example_gradients, plain_sum, private_sum  # noqa: E402

SHAPES = [  # (name, batch, features, classes)
    ("digits head", 64, 32, 10),
    ("MLP fixture head", 64, 384, 10),
    ("batch 256, 512 -> 100", 256, 512, 100),
    ("MobileNet-sized head", 256, 1280, 1000),
]
TARGET = 1.6


def _time(fn: Any, iterations: int, repeats: int) -> float:
    """Median seconds per call."""
    fn()
    runs = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(iterations):
            fn()
        runs.append((time.perf_counter() - started) / iterations)
    return statistics.median(runs)


def step_times(batch: int, d: int, c: int, iterations: int, repeats: int, rows: int, ahead: bool) -> dict[str, float]:
    """Median ms per step of the trainer's private step and of a plain SGD step on the same batch and layer
    (``[W; b]`` on augmented features, as :class:`~device.training.dpsgd.HeadTrainer` keeps them), both with
    the update; the materialised-gradient variant; and drawing a Poisson sample from ``rows`` rows."""
    rng = np.random.default_rng(0)
    raw = rng.standard_normal((batch, d)).astype(np.float32)
    f = augment(raw)
    sq = np.einsum("ij,ij->i", f, f)  # the trainer computes these once per dataset
    y = rng.integers(0, c, size=batch)
    theta0 = (rng.standard_normal((d + 1, c)) * 0.05).astype(np.float32)
    theta = theta0.copy()
    step = DTYPE(0.1 / batch)
    noise = np.random.Generator(np.random.SFC64(1))
    source = GaussianNoise(theta0.shape, 1.1, np.random.Generator(np.random.SFC64(3)), ahead)  # as the trainer draws it
    iterations = max(5, min(iterations, int(2e8 / (batch * d * c + 1))))  # the large head: fewer steps per timing

    def plain() -> None:
        grad = plain_sum(theta, f, y)
        grad *= step
        theta[...] -= grad

    def private() -> None:
        grad, _, _ = private_sum(theta, f, y, clip_norm=1.0, noise=source, sq_norms=sq)
        grad *= step
        theta[...] -= grad

    def materialised() -> None:
        w, b = theta[:-1], theta[-1]
        dw, db = per_example_gradients(w, b, raw, y)
        cw, cb = clip_per_example(dw, db, 1.0)
        gw = cw.sum(axis=0) + noise.standard_normal(w.shape, dtype=np.float32) * np.float32(1.1)
        gb = cb.sum(axis=0) + noise.standard_normal(b.shape, dtype=np.float32) * np.float32(1.1)
        theta[:-1] -= step * gw
        theta[-1] -= step * gb

    q = batch / rows
    sampler = np.random.default_rng(2)

    def sample() -> None:
        np.flatnonzero(sampler.random(rows) < q)

    def noise_only() -> None:
        noise.standard_normal(theta.shape, dtype=np.float32)

    out = {"iterations": iterations, "plain_ms": 1000 * _time(plain, iterations, repeats), "private_ms": 1000 * _time(private, iterations, repeats),
           "noise_ahead": ahead}  # fmt: skip
    source.close()
    theta[...] = theta0
    if batch * d * c <= 5e7:  # the materialised form of the largest head needs 1.3 GB per step
        out["materialised_ms"] = 1000 * _time(materialised, max(3, iterations // 10), repeats)
    out["noise_ms"] = 1000 * _time(noise_only, iterations, repeats)
    out["poisson_sample_ms"] = 1000 * _time(sample, iterations, repeats)
    out["sample_rows"] = rows
    out["ratio"] = out["private_ms"] / out["plain_ms"]
    return out


CHILD = r"""
import json, sys, time
import numpy as np, onnxruntime, safetensors  # noqa: F401  (what the device's worker has loaded)
from device.training.dpsgd import HeadTrainer
from device.training.features import body_features
from device.local_data import LocalDatasets

def status_kib(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))

def rss_kib():
    return status_kib("VmRSS")

args = json.loads(sys.argv[1])
after_imports = rss_kib()
x, y = LocalDatasets(args["datasets"]).load("data")
after_data = rss_kib()
started = time.perf_counter()
features = body_features(args["body"], x, args["feature"], with_ones=True)
features_s = time.perf_counter() - started
del x
weight, bias = np.load(args["head"])["weight"], np.load(args["head"])["bias"]
trainer = HeadTrainer(weight, bias, features, y, learning_rate=0.5, clip_norm=1.0, noise_multiplier=1.1, sample_rate=min(1.0, 64 / len(y)), augmented=True,
                      noise_ahead=args["ahead"])
started = time.perf_counter()
for _ in range(args["steps"]):
    trainer.step()
train_s = time.perf_counter() - started
trainer.close()
print(json.dumps({"rss_after_imports_kib": after_imports, "rss_after_data_kib": after_data, "rss_end_kib": rss_kib(),
                  "peak_rss_kib": status_kib("VmHWM"), "features_s": features_s, "train_s": train_s,
                  "rows": int(len(y)), "feature_dim": int(features.shape[1]) - 1, "steps": args["steps"], "accuracy": trainer.accuracy()}))
"""


def training_run(model: bytes, x: np.ndarray, y: np.ndarray, steps: int, work: Path, ahead: bool) -> dict[str, Any]:
    """The worker's training in a fresh process; its memory figures."""
    from cloud.incremental import surgery
    from device.local_data import LocalDatasets

    onnx_model = surgery.load(model)
    layer = surgery.find_dense(onnx_model)
    weight, bias = surgery.layer_arrays(onnx_model, layer)
    (work / "body.onnx").write_bytes(surgery.body(onnx_model, layer).SerializeToString())
    np.savez(work / "head.npz", weight=weight, bias=bias)
    LocalDatasets(work / "datasets").put("data", x, y)
    args = {"datasets": str(work / "datasets"), "body": str(work / "body.onnx"), "feature": layer.feature, "head": str(work / "head.npz"), "steps": steps, "ahead": ahead}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], capture_output=True, text=True, env=env, timeout=600, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["model_bytes"] = len(model)
    result["dataset_bytes"] = (work / "datasets" / "data.npz").stat().st_size
    return result


def machine() -> dict[str, Any]:
    import onnxruntime

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__, "onnxruntime": onnxruntime.__version__,
            "platform": platform.platform()}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--steps", type=int, default=300, help="DP-SGD steps of each training run")
    parser.add_argument("--rows", type=int, default=20_000, help="rows of the MLP fixture's training run")
    parser.add_argument("--threads", type=int, default=1, help="BLAS threads for the step timings (0: the library's default)")
    parser.add_argument("--noise", choices=["auto", "inline"], default="auto", help="auto: drawn ahead on a thread when there is more than one core (as the trainer does); inline: on the step's own thread (a one-core board)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    ahead = args.noise == "auto" and (os.cpu_count() or 1) > 1
    if args.threads:
        try:
            from threadpoolctl import threadpool_limits

            threadpool_limits(args.threads)
        except ImportError:
            print("threadpoolctl not installed: BLAS runs with its default threads", file=sys.stderr)
    results: dict[str, Any] = {"machine": machine(), "command": " ".join(sys.argv), "noise_ahead": ahead, "steps": {}, "training": {}}
    print(f"{'layer':<24} {'batch':>5} {'d x c':>11} {'plain ms':>9} {'DP ms':>8} {'ratio':>6} {'noise ms':>9} {'ahead':>5} {'materialised ms':>16} {'sample ms':>10}")
    held = True
    for name, batch, d, c in SHAPES:
        t = step_times(batch, d, c, args.iterations, args.repeats, rows=max(20 * batch, 10_000), ahead=ahead)
        results["steps"][name] = {"batch": batch, "features": d, "classes": c, **t}
        held &= t["ratio"] <= TARGET
        mat = f"{t['materialised_ms']:.3f}" if "materialised_ms" in t else "-"
        print(f"{name:<24} {batch:>5} {f'{d} x {c}':>11} {t['plain_ms']:>9.4f} {t['private_ms']:>8.4f} {t['ratio']:>6.2f} {t['noise_ms']:>9.4f} {'yes' if t['noise_ahead'] else 'no':>5} {mat:>16} {t['poisson_sample_ms']:>10.4f}")

    from tests.dp_support import cloud_model, digits

    d = digits()
    fixture = (ROOT / "tests" / "fixtures" / "models" / "mlp-1.0.0.onnx").read_bytes()
    rng = np.random.default_rng(0)
    runs = {
        "digits MLP, 700 rows": (cloud_model(), d.x_device[:700], d.y_device[:700]),
        f"MLP fixture, {args.rows} rows": (fixture, rng.standard_normal((args.rows, 128)).astype(np.float32), rng.integers(0, 10, args.rows)),
    }
    print(f"\n{'training run':<28} {'imports MiB':>11} {'+data MiB':>9} {'peak MiB':>9} {'features s':>10} {'train s':>8} {'ms/step':>8}")
    for name, (model, x, y) in runs.items():
        with tempfile.TemporaryDirectory() as tmp:
            r = training_run(model, x, y, args.steps, Path(tmp), ahead)
        results["training"][name] = r
        print(f"{name:<28} {r['rss_after_imports_kib'] / 1024:>11.1f} {r['rss_after_data_kib'] / 1024:>9.1f} {r['peak_rss_kib'] / 1024:>9.1f} "
              f"{r['features_s']:>10.3f} {r['train_s']:>8.3f} {1000 * r['train_s'] / r['steps']:>8.3f}")  # fmt: skip
    results["held"] = held
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nDP step within {TARGET}x of a plain step for every shape: {held}")
    return 0 if held else 3


if __name__ == "__main__":
    sys.exit(main())
