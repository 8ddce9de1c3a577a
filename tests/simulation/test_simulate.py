"""Federated-training simulation (cloud/simulation/, ``aisynergy simulate``; DESIGN §5, seeds/002): the quality
simulation learns and is deterministic for a seed; the Dirichlet split gives everyone data and is skewed for small
alpha; the efficiency simulation's shares add up, a slower link costs a larger communication share, the model has
the requested size; the CLI runs both and refuses bad arguments with a usage error."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from cloud import simulation as sim
from cloud.cli.root import main

LABELS = np.repeat(np.arange(10), 135)  # 1,350 labels, 10 balanced classes


@pytest.fixture(scope="module")
def digits() -> sim.Digits:
    pytest.importorskip("sklearn")
    return sim.load_digits()


def _curve(result: sim.QualityResult) -> list[tuple[float, float, int]]:
    return [(e.accuracy, e.loss, e.used) for e in result.rounds]


# --------------------------------------------------------------------------------------------------- quality


def test_quality_learns_and_is_deterministic_for_a_seed(digits: sim.Digits) -> None:
    cfg = sim.QualityConfig(participants=20, rounds=4, fraction=0.5, alpha=0.5, seed=3)
    first = sim.run_quality(cfg, data=digits)
    again = sim.run_quality(cfg, data=digits)
    other = sim.run_quality(sim.QualityConfig(participants=20, rounds=4, fraction=0.5, alpha=0.5, seed=4), data=digits)

    assert [e.round for e in first.rounds] == [0, 1, 2, 3, 4]
    assert first.rounds[0].used == 0 and all(e.used == 10 for e in first.rounds[1:])
    assert first.rounds[-1].accuracy > first.rounds[0].accuracy + 0.2
    assert first.best_accuracy == max(e.accuracy for e in first.rounds) > 0.4
    assert _curve(first) == _curve(again)
    assert _curve(first) != _curve(other)
    assert first.data["participant_sizes_min"] >= 67 and first.data["train"] == 1347


def test_quality_dropout_closes_rounds_with_the_rest(digits: sim.Digits) -> None:
    result = sim.run_quality(sim.QualityConfig(participants=20, rounds=2, fraction=0.5, dropout=0.3), data=digits)
    assert [(e.sampled, e.failed, e.used) for e in result.rounds[1:]] == [(10, 3, 7), (10, 3, 7)]
    # even a dropout near 1 leaves one participant to close the round
    almost_all = sim.run_quality(sim.QualityConfig(participants=20, rounds=1, fraction=0.5, dropout=0.99), data=digits)
    assert (almost_all.rounds[1].failed, almost_all.rounds[1].used) == (9, 1)


@pytest.mark.parametrize("strategy", sim.STRATEGY_NAMES)
def test_quality_runs_every_strategy(digits: sim.Digits, strategy: str) -> None:
    result = sim.run_quality(sim.QualityConfig(participants=20, rounds=2, fraction=0.5, strategy=strategy), data=digits)
    assert all(np.isfinite(e.loss) for e in result.rounds)
    assert result.model["strategy"].lower().startswith(strategy.replace("_", ""))


def test_quality_rejects_bad_configurations(digits: sim.Digits) -> None:
    with pytest.raises(sim.SimulationError, match="alpha"):
        sim.run_quality(sim.QualityConfig(participants=20, alpha=-1), data=digits)
    with pytest.raises(sim.SimulationError, match="at least one"):
        sim.run_quality(sim.QualityConfig(participants=2000), data=digits)
    with pytest.raises(sim.SimulationError, match="unknown aggregation strategy"):
        sim.run_quality(sim.QualityConfig(participants=20, strategy="fedsgd"), data=digits)


def test_dirichlet_split_gives_everyone_data_and_is_skewed_for_small_alpha() -> None:
    for participants in (20, 1000, len(LABELS)):
        parts = sim.dirichlet_split(LABELS, participants, 0.5, np.random.default_rng(0))
        assert len(parts) == participants and min(len(p) for p in parts) >= 1
        joined = np.concatenate(parts)
        assert len(joined) == len(LABELS) and len(np.unique(joined)) == len(LABELS)  # a partition
    skew = {alpha: sim.label_skew(LABELS, sim.dirichlet_split(LABELS, 20, alpha, np.random.default_rng(1)))
            for alpha in (0.05, 0.5, 100.0)}
    assert skew[0.05] > 0.75 > skew[0.5] > skew[100.0]
    assert skew[100.0] < 0.3  # close to the balanced mix (0.1 for an infinite sample)
    same = sim.dirichlet_split(LABELS, 20, 0.5, np.random.default_rng(7))
    again = sim.dirichlet_split(LABELS, 20, 0.5, np.random.default_rng(7))
    assert all(np.array_equal(a, b) for a, b in zip(same, again, strict=True))
    with pytest.raises(sim.SimulationError):
        sim.dirichlet_split(LABELS, len(LABELS) + 1, 0.5, np.random.default_rng(0))


# --------------------------------------------------------------------------------------------------- efficiency


@pytest.mark.parametrize("target", [10_000, 100_000, 1_000_000, *(m * 10**6 for m in (10, 20, 40, 60, 80, 100))])
def test_model_size_is_within_one_percent(target: int) -> None:
    sizes = sim.size_mlp(target)
    assert abs(sim.param_count(sizes) - target) <= 0.01 * target
    assert sizes[0] == sim.EFFICIENCY_INPUT and sizes[-1] == sim.EFFICIENCY_CLASSES and len(sizes) == 6


def test_parse_count() -> None:
    assert [sim.parse_count(t) for t in ("100000", "100k", "10M", "1.5m", "1G", " 20M ")] == [
        100_000, 100_000, 10_000_000, 1_500_000, 10**9, 20_000_000]
    for bad in ("0", "-5", "ten", "10T", ""):
        with pytest.raises(sim.SimulationError):
            sim.parse_count(bad)


def test_efficiency_shares_add_up_and_a_slower_link_costs_more() -> None:
    result = sim.run_efficiency(sim.EfficiencyConfig(params=100_000, rounds=2, local_steps=2, batch=8))
    assert abs(result.model["parameters"] - 100_000) <= 1_000
    assert result.update_bytes >= 4 * result.model["parameters"]
    assert [p.name for p in result.participants] == ["client1", "client2"]
    assert [(p.bandwidth_mbps, p.latency_ms) for p in result.participants] == [(1000.0, 5.0), (100.0, 20.0)]
    for p in result.participants:
        shares = [p.compute_utilisation_pct, p.communication_pct, p.serialisation_pct, p.waiting_pct]
        assert all(s >= 0 for s in shares)
        assert sum(shares) == pytest.approx(100.0, abs=1e-6)
        assert p.total_s == result.total_s and p.finished_s <= result.total_s
        one_way = p.latency_ms / 1e3 + result.update_bytes * 8 / (p.bandwidth_mbps * 1e6)
        assert p.upload_s == pytest.approx(2 * one_way)  # two rounds
    assert sum(r.duration_s for r in result.rounds) == pytest.approx(result.total_s)
    fast, slow = result.participants
    assert slow.communication_pct > fast.communication_pct
    assert result.server["aggregate_s"] > 0 and result.peak_rss_mb > 0

    # the same run with the second link 100x slower still: its communication share grows, the fast one waits more
    slower = sim.run_efficiency(sim.EfficiencyConfig(params=100_000, rounds=2, local_steps=2, batch=8,
                                                     bandwidth_mbps=(1000.0, 1.0), latency_ms=(5.0,)))
    assert slower.participants[1].communication_pct > slow.communication_pct
    assert slower.participants[0].waiting_pct > fast.waiting_pct
    assert slower.total_s > result.total_s


def test_efficiency_slowdown_scales_compute() -> None:
    result = sim.run_efficiency(sim.EfficiencyConfig(params=100_000, rounds=1, local_steps=2, batch=8,
                                                     slowdown=(1.0, 3.0)))
    for p in result.participants:
        assert p.compute_s == pytest.approx(p.compute_measured_s * p.slowdown)


def test_efficiency_rejects_bad_link_lists() -> None:
    with pytest.raises(sim.SimulationError, match="3 values for 2 participants"):
        sim.EfficiencyConfig(params=100_000, bandwidth_mbps=(1.0, 2.0, 3.0)).check()
    with pytest.raises(sim.SimulationError, match="slowdown"):
        sim.EfficiencyConfig(params=100_000, slowdown=(0.0,)).check()
    links, slowdown = sim.EfficiencyConfig(params=100_000, participants=3).check()
    assert [lk.bandwidth_mbps for lk in links] == pytest.approx([1000.0, 316.2278, 100.0])
    assert slowdown == [1.0, 1.0, 1.0]


# --------------------------------------------------------------------------------------------------- CLI


def test_cli_runs_both_subcommands(tmp_path: Path, digits: sim.Digits) -> None:
    runner = CliRunner()
    quality_json = tmp_path / "quality.json"
    quality = runner.invoke(main, ["simulate", "quality", "--participants", "20", "--rounds", "2", "--fraction", "0.5",
                                   "--strategy", "fedprox", "--strategy-param", "mu=0.01", "--json", str(quality_json)])
    assert quality.exit_code == 0, quality.output
    assert "best accuracy" in quality.output and "label skew" in quality.output
    saved = json.loads(quality_json.read_text())
    assert saved["kind"] == "quality" and len(saved["rounds"]) == 3
    assert saved["config"]["strategy_params"] == {"mu": 0.01}

    efficiency_json = tmp_path / "efficiency.json"
    efficiency = runner.invoke(main, ["simulate", "efficiency", "--params", "100k", "--rounds", "1",
                                      "--local-steps", "1",
                                      "--bandwidth-mbps", "1000,100", "--latency-ms", "5", "--slowdown", "1,1.5",
                                      "--json", str(efficiency_json)])
    assert efficiency.exit_code == 0, efficiency.output
    assert "client1" in efficiency.output and "client2" in efficiency.output
    assert "100,027 parameters" in efficiency.output
    saved = json.loads(efficiency_json.read_text())
    assert saved["kind"] == "efficiency" and abs(saved["model"]["parameters"] - 100_000) <= 1_000
    assert [p["slowdown"] for p in saved["participants"]] == [1.0, 1.5]
    assert [p["latency_ms"] for p in saved["participants"]] == [5.0, 5.0]


def test_cli_quality_without_scikit_learn_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ["sklearn", *(m for m in sys.modules if m.startswith("sklearn."))]:
        monkeypatch.setitem(sys.modules, name, None)  # importing it now raises ImportError
    result = CliRunner().invoke(main, ["simulate", "quality", "--participants", "20", "--rounds", "1"])
    assert result.exit_code == 1, result.output
    assert "aisynergy[train]" in result.output and "scikit-learn" in result.output


@pytest.mark.parametrize("args", [
    ["efficiency", "--params", "0"],
    ["efficiency", "--params", "lots"],
    ["efficiency", "--params", "5"],  # no MLP over 1,024 inputs that small
    ["efficiency", "--params", "100k", "--bandwidth-mbps", "1,2,3"],
    ["efficiency", "--params", "100k", "--latency-ms", "fast"],
    ["quality", "--alpha", "-1"],
    ["quality", "--alpha", "0"],
    ["quality", "--fraction", "0"],
    ["quality", "--dropout", "1"],
    ["quality", "--strategy", "fedsgd"],
    ["quality", "--strategy-param", "mu"],
])
def test_cli_bad_arguments_are_usage_errors(args: list[str]) -> None:
    result = CliRunner().invoke(main, ["simulate", *args])
    assert result.exit_code == 2, result.output
    assert "Usage:" in result.output or "Error:" in result.output
