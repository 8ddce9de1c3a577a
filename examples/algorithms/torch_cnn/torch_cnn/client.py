"""A small CNN for scikit-learn's digits in PyTorch, as an aisynergy algorithm.

conv1 (1 -> 8 channels, 3x3, padding 1) -> ReLU -> 2x2 max-pool -> flatten (8 x 4 x 4, channel first) -> fc (128 -> 10).
Parameters: ``conv1.weight`` [8, 1, 3, 3], ``conv1.bias`` [8], ``fc.weight`` [10, 128], ``fc.bias`` [10], float32:
the numpy example holds the same names and shapes, so parameters move between the two.

Datasets: ``train`` (required) and ``test`` (optional; evaluation uses ``train`` without it), ``.npz`` files with
``x`` (float32, N x 1 x 8 x 8 or N x 64) and ``y`` (int64).
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from device.algorithm import Client, Parameters


class DigitsCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
        return self.fc(torch.flatten(x, 1))


def _load(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    with np.load(path) as data:
        x, y = data["x"].astype(np.float32).reshape(-1, 1, 8, 8), data["y"].astype(np.int64)
    return torch.from_numpy(x), torch.from_numpy(y)


class TorchCNN(Client):
    def __init__(self, config: Mapping[str, Any], datasets: Mapping[str, Path]) -> None:
        super().__init__(config, datasets)
        torch.manual_seed(int(self.config["seed"]))
        self.model = DigitsCNN()
        self.train = _load(self.datasets["train"])
        self.test = _load(self.datasets["test"]) if "test" in self.datasets else self.train
        self.latest = self._get()

    def _get(self) -> dict[str, np.ndarray]:
        return {name: tensor.detach().numpy().copy() for name, tensor in self.model.state_dict().items()}

    def _set(self, parameters: Parameters) -> None:
        self.model.load_state_dict({name: torch.from_numpy(np.array(array)) for name, array in parameters.items()})

    def initial_parameters(self) -> dict[str, np.ndarray]:
        return self._get()

    def fit(self, parameters: Parameters, config: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], int, dict[str, float]]:
        self._set(parameters)
        x, y = self.train
        generator = torch.Generator().manual_seed(int(self.config["seed"]) + int(config.get("round", 0)))
        optimiser = torch.optim.SGD(self.model.parameters(), lr=float(self.config["learning_rate"]), momentum=0.9)
        size = int(self.config["batch_size"])
        mu = float(config.get("proximal_mu", 0.0))  # FedProx: mu/2 * ||w - w_global||^2 added to the loss
        anchors = [p.detach().clone() for p in self.model.parameters()] if mu else []
        self.model.train()
        total = 0.0
        for _ in range(int(self.config["epochs"])):
            order = torch.randperm(len(x), generator=generator)
            for start in range(0, len(x), size):
                batch = order[start:start + size]
                optimiser.zero_grad()
                loss = nn.functional.cross_entropy(self.model(x[batch]), y[batch])
                if mu:
                    loss = loss + mu / 2 * sum(((p - a) ** 2).sum() for p, a in zip(self.model.parameters(), anchors, strict=True))
                loss.backward()
                optimiser.step()
                total += float(loss.detach()) * len(batch)
        self.latest = self._get()
        return self.latest, len(x), {"train_loss": total / (len(x) * int(self.config["epochs"]))}

    def predict(self, parameters: Parameters, x: np.ndarray) -> np.ndarray:
        """The logits for images ``x`` (N x 1 x 8 x 8)."""
        self._set(parameters)
        self.model.eval()
        with torch.no_grad():
            return self.model(torch.from_numpy(np.asarray(x, np.float32).reshape(-1, 1, 8, 8))).numpy()

    def evaluate(self, parameters: Parameters, config: Mapping[str, Any]) -> tuple[float, int, dict[str, float]]:
        x, y = self.test
        logits = torch.from_numpy(self.predict(parameters, x.numpy()))
        loss = float(nn.functional.cross_entropy(logits, y))
        return loss, len(x), {"accuracy": float((logits.argmax(1) == y).float().mean())}

    def export(self, parameters: Parameters) -> bytes:
        """The network with ``parameters`` as an ONNX model: input ``x`` [batch, 1, 8, 8], output ``logits`` [batch, 10]."""
        self._set(parameters)
        self.model.eval()
        buffer = io.BytesIO()
        torch.onnx.export(self.model, (torch.zeros(1, 1, 8, 8),), buffer, dynamo=False, input_names=["x"], output_names=["logits"],
                          dynamic_axes={"x": {0: "batch"}, "logits": {0: "batch"}}, opset_version=17)
        return buffer.getvalue()

    def checkpoint(self) -> dict[str, np.ndarray]:
        return self.latest

    def restore(self, parameters: Parameters) -> None:
        self._set(parameters)
        self.latest = self._get()
