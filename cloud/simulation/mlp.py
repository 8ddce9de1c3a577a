"""The model both simulations train (with numpy only, no torch).

A multi-layer perceptron ``input → hidden layers (ReLU) → classes`` with softmax cross-entropy, forward and
backward written out in numpy, plain mini-batch SGD. Its weights are a dict ``fc{i}.weight`` (``[in, out]``) and
``fc{i}.bias`` (``[out]``), float32, He-initialised from the seed. One SGD step on a batch (x, y) of size B:
forward, ``dlogits = (softmax − onehot(y)) / B``, then layer by layer from the last: the weight and bias gradients,
the gradient flowing down (``dlogits @ Wᵀ``, masked by the ReLU), and the update ``W −= lr · grad`` done in place
before the next layer's gradient is formed, so a step never holds more than one layer's gradient (the efficiency
simulation keeps one buffer of the largest layer's size for it, allocated once). Under FedProx a participant adds
:func:`interfaces.aggregation.proximal_gradient` ``μ (w − x)`` (x: the round's global model) to every gradient.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np

from interfaces.aggregation import proximal_gradient


def layer_names(n_layers: int) -> list[tuple[str, str]]:
    return [(f"fc{i}.weight", f"fc{i}.bias") for i in range(1, n_layers + 1)]


def param_count(sizes: Sequence[int]) -> int:
    """Parameters of the MLP with layer sizes ``[input, hidden..., classes]`` (weights and biases)."""
    return sum(a * b + b for a, b in itertools.pairwise(sizes))


def init_mlp(sizes: Sequence[int], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """He-normal weights (std √(2 / fan_in); √(1 / fan_in) for the output layer), zero biases, float32."""
    weights: dict[str, np.ndarray] = {}
    names = layer_names(len(sizes) - 1)
    for index, ((w_name, b_name), fan_in, fan_out) in enumerate(zip(names, sizes[:-1], sizes[1:], strict=True)):
        w = rng.standard_normal((fan_in, fan_out), dtype=np.float32)
        w *= np.float32(math.sqrt((1.0 if index == len(names) - 1 else 2.0) / fan_in))
        weights[w_name] = w
        weights[b_name] = np.zeros(fan_out, dtype=np.float32)
    return weights


def _n_layers(weights: dict[str, np.ndarray]) -> int:
    return len(weights) // 2


def forward(weights: dict[str, np.ndarray], x: np.ndarray) -> list[np.ndarray]:
    """``[x, a1, ..., logits]``: the input, each hidden layer's ReLU output, the logits."""
    acts = [x]
    names = layer_names(_n_layers(weights))
    for index, (w_name, b_name) in enumerate(names):
        z = acts[-1] @ weights[w_name]
        z += weights[b_name]
        if index < len(names) - 1:
            np.maximum(z, 0, out=z)
        acts.append(z)
    return acts


def softmax_xent(logits: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean cross-entropy and the softmax probabilities (float64 for the loss's sake)."""
    shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    log_norm = np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    log_p = shifted - log_norm
    loss = float(-log_p[np.arange(len(y)), y].mean())
    return loss, np.exp(log_p)


def sgd_step(weights: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray, lr: float,
             anchor: dict[str, np.ndarray] | None = None, mu: float = 0.0,
             scratch: np.ndarray | None = None) -> float:
    """One SGD step on (x, y), updating ``weights`` in place; returns the batch's loss before the step.

    With ``anchor`` (the round's global model) and ``mu`` > 0, FedProx's proximal gradient is added to each
    gradient. ``scratch``, a float32 buffer of at least the largest weight matrix's size, holds each weight gradient
    in turn (no allocation per layer and step; the efficiency simulation passes one)."""
    acts = forward(weights, x)
    loss, probs = softmax_xent(acts[-1], y)
    probs[np.arange(len(y)), y] -= 1.0
    delta = (probs / len(y)).astype(np.float32)
    lr32 = np.float32(lr)
    names = layer_names(_n_layers(weights))
    for index in range(len(names) - 1, -1, -1):
        w_name, b_name = names[index]
        w, b = weights[w_name], weights[b_name]
        if scratch is not None:
            grad_w = np.matmul(acts[index].T, delta, out=scratch[: w.size].reshape(w.shape))
        else:
            grad_w = acts[index].T @ delta
        grad_b = delta.sum(axis=0)
        below = delta @ w.T if index > 0 else None
        if anchor is not None and mu > 0:
            prox = proximal_gradient({w_name: w, b_name: b}, {w_name: anchor[w_name], b_name: anchor[b_name]}, mu)
            grad_w += prox[w_name]
            grad_b += prox[b_name]
        grad_w *= lr32
        w -= grad_w
        del grad_w
        b -= lr32 * grad_b
        if below is not None:
            below *= acts[index] > 0
            delta = below
    return loss


def evaluate(weights: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """``(accuracy, mean cross-entropy)`` of the model on (x, y)."""
    logits = forward(weights, x)[-1]
    loss, _ = softmax_xent(logits, y)
    return float((logits.argmax(axis=1) == y).mean()), loss


def as_float32(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {name: np.ascontiguousarray(array, dtype=np.float32) for name, array in weights.items()}
