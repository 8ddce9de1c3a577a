"""The split-inference planner on measured costs (pure arithmetic; the end-to-end check lives with the partition tests)."""

from __future__ import annotations

import pytest

from device.split.planner import DEVICE_ONLY, EDGE_ONLY, CutCost, Link, LinkEstimator, Planner, choose

# a slow device, a fast edge; activations shrink along the model
COSTS = [
    CutCost(EDGE_ONLY, 0.0, 2.0, 600_000),
    CutCost("conv1", 5.0, 1.6, 400_000),
    CutCost("pool1", 8.0, 1.2, 100_000),
    CutCost("fc1", 20.0, 0.3, 2_000),
    CutCost(DEVICE_ONLY, 21.0, 0.0, 0),
]


@pytest.mark.parametrize(
    ("mbit", "expected"),
    [(1, DEVICE_ONLY), (10, DEVICE_ONLY), (100, "pool1"), (1000, EDGE_ONLY), (10_000, EDGE_ONLY)],
)
def test_the_cut_moves_towards_the_edge_as_the_link_gets_faster(mbit: float, expected: str) -> None:
    plan = choose(COSTS, Link(mbit * 1e6, rtt_ms=1.0))
    assert plan.cut == expected
    brute = min(COSTS, key=lambda c: c.estimate_ms(Link(mbit * 1e6, 1.0)))
    assert plan.cut == brute.cut and plan.estimate_ms == pytest.approx(brute.estimate_ms(Link(mbit * 1e6, 1.0)))
    assert [ms for _, ms in plan.ranking] == sorted(ms for _, ms in plan.ranking)


def test_estimates_add_the_round_trip_and_the_bytes_on_the_wire() -> None:
    link = Link(8e6, rtt_ms=3.0)  # 1 MB/s
    assert CutCost("x", 2.0, 1.0, 1000).estimate_ms(link) == pytest.approx(2.0 + 3.0 + 1.0 + 1.0)
    assert CutCost(DEVICE_ONLY, 7.0, 0.0, 0).estimate_ms(link) == 7.0  # nothing crosses


def test_the_planner_replans_only_when_the_link_really_moves() -> None:
    planner = Planner(COSTS, Link(100e6, 1.0), replan_ratio=0.25)
    assert planner.plan.cut == "pool1"
    assert planner.update(Link(110e6, 1.1)).cut == "pool1" and planner.replans == 0  # within 25 %: kept
    assert planner.update(Link(1e6, 1.0)).cut == DEVICE_ONLY and planner.replans == 1
    assert planner.update(Link(1000e6, 0.5)).cut == EDGE_ONLY and planner.replans == 2
    slower_edge = [CutCost(c.cut, c.head_ms, c.tail_ms * 50, c.activation_bytes) for c in COSTS]
    assert planner.set_costs(slower_edge).cut == DEVICE_ONLY


def test_the_link_estimator_converges_on_what_it_observes() -> None:
    est = LinkEstimator(Link(1e6, 10.0), alpha=0.5)
    for _ in range(20):
        est.observe_rtt(2.0)
    for _ in range(20):
        est.observe(1_000_000, 0.002 + 0.08)  # 1 MB in 80 ms on the wire = 100 Mbit/s
    link = est.link
    assert link.rtt_ms == pytest.approx(2.0, rel=1e-3)
    assert link.bandwidth_bps == pytest.approx(100e6, rel=1e-3)
    est.observe(0, 1.0)  # nothing measurable: ignored
    est.observe(100, 0.001)  # shorter than the round trip: ignored
    assert est.link == link


def test_no_cut_is_an_error() -> None:
    with pytest.raises(ValueError):
        choose([], Link(1e6, 1))
