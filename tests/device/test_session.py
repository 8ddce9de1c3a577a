"""The session core both tiers run (device.session): what a broker sees of an agent's session."""

from __future__ import annotations

import pytest

from device.session import MAX_SESSION_EXPIRY_S, Backoff, Presence, SessionPlan
from interfaces.messages import ConnectionState, Envelope, StateBody
from interfaces.reconnect import RECONNECT_CAP_S
from interfaces.topics import DEVICE_STATE, NODE_STATE


def _state(payload: bytes) -> Envelope[StateBody]:
    return Envelope[StateBody].model_validate_json(payload)


@pytest.mark.parametrize(("topic", "ids", "expected"), [
    (NODE_STATE, {"node_id": "n-gw1"}, "synergy/v1/nodes/n-gw1/state"),
    (DEVICE_STATE, {"device_id": "d-cam1"}, "synergy/v1/devices/d-cam1/state"),
])  # fmt: skip
def test_presence_is_the_same_at_both_tiers_will_online_and_farewell(topic, ids, expected) -> None:  # type: ignore[no-untyped-def]
    # Prepare
    agent = next(iter(ids.values()))
    presence = Presence(topic, agent, ids)

    # Execute
    wills = [_state(presence.will()) for _ in range(2)]
    online, farewell = _state(presence.online()), _state(presence.farewell())

    # Assert: retained QoS 1 on the agent's own state topic, in envelopes from the agent
    assert presence.state_topic == expected
    assert presence.qos == 1 and presence.retain is True
    assert {m.src for m in (*wills, online, farewell)} == {agent}
    assert [(m.body.state, m.body.reason) for m in (wills[0], online, farewell)] == [
        (ConnectionState.OFFLINE, "will"), (ConnectionState.ONLINE, None), (ConnectionState.OFFLINE, "shutdown"),
    ]  # fmt: skip
    assert wills[0].id != wills[1].id  # each session's will is a fresh envelope


def test_a_persistent_session_asks_the_broker_to_keep_it_and_a_transient_one_starts_clean() -> None:
    # Execute
    persistent = SessionPlan("n-gw1", session_expiry_s=3600)
    transient = SessionPlan("d-cam1")

    # Assert
    assert persistent.clean_start is False
    props = persistent.connect_properties()
    assert props is not None and props.SessionExpiryInterval == 3600
    assert transient.clean_start is True and transient.connect_properties() is None
    assert transient.presence is None and transient.reconnect_cap_s == RECONNECT_CAP_S


@pytest.mark.parametrize("kwargs", [
    {"client_id": ""},
    {"client_id": "a", "keepalive_s": 0},
    {"client_id": "a", "keepalive_s": 65_536},
    {"client_id": "a", "connect_timeout_s": 0},
    {"client_id": "a", "reconnect_cap_s": -1},
    {"client_id": "a", "session_expiry_s": -1},
    {"client_id": "a", "session_expiry_s": MAX_SESSION_EXPIRY_S + 1},
])  # fmt: skip
def test_a_plan_out_of_bounds_is_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SessionPlan(**kwargs)


def test_backoff_is_capped_jittered_and_starts_over_after_a_connect() -> None:
    # Prepare
    backoff = Backoff(cap_s=2.0)

    # Execute
    waits = [backoff.failed() for _ in range(200)]
    attempts = backoff.attempts
    backoff.connected()
    first_again = [Backoff(2.0).failed() for _ in range(200)]

    # Assert: never above the cap, never all the same (jitter), the first wait small again
    assert attempts == 200 and backoff.attempts == 0
    assert all(0 <= w <= 2.0 for w in waits) and len(set(waits)) > 100
    assert max(first_again) <= 0.5  # the first retry waits at most twice the base (0.25 s)
