"""Compression of whole-model updates (issue 19): bytes per round and final accuracy for none (fp32), fp16, int8
and topk, on the numpy digits CNN of ``examples/algorithms/numpy_cnn`` (1,370 parameters: a small model, so the files'
headers weigh on the ratios).

What runs, in this one process (no hub, no broker: the figures are bytes and accuracy, which do not depend on the
transport; the hub's path is the same code, and ``tests/integration/test_federated_whole.py`` runs int8 against
fp32 through the real hub):

* ``--sites`` participants, each the example's client (its own ``fit``, 1 epoch a round) on a non-IID shard of
  scikit-learn's digits: the training split's rows whose class is ``k`` modulo the number of sites, plus every fifth
  row (so each site sees mostly a few classes); a held-out 20 % scores the global model;
* per round and compression: each site trains from the global parameters, encodes its model with
  ``interfaces.compression.encode`` (int8 and topk: the delta plus the site's error feedback, kept between rounds),
  the encoded tensors are written as the safetensors file a site uploads (``safetensors.numpy.save``: its bytes are
  the bytes up), the hub side reads each back through ``interfaces.compression.Decoded`` and fuses them with
  FedAvg (``interfaces.aggregation.Strategy.aggregate_stream``, as ``cloud.fl.whole.fuse`` does);
* the same seeds for every compression: only the encoding differs.

Printed: per compression, bytes up per round (all sites), the ratio to fp32, and the held-out accuracy of the last
global model (and the round it was best). Usage::

    python bench/fl_compression.py [--sites 5] [--rounds 10] [--topk-fraction 0.1] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples" / "algorithms" / "numpy_cnn"))

from examples.algorithms.digits import write_digits  # noqa: E402
from interfaces import compression  # noqa: E402
from interfaces.aggregation import DictSource, StreamUpdate, strategy_from_spec  # noqa: E402


def shards(directory: Path, sites: int) -> tuple[list[Path], Path]:
    train, test = write_digits(directory / "all")
    data = np.load(train)
    out = []
    for k in range(sites):
        rows = np.flatnonzero((data["y"] % sites == k) | (np.arange(len(data["y"])) % 5 == 0))
        path = directory / f"shard-{k}.npz"
        np.savez(path, x=data["x"][rows], y=data["y"][rows])
        out.append(path)
    return out, test


def run(kind: str, paths: list[Path], test: Path, rounds: int, fraction: float) -> dict[str, Any]:
    from safetensors.numpy import load, save

    from numpy_cnn.client import NumpyCNN

    config = {"seed": 0, "epochs": 1, "learning_rate": 0.05, "batch_size": 32}
    clients = [NumpyCNN({**config, "seed": k}, {"train": p, "test": test}) for k, p in enumerate(paths)]
    scorer = NumpyCNN(config, {"train": test, "test": test})
    held = np.load(test)
    global_ = NumpyCNN(config, {"train": paths[0]}).initial_parameters()
    residuals: list[dict[str, np.ndarray] | None] = [None] * len(clients)
    strategy = strategy_from_spec("fedavg")
    bytes_up, accuracy = [], []
    for round_ in range(1, rounds + 1):
        updates, moved = [], 0
        for k, client in enumerate(clients):
            local, n, _ = client.fit(global_, {"round": round_})
            encoded, feedback = compression.encode(kind, local, global_, residuals[k], fraction)
            if kind in ("int8", "topk"):
                residuals[k] = feedback
            data = save(encoded, metadata={compression.METADATA_KEY: kind})
            moved += len(data)
            source = DictSource(load(data))
            updates.append(StreamUpdate(source if kind == "none" else compression.Decoded(kind, source, DictSource(global_)), n, {}, f"site-{k}"))
        fused: dict[str, np.ndarray] = {}
        strategy.aggregate_stream(DictSource(global_), updates, lambda name, array: fused.__setitem__(name, np.asarray(array, np.float32)), None, lambda name, array: None)
        global_ = fused
        bytes_up.append(moved)
        accuracy.append(float((scorer.predict(global_, held["x"]).argmax(axis=1) == held["y"]).mean()))
    return {"kind": kind, "parameters": int(sum(a.size for a in global_.values())), "bytes_up_per_round": int(np.mean(bytes_up)), "final_accuracy": accuracy[-1], "best_accuracy": max(accuracy),
            "best_round": int(np.argmax(accuracy)) + 1, "accuracy": accuracy}  # fmt: skip


def main() -> int:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sites", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--topk-fraction", type=float, default=0.1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fl-compression-") as scratch:
        paths, test = shards(Path(scratch), args.sites)
        results = [run(kind, paths, test, args.rounds, args.topk_fraction) for kind in compression.COMPRESSIONS]
    base = results[0]["bytes_up_per_round"]
    print(f"{args.sites} sites, {args.rounds} rounds, FedAvg, numpy digits CNN ({results[0]['parameters']:,} parameters), topk fraction {args.topk_fraction:g}")
    print(f"{'compression':<12} {'bytes up/round':>15} {'vs fp32':>8} {'final acc':>10} {'best (round)':>13}")
    for r in results:
        print(f"{r['kind']:<12} {r['bytes_up_per_round']:>15,} {r['bytes_up_per_round'] / base:>8.3f} {r['final_accuracy']:>10.4f} {r['best_accuracy']:>8.4f} ({r['best_round']})")
    if args.out:
        args.out.write_text(json.dumps({"machine": platform.processor() or platform.machine(), "sites": args.sites, "rounds": args.rounds,
                                        "topk_fraction": args.topk_fraction, "results": results}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
