"""The two example algorithms (examples/algorithms): both train scikit-learn's digits well above chance, the
torch example's parameters run unchanged in the numpy one, and both ONNX exports answer in ONNX Runtime as the
framework does."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from device.algorithm import checked_evaluate, checked_fit, load_client

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "algorithms"
CONFIG = {"epochs": 3, "learning_rate": 0.05, "batch_size": 32, "seed": 0}


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    spec = importlib.util.spec_from_file_location("examples_digits", EXAMPLES / "digits.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    train, test = module.write_digits(tmp_path_factory.mktemp("digits"))
    return {"train": train, "test": test}


def _trained(example: str, datasets: dict[str, Path]) -> tuple[Any, dict[str, np.ndarray], float]:
    _, client = load_client(EXAMPLES / example, CONFIG, datasets)
    start = client.initial_parameters()
    fitted = checked_fit(client, start, {"round": 1})
    evaluated = checked_evaluate(client, fitted.parameters, {"round": 1})
    return client, fitted.parameters, evaluated.metrics["accuracy"]


@pytest.fixture(scope="module")
def torch_run(digits: dict[str, Path]) -> tuple[Any, dict[str, np.ndarray], float]:
    pytest.importorskip("torch")
    return _trained("torch_cnn", digits)


@pytest.fixture(scope="module")
def numpy_run(digits: dict[str, Path]) -> tuple[Any, dict[str, np.ndarray], float]:
    return _trained("numpy_cnn", digits)


def test_torch_example_learns_digits(torch_run: tuple[Any, dict[str, np.ndarray], float]) -> None:
    _, parameters, accuracy = torch_run
    assert sorted(parameters) == ["conv1.bias", "conv1.weight", "fc.bias", "fc.weight"]
    assert accuracy >= 0.9  # 0.97 measured after 3 epochs; chance is 0.1


def test_numpy_example_learns_digits(numpy_run: tuple[Any, dict[str, np.ndarray], float]) -> None:
    assert numpy_run[2] >= 0.9  # 0.97 measured


def test_the_two_examples_share_parameter_names_and_shapes(torch_run: Any, numpy_run: Any) -> None:
    assert {n: (a.dtype, a.shape) for n, a in torch_run[1].items()} == {n: (a.dtype, a.shape) for n, a in numpy_run[1].items()}


def test_torch_parameters_give_the_same_predictions_in_numpy(torch_run: Any, numpy_run: Any, digits: dict[str, Path]) -> None:
    torch_client, parameters, accuracy = torch_run
    numpy_client = numpy_run[0]
    with np.load(digits["test"]) as data:
        x = data["x"]
    np.testing.assert_allclose(numpy_client.predict(parameters, x), torch_client.predict(parameters, x), rtol=1e-4, atol=1e-4)
    _, _, metrics = checked_evaluate(numpy_client, parameters, {})
    assert metrics["accuracy"] == pytest.approx(accuracy, abs=1 / 360)


def test_numpy_parameters_run_in_torch(torch_run: Any, numpy_run: Any, digits: dict[str, Path]) -> None:
    with np.load(digits["test"]) as data:
        x = data["x"][:50]
    np.testing.assert_allclose(torch_run[0].predict(numpy_run[1], x), numpy_run[0].predict(numpy_run[1], x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("example", ["torch", "numpy"])
def test_onnx_export_answers_as_the_framework(example: str, torch_run: Any, numpy_run: Any, digits: dict[str, Path]) -> None:
    ort = pytest.importorskip("onnxruntime")
    client, parameters, _ = torch_run if example == "torch" else numpy_run
    if example == "numpy":
        pytest.importorskip("onnx")
    session = ort.InferenceSession(client.export(parameters), providers=["CPUExecutionProvider"])
    with np.load(digits["test"]) as data:
        x = data["x"]
    (logits,) = session.run(["logits"], {"x": x})
    np.testing.assert_allclose(logits, client.predict(parameters, x), rtol=1e-4, atol=1e-4)


def test_checkpoint_and_restore(numpy_run: Any) -> None:
    client, parameters, _ = numpy_run
    saved = client.checkpoint()
    client.restore({name: np.zeros_like(a) for name, a in parameters.items()})
    assert all(not a.any() for a in client.checkpoint().values())
    client.restore(saved)
    assert all(np.array_equal(client.checkpoint()[n], parameters[n]) for n in parameters)


def _distance(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    """Over the trained tensors (a batch norm's running statistics are no parameters: mu does not hold them)."""
    return float(np.sqrt(sum(float(((a[k].astype(np.float64) - b[k]) ** 2).sum()) for k in a if ".running_" not in k)))


@pytest.mark.parametrize("example", ["torch_cnn", "numpy_cnn", "torch_resnet"])
def test_fedproxs_mu_keeps_a_fit_near_the_global_parameters_it_started_from(example: str, digits: dict[str, Path], tmp_path: Path) -> None:
    if example.startswith("torch"):
        pytest.importorskip("torch")
    config = {"epochs": 1, "learning_rate": 0.05, "batch_size": 32, "seed": 0} | ({"width": 4} if example == "torch_resnet" else {})
    data = np.load(digits["train"])
    np.savez(tmp_path / "small.npz", x=data["x"][:256], y=data["y"][:256])
    _, client = load_client(EXAMPLES / example, config, {"train": tmp_path / "small.npz"})
    start = client.initial_parameters()
    free = checked_fit(client, start, {"round": 1}).parameters
    held = checked_fit(client, start, {"round": 1, "proximal_mu": 20.0}).parameters
    again = checked_fit(client, start, {"round": 1, "proximal_mu": 0.0}).parameters
    assert _distance(held, start) < 0.5 * _distance(free, start), (_distance(held, start), _distance(free, start))
    assert _distance(again, free) < 1e-4  # mu 0 is plain SGD: the same fit
