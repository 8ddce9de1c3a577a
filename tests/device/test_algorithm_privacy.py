"""DP-SGD inside an algorithm's fit (device.algorithm.privacy) and in the two digits examples: per-example
clipping, the noise's scale, the ε accounting against dp_accounting, the calibration, and noise that the
configuration's seed does not fix."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import dp_accounting
import numpy as np
import pytest

from device.algorithm import checked_evaluate, checked_fit, load_client
from cloud.simulation.dp_sgd import calibrate_sigma
from device.algorithm.privacy import DpSgd, epsilon, fit_calls

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "algorithms"
DP = {"dp_noise_multiplier": 1.0, "dp_clip_norm": 1.0, "dp_delta": 1e-5}


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    spec = importlib.util.spec_from_file_location("examples_digits_dp", EXAMPLES / "digits.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    train, test = module.write_digits(tmp_path_factory.mktemp("digits"))
    return {"train": train, "test": test}


def test_each_example_is_clipped_to_the_norm_before_the_sum() -> None:
    # Prepare: two examples' gradients, of norms 0.5 and 4 over both parameters together; noise too small to matter
    dp = DpSgd(noise_multiplier=1e-9, clip_norm=1.0, delta=1e-5)
    per_example = {"w": np.array([[0.3, 0.4], [0.0, 4.0]]), "b": np.array([[0.0], [0.0]])}

    # Execute
    mean = dp.privatise(per_example, expected_batch=2.0, rng=np.random.default_rng(0))

    # Assert: the first unchanged, the second scaled to norm 1, then the sum over the expected batch
    np.testing.assert_allclose(mean["w"], [(0.3 + 0.0) / 2, (0.4 + 1.0) / 2], atol=1e-6)
    np.testing.assert_allclose(mean["b"], [0.0], atol=1e-6)


def test_the_noise_has_the_multiplier_times_the_clip_over_the_expected_batch() -> None:
    dp = DpSgd(noise_multiplier=2.0, clip_norm=0.5, delta=1e-5)
    mean = dp.privatise({"w": np.zeros((0, 200_000))}, expected_batch=10.0, rng=np.random.default_rng(1))  # an empty batch: noise only
    assert mean["w"].shape == (200_000,)
    assert float(mean["w"].std()) == pytest.approx(2.0 * 0.5 / 10.0, rel=0.01)
    assert abs(float(mean["w"].mean())) < 0.002


def test_poisson_batches_sample_each_example_at_the_rate_for_epochs_times_the_steps_of_an_epoch() -> None:
    dp = DpSgd(noise_multiplier=1.0, clip_norm=1.0, delta=1e-5)
    batches = list(dp.batches(examples=300, batch_size=30, epochs=20, rng=np.random.default_rng(2)))
    assert len(batches) == 20 * 10
    sizes = np.array([len(b) for b in batches])
    assert sizes.mean() == pytest.approx(30, rel=0.05) and sizes.std() > 1  # Poisson: the size varies
    assert all(np.all(np.diff(b) > 0) and (len(b) == 0 or (b[0] >= 0 and b[-1] < 300)) for b in batches)


def test_epsilon_is_dp_accountings_and_the_experiments_calibration_meets_the_target_by_it() -> None:
    # Prepare: the reference, composed by hand
    q, sigma, steps, delta = 32 / 287, 1.3, 400, 1e-5
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)

    # Execute
    spent = epsilon(q, sigma, steps, delta)
    calibrated = calibrate_sigma(q, steps, 8.0, delta)  # what aisynergy experiment sites --dp-epsilon 8 hands the sites

    # Assert
    assert spent == pytest.approx(accountant.get_epsilon(delta), rel=1e-9)
    assert epsilon(q, sigma, 2 * steps, delta) > spent > epsilon(q, 2 * sigma, steps, delta) > 0
    assert epsilon(q, calibrated, steps, delta) <= 8.0 < epsilon(q, calibrated * 0.99, steps, delta)
    assert epsilon(q, sigma, 0, delta) == 0.0


def test_fit_calls_count_the_earlier_rounds_of_a_federated_task() -> None:
    assert fit_calls({"round": 3}) == 3
    assert fit_calls({"server_round": 1, "local_fits": 2, "round": 2}) == 2
    assert fit_calls({"server_round": 4, "local_fits": 2, "round": 1}) == 7


@pytest.mark.parametrize("config", [{"dp_noise_multiplier": -1.0}, {"dp_noise_multiplier": 1.0, "dp_clip_norm": 0.0},
                                    {"dp_noise_multiplier": 1.0, "dp_delta": 1.0}, {"dp_noise_multiplier": float("nan")}])  # fmt: skip
def test_a_bad_dp_configuration_is_refused(config: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="dp_"):
        DpSgd.from_config(config)


def test_no_noise_multiplier_is_no_dp() -> None:
    assert DpSgd.from_config({}) is None and DpSgd.from_config({"dp_noise_multiplier": 0}) is None


def test_the_numpy_examples_per_example_gradients_are_torchs(digits: dict[str, Path]) -> None:
    # Prepare: the same network in both examples, the same parameters and eight images
    torch = pytest.importorskip("torch")
    from torch.func import functional_call, grad, vmap

    _, numpy_client = load_client(EXAMPLES / "numpy_cnn", {"seed": 3}, digits)
    _, torch_client = load_client(EXAMPLES / "torch_cnn", {"seed": 3}, digits)
    parameters = numpy_client.initial_parameters()
    x, y = numpy_client.train[0][:8], numpy_client.train[1][:8]
    module = importlib.import_module("numpy_cnn.client")

    # Execute
    _, ours = module.example_gradients(parameters, x, y)
    model = torch_client.model
    weights = {name: torch.from_numpy(np.array(array)) for name, array in parameters.items()}

    def one(w: dict[str, Any], xi: Any, yi: Any) -> Any:
        return torch.nn.functional.cross_entropy(functional_call(model, w, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    theirs = vmap(grad(one), in_dims=(None, 0, 0))(weights, torch.from_numpy(x), torch.from_numpy(y))

    # Assert
    for name, g in ours.items():
        assert g.shape == (8, *parameters[name].shape)
        np.testing.assert_allclose(g, theirs[name].numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("example", ["numpy_cnn", "torch_cnn"])
def test_an_example_trains_by_dp_sgd_reports_its_epsilon_and_its_noise_is_not_the_seeds(example: str, digits: dict[str, Path]) -> None:
    # Prepare
    if example == "torch_cnn":
        pytest.importorskip("torch")
    config = {"epochs": 5, "learning_rate": 0.2, "batch_size": 64, "seed": 0, **DP}
    _, client = load_client(EXAMPLES / example, config, digits)
    start = client.initial_parameters()
    n = len(client.train[1])

    # Execute: round 2 of a federated task (its first round's fit calls count too)
    first = checked_fit(client, start, {"server_round": 2, "local_fits": 1, "round": 1})
    second = checked_fit(client, start, {"server_round": 2, "local_fits": 1, "round": 1})
    scored = checked_evaluate(client, first.parameters, {})

    # Assert: ε of two calls of 5 epochs of ceil(n / 64) steps; learned above chance (0.85 to 0.91 measured); two
    # fits from the same seed differ
    steps = 2 * 5 * -(-n // 64)
    assert first.metrics["epsilon"] == pytest.approx(epsilon(64 / n, 1.0, steps, 1e-5), rel=1e-9)
    assert 0 < first.metrics["epsilon"] < 50
    assert scored.metrics["accuracy"] > 0.5  # chance is 0.1
    assert any(not np.array_equal(first.parameters[k], second.parameters[k]) for k in first.parameters)
