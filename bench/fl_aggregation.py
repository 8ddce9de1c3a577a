"""Whole-model aggregation on the hub (issue 19): peak memory and wall time of fusing a round's updates from files.

The hub fuses a whole-model round tensor by tensor (``cloud.fl.whole.fuse``): each update is a safetensors file
opened as an :class:`interfaces.tensorfile.TensorFile`, :meth:`interfaces.aggregation.Strategy.aggregate_stream`
reads one tensor of the global model and of each update at a time, and the result (and a server optimiser's
moments) goes to a :class:`interfaces.tensorfile.TensorWriter` as it is computed. This script measures that path
against a plain numpy baseline that holds every update in memory.

1. *The model*: a ResNet-50 laid out as torchvision names it (``conv1.weight``, ``layer1.0.conv1.weight``,
   ``layer1.0.bn1.running_var``, ``layer1.0.downsample.0.weight``, ..., ``fc.weight``: 267 float32 tensors, five
   of 7.7-8.7 MiB, most of a few KiB), its widths scaled (channels rounded to multiples of 8) to about ``--params``
   parameters; 25,000,000 gives 25,154,472 (96 MiB a file, the largest tensor ``layer4.0.conv2.weight``, 8.7 MiB).
   The global model and ``--updates`` updates (the global model plus Gaussian noise, ``num_examples`` 100, 200, ...)
   are written with :func:`interfaces.tensorfile.write_tensors` by this process, one tensor at a time, so the writing
   is in none of the measured processes.
2. *Each measurement in a fresh process* (``python bench/fl_aggregation.py --child ...``): it imports numpy,
   safetensors and the aggregation modules (every path imports the same), reads its RSS (``VmRSS``), runs, and
   reports ``getrusage(RUSAGE_SELF).ru_maxrss`` at the end minus that RSS: the peak resident memory the aggregation
   itself added. The kernel carries into ``ru_maxrss`` the high-water mark of the process that forked the child
   (across ``exec``), so the child also resets its own mark after the imports (``/proc/self/clear_refs``) and
   reports ``VmHWM`` minus the same RSS; the two growths are printed side by side and should agree.
   The files were just written, so they are read from the page cache, which is not the reader's RSS (``pread``
   copies into the process's own arrays; a memory map's pages would count).

   * ``stream``: what the hub runs: ``TensorFile`` sources, ``aggregate_stream``, the output to a ``TensorWriter``
     file and the state to a second one (laid out by ``Strategy.state_infos``; empty for the stateless
     strategies). FedAdam is measured twice: round 1 (no ``state_in``) writes the moments that round 2 reads back
     as ``state_in``, the hub's steady state.
   * ``numpy``: ``safetensors.numpy.load_file`` of every update, then per tensor name ``np.average`` over the
     stacked updates with their ``num_examples`` as weights (FedAvg) or ``np.median`` (Median), cast to float32,
     and ``safetensors.numpy.save_file`` of the result.

3. *The table*: strategy, path, peak RSS growth in MiB and as a multiple of one update's data, wall seconds. The
   streaming FedAvg and Median results are compared with numpy's (max abs difference; within 1e-6 or the run
   fails). The target: the streaming FedAvg's growth at most 2x one update.

Usage::

    python bench/fl_aggregation.py [--params 25000000] [--updates 5] [--strategy fedavg --strategy median ...]
                                   [--trace] [--out DIR]

``--strategy`` (repeatable; fedavg, fedprox, fedadam, median, trimmed_mean) defaults to fedavg, fedadam and median.
``--trace`` also runs each measured process under ``tracemalloc`` (numpy reports its buffers to it), which gives
the peak of the arrays alive at once, to tell them from what the allocator keeps. ``--out DIR`` keeps the model
files, the results and ``results.json`` in DIR; without it they go to a temporary directory, removed at the end.
Exit status: 0 the results agree and the target holds, 3 they agree and the target does not hold, 1 they differ
or a run failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from interfaces.tensorfile import TensorFile, TensorInfo, write_tensors

MIB = 1024 * 1024
TARGET = 2.0
"""The streaming FedAvg's peak RSS growth, as a multiple of one update's size."""
TOLERANCE = 1e-6
STAGES = ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2))  # ResNet-50: (planes, blocks, stride)
EXPANSION = 4
CLASSES = 1000
STRATEGIES = ("fedavg", "fedprox", "fedadam", "median", "trimmed_mean")
BASELINES = {"fedavg", "median"}


# --- the model ---------------------------------------------------------------------------------------------------


def resnet50(width: float) -> dict[str, TensorInfo]:
    """The floating-point tensors of a torchvision ResNet-50 whose channels are scaled by ``width`` (multiples of 8)."""

    def channels(c: int) -> int:
        return max(8, round(c * width / 8) * 8)

    infos: dict[str, TensorInfo] = {}

    def conv(name: str, out: int, inp: int, k: int) -> None:
        infos[f"{name}.weight"] = TensorInfo("float32", (out, inp, k, k))

    def bn(name: str, c: int) -> None:
        for part in ("weight", "bias", "running_mean", "running_var"):
            infos[f"{name}.{part}"] = TensorInfo("float32", (c,))

    stem = channels(64)
    conv("conv1", stem, 3, 7)
    bn("bn1", stem)
    inplanes = stem
    for index, (planes, blocks, _stride) in enumerate(STAGES, start=1):
        width_ = channels(planes)
        for block in range(blocks):
            prefix = f"layer{index}.{block}"
            conv(f"{prefix}.conv1", width_, inplanes, 1)
            bn(f"{prefix}.bn1", width_)
            conv(f"{prefix}.conv2", width_, width_, 3)
            bn(f"{prefix}.bn2", width_)
            conv(f"{prefix}.conv3", width_ * EXPANSION, width_, 1)
            bn(f"{prefix}.bn3", width_ * EXPANSION)
            if block == 0:
                conv(f"{prefix}.downsample.0", width_ * EXPANSION, inplanes, 1)
                bn(f"{prefix}.downsample.1", width_ * EXPANSION)
            inplanes = width_ * EXPANSION
    infos["fc.weight"] = TensorInfo("float32", (CLASSES, inplanes))
    infos["fc.bias"] = TensorInfo("float32", (CLASSES,))
    return infos


def parameters(infos: dict[str, TensorInfo]) -> int:
    return sum(math.prod(info.shape) for info in infos.values())


def layout(target: int) -> dict[str, TensorInfo]:
    """The scaled ResNet-50 with the parameter count closest to ``target``."""
    low, high = 0.05, 1.0
    while parameters(resnet50(high)) < target:
        high *= 2
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if parameters(resnet50(middle)) < target else (low, middle)
    return min((resnet50(w) for w in (low, high)), key=lambda infos: abs(parameters(infos) - target))


def global_tensor(index: int, name: str, info: TensorInfo) -> np.ndarray:
    """Tensor ``name`` of the global model: He-initialised weights, batch-norm scales near 1, biases near 0."""
    rng = np.random.default_rng([0, index])
    norm = name.startswith("bn") or ".bn" in name or ".downsample.1." in name
    if norm and name.endswith((".weight", ".running_var")):
        return (1.0 + 0.1 * rng.standard_normal(info.shape, dtype=np.float32)).astype(np.float32)
    if len(info.shape) < 2:
        return 0.1 * rng.standard_normal(info.shape, dtype=np.float32)
    fan_in = math.prod(info.shape[1:])
    return rng.standard_normal(info.shape, dtype=np.float32) * np.float32(math.sqrt(2.0 / fan_in))


def update_tensor(update: int, index: int, name: str, info: TensorInfo) -> np.ndarray:
    """Tensor ``name`` of update ``update``: the global tensor plus noise of a tenth of its scale."""
    base = global_tensor(index, name, info)
    scale = np.float32(0.1 * (float(np.std(base)) or 0.01))
    noise = np.random.default_rng([1 + update, index]).standard_normal(info.shape, dtype=np.float32)
    base += scale * noise
    return base


def write_models(directory: Path, infos: dict[str, TensorInfo], updates: int) -> list[Path]:
    """The global model and the updates as safetensors files, one tensor held at a time; their paths."""
    position = {name: i for i, name in enumerate(infos)}
    write_tensors(directory / "global.safetensors", infos, lambda name: global_tensor(position[name], name, infos[name]))
    paths = []
    for k in range(updates):
        path = directory / f"update-{k}.safetensors"
        write_tensors(path, infos, lambda name, k=k: update_tensor(k, position[name], name, infos[name]))
        paths.append(path)
    return paths


# --- one measured run (a fresh process) ---------------------------------------------------------------------------


def _status() -> dict[str, int]:
    """``/proc/self/status`` memory lines in KiB (VmRSS, VmHWM, RssAnon, RssFile, ...)."""
    out = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if value.strip().endswith("kB"):
                out[key] = int(value.split()[0])
    return out


def _reset_peak() -> bool:
    """Set the high-water mark of the RSS to the current RSS (Linux >= 4.0); False where that is refused."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        return True
    except OSError:
        return False


def run_stream(job: dict[str, Any]) -> None:
    from contextlib import ExitStack

    from interfaces.aggregation import StreamUpdate, strategy_from_spec
    from interfaces.tensorfile import TensorWriter

    strategy = strategy_from_spec(job["strategy"])
    with ExitStack() as stack:
        base = stack.enter_context(TensorFile(job["global"]))
        updates = [StreamUpdate(stack.enter_context(TensorFile(path)), weight, {}, f"site-{k}")
                   for k, (path, weight) in enumerate(zip(job["updates"], job["weights"], strict=True))]  # fmt: skip
        state_in = stack.enter_context(TensorFile(job["state_in"])) if job.get("state_in") else None
        infos = base.infos()
        with TensorWriter(job["output"], infos) as out, TensorWriter(job["state_out"], strategy.state_infos(infos)) as state_out:
            strategy.aggregate_stream(base, updates, out.write, state_in, state_out.write)


def run_numpy(job: dict[str, Any]) -> None:
    from safetensors.numpy import load_file, save_file

    updates = [load_file(path) for path in job["updates"]]
    weights = np.asarray(job["weights"], dtype=np.float64)
    result = {}
    for name in updates[0]:
        stacked = np.stack([u[name] for u in updates])
        if job["strategy"] == "median":
            merged = np.median(stacked, axis=0)
        else:
            merged = np.average(stacked, axis=0, weights=weights)
        result[name] = merged.astype(updates[0][name].dtype)
        del stacked, merged
    save_file(result, job["output"])


def child(job: dict[str, Any]) -> dict[str, Any]:
    """Run one job in this (fresh) process and say what it cost."""
    import gc
    import resource

    # every path imports the same, so the RSS after the imports is the same baseline
    import safetensors.numpy  # noqa: F401

    import interfaces.aggregation
    import interfaces.tensorfile  # noqa: F401

    if job["trace"]:
        import tracemalloc

        tracemalloc.start()
    gc.collect()
    before = _status()
    reset = _reset_peak()
    started = time.perf_counter()
    (run_stream if job["path"] == "stream" else run_numpy)(job)
    wall = time.perf_counter() - started
    after = _status()
    report = {
        "wall_s": wall,
        "rss_after_imports_kib": before["VmRSS"],
        "peak_rss_kib": after["VmHWM"],
        "peak_reset": reset,
        "ru_maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "hwm_growth_kib": after["VmHWM"] - before["VmRSS"],
        "at_end": {key: after[key] for key in ("VmRSS", "RssAnon", "RssFile") if key in after},
    }
    report["growth_kib"] = report["ru_maxrss_kib"] - before["VmRSS"]
    if job["trace"]:
        import tracemalloc

        report["traced_peak_kib"] = tracemalloc.get_traced_memory()[1] // 1024
    return report


def measure(job: dict[str, Any]) -> dict[str, Any]:
    """``job`` run by :func:`child` in a fresh interpreter."""
    done = subprocess.run([sys.executable, __file__, "--child", json.dumps(job)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{job['strategy']} {job['path']} failed ({done.returncode}):\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# --- comparing results ----------------------------------------------------------------------------------------------


def max_abs_diff(a: Path, b: Path) -> float:
    """The largest absolute difference between two files' tensors of the same names, read one at a time."""
    with TensorFile(a) as left, TensorFile(b) as right:
        if set(left.names) != set(right.names):
            raise ValueError(f"{a.name} and {b.name} hold different tensors")
        worst = 0.0
        for name in left.names:
            x, y = left.read(name), right.read(name)
            if x.shape != y.shape:
                raise ValueError(f"tensor {name!r}: {x.shape} against {y.shape}")
            worst = max(worst, float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)), initial=0.0)))
        return worst


def machine() -> dict[str, Any]:
    cpu = ""
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "")
    except OSError:
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"cpu": cpu, "cpus": os.cpu_count(), "memory_gib": round(memory / 1024**3, 1), "kernel": platform.release(),
            "python": platform.python_version(), "numpy": np.__version__, "loadavg": os.getloadavg()}  # fmt: skip


# --- main -----------------------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, default=25_000_000, help="about how many parameters the model has")
    parser.add_argument("--updates", type=int, default=5, help="participants' updates in the round")
    parser.add_argument("--strategy", action="append", choices=STRATEGIES, help="repeatable; default fedavg, fedadam, median")
    parser.add_argument("--trace", action="store_true", help="also report tracemalloc's peak in each measured process")
    parser.add_argument("--out", type=Path, default=None, help="keep the files and results.json in this directory")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    strategies = list(dict.fromkeys(args.strategy or ["fedavg", "fedadam", "median"]))
    if args.updates < 1:
        parser.error("--updates must be at least 1")

    infos = layout(args.params)
    update_bytes = sum(info.nbytes for info in infos.values())
    largest = max(infos, key=lambda name: infos[name].nbytes)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    directory = args.out if args.out is not None else Path(tempfile.mkdtemp(prefix="fl-aggregation-"))
    results: dict[str, Any] = {
        "command": " ".join(sys.argv), "machine": machine(),
        "model": {"parameters": parameters(infos), "tensors": len(infos), "update_bytes": update_bytes,
                  "largest_tensor": largest, "largest_tensor_bytes": infos[largest].nbytes},
        "updates": args.updates, "runs": [], "diffs": {},
    }  # fmt: skip
    try:
        started = time.perf_counter()
        paths = write_models(directory, infos, args.updates)
        results["write_s"] = time.perf_counter() - started
        weights = [100 * (k + 1) for k in range(args.updates)]
        print(f"model: {parameters(infos):,} parameters in {len(infos)} float32 tensors, {update_bytes / MIB:.1f} MiB an update; "
              f"largest tensor {largest} {list(infos[largest].shape)} ({infos[largest].nbytes / MIB:.1f} MiB); "
              f"{args.updates} updates written in {results['write_s']:.1f} s to {directory}")  # fmt: skip
        common = {"global": str(directory / "global.safetensors"), "updates": [str(p) for p in paths], "weights": weights, "trace": args.trace}
        jobs = []
        for strategy in strategies:
            output = directory / f"{strategy}-stream.safetensors"
            state = directory / f"{strategy}-state.safetensors"
            if strategy == "fedadam":
                first = directory / "fedadam-r1-state.safetensors"
                jobs.append(("fedadam (round 1)", "stream", {"strategy": strategy, "output": str(directory / "fedadam-r1.safetensors"), "state_out": str(first)}))
                jobs.append(("fedadam (round 2)", "stream", {"strategy": strategy, "output": str(output), "state_out": str(state), "state_in": str(first)}))
            else:
                jobs.append((strategy, "stream", {"strategy": strategy, "output": str(output), "state_out": str(state)}))
            if strategy in BASELINES:
                jobs.append((strategy, "numpy", {"strategy": strategy, "output": str(directory / f"{strategy}-numpy.safetensors")}))

        print(f"\n{'strategy':<18} {'path':<6} {'peak RSS growth MiB':>19} {'x update':>8} {'wall s':>7} {'VmHWM growth MiB':>16}"
              + (f" {'traced peak MiB':>15}" if args.trace else ""))  # fmt: skip
        for label, path, job in jobs:
            report = measure({**common, **job, "path": path})
            report.update(strategy=label, path=path, ratio=report["growth_kib"] * 1024 / update_bytes)
            results["runs"].append(report)
            traced = f" {report['traced_peak_kib'] / 1024:>15.1f}" if args.trace else ""
            print(f"{label:<18} {path:<6} {report['growth_kib'] / 1024:>19.1f} {report['ratio']:>8.2f} {report['wall_s']:>7.2f} "
                  f"{report['hwm_growth_kib'] / 1024:>16.1f}{traced}")  # fmt: skip

        agree = True
        for strategy in strategies:
            if strategy in BASELINES:
                diff = max_abs_diff(directory / f"{strategy}-stream.safetensors", directory / f"{strategy}-numpy.safetensors")
                results["diffs"][strategy] = diff
                agree &= diff <= TOLERANCE
                print(f"\n{strategy}: streaming against numpy, max abs diff {diff:.3g} (within {TOLERANCE:g}: {diff <= TOLERANCE})", end="")
        print()
        fedavg = next((r for r in results["runs"] if r["strategy"] == "fedavg" and r["path"] == "stream"), None)
        held = fedavg is None or fedavg["ratio"] <= TARGET
        if fedavg is not None:
            print(f"streaming fedavg peak RSS growth {fedavg['ratio']:.2f}x one update (target <= {TARGET:g}x): {'holds' if held else 'does not hold'}")
        results.update(agree=agree, held=held)
        if args.out is not None:
            (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    finally:
        if args.out is None:
            shutil.rmtree(directory, ignore_errors=True)
    if not agree:
        return 1
    return 0 if held else 3


if __name__ == "__main__":
    sys.exit(main())
