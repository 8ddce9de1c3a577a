"""`aisynergy up`: the README's first command starts broker, hub, an edge agent and devices, and stops them all."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import httpx
import psutil

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
        nodes = httpx.get(f"http://127.0.0.1:{hub_port}/api/v1/nodes", headers={"Authorization": f"Bearer {token}"}).json()["items"]
        assert [n["state"] for n in nodes] == ["ONLINE"]
        devices = httpx.get(f"http://127.0.0.1:{hub_port}/api/v1/nodes/{nodes[0]['id']}/devices", headers={"Authorization": f"Bearer {token}"}).json()["items"]
        assert len(devices) == 2
        children = psutil.Process(proc.pid).children(recursive=True)
        names = " ".join(" ".join(c.cmdline()) for c in children)
        assert "mosquitto" in names and "hub serve" in names and "edge run" in names and names.count("device run") == 2

        # Ctrl-C
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0

        # Assert: nothing left running
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert alive == []
    finally:
        if proc.poll() is None:
            proc.kill()
