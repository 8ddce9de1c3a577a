"""Nothing lost between device, edge and hub (DESIGN §3): four device processes emit 5 events/s each while the
edge, the broker, or the hub and the broker together are killed with SIGKILL; afterwards every event each device
returned from ``emit()`` is at the hub exactly once, in the order of its seq.

The stack is what ``aisynergy up`` runs: one broker for the hub and the devices, the hub, one edge agent (one
connection for both roles), the devices as their own processes (``tests/integration/emitter.py``).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support import AISYNERGY, Broker, Hub, free_port, restart_hub, start, start_broker, start_hub, stop, wait_for

pytestmark = pytest.mark.broker

DEVICES = 4
RATE = 5.0  # events per second per device
HEARTBEAT_S = 0.5


@dataclass
class Emitter:
    device_id: str
    data_dir: Path
    record: Path
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self, enrol_url: str | None = None, issued: dict[str, str] | None = None) -> None:
        """``issued``: the hub's bootstrap-token answer, for a first start."""
        args = [sys.executable, "-m", "tests.integration.emitter", "--device-id", self.device_id,
                "--data-dir", str(self.data_dir), "--record", str(self.record), "--rate", str(RATE)]  # fmt: skip
        if issued:
            args += ["--enrol-url", str(enrol_url), "--bootstrap-token", issued["bootstrap_token"],
                     "--ca-sha256", issued["ca_sha256"], "--tls-server-name", issued["tls_server_name"]]  # fmt: skip
        self.proc = start(args, self.log)

    def emitted(self) -> list[int]:
        return [int(line) for line in self.record.read_text().split()] if self.record.exists() else []


@dataclass
class Stack:
    data: Path
    broker: Broker
    hub: Hub
    node_id: str
    edge_args: list[str]
    edge: subprocess.Popen[bytes]
    emitters: list[Emitter] = field(default_factory=list)

    def kill_edge(self) -> None:
        stop(self.edge, signal.SIGKILL)

    def start_edge(self) -> None:
        self.edge = start(self.edge_args, self.data / "edge.log")

    def states(self) -> dict[str, str]:
        with self.hub.client("viewer") as api:
            states = {self.node_id: api.get(f"/nodes/{self.node_id}/status").json()["state"]}
            for e in self.emitters:
                states[e.device_id] = api.get(f"/devices/{e.device_id}/status").json()["state"]
        return states

    def all_online(self) -> bool:
        return set(self.states().values()) == {"ONLINE"}

    def ticks(self, device_id: str) -> list[int]:
        """The seq of every ``tick`` event the hub holds for the device, in the hub's (arrival) order."""
        seqs: list[int] = []
        cursor: str | None = None
        with self.hub.client("viewer") as api:
            while True:
                params: dict[str, str | int] = {"limit": 500, **({"cursor": cursor} if cursor else {})}
                page = api.get(f"/devices/{device_id}/events", params=params).json()
                seqs += [item["seq"] for item in page["items"] if item["type"] == "tick"]
                cursor = page.get("next_cursor")
                if not cursor:
                    return seqs


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    data = tmp_path_factory.mktemp("saf")
    broker = start_broker(data / "stack")
    hub = start_hub(data / "stack", f"sqlite:///{data / 'hub.db'}", broker.url, heartbeat_interval=HEARTBEAT_S)
    enrol_port = free_port()
    with hub.client("operator") as api:
        reg = api.post("/nodes", json={"name": "edge-saf"}).json()
    node_id = reg["node"]["id"]
    edge_args = [*AISYNERGY, "edge", "run", "--hub", hub.url, "--node-id", node_id, "--data-dir", str(data / "edge"),
                 "--device-listen", f"127.0.0.1:{enrol_port}"]  # fmt: skip
    edge = start([*edge_args, "--bootstrap-token", reg["bootstrap_token"]], data / "edge.log")
    s = Stack(data, broker, hub, node_id, edge_args, edge)
    try:
        with hub.client("viewer") as api:
            wait_for(lambda: api.get(f"/nodes/{node_id}/status").json()["state"] == "ONLINE", 30, what="edge ONLINE")
        acl = broker.data_dir / "broker" / "acl"  # the broker reloads its access file a moment after the hub writes it
        for i in range(DEVICES):
            with hub.client("operator") as api:
                device_id = api.post("/devices", json={"node_id": node_id, "name": f"saf-{i}", "model": "board"}).json()["id"]
                issued = api.post(f"/devices/{device_id}/bootstrap-token", json={}).json()
            wait_for(lambda: acl.exists() and device_id in acl.read_text(), 60, what="the broker knows the device")
            emitter = Emitter(device_id, data / device_id, data / f"{device_id}.seqs", data / f"{device_id}.log")
            emitter.start(f"https://127.0.0.1:{enrol_port}", issued)
            s.emitters.append(emitter)
        wait_for(s.all_online, 60, interval=0.2, what="edge and devices ONLINE")
        yield s
    finally:
        for e in s.emitters:
            if e.proc is not None:
                stop(e.proc)
        stop(s.edge)
        stop(s.hub.proc)
        stop(s.broker.proc)


def _all_delivered(stack: Stack, timeout: float = 60) -> None:
    """Every seq each device recorded is at the hub exactly once and in order (the devices keep running)."""

    promised = {e.device_id: e.emitted() for e in stack.emitters}  # emit() returned for each of these

    def delivered() -> bool:
        return all(set(promised[e.device_id]) <= set(stack.ticks(e.device_id)) for e in stack.emitters)

    wait_for(delivered, timeout, interval=0.5, what="every emitted event at the hub")
    for e in stack.emitters:
        emitted, held = promised[e.device_id], stack.ticks(e.device_id)
        assert len(held) == len(set(held)), f"{e.device_id}: an event is held twice"
        assert held == sorted(held), f"{e.device_id}: events out of order"
        missing = sorted(set(emitted) - set(held))
        assert not missing, f"{e.device_id}: {len(missing)} events lost: {missing[:10]}"


def _running(stack: Stack, seconds: float) -> None:
    """Let the devices emit for ``seconds`` (and check that they do)."""
    before = {e.device_id: len(e.emitted()) for e in stack.emitters}
    time.sleep(seconds)
    for e in stack.emitters:
        assert e.proc is not None and e.proc.poll() is None, f"{e.device_id} exited: {e.log.read_text()[-2000:]}"
        assert len(e.emitted()) > before[e.device_id], f"{e.device_id} stopped emitting"


def test_edge_killed_for_10_s_loses_nothing(stack: Stack) -> None:
    _running(stack, 2)
    stack.kill_edge()
    _running(stack, 10)
    stack.start_edge()
    _running(stack, 3)
    _all_delivered(stack)


def test_broker_killed_for_30_s_loses_nothing_and_everyone_is_online_within_10_s(stack: Stack) -> None:
    _running(stack, 2)
    stop(stack.broker.proc, signal.SIGKILL)
    _running(stack, 30)
    stack.broker = start_broker(stack.broker.data_dir, stack.broker.port)
    back = time.monotonic()
    wait_for(stack.all_online, 30, interval=0.1, what="every node and device ONLINE after the broker's restart")
    took = time.monotonic() - back
    assert took <= 10, f"ONLINE again {took:.1f} s after the broker's restart"
    _running(stack, 2)
    _all_delivered(stack)


def test_hub_and_broker_killed_together_for_30_s_lose_nothing(stack: Stack) -> None:
    _running(stack, 2)
    stop(stack.hub.proc, signal.SIGKILL)
    stop(stack.broker.proc, signal.SIGKILL)
    _running(stack, 30)
    stack.broker = start_broker(stack.broker.data_dir, stack.broker.port)
    stack.hub = restart_hub(stack.hub)
    wait_for(stack.all_online, 30, interval=0.2, what="every node and device ONLINE after the restart")
    _running(stack, 2)
    _all_delivered(stack)


def test_event_emitted_before_the_device_is_killed_arrives_after_its_restart(stack: Stack) -> None:
    victim = stack.emitters[0]
    assert victim.proc is not None
    _running(stack, 1)
    stop(victim.proc, signal.SIGKILL)  # right after an emit() returned: its seq is the record's last line
    last = victim.emitted()[-1]
    victim.start()
    wait_for(lambda: last in stack.ticks(victim.device_id), 30, interval=0.2, what=f"event {last} at the hub")
    _all_delivered(stack)
