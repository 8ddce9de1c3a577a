"""A ResNet-18-style network for scikit-learn's digits upscaled to ``size`` x ``size`` (16 by default: 8x8 would leave the last stage 1x1), in PyTorch,
as an aisynergy algorithm: the large model of the federated benchmark (``aisynergy experiment sites --model resnet``).

stem: conv 3x3 (1 -> w) + batch norm + ReLU; four stages of two basic blocks (w, 2w, 4w, 8w channels; the first
block of stages 2-4 halves the resolution, with a 1x1 projection); global average pool; fc (8w -> 10). At width
``w`` = 64 that is 11,172,810 parameters (44.7 MB as float32). The parameters exchanged are the state dict's
floating-point tensors, batch norms' running statistics included (FedAvg averages them like the weights); the
integer ``num_batches_tracked`` counters stay on the site.

Datasets: ``train`` (required) and ``test`` (optional; evaluation uses ``train`` without it), ``.npz`` files with
``x`` (float32, N x 1 x 8 x 8 or N x 64, in [0, 1]) and ``y`` (int64); images are upscaled bilinearly.
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


def _shuffle_seed(seed: int, config: Mapping[str, Any]) -> int:
    """A different shuffle on every fit call: the federated round (``server_round``) and the call within it (``round``)."""
    return seed + 1000 * int(config.get("server_round", 0)) + int(config.get("round", 0))


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                           if stride != 1 or cin != cout else nn.Identity())  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.downsample(x))


class DigitsResNet(nn.Module):
    def __init__(self, width: int = 64, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        stages, cin = [], width
        for k, stride in enumerate((1, 2, 2, 2)):
            cout = width * 2**k
            stages.append(nn.Sequential(Block(cin, cout, stride), Block(cout, cout, 1)))
            cin = cout
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def _load(path: Path, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    with np.load(path) as data:
        x, y = data["x"].astype(np.float32).reshape(-1, 1, 8, 8), data["y"].astype(np.int64)
    images = nn.functional.interpolate(torch.from_numpy(x), size=(size, size), mode="bilinear", align_corners=False)
    return images.contiguous(), torch.from_numpy(y)


class TorchResNet(Client):
    def __init__(self, config: Mapping[str, Any], datasets: Mapping[str, Path]) -> None:
        super().__init__(config, datasets)
        torch.manual_seed(int(self.config["seed"]))
        self.size = int(self.config["size"])
        self.model = DigitsResNet(int(self.config["width"]))
        self.train = _load(self.datasets["train"], self.size)
        self.test = _load(self.datasets["test"], self.size) if "test" in self.datasets else self.train
        self.initial = self.latest = self._get()

    def _get(self) -> dict[str, np.ndarray]:
        return {name: t.detach().numpy().copy() for name, t in self.model.state_dict().items() if t.is_floating_point()}

    def _set(self, parameters: Parameters) -> None:
        missing, unexpected = self.model.load_state_dict({name: torch.from_numpy(np.array(a)) for name, a in parameters.items()}, strict=False)
        wrong = [m for m in missing if not m.endswith("num_batches_tracked")] + list(unexpected)
        if wrong:
            raise ValueError(f"the parameters do not fit the network: {wrong[:5]}")

    def initial_parameters(self) -> dict[str, np.ndarray]:
        return {name: array.copy() for name, array in self.initial.items()}

    def fit(self, parameters: Parameters, config: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], int, dict[str, float]]:
        self._set(parameters)
        x, y = self.train
        generator = torch.Generator().manual_seed(_shuffle_seed(int(self.config["seed"]), config))
        optimiser = torch.optim.SGD(self.model.parameters(), lr=float(self.config["learning_rate"]), momentum=0.9, weight_decay=5e-4)
        size = int(self.config["batch_size"])
        mu = float(config.get("proximal_mu", 0.0))  # FedProx: mu/2 * ||w - w_global||^2 added to the loss
        anchors = [p.detach().clone() for p in self.model.parameters()] if mu else []
        self.model.train()
        total = 0.0
        for _ in range(int(self.config["epochs"])):
            order = torch.randperm(len(x), generator=generator)
            for start in range(0, len(x), size):
                batch = order[start:start + size]
                if len(batch) < 2:  # batch norm needs two images
                    continue
                optimiser.zero_grad()
                loss = nn.functional.cross_entropy(self.model(x[batch]), y[batch])
                if mu:
                    loss = loss + mu / 2 * sum(((p - a) ** 2).sum() for p, a in zip(self.model.parameters(), anchors, strict=True))
                loss.backward()
                optimiser.step()
                total += float(loss.detach()) * len(batch)
        self.latest = self._get()
        return self.latest, len(x), {"train_loss": total / (len(x) * int(self.config["epochs"]))}

    def evaluate(self, parameters: Parameters, config: Mapping[str, Any]) -> tuple[float, int, dict[str, float]]:
        self._set(parameters)
        self.model.eval()
        x, y = self.test
        with torch.no_grad():
            logits = torch.cat([self.model(x[i:i + 256]) for i in range(0, len(x), 256)])
        loss = float(nn.functional.cross_entropy(logits, y))
        return loss, len(x), {"accuracy": float((logits.argmax(1) == y).float().mean())}

    def export(self, parameters: Parameters) -> bytes:
        """The network with ``parameters`` as ONNX: input ``x`` [batch, 1, 8, 8] (upscaled inside), output ``logits``."""
        self._set(parameters)
        self.model.eval()
        size = self.size

        class Upscaled(nn.Module):
            def __init__(self, net: nn.Module) -> None:
                super().__init__()
                self.net = net

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.net(nn.functional.interpolate(x, size=(size, size), mode="bilinear", align_corners=False))

        buffer = io.BytesIO()
        torch.onnx.export(Upscaled(self.model), (torch.zeros(1, 1, 8, 8),), buffer, dynamo=False, input_names=["x"], output_names=["logits"],
                          dynamic_axes={"x": {0: "batch"}, "logits": {0: "batch"}}, opset_version=17)
        return buffer.getvalue()

    def checkpoint(self) -> dict[str, np.ndarray]:
        return self.latest

    def restore(self, parameters: Parameters) -> None:
        self._set(parameters)
        self.latest = self._get()
