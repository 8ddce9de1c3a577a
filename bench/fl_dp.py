"""Client-level DP-FedAvg on whole models (issue 19): held-out accuracy at a given ε against the same rounds without
privacy and against centralised training, on the numpy digits CNN of ``examples/algorithms/numpy_cnn``.

What runs, in this one process (the figures are accuracies; the hub runs the same code, ``interfaces.dpfedavg``,
and ``tests/integration/test_federated_whole.py`` runs DP-FedAvg through the real hub and devices):

* ``--sites`` participants, each the example's client (1 epoch a round) on a non-IID shard of scikit-learn's digits
  (the training rows whose class is ``k`` modulo the sites, plus every fifth row); a held-out 20 % scores;
* *centralised*: one client on the whole training split, ``--rounds`` epochs;
* *federated*: FedAvg over the sites, ``--rounds`` rounds, no privacy;
* *DP-FedAvg*: the same rounds, each site's delta clipped to C (``interfaces.dpfedavg.clip``), the hub's
  ``NoisedMean`` (noise z·C on the sum, divided by the sites); z is the smallest noise multiplier whose ``--rounds``
  Gaussian mechanisms (RDP, dp-accounting, the hub's accountant) stay within ``--epsilon`` at ``--delta``; C is the
  median norm of the sites' first-round deltas unless ``--clip`` says.

Usage::

    python bench/fl_dp.py [--sites 5] [--rounds 10] [--epsilon 8] [--delta 1e-5] [--clip C] [--seeds 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples" / "algorithms" / "numpy_cnn"))
sys.path.insert(0, str(ROOT / "bench"))

from fl_compression import shards  # noqa: E402
from interfaces.aggregation import DictSource  # noqa: E402
from interfaces.dpfedavg import NoisedMean, clip, delta_norm  # noqa: E402

CONFIG = {"seed": 0, "epochs": 1, "learning_rate": 0.05, "batch_size": 32}


def noise_for(epsilon: float, delta: float, rounds: int) -> float:
    """The smallest z (to 1e-3) whose ``rounds`` Gaussian mechanisms spend at most ``epsilon`` at ``delta``."""
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    def spent(z: float) -> float:
        accountant = RdpAccountant()
        accountant.compose(dp_accounting.GaussianDpEvent(z), rounds)
        return float(accountant.get_epsilon(delta))

    low, high = 0.01, 100.0
    while high - low > 1e-3:
        mid = (low + high) / 2
        low, high = (mid, high) if spent(mid) > epsilon else (low, mid)
    return high


def score(parameters: dict[str, np.ndarray], test: Path) -> float:
    from numpy_cnn.client import NumpyCNN

    held = np.load(test)
    return float((NumpyCNN(CONFIG, {"train": test}).predict(parameters, held["x"]).argmax(axis=1) == held["y"]).mean())


def federated(paths: list[Path], test: Path, rounds: int, seed: int, dp: tuple[float, float] | None) -> tuple[float, float]:
    """Final accuracy, and the clip norm used (DP: C; else the median first-round norm)."""
    from numpy_cnn.client import NumpyCNN

    clients = [NumpyCNN({**CONFIG, "seed": seed * 100 + k}, {"train": p}) for k, p in enumerate(paths)]
    global_ = NumpyCNN({**CONFIG, "seed": seed}, {"train": paths[0]}).initial_parameters()
    rng = np.random.default_rng(seed)
    clip_norm = dp[1] if dp else 0.0
    for round_ in range(1, rounds + 1):
        locals_ = [client.fit(global_, {"round": round_})[0] for client in clients]
        if dp is None:
            global_ = {n: np.mean([w[n] for w in locals_], axis=0).astype(np.float32) for n in global_}
            continue
        if clip_norm <= 0:  # the median norm of the first round's deltas
            clip_norm = float(np.median([delta_norm(DictSource(w), DictSource(global_)) for w in locals_]))
        clipped = [clip(w, global_, clip_norm)[0] for w in locals_]
        mean = NoisedMean(DictSource(global_), [DictSource(w) for w in clipped], clip_norm, dp[0], rng)
        global_ = {n: mean.read(n) for n in global_}
    return score(global_, test), clip_norm


def centralised(train: Path, test: Path, rounds: int, seed: int) -> float:
    from numpy_cnn.client import NumpyCNN

    client = NumpyCNN({**CONFIG, "seed": seed}, {"train": train})
    parameters = client.initial_parameters()
    for round_ in range(1, rounds + 1):
        parameters = client.fit(parameters, {"round": round_})[0]
    return score(parameters, test)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sites", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--clip", type=float, default=0.0)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    z = noise_for(args.epsilon, args.delta, args.rounds)
    rows: dict[str, list[float]] = {"centralised": [], "federated": [], "dp-fedavg": []}
    clips: list[float] = []
    with tempfile.TemporaryDirectory(prefix="fl-dp-") as scratch:
        paths, test = shards(Path(scratch), args.sites)
        train = Path(scratch) / "all" / "train.npz"
        for seed in range(args.seeds):
            rows["centralised"].append(centralised(train, test, args.rounds, seed))
            rows["federated"].append(federated(paths, test, args.rounds, seed, None)[0])
            accuracy, used = federated(paths, test, args.rounds, seed, (z, args.clip))
            rows["dp-fedavg"].append(accuracy)
            clips.append(used)
    print(f"{args.sites} sites, {args.rounds} rounds, numpy digits CNN; DP-FedAvg at epsilon {args.epsilon:g}, delta {args.delta:g}: "
          f"noise multiplier {z:.3f}, clip {np.mean(clips):.4g} (noise std on the mean {z * np.mean(clips) / args.sites:.4g} a coordinate)")
    for name, values in rows.items():
        print(f"{name:<12} accuracy {np.mean(values):.4f} (seeds: {', '.join(f'{v:.4f}' for v in values)})")
    gap: Any = np.mean(rows["centralised"]) - np.mean(rows["dp-fedavg"])
    print(f"dp-fedavg is {100 * gap:.2f} points below centralised")
    return 0


if __name__ == "__main__":
    sys.exit(main())
