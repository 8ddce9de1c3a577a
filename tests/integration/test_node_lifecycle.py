"""Edge node management end to end: real broker, real hub, real edge agent, each its own process."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.support import AISYNERGY, Broker, Hub, start, start_hub, stop, wait_for

HEARTBEAT_S = 0.5
MISSED = 3
OFFLINE_TIMEOUT_S = HEARTBEAT_S * MISSED


@pytest.fixture
def hub(broker: Broker, database_url: str):
    h = start_hub(broker.data_dir, database_url, broker.url, heartbeat_interval=HEARTBEAT_S, offline_after_missed=MISSED)
    try:
        yield h
    finally:
        stop(h.proc)


def _state(hub: Hub, node_id: str) -> str:
    with hub.client("viewer") as api:
        return api.get(f"/nodes/{node_id}/status").json()["state"]


def _agent(hub: Hub, node_id: str, data_dir: Path, token: str | None = None):
    args = [*AISYNERGY, "edge", "run", "--hub", hub.url, "--node-id", node_id, "--data-dir", str(data_dir)]
    if token:
        args += ["--bootstrap-token", token]
    return start(args, data_dir.parent / f"{data_dir.name}.log")


def test_register_enrol_online_kill_offline_restart(hub: Hub, tmp_path: Path) -> None:
    # Prepare
    with hub.client("operator") as api:
        reg = api.post("/nodes", json={"name": "gw-1", "labels": {"zone": "a"}}).json()
    node_id, token = reg["node"]["id"], reg["bootstrap_token"]
    assert reg["node"]["state"] == "REGISTERED"
    agent_dir = tmp_path / "agent"

    # Execute: the agent enrols and connects
    agent = _agent(hub, node_id, agent_dir, token)
    try:
        with hub.client("viewer") as api:
            serial = wait_for(lambda: api.get(f"/nodes/{node_id}").json()["certificate_serial"], 60, what="enrolment")
        wait_for(lambda: _state(hub, node_id) == "ONLINE", 60, what="ONLINE after enrolment")  # how soon: bench/, not a test
        with hub.client("viewer") as api:
            status = wait_for(lambda: (s := api.get(f"/nodes/{node_id}/status").json())["resources"] and s, 60, what="resources")
        assert status["connected"] is True
        assert status["resources"]["cpu"]["cores"] >= 1
        assert status["resources"]["memory"]["total_bytes"] > 0
        assert status["agent_version"]

        # kill -9: the broker publishes the last will, the hub marks the node OFFLINE
        killed_at = time.monotonic()
        stop(agent, signal.SIGKILL)
        wait_for(lambda: _state(hub, node_id) == "OFFLINE", OFFLINE_TIMEOUT_S + 2, what="OFFLINE after kill -9")
        assert time.monotonic() - killed_at <= OFFLINE_TIMEOUT_S + 2

        # restart without a token: same certificate, ONLINE again
        cert_before = (agent_dir / "identity" / "node.crt").read_text()
        agent = _agent(hub, node_id, agent_dir)
        wait_for(lambda: _state(hub, node_id) == "ONLINE", 60, what="ONLINE after restart")
        assert (agent_dir / "identity" / "node.crt").read_text() == cert_before
        with hub.client("viewer") as api:
            assert api.get(f"/nodes/{node_id}").json()["certificate_serial"] == serial
            history = [(h["from_state"], h["to_state"]) for h in api.get(f"/nodes/{node_id}/history").json()]
        assert history[:4] == [(None, "REGISTERED"), ("REGISTERED", "ONLINE"), ("ONLINE", "OFFLINE"), ("OFFLINE", "ONLINE")]
    finally:
        stop(agent)


def test_silent_agent_goes_offline_by_missed_heartbeats(hub: Hub, tmp_path: Path) -> None:
    # Prepare: an online agent
    with hub.client("operator") as api:
        reg = api.post("/nodes", json={"name": "gw-silent"}).json()
    node_id = reg["node"]["id"]
    agent = _agent(hub, node_id, tmp_path / "agent", reg["bootstrap_token"])
    try:
        wait_for(lambda: _state(hub, node_id) == "ONLINE", 60, what="ONLINE")

        # Execute: freeze the agent (its TCP connection stays open, so no last will)
        stopped_at = time.monotonic()
        agent.send_signal(signal.SIGSTOP)
        wait_for(lambda: _state(hub, node_id) == "OFFLINE", OFFLINE_TIMEOUT_S + 3, what="OFFLINE by missed heartbeats")
        assert time.monotonic() - stopped_at >= OFFLINE_TIMEOUT_S - HEARTBEAT_S
        with hub.client("viewer") as api:
            reasons = [h["reason"] for h in api.get(f"/nodes/{node_id}/history").json()]
        assert any("missed" in r for r in reasons)

        # Assert: when it wakes up it heartbeats and is ONLINE again
        agent.send_signal(signal.SIGCONT)
        wait_for(lambda: _state(hub, node_id) == "ONLINE", 60, what="ONLINE after SIGCONT")
    finally:
        agent.send_signal(signal.SIGCONT)
        stop(agent)
