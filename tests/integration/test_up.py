"""`aisynergy up`: the README's first command starts broker, hub, an edge agent and devices, and stops them all."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import httpx
import psutil
import pytest

from tests.support import AISYNERGY, free_port, wait_for


def test_up_starts_the_stack_and_ctrl_c_leaves_nothing_running(tmp_path: Path) -> None:
    # Prepare
    hub_port, broker_port = free_port(), free_port()
    log = (tmp_path / "up.log").open("wb")
    proc = subprocess.Popen(
        [*AISYNERGY, "up", "--data-dir", str(tmp_path / "stack"), "--hub-port", str(hub_port), "--broker-port", str(broker_port),
         "--enrol-port", str(free_port()), "--no-table"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        # Execute: wait until the edge node and its two devices are ONLINE, as the table would show
        wait_for(lambda: (tmp_path / "up.log").read_text().count(": ONLINE") >= 3 or proc.poll() is not None, 120, interval=0.3, what="stack ONLINE")
        assert proc.poll() is None, (tmp_path / "up.log").read_text()
        token = (tmp_path / "stack" / "admin.token").read_text().strip()
        # the hub speaks HTTPS only, with a certificate from its CA
        hub = httpx.Client(base_url=f"https://127.0.0.1:{hub_port}/api/v1", headers={"Authorization": f"Bearer {token}"},
                           verify=str(tmp_path / "stack" / "pki" / "ca.crt"))  # fmt: skip
        with hub:
            nodes = hub.get("/nodes").json()["items"]
            assert [n["state"] for n in nodes] == ["ONLINE"]
            devices = hub.get(f"/nodes/{nodes[0]['id']}/devices").json()["items"]
        assert len(devices) == 2
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{hub_port}/healthz", timeout=5)
        children = psutil.Process(proc.pid).children(recursive=True)
        names = " ".join(" ".join(c.cmdline()) for c in children)
        assert "mosquitto" in names and "hub serve" in names and "edge run" in names and names.count("device run") == 2
        # no bootstrap token on a command line (every user sees them), none left on disk once used
        assert "--bootstrap-token " not in names and "--ca-sha256 sha256:" in names
        assert list((tmp_path / "stack").glob("*.bootstrap")) == []

        # Ctrl-C
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0

        # Assert: nothing left running
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert alive == []
    finally:
        if proc.poll() is None:
            proc.kill()
