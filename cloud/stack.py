"""The local stack behind ``aisynergy up``: broker, hub and one edge agent as child processes.

Everything lives in one data directory, so a second ``up`` resumes the same stack:

    DIR/pki/ broker/ hub.db      hub CA, broker config, SQLite database
    DIR/admin.token               the admin bearer token printed at start (0600)
    DIR/*.bootstrap               a first start's one-time tokens, handed to the agents as files (0600, removed
                                  once the agent is ONLINE): a command line is visible to every user

The hub serves HTTPS with a certificate from its CA, and the edge's device listener with the node's own;
the edge and the devices check the CA's fingerprint (``--ca-sha256``) before they send their tokens.
    DIR/stack.json                the edge node's id and the devices' ids
    DIR/edge-1/                   the edge agent's identity and local state
    DIR/device-N/                 each device's identity and state
    DIR/logs/*.log                each child's output
"""

from __future__ import annotations

import json
import logging
import os
import signal
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from cloud.broker.config import BrokerLayout

log = logging.getLogger("aisynergy.up")
CLI = [sys.executable, "-m", "cloud.cli.root"]
STACK_LABELS = {"stack": "local", "zone": "a"}
"""The edge's labels: the selectors of the README's examples match the local stack as it starts."""
DEVICE_LABELS = {"stack": "local", "zone": "a", "site": "a", "tier": "board"}
"""The devices' labels (``--selector zone=a``, ``site=a``, ``tier=board`` in the README)."""
DIGITS_DATASET = "camera"
"""``up --datasets digits``: the name of each device's dataset (the README's tasks train on ``camera``)"""
ACL_RELOAD_GRACE_S = 0.5  # the broker reloads its access list a moment after the file changes


class StackError(RuntimeError):
    pass


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]


@dataclass
class Stack:
    data_dir: Path
    hub_port: int = 8000
    broker_port: int = 8883
    devices: int = 2
    enrol_port: int = 8090
    host: str = "127.0.0.1"
    children: list[Child] = field(default_factory=list)
    admin_token: str = ""
    node_id: str = ""
    device_ids: list[str] = field(default_factory=list)
    datasets: str | None = None
    """``digits``: every device keeps a non-IID shard of scikit-learn's digits as its dataset ``camera``, and the
    hub has the digits model deployed on them and a held-out set (:meth:`_digits_on_hub`)"""
    digits: dict[str, str] = field(default_factory=dict)
    """with ``datasets`` digits: what was set up (the model's and the held-out set's artefact ids, images a device)"""

    @property
    def hub_url(self) -> str:
        return f"https://{self.host}:{self.hub_port}"

    @property
    def ca_path(self) -> Path:
        return self.data_dir / "pki" / "ca.crt"

    @property
    def broker_url(self) -> str:
        return f"mqtts://{self.host}:{self.broker_port}"

    def _spawn(self, name: str, args: list[str]) -> Child:
        logs = self.data_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        out = (logs / f"{name}.log").open("ab")
        proc = subprocess.Popen([*CLI, *args], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        child = Child(name, proc)
        self.children.append(child)
        log.info("started %s (pid %d), log %s", name, proc.pid, logs / f"{name}.log")
        return child

    def _wait(self, what: str, check: object, child: Child, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if child.proc.poll() is not None:
                raise StackError(f"{what}: {child.name} exited with {child.proc.returncode} (see {self.data_dir}/logs/{child.name}.log)")
            try:
                if check():  # type: ignore[operator]
                    return
            except (httpx.HTTPError, OSError):
                pass
            time.sleep(0.2)
        raise StackError(f"timed out waiting for {what}")

    def start_hub(self) -> None:
        """The broker, then the hub on it; the admin token (made on a first start)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        d = str(self.data_dir)
        broker = self._spawn("broker", ["broker", "run", "--data-dir", d, "--host", self.host, "--port", str(self.broker_port)])
        import socket

        def broker_up() -> bool:
            with socket.create_connection((self.host, self.broker_port), timeout=0.5):
                return True

        self._wait("the broker", broker_up, broker)
        hub = self._spawn("hub", ["hub", "serve", "--data-dir", d, "--host", self.host, "--port", str(self.hub_port), "--broker-url", self.broker_url])
        healthy = lambda: httpx.get(self.hub_url + "/healthz", timeout=1, verify=self._verify()).json()["mqtt"]["connected"]  # noqa: E731
        self._wait("the hub", healthy, hub)
        self.admin_token = self._admin_token()

    def start_edge(self, name: str, node_id: str, token: str | None, pin: str, extra: list[str] | None = None) -> Child:
        """The edge agent ``name`` (its state in ``DIR/<name>/``) for node ``node_id``, ONLINE; ``token`` and ``pin``:
        a first start's bootstrap token and the CA's fingerprint (handed over in a 0600 file, removed once ONLINE)."""
        args = ["edge", "run", "--hub", self.hub_url, "--node-id", node_id, "--data-dir", str(self.data_dir / name), *(extra or [])]
        if token:
            args += ["--bootstrap-token-file", str(self._token_file(name, token)), "--ca-sha256", pin]
        edge = self._spawn(name, args)
        self._wait(f"{name} to come ONLINE", lambda: self._state(f"/nodes/{node_id}/status") == "ONLINE", edge, timeout=90)
        self._forget_token(name)
        return edge

    def start(self) -> None:
        self.start_hub()
        node_id, token, pin = self._edge_node()
        self.start_edge("edge-1", node_id, token, pin, ["--device-listen", f"{self.host}:{self.enrol_port}"])
        enrol_url = f"https://{self.host}:{self.enrol_port}"
        broker = self.children[0]
        devices = self._devices(node_id)
        # a device is started once the broker has loaded the access list that names it (it reloads the list
        # a moment after the hub registers the device); one connecting in between was seen cut off
        acl = BrokerLayout(self.data_dir).acl_file
        self._wait("the broker to know the devices", lambda: all(d in acl.read_text() for d, _ in devices), broker, timeout=15)
        time.sleep(ACL_RELOAD_GRACE_S)
        shards = self._digits_shards(len(devices)) if self.datasets == "digits" else []
        for index, (device_id, issued) in enumerate(devices, start=1):
            name = f"device-{index}"
            args = ["device", "run", "--device-id", device_id, "--data-dir", str(self.data_dir / name), "--enrol-url", enrol_url]
            if shards:
                args += ["--dataset", f"{DIGITS_DATASET}={shards[index - 1]}"]
            if issued is not None:
                args += ["--bootstrap-token-file", str(self._token_file(name, issued["bootstrap_token"])),
                         "--ca-sha256", issued["ca_sha256"], "--tls-server-name", issued["tls_server_name"]]  # fmt: skip
            device = self._spawn(name, args)
            self._wait(f"{name} to come ONLINE", lambda d=device_id: self._state(f"/devices/{d}/status") == "ONLINE", device)
            self._forget_token(name)
        if self.datasets == "digits" and self.device_ids:
            self._digits_on_hub()

    def _digits_shards(self, count: int) -> list[Path]:
        """``DIR/datasets/device-K.npz``: non-IID shards (Dirichlet α 0.5 over the labels, seed 0) of the digits'
        training split, ``x`` float32 [N, 64] (pixel / 16), ``y`` int64; and ``digits-test.npz``, the held-out split.
        Written once: a resumed stack keeps them."""
        import numpy as np

        from cloud.simulation.quality import DIGITS_CLASSES, dirichlet_split, load_digits

        directory = self.data_dir / "datasets"
        paths = [directory / f"device-{k + 1}.npz" for k in range(count)]
        if all(p.exists() for p in paths) and (directory / "digits-test.npz").exists():
            return paths
        data = load_digits()
        directory.mkdir(parents=True, exist_ok=True)
        parts = dirichlet_split(data.y_train, count, 0.5, np.random.default_rng(0), classes=DIGITS_CLASSES)
        for path, rows in zip(paths, parts, strict=True):
            np.savez(path, x=data.x_train[rows], y=data.y_train[rows])
        np.savez(directory / "digits-test.npz", x=data.x_test, y=data.y_test)
        return paths

    def _digits_on_hub(self) -> None:
        """The digits model (``digits`` 1.0.0, ONNX, x [batch, 64] -> logits) stored and deployed to the stack's
        devices, and the held-out split as a safetensors dataset ``digits-held-out`` 1.0.0 (a federated task's
        ``eval_inputs``): what the README's federated, DP and split sections start from."""
        import numpy as np
        from safetensors.numpy import save

        held = np.load(self.data_dir / "datasets" / "digits-test.npz")
        with self.api() as api:
            model = self._stored(api, "model", "digits", "1.0.0", "onnx", (Path(__file__).parent / "ml" / "models" / "digits-mlp.onnx").read_bytes())
            test = self._stored(api, "dataset", "digits-held-out", "1.0.0", "safetensors", save({"x": held["x"], "y": held["y"]}))
            self.digits = {"model": model, "held_out": test}
            deployed = [d for d in api.get("/deployments", params={"limit": 500}).json()["items"] if d["name"] == "digits-on-the-stack"]
            if not deployed:
                r = api.post("/deployments", json={"artifact_id": model, "name": "digits-on-the-stack", "target": {"kind": "device", "selector": "stack=local"},
                                                   "strategy": {"type": "all_at_once"}})  # fmt: skip
                r.raise_for_status()
                deployed = [r.json()]
            done = lambda: api.get(f"/deployments/{deployed[0]['id']}").json()["state"] in ("SUCCEEDED", "FAILED", "CANCELED", "ROLLED_BACK")  # noqa: E731
            self._wait("the digits model on the devices", done, self.children[1], timeout=120)
            state = api.get(f"/deployments/{deployed[0]['id']}").json()["state"]
            if state != "SUCCEEDED":
                raise StackError(f"deploying the digits model to the devices ended {state}; see GET /deployments/{deployed[0]['id']}")

    def _stored(self, api: Any, kind: str, name: str, version: str, fmt: str, data: bytes) -> str:
        """The id of the artefact ``kind`` ``name`` ``version``, uploading ``data`` when it is not stored yet."""
        r = api.post("/artifacts", data={"kind": kind, "name": name, "version": version, "format": fmt}, files={"file": (f"{name}.{fmt}", data)})
        if r.status_code == 409 and r.json().get("artifact_id"):
            return str(r.json()["artifact_id"])
        r.raise_for_status()
        return str(r.json()["id"])

    def _verify(self) -> ssl.SSLContext:
        """The hub's HTTPS is checked against the hub CA (made by the broker's first start)."""
        return ssl.create_default_context(cafile=str(self.ca_path))

    def _token_file(self, name: str, token: str) -> Path:
        path = self.data_dir / f"{name}.bootstrap"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(token + "\n")
        return path

    def _forget_token(self, name: str) -> None:
        (self.data_dir / f"{name}.bootstrap").unlink(missing_ok=True)  # used: the agent holds its certificate now

    def _admin_token(self) -> str:
        path = self.data_dir / "admin.token"
        if path.exists():
            return path.read_text().strip()
        out = subprocess.run([*CLI, "hub", "token", "create", "--role", "admin", "--name", "aisynergy up", "--data-dir", str(self.data_dir)],
                             check=True, capture_output=True, text=True)  # fmt: skip
        token = out.stdout.strip().splitlines()[-1]
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(token + "\n")
        return token

    def api(self) -> httpx.Client:
        return httpx.Client(base_url=self.hub_url + "/api/v1", headers={"Authorization": f"Bearer {self.admin_token}"}, timeout=5, verify=self._verify())

    @property
    def _state_file(self) -> Path:
        return self.data_dir / "stack.json"

    def _saved(self) -> dict:  # type: ignore[type-arg]
        return json.loads(self._state_file.read_text()) if self._state_file.exists() else {}

    def _save(self, **values: object) -> None:
        self._state_file.write_text(json.dumps({**self._saved(), **values}) + "\n")

    def _edge_node(self) -> tuple[str, str | None, str]:
        """The edge node's id, registering it (and returning its bootstrap token) on first start; the CA's pin."""
        node_id = self._saved().get("edge_node_id")
        if node_id:
            with self.api() as api:
                if api.get(f"/nodes/{node_id}").status_code == 200:
                    self.node_id = node_id
                    return node_id, None, ""
        with self.api() as api:
            r = api.post("/nodes", json={"name": "edge-1", "labels": STACK_LABELS})
            r.raise_for_status()
            registered = r.json()
        self.node_id = registered["node"]["id"]
        self._save(edge_node_id=self.node_id, device_ids=[])
        return self.node_id, registered["bootstrap_token"], registered["ca_sha256"]

    def _devices(self, node_id: str) -> list[tuple[str, dict[str, str] | None]]:
        """``devices`` devices under the edge: (id, the bootstrap-token answer for those not enrolled yet)."""
        known = list(self._saved().get("device_ids", []))[: self.devices]
        out: list[tuple[str, dict[str, str] | None]] = []
        with self.api() as api:
            for index in range(self.devices):
                if index < len(known) and (self.data_dir / f"device-{index + 1}" / "enrolment.json").exists():
                    out.append((known[index], None))
                    continue
                if index < len(known) and api.get(f"/devices/{known[index]}").status_code == 200:
                    device_id = known[index]
                else:
                    r = api.post("/devices", json={"node_id": node_id, "name": f"device-{index + 1}", "model": "simulated", "labels": DEVICE_LABELS})
                    r.raise_for_status()
                    device_id = r.json()["id"]
                r = api.post(f"/devices/{device_id}/bootstrap-token", json={})
                r.raise_for_status()
                out.append((device_id, r.json()))
        self.device_ids = [d for d, _ in out]
        self._save(device_ids=self.device_ids)
        return out

    def _state(self, path: str) -> str | None:
        with self.api() as api:
            r = api.get(path)
            return r.json().get("state") if r.status_code == 200 else None

    def failed(self) -> Child | None:
        return next((c for c in self.children if c.proc.poll() is not None), None)

    def stop(self, timeout: float = 10) -> None:
        """Stop children in reverse order: SIGTERM to each process group, SIGKILL what is left."""
        for child in reversed(self.children):
            if child.proc.poll() is None:
                try:
                    os.killpg(child.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    continue
                try:
                    child.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop in %ss, killing it", child.name, timeout)
            try:
                os.killpg(child.proc.pid, signal.SIGKILL)  # anything the child left in its group
            except ProcessLookupError:
                pass
            child.proc.wait()
        self.children.clear()
