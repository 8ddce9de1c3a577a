"""A three-tier stack for device tests: hub + its broker, an edge with its own devices' broker, devices.

The edge connects upstream to the hub's broker and downstream to a second broker that shares the hub's
PKI and access files, so "the cloud" (hub and upstream broker) can be stopped while the edge and its
devices carry on. Devices run in the test process through the importable :class:`device.agent.Device`.
"""

from __future__ import annotations

import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support import AISYNERGY, Broker, Hub, free_port, start, start_broker, start_hub, stop, wait_for

HEARTBEAT_S = 0.5


@dataclass
class DevStack:
    data: Path
    database_url: str
    upstream: Broker
    downstream: Broker
    hub: Hub
    node_id: str = ""
    edge: subprocess.Popen[bytes] | None = None
    enrol_port: int = field(default_factory=free_port)
    devices: list = field(default_factory=list)  # type: ignore[type-arg]
    edge_args: list[str] = field(default_factory=list)  # more options of ``edge run`` (e.g. the site's --dataset)

    @property
    def enrol_url(self) -> str:
        return f"https://127.0.0.1:{self.enrol_port}"  # the edge's listener: HTTPS with the node's certificate

    def enrolment_args(self, issued: dict[str, str]) -> list[str]:
        """``aisynergy device run``'s first-start options from the hub's bootstrap-token answer."""
        return ["--enrol-url", self.enrol_url, "--bootstrap-token", issued["bootstrap_token"],
                "--ca-sha256", issued["ca_sha256"], "--tls-server-name", issued["tls_server_name"]]  # fmt: skip

    def start_edge(self, token: str | None = None) -> None:
        args = [*AISYNERGY, "edge", "run", "--hub", self.hub.url, "--node-id", self.node_id, "--data-dir", str(self.data / "edge"),
                "--downstream-mqtt-url", self.downstream.url, "--device-listen", f"127.0.0.1:{self.enrol_port}"]  # fmt: skip
        if token:
            args += ["--bootstrap-token", token]
        self.edge = start([*args, *self.edge_args], self.data / "edge.log")

    def add_device(self, name: str, handlers: dict | None = None, on_desired=None):  # type: ignore[no-untyped-def]
        """Register a device at the hub and start it in this process, enrolling through the edge."""
        from device.agent import Device

        with self.hub.client("operator") as api:
            device_id = api.post("/devices", json={"node_id": self.node_id, "name": name, "model": "test-board"}).json()["id"]
            issued = api.post(f"/devices/{device_id}/bootstrap-token", json={}).json()
        acl = self.data / "devices-broker" / "acl"  # the broker reloads its access file a moment after the hub writes it
        wait_for(lambda: acl.exists() and device_id in acl.read_text(), 60, what="the devices' broker knows the device")
        dev = Device(device_id, self.data / name, enrol_url=self.enrol_url, bootstrap_token=issued["bootstrap_token"],
                     ca_sha256=issued["ca_sha256"], tls_server_name=issued["tls_server_name"])  # fmt: skip
        for command, handler in (handlers or {}).items():
            dev.command(command)(handler)
        if on_desired is not None:
            dev.on_desired(on_desired)
        dev.start()
        self.devices.append(dev)
        return dev

    def restart_device(self, dev, on_desired=None):  # type: ignore[no-untyped-def]
        from device.agent import Device

        new = Device(dev.device_id, self.data / dev.data_dir.name)
        if on_desired is not None:
            new.on_desired(on_desired)
        new.start()
        self.devices.append(new)
        return new

    def device_state(self, device_id: str) -> str | None:
        with self.hub.client("viewer") as api:
            r = api.get(f"/devices/{device_id}/status")
            return r.json()["state"] if r.status_code == 200 else None

    def close(self) -> None:
        for dev in self.devices:
            try:
                dev.stop()
            except Exception:  # noqa: BLE001 - best effort in teardown
                pass
        if self.edge is not None:
            self.edge.send_signal(signal.SIGCONT)
            stop(self.edge)
        stop(self.hub.proc)
        stop(self.upstream.proc)
        stop(self.downstream.proc)


def start_devstack(tmp_path: Path, database_url: str, edge_args: list[str] | None = None) -> DevStack:
    data = tmp_path / "stack"
    upstream = start_broker(data)
    downstream = start_broker(data, instance="devices-broker")
    hub = start_hub(data, database_url, upstream.url, heartbeat_interval=HEARTBEAT_S, offline_after_missed=4)
    stack = DevStack(data, database_url, upstream, downstream, hub, edge_args=list(edge_args or []))
    with hub.client("operator") as api:
        reg = api.post("/nodes", json={"name": "edge-under-test"}).json()
    stack.node_id = reg["node"]["id"]
    stack.start_edge(reg["bootstrap_token"])
    with hub.client("viewer") as api:
        wait_for(lambda: api.get(f"/nodes/{stack.node_id}/status").json()["state"] == "ONLINE", 30, what="edge ONLINE")
    return stack


# ---- deployments through the public API (DESIGN §4.2) ---------------------------------------------
FINAL_DEPLOYMENT = frozenset({"SUCCEEDED", "FAILED", "CANCELED", "ROLLED_BACK"})


def upload_artifact(stack: DevStack, data: bytes, kind: str, name: str, version: str, fmt: str) -> dict:  # type: ignore[type-arg]
    """``POST /artifacts`` (multipart) as operator; the ArtifactPublic document."""
    with stack.hub.client("operator") as api:
        r = api.post("/artifacts", data={"kind": kind, "name": name, "version": version, "format": fmt},
                     files={"file": (f"{name}-{version}", data, "application/octet-stream")})  # fmt: skip
        assert r.status_code == 201, r.text
        return r.json()  # type: ignore[no-any-return]


def create_deployment(stack: DevStack, artifact_id: str, target: dict, **options: object) -> dict:  # type: ignore[type-arg]
    """``POST /deployments`` as operator; the DeploymentDetail document."""
    with stack.hub.client("operator") as api:
        r = api.post("/deployments", json={"artifact_id": artifact_id, "target": target, **options})
        assert r.status_code == 201, r.text
        return r.json()  # type: ignore[no-any-return]


def wait_deployment_final(stack: DevStack, deployment_id: str, timeout: float = 90) -> dict:  # type: ignore[type-arg]
    """Poll ``GET /deployments/{id}`` until the deployment is final and nothing is rolling back."""
    last: dict = {}  # type: ignore[type-arg]

    def done() -> bool:
        nonlocal last
        with stack.hub.client("viewer") as api:
            r = api.get(f"/deployments/{deployment_id}")
        if r.status_code != 200:
            return False
        last = r.json()
        return last["state"] in FINAL_DEPLOYMENT and all(e["state"] != "ROLLING_BACK" for e in last["executions"])

    try:
        wait_for(done, timeout, interval=0.2, what=f"deployment {deployment_id} final")
    except AssertionError:
        raise AssertionError(f"deployment not final in {timeout} s: {last.get('state')} {last.get('counts')}") from None
    return last


def api(stack: DevStack, method: str, path: str, role: str = "operator", **kw: object) -> Any:
    """One REST call as ``role``; asserts a 200 or 201 and returns the JSON."""
    with stack.hub.client(role) as client:
        r = client.request(method, path, **kw)  # type: ignore[arg-type]
        assert r.status_code in (200, 201), r.text
        return r.json()
