"""Train the two small digits models in torch and export them to ONNX (``[train]`` extra; DESIGN §5).

The data is scikit-learn's shipped ``load_digits`` (1,797 8×8 greyscale images of the digits 0–9, nothing is
downloaded), scaled to [0, 1] (pixel / 16) and split 75/25, stratified, with a fixed seed. Two models:

* ``mlp``: input ``x`` float32 ``[N, 64]`` → 64 → 32 → 10 logits (output ``logits``);
* ``cnn``: input ``x`` float32 ``[N, 1, 8, 8]`` → conv 3×3 (8) → relu → conv 3×3 (16) → relu → max-pool 2 →
  conv 4×4 (32, the dense layer over the 16×4×4 map) → relu → mean over the 1×1 map → 10 logits (``logits``).

Seeds are fixed (data split, initialisation, batch order) and torch runs single-threaded while training, so a
run on the same machine and torch release gives the same weights. The ONNX files have one dynamic axis, the
batch (``batch``), opset 18, weights inside the file, and pass ``onnx.checker``.

    python -m cloud.ml.train --kind mlp --out model.onnx [--epochs 40] [--weights model.safetensors]

Only torch is imported at module level: the TFLite conversion (``tests/fixtures/make_digits_models.py``, run in a
separate virtualenv with ``litert-torch``) imports :func:`build` and :func:`load_weights` from here without
scikit-learn or onnx.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    import numpy as np

KINDS = ("mlp", "cnn")
INPUT, OUTPUT = "x", "logits"
OPSET = 18
CLASSES = 10
SEED = 0
TEST_SIZE = 0.25
DEFAULT_EPOCHS = {"mlp": 40, "cnn": 40}


class DigitsMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 64)
        self.fc2 = nn.Linear(64, 32)
        self.head = nn.Linear(32, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class DigitsCNN(nn.Module):
    """conv → relu → conv → relu → max-pool, then a 4×4 convolution over the whole 16×4×4 map (a dense layer
    that keeps the batch axis free: no reshape whose size a converter could bake in, so a TFLite interpreter can
    be resized to any batch), relu, the mean over the remaining 1×1 map, and a dense head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.dense = nn.Conv2d(16, 32, 4)
        self.head = nn.Linear(32, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.conv2(torch.relu(self.conv1(x)))))
        x = torch.relu(self.dense(x)).mean(dim=(2, 3))
        return self.head(x)


def build(kind: str) -> nn.Module:
    """A freshly initialised model of ``kind`` (``mlp`` or ``cnn``); seed torch first for fixed weights."""
    if kind == "mlp":
        return DigitsMLP()
    if kind == "cnn":
        return DigitsCNN()
    raise ValueError(f"unknown model kind {kind!r} (one of {', '.join(KINDS)})")


def input_shape(kind: str, batch: int) -> tuple[int, ...]:
    return (batch, 64) if kind == "mlp" else (batch, 1, 8, 8)


@dataclass(frozen=True)
class DigitsSplit:
    x_train: np.ndarray  # float32 [N, 64], pixel / 16
    y_train: np.ndarray  # int64 [N]
    x_test: np.ndarray
    y_test: np.ndarray

    def inputs(self, kind: str, part: str = "test") -> np.ndarray:
        """The images of ``part`` (``train`` or ``test``) shaped for ``kind``'s input."""
        x = self.x_train if part == "train" else self.x_test
        return x.reshape(input_shape(kind, len(x)))


def load_digits_split(seed: int = SEED, test_size: float = TEST_SIZE) -> DigitsSplit:
    """scikit-learn's digits, scaled to [0, 1], split stratified with ``seed`` (the same split every time)."""
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=test_size, random_state=seed, stratify=y)
    return DigitsSplit(x_train, y_train, x_test, y_test)


@dataclass(frozen=True)
class Trained:
    kind: str
    module: nn.Module
    accuracy: float  # torch, on the test split
    seconds: float


def train(kind: str, data: DigitsSplit | None = None, epochs: int | None = None, seed: int = SEED, batch_size: int = 64, lr: float = 3e-3) -> Trained:
    """Train ``kind`` on the digits training split (Adam, cross-entropy, shuffled mini-batches, fixed seed)."""
    build(kind)  # ValueError for an unknown kind, before anything is loaded
    data = data or load_digits_split()
    epochs = DEFAULT_EPOCHS[kind] if epochs is None else epochs
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # same weights run after run, and fast enough for models this small
    started = time.perf_counter()
    try:
        torch.manual_seed(seed)
        module = build(kind)
        x = torch.from_numpy(data.inputs(kind, "train"))
        y = torch.from_numpy(data.y_train)
        optimiser = torch.optim.Adam(module.parameters(), lr=lr)
        loss_fn = nn.CrossEntropyLoss()
        order = torch.Generator().manual_seed(seed)
        module.train()
        for _ in range(epochs):
            for batch in torch.randperm(len(x), generator=order).split(batch_size):
                optimiser.zero_grad()
                loss_fn(module(x[batch]), y[batch]).backward()
                optimiser.step()
        module.eval()
        with torch.no_grad():
            predicted = module(torch.from_numpy(data.inputs(kind, "test"))).argmax(dim=1).numpy()
    finally:
        torch.set_num_threads(threads)
    return Trained(kind, module, float((predicted == data.y_test).mean()), time.perf_counter() - started)


def export_onnx(module: nn.Module, kind: str, path: Path) -> Path:
    """Export ``module`` to ``path``: input ``x`` with a dynamic batch axis, output ``logits``, opset 18, one
    file (no external data); checked with ``onnx.checker`` (full check)."""
    import onnx

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    module.eval()
    sample = torch.zeros(input_shape(kind, 2))
    with warnings.catch_warnings():  # torch.export's own deprecation noise, nothing about this model
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        torch.onnx.export(
            module, (sample,), str(path), input_names=[INPUT], output_names=[OUTPUT], opset_version=OPSET,
            dynamic_shapes={"x": {0: torch.export.Dim("batch")}}, dynamo=True, external_data=False, optimize=True, verbose=False,
        )  # fmt: skip
    model = onnx.load(str(path))
    model.producer_name, model.doc_string = "aisynergy cloud.ml.train", f"digits {kind} (scikit-learn load_digits, pixel/16)"
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return path


def save_weights(module: nn.Module, path: Path) -> Path:
    """The module's state as a safetensors file (no pickle), for the TFLite conversion."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(path))
    path.chmod(0o644)  # safetensors creates it readable by its owner only
    return path


def load_weights(kind: str, path: Path) -> nn.Module:
    """A ``kind`` model with the weights of ``path`` (written by :func:`save_weights`), in eval mode."""
    from safetensors.torch import load_file

    module = build(kind)
    module.load_state_dict(load_file(str(path)))
    return module.eval()


def onnx_accuracy(path: Path, data: DigitsSplit | None = None, kind: str | None = None) -> float:
    """Top-1 accuracy of the ONNX model at ``path`` on the digits test split (ONNX Runtime, CPU)."""
    import onnxruntime as ort

    data = data or load_digits_split()
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rank = len(session.get_inputs()[0].shape)
    x = data.x_test.reshape(input_shape("cnn" if rank == 4 else "mlp", len(data.x_test)))
    logits = session.run(None, {session.get_inputs()[0].name: x})[0]
    return float((logits.argmax(axis=1) == data.y_test).mean())


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m cloud.ml.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", choices=KINDS, required=True)
    parser.add_argument("--out", type=Path, required=True, help="the ONNX file to write")
    parser.add_argument("--weights", type=Path, default=None, help="also write the torch state here (safetensors)")
    parser.add_argument("--epochs", type=int, default=None)
    args = parser.parse_args(argv)
    data = load_digits_split()
    trained = train(args.kind, data, epochs=args.epochs)
    export_onnx(trained.module, args.kind, args.out)
    if args.weights:
        save_weights(trained.module, args.weights)
    print(f"{args.kind}: trained in {trained.seconds:.1f} s, test accuracy torch {trained.accuracy:.4f}, "
          f"onnx {onnx_accuracy(args.out, data):.4f}; {args.out} ({args.out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
