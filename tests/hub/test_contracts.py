"""The contract: committed artefacts match the code, migrations match the tables, and the pure
pieces of ``interfaces`` (lifecycle, topic table, selectors, cursors) behave as documented."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlmodel import SQLModel

import cloud.tables  # noqa: F401  (registers the tables on the metadata)
from cloud.contracts import drift
from cloud.db import make_engine, upgrade
from interfaces.lifecycle import (
    NODE_TRANSITIONS,
    IllegalTransition,
    NodeState,
    can_transition,
    check_transition,
    path_to,
    state_after_report,
)
from interfaces.pagination import CursorError, decode_cursor, encode_cursor
from interfaces.selectors import Op, Requirement, SelectorError, matches, parse_selector
from interfaces.topics import (
    DEVICE_HEARTBEAT,
    NODE_CMD,
    NODE_CMD_REPLY,
    NODE_HEARTBEAT,
    NODE_STATE,
    TOPICS,
    Direction,
    Tier,
    own_subtree,
)

# ---- generated artefacts and migrations -------------------------------------------------------------


def test_committed_contract_artefacts_match_the_code() -> None:
    # Execute
    stale = drift()

    # Assert
    assert stale == [], f"regenerate with `aisynergy contracts write`: {[str(p) for p in stale]}"


def test_migrations_produce_exactly_the_table_metadata(database_url: str) -> None:
    # Prepare
    upgrade(database_url)
    engine = make_engine(database_url)

    # Execute
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True, "compare_server_default": True})
            diff = compare_metadata(context, SQLModel.metadata)
    finally:
        engine.dispose()

    # Assert
    assert diff == []


def test_migrating_twice_is_a_no_op(sqlite_url: str) -> None:
    # Prepare
    upgrade(sqlite_url)

    # Execute
    upgrade(sqlite_url)

    # Assert: still exactly the metadata
    engine = make_engine(sqlite_url)
    try:
        with engine.connect() as conn:
            assert compare_metadata(MigrationContext.configure(conn), SQLModel.metadata) == []
    finally:
        engine.dispose()


# ---- node lifecycle ---------------------------------------------------------------------------------

S = NodeState
LEGAL = {
    (S.REGISTERED, S.ONLINE), (S.REGISTERED, S.DELETED),
    (S.ONLINE, S.OFFLINE), (S.ONLINE, S.UNHEALTHY), (S.ONLINE, S.DELETED),
    (S.OFFLINE, S.ONLINE), (S.OFFLINE, S.DELETED),
    (S.UNHEALTHY, S.ONLINE), (S.UNHEALTHY, S.OFFLINE), (S.UNHEALTHY, S.DELETED),
}  # fmt: skip
ALL_PAIRS = [(a, b) for a in NodeState for b in NodeState]


def test_transition_table_is_the_documented_one() -> None:
    assert {(a, b) for a, targets in NODE_TRANSITIONS.items() for b in targets} == LEGAL
    assert set(NODE_TRANSITIONS) == set(NodeState)


@pytest.mark.parametrize(("current", "target"), ALL_PAIRS, ids=[f"{a}->{b}" for a, b in ALL_PAIRS])
def test_each_transition_is_allowed_or_refused(current: NodeState, target: NodeState) -> None:
    # Execute + Assert
    if (current, target) in LEGAL:
        assert can_transition(current, target)
        assert check_transition(current, target) is target
    else:
        assert not can_transition(current, target)
        with pytest.raises(IllegalTransition) as caught:
            check_transition(current, target)
        assert (caught.value.current, caught.value.target) == (current, target)


@pytest.mark.parametrize(
    ("current", "target", "path"),
    [
        (S.ONLINE, S.ONLINE, []),
        (S.REGISTERED, S.ONLINE, [S.ONLINE]),
        (S.REGISTERED, S.UNHEALTHY, [S.ONLINE, S.UNHEALTHY]),
        (S.OFFLINE, S.UNHEALTHY, [S.ONLINE, S.UNHEALTHY]),
        (S.UNHEALTHY, S.OFFLINE, [S.OFFLINE]),
        (S.REGISTERED, S.OFFLINE, [S.ONLINE, S.OFFLINE]),
        (S.OFFLINE, S.DELETED, [S.DELETED]),
    ],
)
def test_path_to(current: NodeState, target: NodeState, path: list[NodeState]) -> None:
    assert path_to(current, target) == path


@pytest.mark.parametrize(("current", "target"), [(S.DELETED, S.ONLINE), (S.ONLINE, S.REGISTERED), (S.OFFLINE, S.REGISTERED), (S.DELETED, S.REGISTERED)])
def test_path_to_refuses_unreachable_states(current: NodeState, target: NodeState) -> None:
    with pytest.raises(IllegalTransition):
        path_to(current, target)


@pytest.mark.parametrize(
    ("current", "connected", "healthy", "after"),
    [
        (S.REGISTERED, True, True, S.ONLINE),
        (S.REGISTERED, True, False, S.UNHEALTHY),
        (S.REGISTERED, False, False, S.REGISTERED),
        (S.ONLINE, True, False, S.UNHEALTHY),
        (S.UNHEALTHY, True, True, S.ONLINE),
        (S.ONLINE, False, True, S.OFFLINE),
        (S.UNHEALTHY, False, False, S.OFFLINE),
        (S.OFFLINE, False, False, S.OFFLINE),
        (S.OFFLINE, True, True, S.ONLINE),
        (S.DELETED, True, True, S.DELETED),
        (S.DELETED, False, False, S.DELETED),
    ],
)
def test_state_after_report(current: NodeState, connected: bool, healthy: bool, after: NodeState) -> None:
    # Execute
    result = state_after_report(current, connected=connected, healthy=healthy)

    # Assert: the documented state, always reachable by legal steps
    assert result is after
    path_to(current, result)


# ---- topic table ------------------------------------------------------------------------------------


def test_topic_table_builds_filters_and_parses() -> None:
    assert NODE_HEARTBEAT.topic(node_id="n-1") == "synergy/v1/nodes/n-1/heartbeat"
    assert DEVICE_HEARTBEAT.topic(device_id="d-1") == "synergy/v1/devices/d-1/heartbeat"
    assert NODE_HEARTBEAT.filter() == "synergy/v1/nodes/+/heartbeat"
    assert NODE_CMD_REPLY.filter() == "synergy/v1/nodes/+/cmd/reply"
    assert NODE_HEARTBEAT.shared_filter() == "$share/hub/synergy/v1/nodes/+/heartbeat"
    assert NODE_HEARTBEAT.parse("synergy/v1/nodes/n-1/heartbeat") == {"node_id": "n-1"}
    assert NODE_CMD_REPLY.parse(NODE_CMD_REPLY.topic(node_id="n_2.x")) == {"node_id": "n_2.x"}


@pytest.mark.parametrize(
    ("topic", "text"),
    [
        (NODE_HEARTBEAT, "synergy/v1/nodes/n-1/state"),
        (NODE_HEARTBEAT, "synergy/v1/nodes/a/b/heartbeat"),
        (NODE_HEARTBEAT, "synergy/v1/nodes//heartbeat"),
        (NODE_HEARTBEAT, "synergy/v1/nodes/+/heartbeat"),
        (NODE_HEARTBEAT, "synergy/v1/devices/n-1/heartbeat"),
        (NODE_HEARTBEAT, "synergy/v1/nodes/n-1/heartbeat/extra"),
        (NODE_CMD, "synergy/v1/nodes/n-1/cmd/reply"),
        (NODE_STATE, "prefix/synergy/v1/nodes/n-1/state"),
    ],
)
def test_topic_parse_refuses_other_topics(topic: object, text: str) -> None:
    assert topic.parse(text) is None  # type: ignore[attr-defined]


@pytest.mark.parametrize("bad_id", ["a/b", "+", "#", "a+b", "a#", "", "-leading", "x" * 65, "sp ace", "$SYS"])
def test_topic_refuses_ids_that_are_not_one_safe_level(bad_id: str) -> None:
    with pytest.raises(ValueError, match="not a valid topic level"):
        NODE_HEARTBEAT.topic(node_id=bad_id)


def test_topic_refuses_missing_ids() -> None:
    with pytest.raises(ValueError, match="missing ids"):
        NODE_HEARTBEAT.topic()
    with pytest.raises(ValueError, match="missing ids"):
        DEVICE_HEARTBEAT.topic(node_id="n-1")


def test_topic_table_is_consistent() -> None:
    patterns = [t.pattern for t in TOPICS]
    assert len(patterns) == len(set(patterns))
    for t in TOPICS:
        assert t.pattern.startswith("synergy/v1/")
        assert "{" not in t.filter() and "}" not in t.filter()
        assert t.qos in (0, 1, 2)
        ids = {name: "x-1" for name in t.placeholders}
        assert t.parse(t.topic(**ids)) == ids
        for other in TOPICS:
            if other is not t:
                assert other.parse(t.topic(**ids)) is None, (t.pattern, other.pattern)
        node_tier = t.pattern.startswith(("synergy/v1/nodes/", "synergy/v1/hub/"))
        assert t.direction in ((Direction.EDGE_TO_HUB, Direction.HUB_TO_EDGE) if node_tier else (Direction.DEVICE_TO_EDGE, Direction.EDGE_TO_DEVICE))
    assert NODE_STATE.retain and NODE_HEARTBEAT.qos == 0
    assert own_subtree(Tier.NODE, "n-1") == "synergy/v1/nodes/n-1/#"


# ---- selectors and cursors --------------------------------------------------------------------------


def test_selector_grammar() -> None:
    assert parse_selector(None) == []
    assert parse_selector("  ") == []
    assert parse_selector("zone=a, tier!=x ,gpu,!legacy,example.com/role==db") == [
        Requirement(key="zone", op=Op.EQ, value="a"),
        Requirement(key="tier", op=Op.NE, value="x"),
        Requirement(key="gpu", op=Op.EXISTS),
        Requirement(key="legacy", op=Op.NOT_EXISTS),
        Requirement(key="example.com/role", op=Op.EQ, value="db"),
    ]
    assert parse_selector("zone=") == [Requirement(key="zone", op=Op.EQ, value="")]


@pytest.mark.parametrize(
    "text",
    ["zone=a,,gpu", ",", "zone=a,", "=a", "!=a", "!", "bad key", "zone=a b", "zone=a=b", "zone!=x/y", "-zone", "k" * 64, "a" * 4097],
)
def test_selector_parse_errors(text: str) -> None:
    with pytest.raises(SelectorError):
        parse_selector(text)


@pytest.mark.parametrize(
    ("text", "labels", "expected"),
    [
        ("zone=a", {"zone": "a"}, True),
        ("zone=a", {"zone": "b"}, False),
        ("zone=a", {}, False),
        ("zone!=a", {}, True),
        ("zone!=a", {"zone": "a"}, False),
        ("gpu", {"gpu": ""}, True),
        ("!gpu", {"gpu": ""}, False),
        ("zone=a,!gpu", {"zone": "a"}, True),
        ("", {"anything": "x"}, True),
    ],
)
def test_selector_matches(text: str, labels: dict[str, str], expected: bool) -> None:
    assert matches(parse_selector(text), labels) is expected


def test_cursor_round_trip_and_refusal() -> None:
    assert decode_cursor(encode_cursor("n-01m8mvg8wfk38fba6xc35xb9h0")) == "n-01m8mvg8wfk38fba6xc35xb9h0"
    for bad in ["", "!!!", "A", "AA", encode_cursor("x" * 65), encode_cursor("a\nb")]:
        with pytest.raises(CursorError):
            decode_cursor(bad)
