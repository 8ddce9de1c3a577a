"""Split inference: the planner's cut against device-only, edge-only and every cut, measured end to end on an
emulated device and link (DESIGN §5, issue 6). No broker, hub or network: one process, two threads.

For each model, link speed and activation encoding (float32, int8), every option is measured end to end:
``<device>`` (the whole model on the device), ``<edge>`` (the raw input crosses the link, the whole model runs on
the edge) and every candidate cut (``cloud.ml.partition.candidate_cuts``: the head on the device, the activation
frame of ``device.tensors`` through the link, the tail on the edge, the answer back). Then the planner
(``device.split.planner.choose``) picks a cut from what a device would know: the parts' profiled latencies
(``cloud.ml.partition.profile``, the heads' times multiplied by the slowdown, with the device's frame encoding
and answer decoding; the frame's and the answer's bytes) and the link as ``probe_link`` measured it, as
``device/tasks/split/head.py`` calibrates them. The result: the planner's cut and its measured latency, the
brute-force best, the regret (chosen / best) and the speed-ups edge-only / chosen and device-only / chosen
(Neurosurgeon, ASPLOS 2017, reports 3.1x on average over cloud-only). For comparison (``frames_only``): the cut
of a cost model that counts neither the answer's bytes nor the codec (the planner's first version).

Emulation (adapted from ``tests/ml/test_split_link.py``, copied rather than imported):

* *the link* is a loopback TCP connection whose sender is paced to the link rate: the byte k of a message leaves
  no earlier than k * 8 / rate after its first (segments of 1,448 bytes, no burst allowance: a 300-byte frame
  takes 2.4 ms at 1 Mbit/s, as on a real link of that rate), plus the round trip's propagation as two one-way
  delays of ``--rtt-ms`` / 2 (before the request, before the answer, so the edge's compute is not hidden behind
  the round trip). The answer (the model's outputs as a float32 frame) is paced too.
* *the device* is this CPU made ``--slowdown`` times slower: after doing its part it sleeps ``slowdown - 1`` times
  the part's profiled time (busy-waiting the last millisecond, so sub-millisecond sleeps are accurate). Its part
  is the head and, unless ``--fast-codec``, encoding the frame (int8 quantisation included) and decoding the
  answer; the planner, like the product's calibration (``device/tasks/split/head.py``), knows only the head's time.
* *the edge* is a thread of this process on the same CPU, one intra-op thread (as the device's sessions).

Each (model, speed, encoding) measures the options in rounds, a shuffled order each round (``--warmup`` rounds
unrecorded, then ``--runs``). A cut (never ``<device>`` or ``<edge>``) whose median after ``--min-runs`` is over
``--prune`` (3) times the best median so far and over ``--prune-min-ms`` (20 ms) runs no more: it cannot be the
best, and a 262 KB activation takes 2 s a request at 1 Mbit/s. Medians; the runs each option got are recorded.

    .venv/bin/python bench/split.py [--batch 1] [--slowdown 20] [--rtt-ms 2] [--runs 51] [--models digits-mlp,digits-cnn] [--out bench/results/split.json]

Exit status 0 when every choice is within ``--target-regret`` (1.10) of the best measured option, 3 when one is
not, 1 on failure.
"""

from __future__ import annotations

import argparse
import atexit
import datetime as dt
import json
import os
import platform
import random
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

import numpy as np
import onnx

from cloud.ml.partition import profile, split_model
from device.runtime import open_model
from device.split.planner import DEVICE_ONLY, EDGE_ONLY, CutCost, Link, LinkEstimator, choose, probe_link
from device.tensors import decode_activation, encode_activation

MODELS = ROOT / "tests" / "fixtures" / "models"
SPEEDS_MBIT = (1, 5, 20, 100, 1000)
NEUROSURGEON_MEAN = 3.1  # Kang et al., "Neurosurgeon", ASPLOS 2017: mean latency improvement over cloud-only
INITIAL_LINK = Link(10e6, 5.0)  # the device's estimate before it measured anything (device/tasks/split/head.py)
MAX_PROBE_BYTES = 1 << 20  # as device/tasks/split/head.py
SEGMENT = 1448  # bytes of one TCP segment on a 1500-byte MTU: the link's pacing quantum


def precise_sleep(seconds: float) -> None:
    """Sleep ``seconds``: ``time.sleep`` until the last millisecond, then a loop that yields the GIL."""
    deadline = time.perf_counter() + seconds
    if seconds > 0.0015:
        time.sleep(seconds - 0.001)
    while time.perf_counter() < deadline:
        time.sleep(0)


class PacedLink:
    """A loopback TCP connection paced to ``rate_bps`` in both directions with ``rtt_ms`` of propagation per round
    trip (half before the request, half before the answer). The far end runs ``serve(frame) -> frame`` (the
    edge) on a thread of its own. Messages are length-prefixed (4 bytes, counted on the wire)."""

    def __init__(self, rate_bps: float, rtt_ms: float, serve: Callable[[bytes], bytes]) -> None:
        self.rate_bps, self.one_way_s, self.serve = rate_bps, rtt_ms / 2000, serve
        listener = socket.create_server(("127.0.0.1", 0))
        self.client = socket.create_connection(listener.getsockname())
        self.server, _ = listener.accept()
        listener.close()
        for s in (self.client, self.server):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.client.settimeout(120)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._edge, daemon=True, name="edge")
        self._thread.start()

    def _send(self, sock: socket.socket, data: bytes) -> None:
        """Byte k leaves no earlier than ``(k + 1) * 8 / rate`` after the first: whole segments (or the rest)."""
        payload = memoryview(struct.pack("!I", len(data)) + data)
        total, sent, started = len(payload), 0, time.perf_counter()
        bytes_per_s = self.rate_bps / 8
        while sent < total:
            quantum = min(SEGMENT, total - sent)
            due = started + (sent + quantum) / bytes_per_s
            wait = due - time.perf_counter()
            if wait > 0:
                precise_sleep(wait)
            allowed = int((time.perf_counter() - started) * bytes_per_s) - sent
            sent += sock.send(payload[sent : sent + max(quantum, min(allowed, 65536), 1)])

    @staticmethod
    def _recv(sock: socket.socket) -> bytes:
        def exactly(n: int) -> bytes:
            buf = bytearray()
            while len(buf) < n:
                chunk = sock.recv(n - len(buf))
                if not chunk:
                    raise ConnectionError("closed")
                buf += chunk
            return bytes(buf)

        (size,) = struct.unpack("!I", exactly(4))
        return exactly(size)

    def _edge(self) -> None:
        while True:
            try:
                frame = self._recv(self.server)
            except (ConnectionError, OSError):
                return
            try:
                answer = self.serve(frame)
            except Exception as exc:  # noqa: BLE001 - reported to the caller by an empty answer
                self.error, answer = exc, b""
            precise_sleep(self.one_way_s)  # the answer's propagation
            try:
                self._send(self.server, answer)
            except OSError:
                return

    def call(self, frame: bytes) -> bytes:
        precise_sleep(self.one_way_s)  # the request's propagation (the same sum as after its last byte)
        self._send(self.client, frame)
        answer = self._recv(self.client)
        if self.error is not None:
            raise RuntimeError(f"the edge failed: {self.error!r}") from self.error
        return answer

    def close(self) -> None:
        for s in (self.client, self.server):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        self._thread.join(timeout=5)


def _median_ms(fn: Callable[[], Any], runs: int = 50) -> float:
    fn()
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples)


@dataclass
class Option:
    """One way to serve a request. ``head`` runs on the device (``None``: nothing does), ``tail`` on the edge
    (``None``: device only). ``head_ms``/``tail_ms`` profiled on this CPU; ``frame_bytes``, ``codec_ms`` per
    encoding (the device's encoding of the frame plus its decoding of the answer, on this CPU)."""

    name: str
    head: Any | None
    tail: Any | None
    head_ms: float
    tail_ms: float
    activation_shape: tuple[int, ...]
    frame_bytes: dict[str, int] = field(default_factory=dict)
    codec_ms: dict[str, float] = field(default_factory=dict)

    def head_out(self, x: np.ndarray) -> np.ndarray:
        if self.head is None:
            return x
        return next(iter(self.head.run({self.head.inputs[0].name: x}).values()))


def build_options(path: Path, x: np.ndarray, profile_runs: int, profile_repeats: int, work: Path) -> tuple[list[Option], list[dict[str, Any]], int]:  # fmt: skip
    """Device-only, edge-only and one option per candidate cut, each with its parts' profiled latencies; the
    profile's rows; the bytes of the answer's frame. Each part's time is the least of ``profile_repeats``
    profiles' medians (other work on the machine only ever adds time)."""
    model = onnx.load(str(path))
    repeats = [profile(model, runs=profile_runs, feeds={"x": x}, threads=1) for _ in range(max(1, profile_repeats))]
    rows = [replace(r, head_ms=min(p[i].head_ms for p in repeats), tail_ms=min(p[i].tail_ms for p in repeats)) for i, r in enumerate(repeats[0])]  # fmt: skip
    whole = rows[0]
    options = [
        Option(DEVICE_ONLY, open_model(path, threads=1), None, whole.head_ms, 0.0, ()),
        Option(EDGE_ONLY, None, open_model(path, threads=1), 0.0, whole.head_ms, tuple(x.shape)),
    ]
    for row in rows[1:]:
        assert row.tensor is not None
        head, tail = split_model(model, row.tensor)
        onnx.save(head, str(work / f"{path.stem}-{row.tensor}-head.onnx"))
        onnx.save(tail, str(work / f"{path.stem}-{row.tensor}-tail.onnx"))
        options.append(Option(row.tensor, open_model(work / f"{path.stem}-{row.tensor}-head.onnx", threads=1),
                              open_model(work / f"{path.stem}-{row.tensor}-tail.onnx", threads=1), row.head_ms, row.tail_ms,
                              row.activation_shape))  # fmt: skip
    answer = encode_activation(next(iter(options[0].head.run({"x": x}).values())))[0]  # type: ignore[union-attr]
    decode_ms = _median_ms(lambda: decode_activation(answer))
    for option in options[1:]:
        activation = option.head_out(x)
        for encoding, quantize in (("float32", False), ("int8", True)):
            option.frame_bytes[encoding] = len(encode_activation(activation, quantize)[0])
            option.codec_ms[encoding] = _median_ms(lambda a=activation, q=quantize: encode_activation(a, q)) + decode_ms
    return options, [r.as_dict() for r in rows], len(answer)


def costs_for(options: list[Option], encoding: str, slowdown: float, answer_bytes: int | None = None, codec_factor: float = 0.0) -> list[CutCost]:  # fmt: skip
    """What the planner knows: the device's parts at ``slowdown`` times their profiled time, the edge's parts
    as profiled, the frame's bytes, and (as ``device/tasks/split/head.py`` calibrates them) ``answer_bytes`` crossing
    back and the device's codec time times ``codec_factor`` in its part. Without those two: the cost model of
    frames only, kept for comparison."""
    costs = []
    for o in options:
        if o.name == DEVICE_ONLY:
            costs.append(CutCost(DEVICE_ONLY, o.head_ms * slowdown, 0.0, 0))
        else:
            costs.append(CutCost(o.name, o.head_ms * slowdown + o.codec_ms[encoding] * codec_factor, o.tail_ms, o.frame_bytes[encoding], answer_bytes or 0))
    return costs


class Bench:
    def __init__(self, options: list[Option], x: np.ndarray, slowdown: float, fast_codec: bool) -> None:
        self.options, self.x, self.slowdown, self.fast_codec = options, x, slowdown, fast_codec
        self.by_index = {i: o for i, o in enumerate(options)}

    def edge_serve(self, frame: bytes) -> bytes:
        """The edge: the option's index (1 byte), then the activation frame; answers with the outputs' frame."""
        option = self.by_index[frame[0]]
        assert option.tail is not None
        activation = decode_activation(frame[1:])
        out = option.tail.run({option.tail.inputs[0].name: activation})
        return encode_activation(next(iter(out.values())))[0]

    def request(self, index: int, link: PacedLink, quantize: bool, encoding: str) -> float:
        """One request through option ``index``, end to end, in ms."""
        option = self.options[index]
        started = time.perf_counter()
        if option.tail is None:
            option.head_out(self.x)
            precise_sleep(option.head_ms * (self.slowdown - 1) / 1000)
        else:
            activation = option.head_out(self.x)
            frame = encode_activation(activation, quantize)[0]
            device_ms = option.head_ms + (0.0 if self.fast_codec else option.codec_ms[encoding])
            precise_sleep(device_ms * (self.slowdown - 1) / 1000)  # the codec's share before the answer: the same sum
            decode_activation(link.call(bytes([index]) + frame))
        return (time.perf_counter() - started) * 1000

    @staticmethod
    def _slow(samples: list[float], best: float, prune: float, prune_min_ms: float) -> bool:
        median = statistics.median(samples)
        return median > prune * best and median > prune_min_ms

    def measure(self, link: PacedLink, encoding: str, runs: int, warmup: int, min_runs: int, prune: float, prune_min_ms: float,
                seed: int) -> dict[str, list[float]]:  # fmt: skip
        quantize = encoding == "int8"
        samples: dict[int, list[float]] = {i: [] for i in range(len(self.options))}
        active = list(samples)
        shuffle = random.Random(seed).shuffle
        for round_ in range(warmup + runs):
            shuffle(active)
            for i in active:
                ms = self.request(i, link, quantize, encoding)
                if round_ >= warmup:
                    samples[i].append(ms)
            if round_ - warmup + 1 >= min_runs and prune > 0:
                best = min(statistics.median(v) for v in samples.values() if v)
                active = [i for i in active if self.options[i].name in (DEVICE_ONLY, EDGE_ONLY) or not self._slow(samples[i], best, prune, prune_min_ms)]  # fmt: skip
        return {self.options[i].name: v for i, v in samples.items()}


def probe(rate_bps: float, rtt_ms: float, probes: int) -> tuple[Link, list[dict[str, float]]]:
    """The device's estimate of the link after ``probes`` calls of ``probe_link`` (the product's estimator and
    initial guess; it probes again every ``probe_interval_s`` when nothing crossed)."""
    estimator = LinkEstimator(INITIAL_LINK)
    link = PacedLink(rate_bps, rtt_ms, lambda frame: b"")
    history = []
    try:
        for _ in range(probes):
            est = probe_link(link.call, estimator, max_bytes=MAX_PROBE_BYTES)
            history.append({"mbit": est.bandwidth_bps / 1e6, "rtt_ms": est.rtt_ms})
    finally:
        link.close()
    return estimator.link, history


def machine() -> dict[str, Any]:
    import onnxruntime

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")), platform.processor())  # fmt: skip
    info: dict[str, Any] = {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__,
                            "onnxruntime": onnxruntime.__version__, "platform": platform.platform(),
                            "load_average_at_start": [round(v, 2) for v in os.getloadavg()]}  # fmt: skip
    try:
        git = ["git", "-C", str(ROOT)]
        info["commit"] = subprocess.run([*git, "rev-parse", "--short", "HEAD"], check=False, capture_output=True, text=True, timeout=10).stdout.strip()  # fmt: skip
        used = ["device/split", "device/tensors.py", "device/runtime.py", "cloud/ml/partition.py", "bench/split.py"]
        info["uncommitted"] = subprocess.run([*git, "status", "--porcelain", "--", *used], check=False, capture_output=True, text=True, timeout=10).stdout.split("\n")  # fmt: skip
        info["uncommitted"] = [line for line in info["uncommitted"] if line.strip()]
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def _gmean(values: list[float]) -> float:
    return statistics.geometric_mean(values) if values else float("nan")


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Means of the speed-ups and regrets: over everything, per encoding, per model and encoding, per speed."""

    def block(selected: list[dict[str, Any]]) -> dict[str, Any]:
        vs_edge = [r["speedup_vs_edge"] for r in selected]
        vs_device = [r["speedup_vs_device"] for r in selected]
        regret = [r["regret"] for r in selected]
        return {"n": len(selected), "mean_speedup_vs_edge": _mean(vs_edge), "gmean_speedup_vs_edge": _gmean(vs_edge),
                "mean_speedup_vs_device": _mean(vs_device), "gmean_speedup_vs_device": _gmean(vs_device),
                "mean_regret": _mean(regret), "worst_regret": max(regret, default=float("nan")),
                "best_is_chosen": sum(r["chosen"] == r["best"] for r in selected),
                "frames_only": {"mean_speedup_vs_edge": _mean([r["frames_only"]["speedup_vs_edge"] for r in selected]),
                                             "mean_speedup_vs_device": _mean([r["frames_only"]["speedup_vs_device"] for r in selected]),
                                             "worst_regret": max((r["frames_only"]["regret"] for r in selected), default=float("nan")),
                                             "best_is_chosen": sum(r["frames_only"]["chosen"] == r["best"] for r in selected)}}  # fmt: skip

    out: dict[str, Any] = {"all": block(rows)}
    for encoding in sorted({r["encoding"] for r in rows}):
        of = [r for r in rows if r["encoding"] == encoding]
        out[encoding] = block(of)
        for model in sorted({r["model"] for r in of}):
            out[f"{model} {encoding}"] = block([r for r in of if r["model"] == model])
    for mbit in sorted({r["mbit"] for r in rows}):
        out[f"{mbit} Mbit/s"] = block([r for r in rows if r["mbit"] == mbit])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="digits-mlp,digits-cnn", help="comma-separated names under tests/fixtures/models (.onnx), or paths")  # fmt: skip
    parser.add_argument("--speeds", default=",".join(str(s) for s in SPEEDS_MBIT), help="link rates, Mbit/s, comma-separated")  # fmt: skip
    parser.add_argument("--encodings", default="float32,int8", help="activation encodings: float32, int8 or both")
    parser.add_argument("--batch", type=int, default=1, help="rows per request (1: single requests)")
    parser.add_argument("--slowdown", type=float, default=20.0, help="the emulated device is this many times slower than the edge")  # fmt: skip
    parser.add_argument("--rtt-ms", type=float, default=2.0, help="the link's round trip (propagation)")
    parser.add_argument("--runs", type=int, default=51, help="recorded requests per option (median)")
    parser.add_argument("--warmup", type=int, default=2, help="unrecorded rounds first")
    parser.add_argument("--min-runs", type=int, default=3, help="runs before an option can be pruned")
    parser.add_argument("--prune", type=float, default=3.0, help="stop measuring a cut whose median is over this times the best's and over --prune-min-ms (0: never)")  # fmt: skip
    parser.add_argument("--prune-min-ms", type=float, default=20.0, help="cuts faster than this are never pruned")
    parser.add_argument("--probes", type=int, default=5, help="probe_link calls into the device's link estimator per speed")  # fmt: skip
    parser.add_argument("--profile-runs", type=int, default=100, help="runs of each part in one profile (median)")
    parser.add_argument("--profile-repeats", type=int, default=3, help="profiles per model (each part: least median)")
    parser.add_argument("--fast-codec", action="store_true", help="do not slow the device's frame encoding and answer decoding (as tests/ml/test_split_link.py)")  # fmt: skip
    parser.add_argument("--target-regret", type=float, default=1.10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "split.json")
    args = parser.parse_args()
    speeds = [float(s) for s in args.speeds.split(",") if s.strip()]
    encodings = [e.strip() for e in args.encodings.split(",") if e.strip()]
    if not set(encodings) <= {"float32", "int8"} or args.batch < 1 or args.slowdown < 1 or args.runs < 1:
        parser.error("encodings float32/int8, batch >= 1, slowdown >= 1, runs >= 1")

    started, info = time.time(), machine()
    rows: list[dict[str, Any]] = []
    profiles: dict[str, Any] = {}
    links: dict[str, Any] = {}
    work = Path(tempfile.mkdtemp(prefix="aisynergy-bench-split-"))
    atexit.register(shutil.rmtree, work, True)  # the heads and tails written for open_model
    header = (f"{'model':<11} {'enc':<7} {'Mbit/s':>6} {'device ms':>9} {'edge ms':>8} {'planner: cut':>14} {'ms':>8} "
              f"{'best: cut':>14} {'ms':>8} {'regret':>6} {'x edge':>7} {'x device':>8} {'frames-only':>14}")  # fmt: skip
    print(f"batch {args.batch}, slowdown {args.slowdown:g}, rtt {args.rtt_ms:g} ms, {args.runs} runs; link estimate after {args.probes} probes")  # fmt: skip
    print(header)
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        path = Path(name) if name.endswith(".onnx") else MODELS / f"{name}.onnx"
        model_name = path.stem
        info_in = onnx.load(str(path)).graph.input[0]
        dims = [d.dim_value for d in info_in.type.tensor_type.shape.dim][1:]
        x = np.random.default_rng(args.seed).standard_normal((args.batch, *dims)).astype(np.float32)
        options, profiled, answer_bytes = build_options(path, x, args.profile_runs, args.profile_repeats, work)
        profiles[model_name] = {"rows": profiled, "answer_bytes": answer_bytes, "options": {o.name: {"head_ms": o.head_ms, "tail_ms": o.tail_ms, "activation_shape": list(o.activation_shape),
                                                                        "frame_bytes": o.frame_bytes, "device_codec_ms": o.codec_ms} for o in options}}  # fmt: skip
        bench = Bench(options, x, args.slowdown, args.fast_codec)
        for mbit in speeds:
            key = f"{mbit:g}"
            if key not in links:  # the link does not depend on the model: probe each speed once
                estimate, history = probe(mbit * 1e6, args.rtt_ms, args.probes)
                links[key] = {"mbit": mbit, "estimate_mbit": estimate.bandwidth_bps / 1e6, "estimate_rtt_ms": estimate.rtt_ms, "history": history}  # fmt: skip
            estimate = Link(links[key]["estimate_mbit"] * 1e6, links[key]["estimate_rtt_ms"])
            link = PacedLink(mbit * 1e6, args.rtt_ms, bench.edge_serve)
            try:
                for encoding in encodings:
                    samples = bench.measure(link, encoding, args.runs, args.warmup, args.min_runs, args.prune, args.prune_min_ms, args.seed)  # fmt: skip
                    measured = {k: statistics.median(v) for k, v in samples.items()}
                    # the planner as device/tasks/split/head.py calibrates it: frame and answer bytes, the device's codec in its share
                    plan = choose(costs_for(options, encoding, args.slowdown, answer_bytes, 1.0 if args.fast_codec else args.slowdown), estimate)  # fmt: skip
                    best = min(measured, key=lambda k: measured[k])
                    chosen_ms = measured[plan.cut]
                    # for comparison: the cost model before it counted the answer and the codec (frames only)
                    full = choose(costs_for(options, encoding, args.slowdown), estimate)
                    row = {
                        "model": model_name, "batch": args.batch, "encoding": encoding, "mbit": mbit,
                        "device_ms": measured[DEVICE_ONLY], "edge_ms": measured[EDGE_ONLY],
                        "chosen": plan.cut, "chosen_ms": chosen_ms, "chosen_estimate_ms": plan.estimate_ms,
                        "best": best, "best_ms": measured[best], "regret": chosen_ms / measured[best],
                        "speedup_vs_edge": measured[EDGE_ONLY] / chosen_ms, "speedup_vs_device": measured[DEVICE_ONLY] / chosen_ms,
                        "frames_only": {"chosen": full.cut, "chosen_ms": measured[full.cut], "regret": measured[full.cut] / measured[best],
                                                     "speedup_vs_edge": measured[EDGE_ONLY] / measured[full.cut],
                                                     "speedup_vs_device": measured[DEVICE_ONLY] / measured[full.cut]},
                        "link_estimate": {"mbit": estimate.bandwidth_bps / 1e6, "rtt_ms": estimate.rtt_ms},
                        "options": {k: {"measured_ms": measured[k], "estimate_ms": dict(plan.ranking)[k], "runs": len(samples[k]),
                                        "p10_ms": float(np.percentile(samples[k], 10)), "p90_ms": float(np.percentile(samples[k], 90))} for k in measured},
                    }  # fmt: skip
                    rows.append(row)
                    print(f"{model_name:<11} {encoding:<7} {mbit:>6g} {row['device_ms']:9.3f} {row['edge_ms']:8.3f} {plan.cut:>14} {chosen_ms:8.3f} "
                          f"{best:>14} {row['best_ms']:8.3f} {row['regret']:6.3f} {row['speedup_vs_edge']:7.2f} {row['speedup_vs_device']:8.2f} {full.cut:>14}", flush=True)  # fmt: skip
            finally:
                link.close()
    summary = summarise(rows)
    print()
    for key, s in summary.items():
        print(f"{key:<22} mean x edge {s['mean_speedup_vs_edge']:6.2f} (geo {s['gmean_speedup_vs_edge']:5.2f})  mean x device {s['mean_speedup_vs_device']:5.2f}  "
              f"regret mean {s['mean_regret']:.3f} worst {s['worst_regret']:.3f}  best chosen {s['best_is_chosen']}/{s['n']}")  # fmt: skip
    print(f"\nNeurosurgeon reports {NEUROSURGEON_MEAN}x over cloud-only on average; here: {summary['all']['mean_speedup_vs_edge']:.2f}x over edge-only "
          f"(every model, speed and encoding at batch {args.batch})")  # fmt: skip
    what_if = summary["all"]["frames_only"]
    print(f"for comparison, a planner counting frames only: worst regret {what_if['worst_regret']:.3f}, "
          f"best chosen {what_if['best_is_chosen']}/{summary['all']['n']}, mean x edge {what_if['mean_speedup_vs_edge']:.2f}")  # fmt: skip
    held = summary["all"]["worst_regret"] <= args.target_regret
    print(f"worst regret {summary['all']['worst_regret']:.3f} (target <= {args.target_regret}): {'holds' if held else 'does not hold'}")  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "bench": "split", "started": dt.datetime.fromtimestamp(started, dt.UTC).isoformat(), "seconds": round(time.time() - started, 1),
            "command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": {**info, "load_average_at_end": [round(v, 2) for v in os.getloadavg()]},
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "neurosurgeon_mean_speedup": NEUROSURGEON_MEAN, "links": links, "profiles": profiles, "rows": rows, "summary": summary, "held": held,
        }, indent=2) + "\n")  # fmt: skip
        print(f"wrote {args.out}")
    return 0 if held else 3


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(1)
