"""The hub serves REST while the broker is unreachable, and connects (and reconnects) when it is there."""

from __future__ import annotations

from pathlib import Path

from tests.support import AISYNERGY, free_port, logs_on_failure, start, start_broker, start_hub, stop, wait_for


def test_hub_serves_without_broker_then_connects_and_reconnects(tmp_path: Path, sqlite_url: str) -> None:
    # Prepare: the hub first, pointing at a broker that is not running yet
    data = tmp_path / "stack"
    port = free_port()
    hub = start_hub(data, sqlite_url, f"mqtts://127.0.0.1:{port}", heartbeat_interval=0.5, wait_mqtt=False)
    broker = None
    agent = None
    with logs_on_failure(data / "hub.log", data / "broker.log", tmp_path / "agent.log"):
        try:
            # Execute / Assert: REST works without a broker
            assert hub.health()["mqtt"]["connected"] is False
            with hub.client("operator") as api:
                reg = api.post("/nodes", json={"name": "gw-early"})
                assert reg.status_code == 201
            node_id = reg.json()["node"]["id"]

            # the broker comes up: the hub connects by itself
            broker = start_broker(data, port)
            wait_for(lambda: hub.health()["mqtt"]["connected"], 60, interval=0.2, what="hub connects to the late broker")
            agent = start([*AISYNERGY, "edge", "run", "--hub", hub.url, "--node-id", node_id, "--bootstrap-token",
                           reg.json()["bootstrap_token"], "--data-dir", str(tmp_path / "agent")], tmp_path / "agent.log")  # fmt: skip
            with hub.client("viewer") as api:
                wait_for(lambda: api.get(f"/nodes/{node_id}/status").json()["state"] == "ONLINE", 60, what="ONLINE")

            # the broker restarts: hub and agent reconnect, the node is ONLINE again
            stop(broker.proc)
            wait_for(lambda: not hub.health()["mqtt"]["connected"], 60, what="hub notices the broker is gone")
            with hub.client("viewer") as api:  # no heartbeats reach the hub: missed-heartbeat liveness
                wait_for(lambda: api.get(f"/nodes/{node_id}/status").json()["state"] == "OFFLINE", 60, what="OFFLINE during outage")
            broker = start_broker(data, port)
            wait_for(lambda: hub.health()["mqtt"]["connected"], 60, interval=0.2, what="hub reconnects")
            with hub.client("viewer") as api:
                wait_for(lambda: api.get(f"/nodes/{node_id}/status").json()["state"] == "ONLINE", 60, what="ONLINE after broker restart")
                assert api.get(f"/nodes/{node_id}").status_code == 200
        finally:
            if agent is not None:
                stop(agent)
            stop(hub.proc)
            if broker is not None:
                stop(broker.proc)
