"""A fleet whose CRL has expired connects again once the hub is up: the hub signs the CRL again at start.

The clock is moved by signing the CRL as if 31 days ago (it expired a day ago): what the broker then holds is
what it would hold 31 days after the last revocation had nothing refreshed it.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from cloud.pki import CertificateAuthority
from tests.support import AISYNERGY, logs_on_failure, start, start_broker, start_hub, stop, wait_for


def test_an_expired_crl_is_signed_again_at_start_and_the_hub_and_a_node_connect(tmp_path: Path, sqlite_url: str) -> None:
    # Prepare: the stack's CA with an expired CRL, and the broker running with it
    data = tmp_path / "stack"
    ca = CertificateAuthority.load_or_create(data / "pki", broker_hosts=("127.0.0.1",))
    ca.write_crl([], now=dt.datetime.now(dt.UTC) - dt.timedelta(days=31))
    expired = ca.crl_next_update()
    assert expired is not None and expired < dt.datetime.now(dt.UTC)
    broker = start_broker(data)
    hub = agent = None
    try:
        with logs_on_failure(data / "hub.log", data / "broker.log", tmp_path / "agent.log"):
            # Execute: the hub starts (its housekeeping runs at once)
            hub = start_hub(data, sqlite_url, broker.url, wait_mqtt=False)

            # Assert: the CRL is fresh again, the broker reloaded it, the hub and a new node connect
            wait_for(lambda: (ca.crl_next_update() or expired) > dt.datetime.now(dt.UTC) + dt.timedelta(days=29), 60,
                     what="the CRL signed again")  # fmt: skip
            wait_for(lambda: (hub.health() or {}).get("mqtt", {}).get("connected"), 30, what="the hub connected")
            with hub.client("operator") as api:
                reg = api.post("/nodes", json={"name": "gw-after-crl"}).json()
            node_id = reg["node"]["id"]
            agent = start([*AISYNERGY, "edge", "run", "--hub", hub.url, "--node-id", node_id, "--bootstrap-token",
                           reg["bootstrap_token"], "--data-dir", str(tmp_path / "agent")], tmp_path / "agent.log")  # fmt: skip
            with hub.client("viewer") as api:
                wait_for(lambda: api.get(f"/nodes/{node_id}/status").json()["state"] == "ONLINE", 30, what="the node ONLINE")
    finally:
        if agent is not None:
            stop(agent)
        if hub is not None:
            stop(hub.proc)
        stop(broker.proc)
