"""Federated aggregation strategies (interfaces/aggregation.py) against direct numpy references of their definitions."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from interfaces.aggregation import (
    ClientUpdate,
    FedAdam,
    FedAvg,
    FedProx,
    Median,
    TrimmedMean,
    Weights,
    combine,
    proximal_gradient,
    strategy_from_spec,
    strategy_from_state,
    weighted_metrics,
)

SHAPES = {"conv.weight": (4, 3, 3, 3), "conv.bias": (4,), "fc.weight": (10, 36), "fc.bias": (10,), "scale": ()}


def model(rng: np.random.Generator, dtype: type = np.float32, spread: float = 1.0) -> Weights:
    return {name: (rng.standard_normal(shape) * spread).astype(dtype) for name, shape in SHAPES.items()}


def updates_around(global_weights: Weights, n: int, seed: int) -> list[ClientUpdate]:
    """``n`` participants' models near ``global_weights``, with unequal example counts."""
    rng = np.random.default_rng(seed)
    return [
        ClientUpdate(
            weights={k: (v + 0.1 * rng.standard_normal(v.shape)).astype(v.dtype) for k, v in global_weights.items()},
            num_examples=int(rng.integers(1, 500)),
            metrics={"loss": float(rng.uniform(0, 2))},
            participant=f"device-{i}",
        )
        for i in range(n)
    ]


def reference_fedavg(updates: list[ClientUpdate]) -> dict[str, np.ndarray]:
    n = np.array([u.num_examples for u in updates], dtype=np.float64)
    return {
        name: np.tensordot(n / n.sum(), np.stack([u.weights[name].astype(np.float64) for u in updates]), axes=1)
        for name in SHAPES
    }


def assert_close(actual: Weights, expected: dict[str, np.ndarray], atol: float = 1e-6) -> None:
    assert set(actual) == set(expected)
    for name, want in expected.items():
        np.testing.assert_allclose(actual[name].astype(np.float64), want, rtol=0, atol=atol, err_msg=name)


@pytest.fixture
def round_inputs() -> tuple[Weights, list[ClientUpdate]]:
    global_weights = model(np.random.default_rng(1))
    return global_weights, updates_around(global_weights, 7, seed=2)


# ------------------------------------------------------------------------------------------ strategies vs references


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fedavg_is_the_sample_weighted_mean_in_the_global_dtype(dtype: type) -> None:
    global_weights = model(np.random.default_rng(3), dtype)
    updates = updates_around(global_weights, 5, seed=4)

    new = FedAvg().aggregate(global_weights, updates)

    assert_close(new, reference_fedavg(updates))
    assert all(new[name].dtype == dtype and new[name].shape == SHAPES[name] for name in SHAPES)


def test_fedavg_with_equal_counts_is_the_plain_mean() -> None:
    global_weights = {"w": np.zeros(3, dtype=np.float32)}
    updates = [ClientUpdate({"w": np.full(3, v, dtype=np.float32)}, 10) for v in (1.0, 2.0, 6.0)]

    new = FedAvg().aggregate(global_weights, updates)

    np.testing.assert_array_equal(new["w"], np.full(3, 3.0, dtype=np.float32))


def test_fedprox_server_side_equals_fedavg(round_inputs: tuple[Weights, list[ClientUpdate]]) -> None:
    global_weights, updates = round_inputs

    new = FedProx(mu=0.1).aggregate(global_weights, updates)

    assert_close(new, reference_fedavg(updates))


def test_proximal_gradient_is_mu_times_local_minus_global() -> None:
    local = {"a": np.array([1.0, -2.0, 3.5], dtype=np.float32), "b": np.array([[0.5]], dtype=np.float64)}
    global_ = {"a": np.array([0.5, 0.0, 3.5], dtype=np.float32), "b": np.array([[2.0]], dtype=np.float64)}

    grad = proximal_gradient(local, global_, mu=0.2)

    np.testing.assert_allclose(grad["a"], [0.1, -0.4, 0.0], atol=1e-7)
    np.testing.assert_allclose(grad["b"], [[-0.3]], atol=1e-12)
    assert grad["a"].dtype == np.float32 and grad["b"].dtype == np.float64
    assert np.allclose(proximal_gradient(local, global_, mu=0.0)["a"], 0.0)


def test_proximal_gradient_rejects_mismatched_models() -> None:
    with pytest.raises(ValueError, match="'a'"):
        proximal_gradient({"a": np.zeros(2)}, {"a": np.zeros(3)}, mu=0.1)
    with pytest.raises(ValueError, match="missing"):
        proximal_gradient({"a": np.zeros(2)}, {"a": np.zeros(2), "b": np.zeros(1)}, mu=0.1)
    with pytest.raises(ValueError, match="mu"):
        proximal_gradient({"a": np.zeros(2)}, {"a": np.zeros(2)}, mu=-1.0)


def test_median_is_the_unweighted_coordinate_wise_median(round_inputs: tuple[Weights, list[ClientUpdate]]) -> None:
    global_weights, updates = round_inputs

    new = Median().aggregate(global_weights, updates)

    expected = {name: np.median(np.stack([u.weights[name] for u in updates]).astype(np.float64), axis=0) for name in SHAPES}
    assert_close(new, expected)


@pytest.mark.parametrize(("beta", "n"), [(0.1, 10), (0.2, 7), (0.25, 9), (0.0, 3)])
def test_trimmed_mean_drops_floor_beta_n_at_each_end(beta: float, n: int) -> None:
    global_weights = model(np.random.default_rng(5))
    updates = updates_around(global_weights, n, seed=6)
    t = math.floor(beta * n)

    new = TrimmedMean(beta=beta).aggregate(global_weights, updates)

    expected = {}
    for name, shape in SHAPES.items():
        flat = np.stack([u.weights[name].astype(np.float64) for u in updates]).reshape(n, -1)
        expected[name] = np.array([np.mean(sorted(flat[:, c])[t : n - t]) for c in range(flat.shape[1])]).reshape(shape)
    assert_close(new, expected)


def fedadam_reference(x: dict[str, np.ndarray], rounds: list[list[ClientUpdate]], eta: float, b1: float, b2: float,
                      tau: float) -> list[dict[str, np.ndarray]]:
    """Reddi et al. 2021, Algorithm 2 (Adam), written out: m, v from zero, no bias correction."""
    m = {k: np.zeros_like(v, dtype=np.float64) for k, v in x.items()}
    v = {k: np.zeros_like(a, dtype=np.float64) for k, a in x.items()}
    x = {k: a.astype(np.float64) for k, a in x.items()}
    models = []
    for updates in rounds:
        avg = reference_fedavg(updates)
        for k in x:
            delta = avg[k] - x[k]
            m[k] = b1 * m[k] + (1 - b1) * delta
            v[k] = b2 * v[k] + (1 - b2) * delta * delta
            x[k] = x[k] + eta * m[k] / (np.sqrt(v[k]) + tau)
        models.append({k: a.copy() for k, a in x.items()})
    return models


def test_fedadam_over_three_rounds_follows_the_reference_loop() -> None:
    x0 = model(np.random.default_rng(7), np.float64)
    strategy = FedAdam(eta=0.05, beta_1=0.8, beta_2=0.95, tau=1e-3)
    x, rounds = x0, []

    for r in range(3):
        updates = updates_around(x, 4, seed=10 + r)
        rounds.append(updates)
        x = strategy.aggregate(x, updates)
        assert_close(x, fedadam_reference(x0, rounds, 0.05, 0.8, 0.95, 1e-3)[-1], atol=1e-9)

    assert strategy.rounds == 3
    assert not np.allclose(x["fc.weight"], x0["fc.weight"])  # it moved


def test_fedadam_first_step_is_eta_times_sign_of_delta_up_to_tau() -> None:
    # m = (1-b1) Δ, v = (1-b2) Δ², so the step is eta (1-b1)/sqrt(1-b2) * sign(Δ) when |Δ| >> tau
    global_weights = {"w": np.zeros(4)}
    updates = [ClientUpdate({"w": np.array([1.0, -1.0, 2.0, -3.0])}, 1)]

    new = FedAdam(eta=0.01, beta_1=0.9, beta_2=0.99, tau=1e-9).aggregate(global_weights, updates)

    np.testing.assert_allclose(new["w"], 0.01 * 0.1 / math.sqrt(0.01) * np.sign(updates[0].weights["w"]), rtol=1e-6)


def test_fedadam_state_saved_and_restored_mid_way_continues_identically() -> None:
    x0 = model(np.random.default_rng(8))
    rounds = [updates_around(x0, 3, seed=20 + r) for r in range(4)]
    uninterrupted = FedAdam(eta=0.03)
    x = x0
    for updates in rounds:
        x = uninterrupted.aggregate(x, updates)

    first = FedAdam(eta=0.03)
    y = x0
    for updates in rounds[:2]:
        y = first.aggregate(y, updates)
    meta, arrays = first.state()
    meta = json.loads(json.dumps(meta))  # it really is JSON
    arrays = {k: a.copy() for k, a in arrays.items()}
    resumed = strategy_from_state(meta, arrays)  # a "restarted hub"
    for updates in rounds[2:]:
        y = resumed.aggregate(y, updates)

    assert isinstance(resumed, FedAdam) and resumed.rounds == 4
    assert set(arrays) == {f"{kind}/{name}" for kind in "mv" for name in SHAPES}
    for name in SHAPES:
        np.testing.assert_array_equal(y[name], x[name])


def test_restoring_a_state_into_a_differently_configured_strategy_is_refused() -> None:
    strategy = FedAdam(eta=0.03)
    strategy.aggregate({"w": np.zeros(2)}, [ClientUpdate({"w": np.ones(2)}, 1)])
    meta, arrays = strategy.state()

    with pytest.raises(ValueError, match="parameters"):
        FedAdam(eta=0.1).restore(meta, arrays)
    with pytest.raises(ValueError, match="fedadam"):
        FedAvg().restore(meta, arrays)
    with pytest.raises(ValueError, match="m has tensors"):
        strategy_from_state(meta, {"m/w": arrays["m/w"]})


def test_fedadam_refuses_a_model_whose_tensors_changed_since_its_moments() -> None:
    strategy = FedAdam()
    strategy.aggregate({"w": np.zeros(2)}, [ClientUpdate({"w": np.ones(2)}, 1)])

    with pytest.raises(ValueError, match="moments"):
        strategy.aggregate({"w": np.zeros(3)}, [ClientUpdate({"w": np.ones(3)}, 1)])


def test_stateless_strategies_round_trip_their_state() -> None:
    for strategy in (FedAvg(), FedProx(mu=0.5), Median(), TrimmedMean(beta=0.2)):
        meta, arrays = strategy.state()
        clone = strategy_from_state(json.loads(json.dumps(meta)), arrays)
        assert type(clone) is type(strategy) and clone.params() == strategy.params() and arrays == {}


# ------------------------------------------------------------------------------------------------------ robustness


def test_median_and_trimmed_mean_resist_an_outlier_where_fedavg_does_not() -> None:
    rng = np.random.default_rng(9)
    global_weights = {"w": np.zeros(50, dtype=np.float32)}
    honest = [ClientUpdate({"w": (1.0 + 0.01 * rng.standard_normal(50)).astype(np.float32)}, 100) for _ in range(9)]
    attacker = ClientUpdate({"w": np.full(50, 1e6, dtype=np.float32)}, 100, participant="evil")
    updates = honest + [attacker]

    averaged = FedAvg().aggregate(global_weights, updates)
    median = Median().aggregate(global_weights, updates)
    trimmed = TrimmedMean(beta=0.1).aggregate(global_weights, updates)

    assert np.all(averaged["w"] > 1e4)
    assert np.all(np.abs(median["w"] - 1.0) < 0.05)
    assert np.all(np.abs(trimmed["w"] - 1.0) < 0.05)


# --------------------------------------------------------------------------------------------------------- hierarchy


def test_hierarchical_fedavg_over_edge_combines_equals_flat_fedavg() -> None:
    global_weights = model(np.random.default_rng(11))
    edge1, edge2 = updates_around(global_weights, 4, seed=12), updates_around(global_weights, 6, seed=13)

    hierarchical = FedAvg().aggregate(global_weights, [combine(edge1, "edge-1"), combine(edge2, "edge-2")])
    flat = FedAvg().aggregate(global_weights, edge1 + edge2)

    assert_close(hierarchical, {k: v.astype(np.float64) for k, v in flat.items()})


def test_hierarchical_fedadam_over_edge_combines_equals_flat_fedadam() -> None:
    global_weights = model(np.random.default_rng(14), np.float64)
    edge1, edge2 = updates_around(global_weights, 3, seed=15), updates_around(global_weights, 5, seed=16)

    hierarchical = FedAdam().aggregate(global_weights, [combine(edge1), combine(edge2)])
    flat = FedAdam().aggregate(global_weights, edge1 + edge2)

    assert_close(hierarchical, flat)


def test_combine_sums_examples_and_weights_the_metrics() -> None:
    updates = [
        ClientUpdate({"w": np.array([0.0], dtype=np.float32)}, 1, {"loss": 1.0, "acc": 0.5}),
        ClientUpdate({"w": np.array([4.0], dtype=np.float32)}, 3, {"loss": 3.0}),
    ]

    combined = combine(updates, participant="edge-1")

    assert combined.num_examples == 4 and combined.participant == "edge-1"
    np.testing.assert_allclose(combined.weights["w"], [3.0])
    assert combined.weights["w"].dtype == np.float32
    assert combined.metrics == {"loss": 2.5}  # acc is not reported by every update
    assert weighted_metrics(updates) == {"loss": 2.5}


def test_decomposability_is_declared() -> None:
    assert FedAvg.decomposable and FedProx.decomposable and FedAdam.decomposable
    assert not Median.decomposable and not TrimmedMean.decomposable


# ------------------------------------------------------------------------------------------------------- bad inputs


def test_an_empty_round_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one"):
        FedAvg().aggregate({"w": np.zeros(2)}, [])
    with pytest.raises(ValueError, match="at least one"):
        combine([])


def test_a_shape_mismatch_names_the_participant_and_the_tensor(round_inputs: tuple[Weights, list[ClientUpdate]]) -> None:
    global_weights, updates = round_inputs
    bad = dict(updates[3].weights, **{"fc.bias": np.zeros(11, dtype=np.float32)})
    updates[3] = ClientUpdate(bad, 5, participant="device-3")

    with pytest.raises(ValueError, match=r"update #3 \('device-3'\).*'fc.bias'.*\(11,\).*\(10,\)"):
        FedAvg().aggregate(global_weights, updates)


def test_missing_or_extra_tensors_are_named(round_inputs: tuple[Weights, list[ClientUpdate]]) -> None:
    global_weights, updates = round_inputs
    weights = {k: v for k, v in updates[0].weights.items() if k != "conv.bias"}
    weights["extra"] = np.zeros(1)
    updates[0] = ClientUpdate(weights, 5)

    with pytest.raises(ValueError, match=r"update #0.*missing tensors \['conv.bias'\].*unexpected tensors \['extra'\]"):
        Median().aggregate(global_weights, updates)


@pytest.mark.parametrize("bad_value", [np.nan, np.inf, -np.inf])
def test_non_finite_values_are_refused(round_inputs: tuple[Weights, list[ClientUpdate]], bad_value: float) -> None:
    global_weights, updates = round_inputs
    weights = {k: v.copy() for k, v in updates[1].weights.items()}
    weights["fc.weight"][2, 3] = bad_value
    updates[1] = ClientUpdate(weights, 5, participant="device-1")

    with pytest.raises(ValueError, match=r"update #1 \('device-1'\).*'fc.weight'.*NaN or infinite"):
        FedAdam().aggregate(global_weights, updates)


def test_a_non_finite_or_integer_global_model_is_refused() -> None:
    update = ClientUpdate({"w": np.ones(2)}, 1)
    with pytest.raises(ValueError, match="global tensor 'w'.*NaN"):
        FedAvg().aggregate({"w": np.array([np.nan, 0.0])}, [update])
    with pytest.raises(ValueError, match="global tensor 'w'.*dtype int64"):
        FedAvg().aggregate({"w": np.zeros(2, dtype=np.int64)}, [update])


@pytest.mark.parametrize("count", [0, -3, 2.5, True])
def test_num_examples_must_be_a_positive_int(count: object) -> None:
    with pytest.raises(ValueError, match="num_examples"):
        ClientUpdate({"w": np.ones(2)}, count)  # type: ignore[arg-type]


def test_trimmed_mean_with_too_few_participants_to_trim_is_refused() -> None:
    global_weights = {"w": np.zeros(2)}
    updates = [ClientUpdate({"w": np.full(2, float(i))}, 1) for i in range(9)]

    with pytest.raises(ValueError, match=r"trimmed_mean needs at least 10 updates per round, got 9.*plain mean"):
        TrimmedMean(beta=0.1).aggregate(global_weights, updates)
    assert TrimmedMean(beta=0.1).min_updates == 10
    assert TrimmedMean(beta=0.25).min_updates == 4
    assert TrimmedMean(beta=0.3).min_updates == 4
    assert TrimmedMean(beta=0.0).min_updates == 1
    assert TrimmedMean(beta=0.25).aggregate(global_weights, updates[:4])["w"][0] == pytest.approx(1.5)


def test_a_failed_round_leaves_fedadam_state_untouched() -> None:
    strategy = FedAdam()
    x = strategy.aggregate({"w": np.zeros(2)}, [ClientUpdate({"w": np.ones(2)}, 1)])
    before = strategy.state()

    with pytest.raises(ValueError):
        strategy.aggregate(x, [ClientUpdate({"w": np.array([1.0, np.nan])}, 1)])

    after = strategy.state()
    assert after[0] == before[0]
    assert all(np.array_equal(after[1][k], before[1][k]) for k in before[1])


# ----------------------------------------------------------------------------------------------------------- specs


def test_strategy_from_spec_builds_each_strategy_with_its_parameters() -> None:
    assert isinstance(strategy_from_spec("fedavg"), FedAvg)
    assert strategy_from_spec("fedprox", mu=0.3).params() == {"mu": 0.3}
    adam = strategy_from_spec("fedadam", eta=0.1, tau=1e-4)
    assert isinstance(adam, FedAdam) and (adam.eta, adam.beta_1, adam.beta_2, adam.tau) == (0.1, 0.9, 0.99, 1e-4)
    assert isinstance(strategy_from_spec("median"), Median)
    assert strategy_from_spec("trimmed_mean", beta=0.2).params() == {"beta": 0.2}


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("fedsgd", {}, "unknown aggregation strategy 'fedsgd'"),
        ("fedavg", {"mu": 0.1}, "bad parameters for strategy 'fedavg'"),
        ("median", {"beta": 0.1}, "bad parameters for strategy 'median'"),
        ("fedprox", {"mu": -0.1}, "mu must be"),
        ("fedadam", {"eta": 0}, "eta must be"),
        ("fedadam", {"beta_1": 1.0}, "beta_1 must be"),
        ("fedadam", {"tau": float("nan")}, "tau must be"),
        ("trimmed_mean", {"beta": 0.5}, "beta must be"),
        ("trimmed_mean", {"beta": "0.1"}, "beta must be a number"),
    ],
)
def test_strategy_from_spec_refuses_unknown_names_and_bad_parameters(name: str, params: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        strategy_from_spec(name, **params)
