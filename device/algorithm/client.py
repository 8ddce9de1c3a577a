"""The client API a user's algorithm implements (issue 18), in the spirit of Flower's ClientApp.

An algorithm is a class built with ``(config, datasets)``: ``config`` is its configuration, already checked
against the manifest's ``config_schema`` (its top-level defaults filled in), ``datasets`` maps a dataset's name
to a read-only path (a file or a folder). It holds no hub or broker credentials and needs none.

Required::

    initial_parameters() -> Parameters                      # where training starts when nobody gives parameters
    fit(parameters, config) -> (parameters, num_examples, metrics)
    evaluate(parameters, config) -> (loss, num_examples, metrics)

``fit``'s ``config`` holds ``round`` (the fit call of this run, from 1) and, in a whole-model federated round,
``server_round`` (the round), ``local_fits`` (the fit calls of each round) and, for FedProx, ``proximal_mu`` (μ: add μ/2 ‖w − w_global‖² to the local loss, with
``w_global`` the parameters ``fit`` was given; the hub fuses FedProx updates as FedAvg does). A shuffle seeded
from both ``server_round`` and ``round`` differs on every call, as the examples' does: ``round`` alone is 1 in
every federated round that makes one fit call.

Optional: ``export(parameters) -> bytes`` (an ONNX model), ``checkpoint() -> Parameters`` and
``restore(parameters)`` (a site that restarts resumes from its last checkpoint).

:data:`Parameters` are named numpy arrays, exchanged as safetensors files, so the hub and the aggregation never
depend on the framework. :func:`checked_fit` and :func:`checked_evaluate` call a client and refuse what does not
keep the contract (other names, dtypes or shapes than those given; ``num_examples`` not a positive int; metrics
not ``str -> float``) with an :class:`AlgorithmError` that says what is wrong.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from safetensors.numpy import load, load_file, save, save_file

Parameters = Mapping[str, np.ndarray]
"""Named tensors: a parameter's name (``conv1.weight``) to its numpy array."""
Config = Mapping[str, Any]
Metrics = dict[str, float]


class AlgorithmError(Exception):
    """A package, its configuration or its client that does not keep the contract; the message says what."""


class FitResult(NamedTuple):
    parameters: dict[str, np.ndarray]
    num_examples: int
    metrics: Metrics


class EvaluateResult(NamedTuple):
    loss: float
    num_examples: int
    metrics: Metrics


class Client:
    """Base class of an algorithm's client. Subclasses override the three methods below (and may add
    ``export``, ``checkpoint`` and ``restore``)."""

    def __init__(self, config: Config, datasets: Mapping[str, Path]) -> None:
        self.config = dict(config)
        self.datasets = dict(datasets)

    def initial_parameters(self) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def fit(self, parameters: Parameters, config: Config) -> tuple[dict[str, np.ndarray], int, Metrics]:
        raise NotImplementedError

    def evaluate(self, parameters: Parameters, config: Config) -> tuple[float, int, Metrics]:
        raise NotImplementedError


REQUIRED = ("initial_parameters", "fit", "evaluate")


def save_parameters(parameters: Parameters, path: Path) -> None:
    """Writes ``parameters`` as a safetensors file."""
    save_file({name: np.ascontiguousarray(array) for name, array in parameters.items()}, str(path))


def load_parameters(path: Path) -> dict[str, np.ndarray]:
    try:
        return load_file(str(path))
    except Exception as exc:  # safetensors raises its own error types for a truncated or foreign file
        raise AlgorithmError(f"{path} is not a safetensors file of parameters: {exc}") from None


def parameters_to_bytes(parameters: Parameters) -> bytes:
    return save({name: np.ascontiguousarray(array) for name, array in parameters.items()})


def parameters_from_bytes(data: bytes) -> dict[str, np.ndarray]:
    try:
        return load(data)
    except Exception as exc:
        raise AlgorithmError(f"not safetensors parameters: {exc}") from None


def check_parameters(given: Parameters, returned: object, where: str) -> dict[str, np.ndarray]:
    """``returned`` if it has the names, dtypes and shapes of ``given``."""
    if not isinstance(returned, Mapping):
        raise AlgorithmError(f"{where} returned parameters of type {type(returned).__name__}, not a mapping of name to numpy array")
    missing, extra = sorted(set(given) - set(returned)), sorted(set(returned) - set(given))
    if missing or extra:
        raise AlgorithmError(f"{where} returned other parameter names than it was given: missing {missing}, unexpected {extra}")
    for name, array in returned.items():
        if not isinstance(array, np.ndarray):
            raise AlgorithmError(f"{where}: parameter {name!r} is a {type(array).__name__}, not a numpy array")
        expected = given[name]
        if array.dtype != expected.dtype or array.shape != expected.shape:
            raise AlgorithmError(f"{where}: parameter {name!r} is {array.dtype}{list(array.shape)}, "
                                 f"it was given as {expected.dtype}{list(expected.shape)}")
    return dict(returned)


def _num_examples(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise AlgorithmError(f"{where} returned num_examples {value!r}; it is a positive integer")
    return int(value)


def _metrics(value: object, where: str) -> Metrics:
    if not isinstance(value, Mapping):
        raise AlgorithmError(f"{where} returned metrics of type {type(value).__name__}, not a mapping of str to float")
    metrics: Metrics = {}
    for key, item in value.items():
        if not isinstance(key, str) or isinstance(item, bool) or not isinstance(item, int | float | np.number) or not math.isfinite(float(item)):
            raise AlgorithmError(f"{where} returned metric {key!r}: {item!r}; metrics map a name to a finite number")
        metrics[key] = float(item)
    return metrics


def _triple(result: object, where: str, shape: str) -> tuple[Any, Any, Any]:
    if not isinstance(result, tuple) or len(result) != 3:
        raise AlgorithmError(f"{where} returned {type(result).__name__}; it returns {shape}")
    return result[0], result[1], result[2]


def checked_fit(client: Any, parameters: Parameters, config: Config) -> FitResult:
    trained, num_examples, metrics = _triple(client.fit(parameters, config), "fit", "(parameters, num_examples, metrics)")
    return FitResult(check_parameters(parameters, trained, "fit"), _num_examples(num_examples, "fit"), _metrics(metrics, "fit"))


def checked_evaluate(client: Any, parameters: Parameters, config: Config) -> EvaluateResult:
    loss, num_examples, metrics = _triple(client.evaluate(parameters, config), "evaluate", "(loss, num_examples, metrics)")
    if isinstance(loss, bool) or not isinstance(loss, int | float | np.number) or not math.isfinite(float(loss)):
        raise AlgorithmError(f"evaluate returned loss {loss!r}; it is a finite number")
    return EvaluateResult(float(loss), _num_examples(num_examples, "evaluate"), _metrics(metrics, "evaluate"))


def checked_initial_parameters(client: Any) -> dict[str, np.ndarray]:
    parameters = client.initial_parameters()
    if not isinstance(parameters, Mapping) or not all(isinstance(k, str) and isinstance(v, np.ndarray) for k, v in parameters.items()):
        raise AlgorithmError("initial_parameters returned something other than a mapping of name to numpy array")
    return dict(parameters)
