"""Data and a cloud-trained model for the DP incremental-training tests (DESIGN §5).

scikit-learn's digits (shipped with it, nothing downloaded), pixel / 16, in a fixed shuffle: the first
``CENTRAL`` images train the classifier "in the cloud"; the rest are a device's own data, seen through a
camera mounted one pixel off (every image shifted one pixel right and down). The cloud model scores about
14 % on them; fine-tuning its last layer on the device (DP-SGD, ε of a few) brings that to 60-70 %.

The classifier is ``cloud.ml.train``'s digits MLP (64 -> 64 -> 32 -> 10 logits) when that module is there;
otherwise a stand-in of the same shape trained here.
"""

from __future__ import annotations

import io
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

CENTRAL = 900
SEED = 0


@dataclass(frozen=True)
class Digits:
    x_cloud: np.ndarray
    y_cloud: np.ndarray
    x_device: np.ndarray
    """the device's images, shifted"""
    y_device: np.ndarray


def shift(x: np.ndarray) -> np.ndarray:
    """Each 8x8 image moved one pixel right and one down (wrapping round)."""
    images = np.roll(np.roll(x.reshape(-1, 8, 8), 1, axis=2), 1, axis=1)
    return np.ascontiguousarray(images.reshape(-1, 64), dtype=np.float32)


@lru_cache(maxsize=1)
def digits() -> Digits:
    from sklearn.datasets import load_digits

    data = load_digits()
    x, y = (data.data / 16.0).astype(np.float32), data.target.astype(np.int64)
    order = np.random.default_rng(SEED).permutation(len(x))
    x, y = x[order], y[order]
    return Digits(x[:CENTRAL], y[:CENTRAL], shift(x[CENTRAL:]), y[CENTRAL:])


@lru_cache(maxsize=1)
def cloud_model() -> bytes:
    """The classifier trained on the cloud's images, as ONNX bytes (input ``x`` [N, 64], output ``logits``)."""
    d = digits()
    try:
        from cloud.ml.train import DigitsSplit, export_onnx, train
    except ImportError:
        return _stand_in(d)
    trained = train("mlp", DigitsSplit(d.x_cloud, d.y_cloud, d.x_device, d.y_device), epochs=40)
    with tempfile.TemporaryDirectory() as tmp:
        return export_onnx(trained.module, "mlp", Path(tmp) / "digits.onnx").read_bytes()


def _stand_in(d: Digits) -> bytes:
    import torch
    from torch import nn

    torch.manual_seed(SEED)
    module = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    optimiser = torch.optim.Adam(module.parameters(), lr=3e-3)
    x, y = torch.from_numpy(d.x_cloud), torch.from_numpy(d.y_cloud)
    order = torch.Generator().manual_seed(SEED)
    for _ in range(40):
        for batch in torch.randperm(len(x), generator=order).split(64):
            optimiser.zero_grad()
            nn.functional.cross_entropy(module(x[batch]), y[batch]).backward()
            optimiser.step()
    module.eval()
    buf = io.BytesIO()
    torch.onnx.export(module, (torch.zeros(2, 64),), buf, input_names=["x"], output_names=["logits"], dynamic_axes={"x": {0: "batch"}}, dynamo=False)
    return buf.getvalue()


def accuracy(model: bytes | Path, x: np.ndarray, y: np.ndarray) -> float:
    """Top-1 accuracy of an ONNX classifier in ONNX Runtime."""
    import onnxruntime as ort

    session = ort.InferenceSession(model if isinstance(model, bytes) else str(model), providers=["CPUExecutionProvider"])
    logits = session.run(None, {session.get_inputs()[0].name: x})[0]
    return float((logits.argmax(axis=1) == y).mean())
