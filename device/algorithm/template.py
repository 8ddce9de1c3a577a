"""What ``aisynergy algorithm new NAME`` writes: a manifest and a numpy client that ``run`` executes at once
(softmax regression on a ``.npz`` dataset with ``x``, float32 rows or images, and ``y``, int64 labels)."""

from __future__ import annotations

import json
from pathlib import Path

from device.algorithm.client import AlgorithmError
from interfaces.algorithms import DRAFT_2020_12, MANIFEST_NAME, AlgorithmManifest

CLIENT = '''"""{name}: softmax regression in numpy, written from the aisynergy algorithm template.

Datasets: ``train`` (required) and ``test`` (optional; evaluation uses ``train`` without it), each a ``.npz``
with ``x`` (float32, N rows of features, or N images flattened here) and ``y`` (int64 labels).
"""

from __future__ import annotations

import numpy as np

from device.algorithm import Client


def _load(path):
    with np.load(path) as data:
        return data["x"].reshape(len(data["x"]), -1).astype(np.float32), data["y"].astype(np.int64)


class {cls}(Client):
    def __init__(self, config, datasets):
        super().__init__(config, datasets)
        self.train = _load(datasets["train"])
        self.test = _load(datasets["test"]) if "test" in datasets else self.train
        self.classes = int(self.config["classes"])

    def initial_parameters(self):
        features = self.train[0].shape[1]
        return {{"linear.weight": np.zeros((self.classes, features), np.float32),
                 "linear.bias": np.zeros(self.classes, np.float32)}}

    def _probabilities(self, parameters, x):
        logits = x @ parameters["linear.weight"].T + parameters["linear.bias"]
        logits -= logits.max(axis=1, keepdims=True)
        e = np.exp(logits)
        return e / e.sum(axis=1, keepdims=True)

    def fit(self, parameters, config):
        w, b = parameters["linear.weight"].copy(), parameters["linear.bias"].copy()
        x, y = self.train
        rng = np.random.default_rng(1000 * int(config.get("server_round", 0)) + int(config.get("round", 0)))  # another shuffle each call
        size, rate = int(self.config["batch_size"]), float(self.config["learning_rate"])
        for _ in range(int(self.config["epochs"])):
            order = rng.permutation(len(x))
            for start in range(0, len(x), size):
                batch = order[start:start + size]
                p = self._probabilities({{"linear.weight": w, "linear.bias": b}}, x[batch])
                p[np.arange(len(batch)), y[batch]] -= 1.0
                w -= rate * (p.T @ x[batch]) / len(batch)
                b -= rate * p.mean(axis=0)
        loss, _, metrics = self.evaluate({{"linear.weight": w, "linear.bias": b}}, config, self.train)
        return {{"linear.weight": w, "linear.bias": b}}, len(x), {{"train_loss": loss, "train_accuracy": metrics["accuracy"]}}

    def evaluate(self, parameters, config, data=None):
        x, y = data if data is not None else self.test
        p = self._probabilities(parameters, x)
        loss = float(-np.log(p[np.arange(len(y)), y] + 1e-12).mean())
        return loss, len(x), {{"accuracy": float((p.argmax(axis=1) == y).mean())}}
'''


def _class_name(name: str) -> str:
    return "".join(part.capitalize() for part in name.replace("-", "_").replace(".", "_").split("_") if part) + "Client"


def write_template(name: str, directory: Path) -> Path:
    """Writes the template into ``directory/name`` (which must not exist) and returns that folder."""
    module = name.replace("-", "_").replace(".", "_").lower()
    if not module.isidentifier():
        raise AlgorithmError(f"{name!r} cannot name a Python package (letters, digits, _ and - only, not first a digit)")
    manifest = AlgorithmManifest(
        name=name, version="0.1.0", entry_point=f"{module}.client:{_class_name(name)}", frameworks={"numpy": ">=1.26"},
        description=f"{name}: softmax regression in numpy (the aisynergy template)",
        config_schema={
            "$schema": DRAFT_2020_12, "type": "object", "additionalProperties": False,
            "properties": {
                "epochs": {"type": "integer", "minimum": 1, "maximum": 1000, "default": 5},
                "learning_rate": {"type": "number", "exclusiveMinimum": 0, "maximum": 10, "default": 0.05},
                "batch_size": {"type": "integer", "minimum": 1, "maximum": 65536, "default": 32},
                "classes": {"type": "integer", "minimum": 2, "maximum": 100000, "default": 10},
            },
        },
    )
    root = Path(directory) / name
    if root.exists():
        raise AlgorithmError(f"{root} exists already")
    (root / module).mkdir(parents=True)
    (root / MANIFEST_NAME).write_text(json.dumps(manifest.model_dump(mode="json"), indent=2) + "\n")
    (root / module / "__init__.py").write_text("")
    (root / module / "client.py").write_text(CLIENT.format(name=name, cls=_class_name(name)))
    return root
