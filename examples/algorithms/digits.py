"""The examples' dataset: scikit-learn's shipped digits (8x8 images, 10 classes; nothing is downloaded) as two
``.npz`` files, ``train.npz`` and ``test.npz``, each with ``x`` (float32, N x 1 x 8 x 8, scaled to [0, 1]) and
``y`` (int64). ``python examples/algorithms/digits.py DIR`` writes them."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from sklearn.datasets import load_digits


def write_digits(directory: Path, test_fraction: float = 0.2, seed: int = 0) -> tuple[Path, Path]:
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[:, None, :, :]
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    cut = int(len(x) * (1 - test_fraction))
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    train, test = directory / "train.npz", directory / "test.npz"
    np.savez(train, x=x[order[:cut]], y=y[order[:cut]])
    np.savez(test, x=x[order[cut:]], y=y[order[cut:]])
    return train, test


if __name__ == "__main__":
    print(*write_digits(Path(sys.argv[1] if len(sys.argv) > 1 else ".")))
