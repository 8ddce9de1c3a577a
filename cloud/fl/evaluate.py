"""Scoring a federated task's global model on a held-out set at the cloud (``FederatedTrainingSpec.eval_inputs``).

The held-out set is a dataset artefact in safetensors with ``x`` (the model's input rows) and ``y`` (integer labels
in ``[0, classes)``), checked when the task is created (:func:`load`). At each round's close the hub runs the
frozen body over ``x`` (ONNX Runtime, once per task and hub process: the body does not change) and scores the new
last layer on those features: ``eval_accuracy`` (top-1) and ``eval_loss`` (mean softmax cross-entropy).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from cloud.errors import BadRequest

_CACHE: OrderedDict[tuple[str, str], tuple[np.ndarray, np.ndarray]] = OrderedDict()
_LOCK = threading.Lock()
CACHED = 4
BATCH = 1024


def load(session: Any, blobs: Any, artifact_id: str, classes: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)`` of a held-out dataset artefact; a 422 naming what is wrong with it."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    from cloud.tables import Artifact
    from interfaces.deployments import ArtifactFormat, ArtifactKind

    artifact = session.get(Artifact, artifact_id)
    if artifact is None:
        raise BadRequest(f"eval_inputs: no artefact {artifact_id}", status=422)
    if artifact.kind != ArtifactKind.DATASET.value or artifact.format != ArtifactFormat.SAFETENSORS.value:
        raise BadRequest(f"eval_inputs: artefact {artifact_id} is a {artifact.kind} in {artifact.format}, not a safetensors dataset", status=422)
    try:
        tensors = load_file(str(blobs.path(artifact.sha256)))
    except (OSError, SafetensorError) as exc:
        raise BadRequest(f"eval_inputs: cannot read artefact {artifact_id}: {exc}", status=422) from None
    x, y = tensors.get("x"), tensors.get("y")
    if x is None or y is None:
        raise BadRequest(f"eval_inputs: artefact {artifact_id} must hold tensors x and y; it holds {sorted(tensors)}", status=422)
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer) or len(y) != len(x) or not len(y):
        raise BadRequest(f"eval_inputs: y must be one integer label per row of x ({len(x)} rows); it is {y.dtype} {list(y.shape)}", status=422)
    if classes is not None and (y.min() < 0 or y.max() >= classes):
        raise BadRequest(f"eval_inputs: labels run {int(y.min())}..{int(y.max())}; the model has {classes} classes", status=422)
    return x, y.astype(np.int64)


def held_out(session: Any, blobs: Any, artifact_id: str, key: tuple[str, str], body: Callable[[], bytes], output: str) -> tuple[np.ndarray, np.ndarray]:
    """The body's ``output`` over the held-out ``x``, and ``y``: read and computed once per ``key`` (task id and body
    digest) and hub process, since neither the body nor the set changes during a task."""
    import onnxruntime as ort

    with _LOCK:
        if key in _CACHE:
            _CACHE.move_to_end(key)
            return _CACHE[key]
    x, y = load(session, blobs, artifact_id)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    runner = ort.InferenceSession(body(), options, providers=["CPUExecutionProvider"])
    name = runner.get_inputs()[0].name
    parts = [runner.run([output], {name: np.ascontiguousarray(x[i : i + BATCH], dtype=np.float32)})[0] for i in range(0, len(x), BATCH)]
    feats = np.concatenate(parts).reshape(len(x), -1).astype(np.float32)
    with _LOCK:
        _CACHE[key] = (feats, y)
        while len(_CACHE) > CACHED:
            _CACHE.popitem(last=False)
    return feats, y


def score(feats: np.ndarray, y: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> dict[str, float]:
    """Top-1 accuracy and mean softmax cross-entropy of the layer on the features."""
    z = (feats @ weight + bias).astype(np.float64)
    top = z.max(axis=1)
    log_norm = top + np.log(np.exp(z - top[:, None]).sum(axis=1))
    return {"eval_accuracy": float(np.mean(z.argmax(axis=1) == y)), "eval_loss": float(np.mean(log_norm - z[np.arange(len(y)), y]))}
