"""DP-SGD for the last dense layer of a softmax classifier, in numpy (Abadi et al. 2016, as Opacus runs it).

The layer maps a feature row ``f`` (d) to logits ``z = f @ W + b`` (W: d x c, b: c); the loss is softmax
cross-entropy. One example's gradients have a closed form: with ``e = softmax(z) - onehot(y)``::

    dL/dW = f ⊗ e        dL/db = e        ||(dL/dW, dL/db)||₂ = sqrt(||f||² + 1) · ||e||

so each example's norm over the concatenated (W, b) gradient costs O(d + c) without materialising it, and
the clipped sum ``Σ min(1, C / norm_i) · f_i ⊗ e_i`` is one product ``Fᵀ (s ⊙ E)``: a private step costs
little more than a plain one. One step (:meth:`HeadTrainer.step`):

1. Poisson sampling: every example joins the batch with probability q (the batch size varies, may be 0);
2. each example's gradient is clipped to L2 norm ≤ C (``clip_norm``) over (W, b) together;
3. the clipped gradients are summed and N(0, σ²C²) noise is added to every coordinate (σ = ``noise_multiplier``);
4. the result is divided by the expected batch size q·n (not the drawn one, which would leak it);
5. W, b -= learning_rate · that.

The privacy of ``steps`` such steps is accounted by the hub (RDP of the Poisson-sampled Gaussian); this
module neither knows nor needs ε.

The noise (:class:`GaussianNoise`) is numpy's ziggurat sampler over SFC64, seeded from the operating system's
entropy (pass ``seed`` only in tests: a known seed makes the noise predictable); the batches are drawn from a
separate stream. Drawing (d+1)·c Gaussians is most of what a private step adds to a plain one, so on a board with
more than one core a thread draws the next steps' noise while this step's gradient is computed (numpy's
generators release the GIL while they fill an array), in chunks of several steps for a small layer; every
draw is used once.
"""

from __future__ import annotations

import os
import queue
import threading
from dataclasses import dataclass

import numpy as np

DTYPE = np.float32
CHUNK_VALUES = 1 << 18
"""Gaussians drawn at once (a chunk of several steps' noise for a small layer)"""
_vecdot = getattr(np, "vecdot", None)  # numpy >= 2: row-wise dot products, cheaper than einsum on small arrays


def _row_squares(a: np.ndarray) -> np.ndarray:
    return _vecdot(a, a) if _vecdot is not None else np.einsum("ij,ij->i", a, a)


def _std(noise_multiplier: float, clip_norm: float) -> float:
    """σ·C (no noise at all when σ = 0, whatever C)."""
    return noise_multiplier * clip_norm if noise_multiplier > 0 else 0.0


class GaussianNoise:
    """N(0, std²) float32 arrays of ``shape``, one per :meth:`add_to`, each used once.

    They are drawn in chunks of several steps' worth (about ``CHUNK_VALUES`` numbers; one step for a large
    layer), so that a small layer does not pay numpy's per-call cost every step. ``ahead``: a thread draws the
    next chunk while the current one is used (two chunks take turns); else the caller draws a chunk when the
    current one is used up."""

    def __init__(self, shape: tuple[int, ...], std: float, rng: np.random.Generator, ahead: bool = False) -> None:
        self.shape, self.std, self.rng = tuple(shape), DTYPE(std), rng
        self.per_chunk = max(1, CHUNK_VALUES // max(1, int(np.prod(self.shape))))
        self._chunk: np.ndarray | None = None
        self._spare: np.ndarray | None = None
        self._used = 0
        self._thread: threading.Thread | None = None
        if ahead and std > 0:
            self._free: queue.SimpleQueue[np.ndarray | None] = queue.SimpleQueue()
            self._ready: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()
            for _ in range(2):
                self._free.put(np.empty((self.per_chunk, *self.shape), DTYPE))
            self._thread = threading.Thread(target=self._draw, name="aisynergy-dp-noise", daemon=True)
            self._thread.start()

    def add_to(self, grad: np.ndarray) -> None:
        if self.std == 0:
            return
        if self._chunk is None:
            if self._thread is not None:
                self._chunk = self._ready.get()
            else:
                self._chunk = self._fill(self._spare if self._spare is not None else np.empty((self.per_chunk, *self.shape), DTYPE))
            self._used = 0
        grad += self._chunk[self._used]
        self._used += 1
        if self._used == self.per_chunk:  # used up: back to be drawn again at once
            if self._thread is not None:
                self._free.put(self._chunk)
            else:
                self._spare = self._chunk
            self._chunk = None

    def close(self) -> None:
        if self._thread is not None:
            self._free.put(None)
            self._thread.join(5)
            self._thread = None

    def _fill(self, buf: np.ndarray) -> np.ndarray:
        self.rng.standard_normal(out=buf, dtype=DTYPE)
        buf *= self.std
        return buf

    def _draw(self) -> None:
        while (buf := self._free.get()) is not None:
            self._ready.put(self._fill(buf))


def softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    return p


def augment(features: np.ndarray) -> np.ndarray:
    """``[F | 1]``: with the bias as the last row of ``theta = [W; b]`` the layer is one product, ``F_aug @ theta``,
    and an example's gradient over (W, b) is ``f_aug ⊗ e``, of norm ``||f_aug|| · ||e||``."""
    out = np.empty((features.shape[0], features.shape[1] + 1), dtype=DTYPE)
    out[:, :-1] = features
    out[:, -1] = 1
    return out


def _residuals(logits: np.ndarray, labels: np.ndarray, want_loss: bool) -> tuple[np.ndarray, float]:
    """``E = softmax(logits) - onehot(labels)`` computed in place in ``logits``, and the summed cross-entropy
    (log-sum-exp of the same numbers; 0.0 unless ``want_loss``)."""
    rows = np.arange(len(labels))
    logits -= logits.max(axis=1, keepdims=True)
    picked = logits[rows, labels] if want_loss else None
    np.exp(logits, out=logits)
    total = logits.sum(axis=1, keepdims=True)
    loss = float(np.log(total).sum() - picked.sum()) if picked is not None else 0.0
    logits /= total
    logits[rows, labels] -= 1
    return logits, loss


def residuals(weight: np.ndarray, bias: np.ndarray, features: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(E, p)``: ``E = softmax(F W + b) - onehot(y)`` (n x c), the gradient of each example's loss in the
    logits, and the probabilities ``p``."""
    p = softmax(features @ weight + bias)
    e = p.copy()
    e[np.arange(len(labels)), labels] -= 1
    return e, p


def per_example_gradients(weight: np.ndarray, bias: np.ndarray, features: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every example's gradient, materialised: ``dW`` (n x d x c) and ``db`` (n x c). For tests and references;
    training never builds these."""
    e, _ = residuals(weight, bias, features, labels)
    return features[:, :, None] * e[:, None, :], e


def gradient_norms(features: np.ndarray, e: np.ndarray) -> np.ndarray:
    """Each example's L2 norm over its concatenated (dW, db): ``sqrt(||f||² + 1) · ||e||``."""
    return np.sqrt((np.einsum("ij,ij->i", features, features) + 1) * np.einsum("ij,ij->i", e, e))


def clip_scales(norms: np.ndarray, clip_norm: float) -> np.ndarray:
    """``min(1, C / norm)`` per example (1 for a zero gradient and for C = inf)."""
    with np.errstate(divide="ignore"):
        return np.minimum(1.0, clip_norm / norms).astype(norms.dtype, copy=False)


def clip_per_example(dw: np.ndarray, db: np.ndarray, clip_norm: float) -> tuple[np.ndarray, np.ndarray]:
    """Materialised per-example gradients clipped to L2 norm ≤ ``clip_norm`` each (the reference for the closed form)."""
    norms = np.sqrt(np.einsum("nij,nij->n", dw, dw) + np.einsum("nj,nj->n", db, db))
    s = clip_scales(norms, clip_norm)
    return dw * s[:, None, None], db * s[:, None]


def private_sum(
    theta: np.ndarray, features: np.ndarray, labels: np.ndarray, *, clip_norm: float, noise: GaussianNoise, sq_norms: np.ndarray | None = None,
    want_loss: bool = False,
) -> tuple[np.ndarray, np.ndarray, float]:  # fmt: skip
    """The hot path of a private step on augmented ``features`` (:func:`augment`) and ``theta = [W; b]``:
    ``Σ_i min(1, C / ||g_i||) g_i + noise`` (not yet divided), each example's clip scale, and the batch's
    summed loss when asked. ``sq_norms``: the rows' ``||f_aug||²`` when known beforehand (the trainer's are)."""
    e, loss = _residuals(features @ theta, labels, want_loss)
    if sq_norms is None:
        sq_norms = _row_squares(features)
    scale = _row_squares(e)
    scale *= sq_norms
    scale *= DTYPE(1 / clip_norm**2)  # (norm / C)²; 0 for C = inf
    np.maximum(scale, DTYPE(1), out=scale)
    scale **= DTYPE(-0.5)  # min(1, C / norm)
    e *= scale[:, None]
    grad = features.T @ e
    noise.add_to(grad)
    return grad, scale, loss


def plain_sum(theta: np.ndarray, features: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """The non-private counterpart of :func:`private_sum`: the summed gradient of the batch's cross-entropy."""
    e, _ = _residuals(features @ theta, labels, False)
    return features.T @ e


def noisy_gradient(
    weight: np.ndarray, bias: np.ndarray, features: np.ndarray, labels: np.ndarray, *, clip_norm: float, noise_multiplier: float,
    expected_batch: float, rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray, float]:  # fmt: skip
    """The private gradient of one batch, for W and b apart: ``(Σ clipped per-example gradients + N(0, σ²C²)) /
    expected_batch`` (:func:`private_sum`), and the fraction of the batch that was clipped."""
    theta = np.vstack([weight, bias[None, :]]).astype(DTYPE)
    grad, scale, _ = private_sum(theta, augment(features), labels, clip_norm=clip_norm, noise=GaussianNoise(theta.shape, _std(noise_multiplier, clip_norm), rng))
    grad /= DTYPE(expected_batch)
    clipped = float(np.count_nonzero(scale < 1)) / len(scale) if len(scale) else 0.0
    return grad[:-1], grad[-1], clipped


def plain_gradient(weight: np.ndarray, bias: np.ndarray, features: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The ordinary (non-private) mean gradient of the batch's cross-entropy."""
    e, _ = residuals(weight, bias, features, labels)
    n = max(len(labels), 1)
    return features.T @ e / n, e.sum(axis=0) / n


def cross_entropy(weight: np.ndarray, bias: np.ndarray, features: np.ndarray, labels: np.ndarray) -> float:
    """Mean softmax cross-entropy (log-sum-exp, stable for large logits); nan for no examples."""
    if not len(labels):
        return float("nan")
    z = (features @ weight + bias).astype(np.float64)
    top = z.max(axis=1)
    log_norm = top + np.log(np.exp(z - top[:, None]).sum(axis=1))
    return float((log_norm - z[np.arange(len(labels)), labels]).mean())


@dataclass(frozen=True)
class StepStats:
    batch: int
    """examples the Poisson sample drew"""
    loss: float
    """mean cross-entropy of the batch before the update (nan for an empty batch)"""
    clipped: float
    """fraction of the batch whose gradient was clipped"""


class HeadTrainer:
    """DP-SGD on (``weight`` d x c, ``bias`` c) over ``features`` (n x d) and integer ``labels`` (n) in [0, c).

    ``sample_rate`` is q (each example's chance to be in a batch); the expected batch size is q·n.
    ``proximal_mu`` > 0: FedProx, the step also pulls towards the starting layer (``mu (theta - theta_0)``).
    ``augmented``: ``features`` already end in a column of ones (``body_features(..., with_ones=True)``) and are
    used as they are, not copied. ``noise_ahead``: draw the noise on a thread (default: with more than one core).
    Raises ``ValueError`` for shapes or labels that do not fit. :meth:`close` (or
    ``with``) ends its noise thread.
    """

    def __init__(
        self, weight: np.ndarray, bias: np.ndarray, features: np.ndarray, labels: np.ndarray, *, learning_rate: float, clip_norm: float,
        noise_multiplier: float, sample_rate: float, seed: int | None = None, augmented: bool = False, noise_ahead: bool | None = None,
        proximal_mu: float = 0.0,
    ) -> None:  # fmt: skip
        weight, bias = np.asarray(weight), np.asarray(bias)
        features, labels = np.asarray(features), np.asarray(labels)
        if weight.ndim != 2 or bias.shape != (weight.shape[1],):
            raise ValueError(f"weight must be [features, classes] and bias [classes]; got {list(weight.shape)} and {list(bias.shape)}")
        width = weight.shape[0] + augmented
        if features.ndim != 2 or features.shape[1] != width:
            raise ValueError(f"features must be [rows, {width}]{' (with the column of ones)' if augmented else ''}; got {list(features.shape)}")
        if labels.shape != (features.shape[0],) or not np.issubdtype(labels.dtype, np.integer):
            raise ValueError(f"labels must be {features.shape[0]} integers; got {labels.dtype} {list(labels.shape)}")
        classes = weight.shape[1]
        if len(labels) and (labels.min() < 0 or labels.max() >= classes):
            raise ValueError(f"labels must lie in [0, {classes}) for this layer; found {int(labels.min())}..{int(labels.max())}")
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1]; got {sample_rate}")
        self.theta = np.vstack([weight, bias[None, :]]).astype(DTYPE)
        """[W; b]: the layer, the bias as its last row"""
        self.proximal_mu = proximal_mu
        self.anchor = self.theta.copy() if proximal_mu > 0 else None
        """FedProx: the round's global layer; each step adds ``mu (theta - anchor)`` to the gradient"""
        self.features = features if augmented and features.dtype == DTYPE and features.flags.c_contiguous else augment(features[:, : weight.shape[0]])
        self.sq_norms = np.einsum("ij,ij->i", self.features, self.features)  # ||f||² + 1, fixed: the body is frozen
        self.labels = labels.astype(np.int64, copy=False)
        self.learning_rate, self.clip_norm, self.noise_multiplier = learning_rate, clip_norm, noise_multiplier
        self.sample_rate = sample_rate
        self.expected_batch = sample_rate * len(labels)
        sampling, noise = np.random.SeedSequence(seed).spawn(2)
        self.rng = np.random.Generator(np.random.SFC64(sampling))
        ahead = (os.cpu_count() or 1) > 1 if noise_ahead is None else noise_ahead
        self.noise = GaussianNoise(self.theta.shape, _std(noise_multiplier, clip_norm), np.random.Generator(np.random.SFC64(noise)), ahead)
        self.steps = 0

    def __enter__(self) -> HeadTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.noise.close()

    @property
    def weight(self) -> np.ndarray:
        return self.theta[:-1]

    @property
    def bias(self) -> np.ndarray:
        return self.theta[-1]

    def sample(self) -> np.ndarray:
        """The indices of one Poisson sample."""
        return np.flatnonzero(self.rng.random(len(self.labels)) < self.sample_rate)

    def step(self) -> StepStats:
        index = self.sample()
        grad, scale, loss = private_sum(
            self.theta, self.features[index], self.labels[index], clip_norm=self.clip_norm, noise=self.noise, sq_norms=self.sq_norms[index], want_loss=True,
        )  # fmt: skip
        grad *= DTYPE(self.learning_rate / max(self.expected_batch, 1e-12))
        if self.anchor is not None:  # the proximal term is not private data: it needs no clipping or noise
            grad += DTYPE(self.learning_rate * self.proximal_mu) * (self.theta - self.anchor)
        self.theta -= grad
        self.steps += 1
        n = len(index)
        return StepStats(n, loss / n if n else float("nan"), float(np.count_nonzero(scale < 1)) / n if n else 0.0)

    def accuracy(self) -> float:
        """Top-1 accuracy on the training data (computed on the device; not covered by the DP guarantee)."""
        if not len(self.labels):
            return float("nan")
        return float(np.mean(np.argmax(self.features @ self.theta, axis=1) == self.labels))
