"""A small CNN for scikit-learn's digits in PyTorch, as an aisynergy algorithm.

conv1 (1 -> 8 channels, 3x3, padding 1) -> ReLU -> 2x2 max-pool -> flatten (8 x 4 x 4, channel first) -> fc (128 -> 10).
Parameters: ``conv1.weight`` [8, 1, 3, 3], ``conv1.bias`` [8], ``fc.weight`` [10, 128], ``fc.bias`` [10], float32:
the numpy example holds the same names and shapes, so parameters move between the two. With ``dp_noise_multiplier`` > 0 it trains by DP-SGD
(:mod:`device.algorithm.privacy`: Poisson-sampled batches, each example's gradient clipped to ``dp_clip_norm``,
Gaussian noise) and reports ``epsilon`` at ``dp_delta`` over its fit calls so far.

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
from device.algorithm.privacy import DpSgd, fit_calls, secret_rng


def _shuffle_seed(seed: int, config: Mapping[str, Any]) -> int:
    """A different shuffle on every fit call: the federated round (``server_round``) and the call within it (``round``)."""
    return seed + 1000 * int(config.get("server_round", 0)) + int(config.get("round", 0))


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
        self.initial = self.latest = self._get()

    def _get(self) -> dict[str, np.ndarray]:
        return {name: tensor.detach().numpy().copy() for name, tensor in self.model.state_dict().items()}

    def _set(self, parameters: Parameters) -> None:
        self.model.load_state_dict({name: torch.from_numpy(np.array(array)) for name, array in parameters.items()})

    def initial_parameters(self) -> dict[str, np.ndarray]:
        return {name: array.copy() for name, array in self.initial.items()}

    def fit(self, parameters: Parameters, config: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], int, dict[str, float]]:
        self._set(parameters)
        x, y = self.train
        optimiser = torch.optim.SGD(self.model.parameters(), lr=float(self.config["learning_rate"]), momentum=0.9)
        size, epochs = int(self.config["batch_size"]), int(self.config["epochs"])
        mu = float(config.get("proximal_mu", 0.0))  # FedProx: mu/2 * ||w - w_global||^2 added to the loss
        anchors = [p.detach().clone() for p in self.model.parameters()] if mu else []
        dp = DpSgd.from_config(self.config)
        if dp is None:
            generator = torch.Generator().manual_seed(_shuffle_seed(int(self.config["seed"]), config))
            batches = (order[start:start + size] for _ in range(epochs) for order in [torch.randperm(len(x), generator=generator)]
                       for start in range(0, len(x), size))  # fmt: skip
        else:  # DP-SGD: Poisson-sampled batches, each example's gradient clipped, Gaussian noise (device.algorithm.privacy)
            secret = secret_rng()
            batches = (torch.from_numpy(b) for b in dp.batches(len(x), size, epochs, secret))
        self.model.train()
        total, seen, steps = 0.0, 0, 0
        for batch in batches:
            optimiser.zero_grad()
            if dp is None:
                loss = nn.functional.cross_entropy(self.model(x[batch]), y[batch])
            else:
                loss, per_example = self._example_gradients(x[batch], y[batch])
                noised = dp.privatise(per_example, dp.sample_rate(len(x), size) * len(x), secret)
                for name, p in self.model.named_parameters():
                    p.grad = torch.from_numpy(noised[name])
            if mu:
                loss = loss + mu / 2 * sum(((p - a) ** 2).sum() for p, a in zip(self.model.parameters(), anchors, strict=True))
            if loss.requires_grad:
                loss.backward()  # with DP-SGD only the proximal term's gradient adds to the noised one
            optimiser.step()
            total, seen, steps = total + float(loss.detach()) * len(batch), seen + len(batch), steps + 1
        self.latest = self._get()
        metrics = {"train_loss": total / max(seen, 1)}
        if dp is not None:  # every step of every fit call so far (an upper bound: the calls of rounds it missed too)
            metrics["epsilon"] = dp.epsilon(len(x), size, fit_calls(config) * steps)
        return self.latest, len(x), metrics

    def _example_gradients(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
        """The mean loss over (x, y) (no graph) and each example's gradient, ``name -> [N, *shape]`` (torch.func)."""
        from torch.func import functional_call, grad, vmap

        weights = {name: p.detach() for name, p in self.model.named_parameters()}
        if len(x) == 0:
            return torch.tensor(0.0), {name: np.zeros((0, *p.shape), np.float32) for name, p in weights.items()}

        def one(w: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
            return nn.functional.cross_entropy(functional_call(self.model, w, (xi.unsqueeze(0),)), yi.unsqueeze(0))

        per_example = vmap(grad(one), in_dims=(None, 0, 0))(weights, x, y)
        with torch.no_grad():
            loss = nn.functional.cross_entropy(self.model(x), y)
        return loss, {name: g.numpy() for name, g in per_example.items()}

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
