"""The ``incremental_training`` worker program (``IncrementalTrainingSpec`` + the order's ``TrainingOrder``).

Checks first (each failing one REJECTS the order): the model is loaded here and is the very file the hub cut
(``base_sha256``); the dataset is kept on this device with labels that fit the layer; the layer fits the body.
Then, RUNNING:

1. the frozen body (a signed model artefact, verified like any download) runs once over the local inputs:
   its features are all the trainable layer sees (:mod:`device.training.features`);
2. DP-SGD trains the layer's weight and bias (:class:`device.training.dpsgd.HeadTrainer`) for exactly
   ``max_steps`` steps: the most the device's privacy budget allows (the hub accounted them), never more.
   Pause and stop take effect between steps; metrics every heartbeat: ``steps``, ``max_steps``, ``loss``
   (mean of the recent batches), ``train_accuracy`` (on the local data, every ``ACCURACY_EVERY`` steps),
   ``step_ms``, ``features_s``;
3. the trained layer leaves as the one ``WorkerOutput`` (chunk 0, ``items`` = steps taken, safetensors
   ``weight`` [features, classes] and ``bias`` [classes]); the worker SUCCEEDS with ``items_done`` = steps.

Only the trained layer leaves the device (clipped, noised updates folded into it), and the loss and accuracy
numbers, which are not covered by the DP guarantee (as in Opacus' examples). The data itself never leaves.
"""

from __future__ import annotations

import base64
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

from device.tasks.programs import require_model
from device.tasks.worker import Failed, Rejected, Worker
from interfaces.tasks import IncrementalTrainingOrder, IncrementalTrainingSpec, TrainingOrder

if TYPE_CHECKING:
    import numpy as np

ACCURACY_EVERY = 25  # steps between two train-accuracy readings (each costs one pass over the features)
LOG_EVERY = 100  # steps between two progress log lines


def run(worker: Worker) -> None:
    from device.local_data import DatasetError
    from device.training.dpsgd import HeadTrainer
    from device.training.features import Stopped, body_features

    spec = worker.spec(IncrementalTrainingSpec)
    training = worker.order_as(IncrementalTrainingOrder).training
    if training is None:
        raise Rejected("an incremental_training order must carry its training part (body, layer, max_steps)")
    if training.max_steps < 1:
        raise Rejected("the privacy budget allows no step (max_steps is 0)")
    model = require_model(worker.models, spec.model)
    if model.sha256 != training.base_sha256:
        raise Rejected(f"the loaded {model.name} {model.version} ({model.sha256[:12]}) is not the model the hub cut ({training.base_sha256[:12]})")
    if len(model.inputs) != 1:
        raise Rejected(f"training feeds one input; {model.name} {model.version} takes {[t.name for t in model.inputs]}")
    if worker.datasets is None:
        raise Rejected("this target keeps no local datasets")
    try:
        x, y = worker.datasets.load(spec.dataset)
    except DatasetError as exc:
        raise Rejected(str(exc)) from None
    weight, bias = _head(training)
    if len(y) == 0:
        raise Rejected(f"dataset {spec.dataset} has no rows")
    if y.min() < 0 or y.max() >= weight.shape[1]:
        raise Rejected(f"dataset {spec.dataset}'s labels run {int(y.min())}..{int(y.max())}; the layer has {weight.shape[1]} classes")
    progress = _Progress(training.max_steps)
    worker.metrics_source(progress.sample)
    worker.running()
    worker.log(f"training the last layer of {model.name} {model.version} ({weight.shape[0]} -> {weight.shape[1]}) on {spec.dataset}: "
               f"{len(y)} rows, q={training.sample_rate:.4g}, sigma={spec.noise_multiplier:g}, C={spec.clip_norm:g}, at most {training.max_steps} steps")  # fmt: skip
    body = worker.fetch_inputs(training.body)
    started = time.perf_counter()
    try:
        features = body_features(body, x, training.feature, go_on=worker.checkpoint, with_ones=True)
    except Stopped:
        return
    except ValueError as exc:
        raise Failed(f"the body does not run on {spec.dataset}: {exc}") from exc
    progress.features_s = time.perf_counter() - started
    del x
    try:
        trainer = HeadTrainer(
            weight, bias, features, y, learning_rate=spec.learning_rate, clip_norm=spec.clip_norm, noise_multiplier=spec.noise_multiplier,
            sample_rate=training.sample_rate, augmented=True,
        )  # fmt: skip
    except ValueError as exc:
        raise Failed(str(exc)) from exc
    del features
    try:
        before = trainer.accuracy()
        progress.accuracy = before
        worker.log(f"features of {len(y)} rows in {progress.features_s:.2f} s; train accuracy before: {before:.4f}")
        for _ in range(training.max_steps):
            if not worker.checkpoint():
                return
            t = time.perf_counter()
            stats = trainer.step()
            progress.step(stats.loss, time.perf_counter() - t)
            worker.items_done = trainer.steps
            if trainer.steps % ACCURACY_EVERY == 0 or trainer.steps == training.max_steps:
                progress.accuracy = trainer.accuracy()
            if trainer.steps % LOG_EVERY == 0:
                worker.log(f"step {trainer.steps}/{training.max_steps}: loss {progress.loss():.4f}, train accuracy {progress.accuracy:.4f}")
    finally:
        trainer.close()
    worker.output(0, trainer.steps, _frame(trainer.weight, trainer.bias))
    worker.log(f"trained {trainer.steps} steps: train accuracy {before:.4f} -> {progress.accuracy:.4f}; the new layer is sent")


def _head(training: TrainingOrder) -> tuple[np.ndarray, np.ndarray]:
    from safetensors.numpy import load

    try:
        tensors = load(base64.b64decode(training.head, validate=True))
        weight, bias = tensors["weight"], tensors["bias"]
    except Exception as exc:  # noqa: BLE001 - binascii, KeyError and safetensors' own errors alike
        raise Rejected(f"the order's layer is not a safetensors frame of weight and bias: {exc}") from None
    if weight.ndim != 2 or bias.shape != (weight.shape[1],):
        raise Rejected(f"the order's layer has weight {list(weight.shape)} and bias {list(bias.shape)}")
    return weight, bias


def _frame(weight: np.ndarray, bias: np.ndarray) -> bytes:
    import numpy as np
    from safetensors.numpy import save

    return save({"weight": np.ascontiguousarray(weight, np.float32), "bias": np.ascontiguousarray(bias, np.float32)})


class _Progress:
    """Numbers for the metrics samples (written by the worker, read by the host's ticker)."""

    def __init__(self, max_steps: int) -> None:
        self._lock = threading.Lock()
        self.max_steps, self.steps = max_steps, 0
        self.accuracy = float("nan")
        self.features_s = 0.0
        self._losses: deque[float] = deque(maxlen=20)
        self._seconds: deque[float] = deque(maxlen=20)

    def step(self, loss: float, seconds: float) -> None:
        with self._lock:
            self.steps += 1
            if loss == loss:  # an empty batch has no loss
                self._losses.append(loss)
            self._seconds.append(seconds)

    def loss(self) -> float:
        with self._lock:
            return sum(self._losses) / len(self._losses) if self._losses else float("nan")

    def sample(self) -> dict[str, float]:
        with self._lock:
            values = {"steps": self.steps, "max_steps": self.max_steps, "features_s": self.features_s}
            if self._losses:
                values["loss"] = sum(self._losses) / len(self._losses)
            if self._seconds:
                values["step_ms"] = 1000 * sum(self._seconds) / len(self._seconds)
            if self.accuracy == self.accuracy:
                values["train_accuracy"] = self.accuracy
            return values
