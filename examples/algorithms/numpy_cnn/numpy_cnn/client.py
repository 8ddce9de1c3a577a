"""The torch example's CNN for scikit-learn's digits, written in plain numpy, as an aisynergy algorithm.

conv1 (1 -> 8 channels, 3x3, padding 1) -> ReLU -> 2x2 max-pool -> flatten (channel first) -> fc (128 -> 10), with
the torch example's parameter names, shapes and layouts (``conv1.weight`` [8, 1, 3, 3], ``conv1.bias`` [8],
``fc.weight`` [10, 128], ``fc.bias`` [10]), so parameters trained by either run in the other. Trained by SGD with
momentum on the cross-entropy, gradients written out by hand. ``export`` builds the same network as ONNX with
the ``onnx`` package's helpers. With ``dp_noise_multiplier`` > 0 it trains by DP-SGD
(:mod:`device.algorithm.privacy`: Poisson-sampled batches, each example's gradient clipped to ``dp_clip_norm``,
Gaussian noise) and reports ``epsilon`` at ``dp_delta`` over its fit calls so far.

Datasets: ``train`` (required) and ``test`` (optional), ``.npz`` with ``x`` (float32, N x 1 x 8 x 8 or N x 64)
and ``y`` (int64).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from device.algorithm import Client, Parameters
from device.algorithm.privacy import DpSgd, fit_calls, secret_rng

CHANNELS, KERNEL, CLASSES = 8, 3, 10


def _load(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with np.load(path) as data:
        return data["x"].astype(np.float32).reshape(-1, 1, 8, 8), data["y"].astype(np.int64)


def _columns(x: np.ndarray) -> np.ndarray:
    """The 3x3 neighbourhoods of every pixel (zero padding 1): N x 64 x (C_in * 9), in the weight's order."""
    padded = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    windows = np.lib.stride_tricks.sliding_window_view(padded, (KERNEL, KERNEL), axis=(2, 3))  # N, C, 8, 8, 3, 3
    n, c, h, w = windows.shape[:4]
    return windows.transpose(0, 2, 3, 1, 4, 5).reshape(n, h * w, c * KERNEL * KERNEL)


def forward(parameters: Parameters, x: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The logits and what the backward pass needs."""
    cols = _columns(x)
    kernel = parameters["conv1.weight"].reshape(CHANNELS, -1)
    conv = (cols @ kernel.T + parameters["conv1.bias"]).transpose(0, 2, 1).reshape(len(x), CHANNELS, 8, 8)
    relu = np.maximum(conv, 0)
    blocks = relu.reshape(len(x), CHANNELS, 4, 2, 4, 2)
    pooled = blocks.max(axis=(3, 5))
    flat = pooled.reshape(len(x), -1)
    logits = flat @ parameters["fc.weight"].T + parameters["fc.bias"]
    return logits, {"cols": cols, "relu": relu, "blocks": blocks, "pooled": pooled, "flat": flat}


def _softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def gradients(parameters: Parameters, x: np.ndarray, y: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
    """The mean cross-entropy over (x, y) and its gradient for every parameter."""
    loss, per_example = example_gradients(parameters, x, y)
    return loss, {name: (g.sum(axis=0) / len(y)).astype(np.float32) for name, g in per_example.items()}


def example_gradients(parameters: Parameters, x: np.ndarray, y: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
    """The mean cross-entropy over (x, y) and each example's gradient for every parameter (``[N, *shape]``)."""
    logits, saved = forward(parameters, x)
    p = _softmax(logits)
    loss = float(-np.log(p[np.arange(len(y)), y] + 1e-12).mean()) if len(y) else 0.0
    d_logits = p
    d_logits[np.arange(len(y)), y] -= 1.0
    grads = {"fc.weight": np.einsum("nc,nf->ncf", d_logits, saved["flat"]), "fc.bias": d_logits}
    d_pooled = (d_logits @ parameters["fc.weight"]).reshape(saved["pooled"].shape)
    # the gradient reaches the maximum of each 2x2 block: its first in row order on a tie, as torch's max-pool
    windows = saved["blocks"].transpose(0, 1, 2, 4, 3, 5).reshape(len(x), CHANNELS, 4, 4, 4)
    first = np.arange(4) == windows.argmax(axis=-1)[..., None]
    d_windows = (first * d_pooled[..., None]).reshape(len(x), CHANNELS, 4, 4, 2, 2).transpose(0, 1, 2, 4, 3, 5)
    d_relu = d_windows.reshape(saved["relu"].shape) * (saved["relu"] > 0)
    d_conv = d_relu.reshape(len(x), CHANNELS, -1).transpose(0, 2, 1)  # N, 64, C_out
    grads["conv1.weight"] = np.einsum("npo,npk->nok", d_conv, saved["cols"]).reshape(len(x), *parameters["conv1.weight"].shape)
    grads["conv1.bias"] = d_conv.sum(axis=1)
    return loss, grads


def _shuffle_seed(seed: int, config: Mapping[str, Any]) -> int:
    """A different shuffle on every fit call: the federated round (``server_round``) and the call within it (``round``)."""
    return seed + 1000 * int(config.get("server_round", 0)) + int(config.get("round", 0))


class NumpyCNN(Client):
    def __init__(self, config: Mapping[str, Any], datasets: Mapping[str, Path]) -> None:
        super().__init__(config, datasets)
        self.train = _load(self.datasets["train"])
        self.test = _load(self.datasets["test"]) if "test" in self.datasets else self.train
        self.latest = self.initial_parameters()

    def initial_parameters(self) -> dict[str, np.ndarray]:
        # torch's default for both layers: uniform within 1/sqrt(fan_in)
        rng = np.random.default_rng(int(self.config["seed"]))
        conv_bound, fc_bound = 1 / np.sqrt(KERNEL * KERNEL), 1 / np.sqrt(CHANNELS * 16)
        return {
            "conv1.weight": rng.uniform(-conv_bound, conv_bound, (CHANNELS, 1, KERNEL, KERNEL)).astype(np.float32),
            "conv1.bias": rng.uniform(-conv_bound, conv_bound, CHANNELS).astype(np.float32),
            "fc.weight": rng.uniform(-fc_bound, fc_bound, (CLASSES, CHANNELS * 16)).astype(np.float32),
            "fc.bias": rng.uniform(-fc_bound, fc_bound, CLASSES).astype(np.float32),
        }

    def fit(self, parameters: Parameters, config: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], int, dict[str, float]]:
        weights = {name: np.array(array, np.float32) for name, array in parameters.items()}
        anchor = {name: array.copy() for name, array in weights.items()}  # FedProx: the global parameters this fit started from
        mu = float(config.get("proximal_mu", 0.0))
        velocity = {name: np.zeros_like(array) for name, array in weights.items()}
        x, y = self.train
        rate, size, epochs = float(self.config["learning_rate"]), int(self.config["batch_size"]), int(self.config["epochs"])
        dp = DpSgd.from_config(self.config)
        if dp is None:
            rng = np.random.default_rng(_shuffle_seed(int(self.config["seed"]), config))
            batches = (order[start:start + size] for _ in range(epochs) for order in [rng.permutation(len(x))] for start in range(0, len(x), size))
        else:  # DP-SGD: Poisson-sampled batches, each example's gradient clipped, Gaussian noise (device.algorithm.privacy)
            secret = secret_rng()
            batches = dp.batches(len(x), size, epochs, secret)
        total, seen, steps = 0.0, 0, 0
        for batch in batches:
            if dp is None:
                loss, grads = gradients(weights, x[batch], y[batch])
            else:
                loss, per_example = example_gradients(weights, x[batch], y[batch])
                grads = dp.privatise(per_example, dp.sample_rate(len(x), size) * len(x), secret)
            total, seen, steps = total + loss * len(batch), seen + len(batch), steps + 1
            for name, grad in grads.items():
                if mu:  # the gradient of mu/2 * ||w - w_global||^2
                    grad = grad + mu * (weights[name] - anchor[name])
                velocity[name] = 0.9 * velocity[name] + grad
                weights[name] -= rate * velocity[name]
        self.latest = weights
        metrics = {"train_loss": total / max(seen, 1)}
        if dp is not None:  # every step of every fit call so far (an upper bound: the calls of rounds it missed too)
            metrics["epsilon"] = dp.epsilon(len(x), size, fit_calls(config) * steps)
        return weights, len(x), metrics

    def predict(self, parameters: Parameters, x: np.ndarray) -> np.ndarray:
        """The logits for images ``x`` (N x 1 x 8 x 8)."""
        return forward(parameters, np.asarray(x, np.float32).reshape(-1, 1, 8, 8))[0]

    def evaluate(self, parameters: Parameters, config: Mapping[str, Any]) -> tuple[float, int, dict[str, float]]:
        x, y = self.test
        p = _softmax(self.predict(parameters, x))
        loss = float(-np.log(p[np.arange(len(y)), y] + 1e-12).mean())
        return loss, len(x), {"accuracy": float((p.argmax(axis=1) == y).mean())}

    def export(self, parameters: Parameters) -> bytes:
        """The network as ONNX (opset 17): input ``x`` [batch, 1, 8, 8], output ``logits`` [batch, 10]."""
        from onnx import TensorProto, helper, numpy_helper

        initialisers = [numpy_helper.from_array(np.asarray(array, np.float32), name) for name, array in parameters.items()]
        nodes = [
            helper.make_node("Conv", ["x", "conv1.weight", "conv1.bias"], ["conv"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["conv"], ["relu"]),
            helper.make_node("MaxPool", ["relu"], ["pooled"], kernel_shape=[2, 2], strides=[2, 2]),
            helper.make_node("Flatten", ["pooled"], ["flat"], axis=1),
            helper.make_node("Gemm", ["flat", "fc.weight", "fc.bias"], ["logits"], transB=1),
        ]
        graph = helper.make_graph(nodes, "digits_cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 1, 8, 8])],
                                  [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", CLASSES])], initialisers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        return bytes(model.SerializeToString())

    def checkpoint(self) -> dict[str, np.ndarray]:
        return self.latest

    def restore(self, parameters: Parameters) -> None:
        self.latest = {name: np.array(array, np.float32) for name, array in parameters.items()}
