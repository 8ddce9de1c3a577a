"""Device ML runtimes: the SDK's inference overhead and the memory a model costs (DESIGN §5, issue 6).

1. *Overhead*: ``ModelHost.infer`` (the SDK path every request takes: the ``infer`` command, task workers, the
   application) against a raw ``InferenceSession.run`` of the same model file on the same inputs, in the same
   process, at batch 1 and 32. The raw session has the SDK's session options (``--threads`` intra-op threads,
   spinning off), so the ratio is the SDK layer's cost alone; an ONNX Runtime session with its defaults (all
   cores, spinning on) is measured too, for reference. The calls alternate in blocks of ``--iterations`` calls,
   ``--repeats`` blocks each, in a shuffled order each round; the time per call is the median block's, the
   ratio the median of the SDK / raw ratios of the blocks of one round (other work on the machine slows both
   of a pair). The session with ORT's defaults is timed after the others (its pool threads spin on after
   each call and would slow the next block). TFLite models are measured the
   same way against a raw LiteRT interpreter (``set_tensor``, ``invoke``, ``get_tensor``). The compiled call
   under ``InferenceSession.run`` (``session._sess.run``, which the SDK calls) is timed as the floor.
2. *Peak RSS*: a fresh Python process per model file opens it with :func:`device.runtime.open_model` and runs
   ``--rss-runs`` inferences at batch 32; it reports its peak resident set (``VmHWM``; ``ru_maxrss`` where there
   is no ``/proc``) after starting, after importing numpy, the runtime and ``device.runtime``, after loading the
   model and after the inferences.

    .venv/bin/python bench/ml.py [--threads 1] [--iterations 200] [--repeats 30] [--out bench/results/ml.json]

Models: the digits MLP and CNN (``tests/fixtures/models/digits-*.onnx`` and ``.tflite``, made by
``tests/fixtures/make_digits_models.py``) and the OTA tests' larger MLP (``mlp-1.0.0.onnx``, 128 → 384 → 10).
Exit status 0 when every ONNX ratio is within ``--target`` (1.05), 3 when not, 1 on failure.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for p in (str(ROOT), str(BENCH)):
    if p not in sys.path:  # run as a script from a checkout
        sys.path.insert(0, p)

MODELS = ROOT / "tests" / "fixtures" / "models"
ONNX_MODELS = ["digits-mlp.onnx", "digits-cnn.onnx", "mlp-1.0.0.onnx"]
TFLITE_MODELS = ["digits-mlp.tflite", "digits-cnn.tflite"]


def machine() -> dict[str, Any]:
    import platform

    import numpy
    import onnxruntime

    info: dict[str, Any] = {"nproc": __import__("os").cpu_count(), "python": platform.python_version(), "kernel": platform.release()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info.update(numpy=numpy.__version__, onnxruntime=onnxruntime.__version__, load_average_at_start=[round(v, 2) for v in __import__("os").getloadavg()])
    try:
        from importlib.metadata import version

        info["ai_edge_litert"] = version("ai-edge-litert")
    except Exception:  # noqa: BLE001
        info["ai_edge_litert"] = None
    try:
        info["commit"] = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10).stdout.strip()
        info["uncommitted"] = bool(subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "device"], capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def interleaved(calls: dict[str, Any], iterations: int, repeats: int) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Median microseconds per call of each callable, measured in alternating blocks, and every block's figure."""
    for call in calls.values():  # warm-up
        for _ in range(max(20, iterations // 4)):
            call()
    samples: dict[str, list[float]] = {k: [] for k in calls}
    order, shuffle = list(calls.items()), random.Random(0).shuffle
    for _ in range(repeats):
        shuffle(order)  # no variant always follows the same one
        for key, call in order:
            started = time.perf_counter_ns()
            for _ in range(iterations):
                call()
            samples[key].append((time.perf_counter_ns() - started) / iterations / 1000.0)
    return {k: statistics.median(v) for k, v in samples.items()}, samples


def paired_ratio(samples: dict[str, list[float]]) -> float:
    """The median over repeats of SDK block / raw block, measured back to back: robust to other work on the
    machine that slows a few seconds of the run (both blocks of a pair see it), unlike a ratio of medians."""
    return statistics.median(a / b for a, b in zip(samples["sdk"], samples["raw"], strict=True))


def onnx_overhead(name: str, threads: int | None, iterations: int, repeats: int, work: Path) -> list[dict[str, Any]]:
    import numpy as np
    import onnxruntime as ort

    from device.ota.models import ModelHost
    from interfaces.deployments import ArtifactFormat

    path = MODELS / name
    host = ModelHost(work / name, threads=threads)
    host.activate(host.load(name, "1", "bench", ArtifactFormat.ONNX, path))
    options = ort.SessionOptions()  # what device.runtime.OnnxRunner sets
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    if threads:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    raw = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    default = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    binding, names = raw._sess.run, [o.name for o in raw.get_outputs()]  # the compiled call under InferenceSession.run
    info = raw.get_inputs()[0]
    rows = []
    for batch in (1, 32):
        x = np.random.default_rng(0).random((batch, *info.shape[1:]), dtype=np.float32)
        feeds = {info.name: x}
        np.testing.assert_allclose(host.infer(feeds, name).outputs[raw.get_outputs()[0].name], raw.run(None, feeds)[0], rtol=1e-6, atol=1e-6)
        us, samples = interleaved({
            "sdk": lambda: host.infer(feeds, name), "raw": lambda: raw.run(None, feeds), "binding": lambda: binding(names, feeds, None),
        }, iterations, repeats)  # fmt: skip
        # apart: its pool threads spin on after each call and would slow whichever block follows
        us.update(interleaved({"raw_ort_defaults": lambda: default.run(None, feeds)}, iterations, max(5, repeats // 4))[0])
        rows.append({"model": name, "runtime": "onnx", "batch": batch, "us": us, "ratio": paired_ratio(samples), "overhead_us": us["sdk"] - us["raw"],
                     "ratio_vs_ort_defaults": us["sdk"] / us["raw_ort_defaults"], "sdk_above_binding_us": us["sdk"] - us["binding"]})  # fmt: skip
    return rows


def tflite_overhead(name: str, threads: int | None, iterations: int, repeats: int, work: Path) -> list[dict[str, Any]]:
    import numpy as np
    from ai_edge_litert.interpreter import Interpreter

    from device.ota.models import ModelHost
    from interfaces.deployments import ArtifactFormat

    path = MODELS / name
    host = ModelHost(work / name, threads=threads)
    host.activate(host.load(name, "1", "bench", ArtifactFormat.TFLITE, path))
    model = host.get(name)
    rows = []
    for batch in (1, 32):
        interpreter = Interpreter(model_path=str(path), num_threads=threads)
        index = interpreter.get_input_details()[0]["index"]
        out = interpreter.get_output_details()[0]["index"]
        x = np.random.default_rng(0).random((batch, *model.inputs[0].shape[1:]), dtype=np.float32)
        interpreter.resize_tensor_input(index, x.shape)
        interpreter.allocate_tensors()

        def raw() -> Any:
            interpreter.set_tensor(index, x)
            interpreter.invoke()
            return interpreter.get_tensor(out)

        feeds = {model.inputs[0].name: x}
        np.testing.assert_allclose(host.infer(feeds, name).outputs[model.outputs[0].name], raw(), rtol=1e-6, atol=1e-6)
        us, samples = interleaved({"sdk": lambda: host.infer(feeds, name), "raw": raw}, iterations, repeats)
        rows.append({"model": name, "runtime": "tflite", "batch": batch, "us": us, "ratio": paired_ratio(samples), "overhead_us": us["sdk"] - us["raw"]})
    return rows


# ---- peak RSS, in a fresh process per model ---------------------------------------------------------------
def _peak_kib() -> int:
    """This process's peak resident set in KiB: ``VmHWM`` where Linux has it, else ``ru_maxrss``. (Linux carries
    ``ru_maxrss`` over ``exec`` from the parent that forked the process, so a child started by this script would
    report at least this script's own size; ``VmHWM`` belongs to the new program's memory map alone.)"""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def child(path: str | None, batch: int, runs: int, threads: int | None) -> None:
    """Run in the child: print the peak RSS (KiB) after each stage as one JSON line."""
    peak = _peak_kib
    stages = {"interpreter": peak()}
    import numpy as np

    stages["numpy"] = peak()
    if path is None:
        print(json.dumps(stages))
        return
    if path.endswith(".tflite"):
        import ai_edge_litert.interpreter  # noqa: F401
    else:
        import onnxruntime  # noqa: F401
    from device.runtime import open_model

    stages["runtime_imported"] = peak()
    model = open_model(path, threads=threads)
    stages["model_loaded"] = peak()
    x = np.random.default_rng(0).random((batch, *[d if isinstance(d, int) else 1 for d in model.inputs[0].shape[1:]]), dtype=np.float32)
    for _ in range(runs):
        model.run({model.inputs[0].name: x})
    stages["after_inference"] = peak()
    print(json.dumps(stages))


def peak_rss(name: str | None, batch: int, runs: int, threads: int | None) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", str(MODELS / name) if name else "-", "--rss-batch", str(batch), "--rss-runs", str(runs)]
    if threads:
        command += ["--threads", str(threads)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"child for {name} failed: {done.stderr[-2000:]}")
    stages = json.loads(done.stdout.strip().splitlines()[-1])
    return {"model": name or "(none)", "file_bytes": (MODELS / name).stat().st_size if name else 0, "peak_kib": stages}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of the SDK and the raw sessions (0: the runtime's default)")
    parser.add_argument("--iterations", type=int, default=200, help="calls per timed block")
    parser.add_argument("--repeats", type=int, default=30, help="timed blocks per variant")
    parser.add_argument("--rss-batch", type=int, default=32)
    parser.add_argument("--rss-runs", type=int, default=100)
    parser.add_argument("--target", type=float, default=1.05, help="the largest acceptable SDK / raw ratio (ONNX)")
    parser.add_argument("--out", type=Path, default=None, help="write every figure as JSON")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    threads = args.threads or None
    if args.child is not None:
        child(None if args.child == "-" else args.child, args.rss_batch, args.rss_runs, threads)
        return 0

    started, info = time.time(), machine()
    work = Path(tempfile.mkdtemp(prefix="aisynergy-bench-ml-"))
    try:
        overhead = [row for name in ONNX_MODELS for row in onnx_overhead(name, threads, args.iterations, args.repeats, work)]
        try:
            import ai_edge_litert  # noqa: F401

            overhead += [row for name in TFLITE_MODELS if (MODELS / name).exists() for row in tflite_overhead(name, threads, args.iterations, args.repeats, work)]
        except ImportError:
            print("LiteRT not installed: TFLite rows skipped", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rss = [peak_rss(None, args.rss_batch, args.rss_runs, threads)]
    rss += [peak_rss(name, args.rss_batch, args.rss_runs, threads) for name in [*ONNX_MODELS, *TFLITE_MODELS] if (MODELS / name).exists()]

    print(f"{'model':<20} {'runtime':<7} {'batch':>5} {'SDK us':>9} {'raw us':>9} {'ratio':>7} {'+us':>6} {'ORT defaults us':>16} {'binding us':>11}")
    for r in overhead:
        print(f"{r['model']:<20} {r['runtime']:<7} {r['batch']:>5} {r['us']['sdk']:9.2f} {r['us']['raw']:9.2f} {r['ratio']:7.3f} {r['overhead_us']:6.2f} "
              f"{r['us'].get('raw_ort_defaults', float('nan')):16.2f} {r['us'].get('binding', float('nan')):11.2f}")  # fmt: skip
    print(f"\n{'peak RSS (MiB)':<20} {'file KiB':>9} {'numpy':>7} {'runtime':>8} {'loaded':>7} {'inferred':>9}")
    for r in rss:
        s = r["peak_kib"]
        mib = lambda k: f"{s[k] / 1024:.1f}" if k in s else "-"  # noqa: E731
        print(f"{r['model']:<20} {r['file_bytes'] / 1024:9.1f} {mib('numpy'):>7} {mib('runtime_imported'):>8} {mib('model_loaded'):>7} {mib('after_inference'):>9}")
    worst = max(r["ratio"] for r in overhead if r["runtime"] == "onnx")
    held = worst <= args.target
    print(f"\nworst ONNX SDK/raw ratio {worst:.3f} (target <= {args.target}): {'holds' if held else 'does not hold'}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "bench": "ml", "started": dt.datetime.fromtimestamp(started, dt.UTC).isoformat(), "seconds": round(time.time() - started, 1),
            "command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": info,
            "settings": {"threads": threads, "iterations": args.iterations, "repeats": args.repeats, "rss_batch": args.rss_batch, "rss_runs": args.rss_runs},
            "overhead": overhead, "peak_rss": rss, "target": args.target, "held": held,
        }, indent=2) + "\n")  # fmt: skip
    return 0 if held else 3


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(1)
