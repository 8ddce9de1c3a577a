"""Task run management end to end (DESIGN §4.3): hub + brokers + an edge process + device processes.

Three devices run ``aisynergy device run`` (separate processes, so one can be killed with SIGKILL); the
model they run arrives through a deployment (§8.2), the inputs as a dataset artefact through the edge's
cache; outputs come back as events through the edge and are gathered by the hub.
"""

from __future__ import annotations

import io
import json
import os
import signal
import sqlite3
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnxruntime as ort
import pytest
from safetensors.numpy import load

from tests.integration.devstack import DevStack, create_deployment, start_devstack, upload_artifact, wait_deployment_final
from tests.support import AISYNERGY, start, stop, wait_for

MODEL = Path(__file__).parent.parent / "fixtures" / "models" / "mlp-1.0.0.onnx"
FINAL = {"SUCCEEDED", "FAILED", "CANCELED", "TIMED_OUT"}


class DeviceProcess:
    """``aisynergy device run`` for one registered device, killable with SIGKILL."""

    def __init__(self, stack: DevStack, name: str) -> None:
        with stack.hub.client("operator") as api:
            self.device_id = api.post("/devices", json={"node_id": stack.node_id, "name": name, "model": "test-board"}).json()["id"]
            issued = api.post(f"/devices/{self.device_id}/bootstrap-token", json={}).json()
        # as on a real site, the device starts after the devices' broker's access list knows it (see test_firmware_rollout)
        acl = stack.data / "devices-broker" / "acl"
        wait_for(lambda: acl.exists() and self.device_id in acl.read_text(), 60, what="the devices' broker knows the device")
        self.log = stack.data / f"{name}.log"
        self.args = [*AISYNERGY, "device", "run", "--device-id", self.device_id, "--data-dir", str(stack.data / name),
                     *stack.enrolment_args(issued)]  # fmt: skip
        self.proc: subprocess.Popen[bytes] = start(self.args, self.log)

    def kill_9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def throttle(self, on_s: float = 0.005, off_s: float = 0.095) -> threading.Event:
        """Make this a slow device: it runs ``on_s`` of every ``on_s + off_s`` (SIGSTOP/SIGCONT) until the event is set."""
        done = threading.Event()

        def cycle() -> None:
            while not done.is_set() and self.proc.poll() is None:
                self.proc.send_signal(signal.SIGCONT)
                time.sleep(on_s)
                if self.proc.poll() is None:
                    self.proc.send_signal(signal.SIGSTOP)
                time.sleep(off_s)
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGCONT)

        threading.Thread(target=cycle, daemon=True).start()
        return done

    def stop(self) -> None:
        if self.proc.poll() is None:
            stop(self.proc)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DevStack, list[DeviceProcess]]]:
    tmp = tmp_path_factory.mktemp("tasks")
    stack = start_devstack(tmp, f"sqlite:///{tmp / 'hub.db'}")
    devices: list[DeviceProcess] = []
    try:
        devices = [DeviceProcess(stack, f"dev-{i}") for i in range(3)]
        wait_for(lambda: all(stack.device_state(d.device_id) == "ONLINE" for d in devices), 60, what="3 devices ONLINE")
        model = upload_artifact(stack, MODEL.read_bytes(), "model", "mlp", "1.0.0", "onnx")
        deployment = create_deployment(stack, model["id"], {"ids": [d.device_id for d in devices]})
        assert wait_deployment_final(stack, deployment["id"])["state"] == "SUCCEEDED"
        yield stack, devices
    finally:
        for d in devices:
            d.stop()
        stack.close()


def _dataset(stack: DevStack, rows: int, name: str, seed: int) -> tuple[str, np.ndarray]:
    data = np.random.default_rng(seed).standard_normal((rows, 128)).astype(np.float32)
    buf = io.BytesIO()
    np.save(buf, data, allow_pickle=False)
    return upload_artifact(stack, buf.getvalue(), "dataset", name, "1", "npy")["id"], data


def _create(stack: DevStack, **body: Any) -> dict[str, Any]:
    with stack.hub.client("operator") as api:
        r = api.post("/tasks", json=body)
        assert r.status_code == 201, r.text
        return r.json()  # type: ignore[no-any-return]


def _get(stack: DevStack, path: str) -> Any:
    with stack.hub.client("viewer") as api:
        r = api.get(path)
        assert r.status_code == 200, r.text
        return r.json()


def _wait_final(stack: DevStack, task_id: str, timeout: float = 120) -> dict[str, Any]:
    return wait_for(lambda: (t := _get(stack, f"/tasks/{task_id}"))["state"] in FINAL and t, timeout, interval=0.2, what=f"task {task_id} final")  # type: ignore[return-value]


def _direct(inputs: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(MODEL), providers=["CPUExecutionProvider"])
    return session.run(["probabilities"], {"x": inputs})[0]  # type: ignore[no-any-return]


def _gathered(stack: DevStack, task_id: str) -> dict[str, np.ndarray]:
    with stack.hub.client("viewer") as api:
        r = api.get(f"/tasks/{task_id}/outputs/content")
        assert r.status_code == 200, r.text
        return load(r.content)


def test_batch_inference_over_three_devices_matches_the_model(site: tuple[DevStack, list[DeviceProcess]]) -> None:
    stack, devices = site
    inputs_id, inputs = _dataset(stack, 1000, "inputs-small", seed=1)
    task = _create(stack, type="batch_inference", spec={"model": {"name": "mlp"}, "inputs": inputs_id, "chunk_size": 64},
                   placement={"ids": [d.device_id for d in devices]}, heartbeat_s=0.5)  # fmt: skip
    done = _wait_final(stack, task["id"])
    assert done["state"] == "SUCCEEDED", done
    workers = _get(stack, f"/tasks/{task['id']}/workers")
    assert sorted(w["target_id"] for w in workers) == sorted(d.device_id for d in devices)
    assert all(w["state"] == "SUCCEEDED" for w in workers)
    outputs = _gathered(stack, task["id"])
    assert outputs["probabilities"].shape == (1000, 10)
    np.testing.assert_allclose(outputs["probabilities"], _direct(inputs), rtol=1e-5, atol=1e-6)
    metrics = _get(stack, f"/tasks/{task['id']}/metrics")
    assert metrics["totals"].get("items_done") == 1000


def test_inference_service_counts_requests_and_ends_after_its_duration(site: tuple[DevStack, list[DeviceProcess]]) -> None:
    stack, devices = site
    served = devices[1:]
    task = _create(stack, type="inference", spec={"model": {"name": "mlp", "version": "1.0.0"}, "duration_s": 4, "report_interval_s": 0.5},
                   placement={"ids": [d.device_id for d in served]}, heartbeat_s=0.5)  # fmt: skip
    wait_for(lambda: _get(stack, f"/tasks/{task['id']}")["state"] == "RUNNING", 30, interval=0.1, what="inference task RUNNING")
    x = np.random.default_rng(4).standard_normal((2, 128)).astype(np.float32)
    with stack.hub.client("operator") as api:
        for d in served:
            for _ in range(3):
                r = api.post(f"/devices/{d.device_id}/commands", json={"name": "infer", "args": {"inputs": {"x": x.tolist()}}, "timeout_s": 10})
                assert r.status_code == 200 and r.json()["ok"], r.text
                np.testing.assert_allclose(np.array(r.json()["result"]["outputs"]["probabilities"], np.float32), _direct(x), rtol=1e-5, atol=1e-6)
    done = _wait_final(stack, task["id"], timeout=60)
    assert done["state"] == "SUCCEEDED", done
    assert {w["state"] for w in _get(stack, f"/tasks/{task['id']}/workers")} == {"SUCCEEDED"}
    metrics = _get(stack, f"/tasks/{task['id']}/metrics")
    assert metrics["totals"]["requests"] >= 6 and set(metrics["workers"]) == {w["id"] for w in _get(stack, f"/tasks/{task['id']}/workers")}


def test_cli_creates_watches_and_follows_a_task(site: tuple[DevStack, list[DeviceProcess]], tmp_path: Path) -> None:
    """What an integrator types: ``aisynergy task create --inputs x.npy --watch``, then ``logs -f`` and ``outputs --out``."""
    stack, devices = site
    inputs = np.random.default_rng(3).standard_normal((300, 128)).astype(np.float32)
    np.save(tmp_path / "x.npy", inputs, allow_pickle=False)
    env = {**os.environ, "AISYNERGY_HUB_URL": stack.hub.url, "AISYNERGY_TOKEN": stack.hub.tokens["operator"]}
    ids = ",".join(d.device_id for d in devices)
    created = subprocess.run([*AISYNERGY, "task", "create", "--type", "batch_inference", "--model", "mlp:1.0.0", "--inputs", str(tmp_path / "x.npy"),
                              "--chunk-size", "32", "--ids", ids, "--heartbeat", "1", "--watch"], env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert created.returncode == 0, created.stdout[-2000:] + created.stderr[-2000:]
    with stack.hub.client("viewer") as api:
        task_id = api.get("/tasks", params={"limit": 200}).json()["items"][-1]["id"]
    assert _get(stack, f"/tasks/{task_id}")["state"] == "SUCCEEDED"
    logs = subprocess.run([*AISYNERGY, "task", "logs", "-f", task_id], env=env, capture_output=True, text=True, timeout=60)
    assert logs.returncode == 0, logs.stderr[-2000:]
    assert "chunk 0:" in logs.stdout and "SUCCEEDED" in logs.stdout + logs.stderr
    out = subprocess.run([*AISYNERGY, "task", "outputs", task_id, "--out", str(tmp_path / "y.safetensors")], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    gathered = load((tmp_path / "y.safetensors").read_bytes())["probabilities"]
    np.testing.assert_allclose(gathered, _direct(inputs), rtol=1e-5, atol=1e-6)


def test_kill_9_one_device_mid_task_reschedules_its_shard(site: tuple[DevStack, list[DeviceProcess]]) -> None:
    stack, devices = site
    rows, chunk = 3 * 200 * 32, 32
    inputs_id, inputs = _dataset(stack, rows, "inputs-large", seed=2)
    lines: list[dict[str, Any]] = []
    reader = threading.Thread(target=_read_sse, args=(stack, lines), daemon=True)
    victim = devices[0]
    slow = victim.throttle()  # a slow board: the test catches it in the middle of its shard
    task = _create(stack, type="batch_inference", spec={"model": {"name": "mlp"}, "inputs": inputs_id, "chunk_size": chunk},
                   placement={"ids": [d.device_id for d in devices]}, heartbeat_s=0.5, retry={"backoff_s": 0})  # fmt: skip
    reader.task_id = task["id"]  # type: ignore[attr-defined]
    reader.start()
    db = sqlite3.connect(f"file:{stack.data.parent / 'hub.db'}?mode=ro", uri=True, timeout=30)

    def victim_chunks() -> tuple[int, int]:
        rows_ = db.execute(
            "SELECT c.state FROM task_chunks c JOIN task_workers w ON c.worker_id = w.id WHERE c.task_id = ? AND w.target_id = ?",
            (task["id"], victim.device_id),
        ).fetchall()
        return sum(1 for (s,) in rows_ if s == "DONE"), len(rows_)

    wait_for(lambda: victim_chunks()[0] >= 1, 60, interval=0.01, what="the victim's first chunk stored")
    victim.kill_9()
    slow.set()
    done_at_kill, owned = victim_chunks()
    assert done_at_kill < owned, "the victim finished its shard before it was killed; the test proves nothing"
    done = _wait_final(stack, task["id"])
    assert done["state"] == "SUCCEEDED", done
    workers = _get(stack, f"/tasks/{task['id']}/workers")
    lost = [w for w in workers if w["target_id"] == victim.device_id]
    assert [w["state"] for w in lost] == ["LOST"], lost
    survivors = [w for w in workers if w["target_id"] != victim.device_id]
    assert all(w["state"] == "SUCCEEDED" for w in survivors)
    assert sum(w["items_assigned"] for w in survivors) > rows * 2 // 3  # they took the victim's unfinished chunks
    # every input has exactly one output, equal to running the model directly
    outputs = _gathered(stack, task["id"])["probabilities"]
    assert outputs.shape == (rows, 10)
    np.testing.assert_allclose(outputs, _direct(inputs), rtol=1e-5, atol=1e-6)
    (stored,) = db.execute("SELECT COUNT(*) FROM task_chunks WHERE task_id = ? AND state = 'DONE'", (task["id"],)).fetchone()
    assert stored == rows // chunk
    # the SSE reader saw the whole log, in order, while the task ran
    reader.join(30)
    assert lines and lines[-1]["event"] == "end"
    ids = [int(e["id"]) for e in lines if e["event"] == "log"]
    assert ids == sorted(ids) and len(ids) == len(set(ids))
    texts = [json.loads(e["data"])["text"] for e in lines if e["event"] == "log"]
    assert any("LOST" in t for t in texts)
    for worker in survivors:  # each worker's own lines arrive in the order it wrote them
        chunks = [int(t.split()[1].rstrip(":")) for e in lines if e["event"] == "log"
                  for t in [json.loads(e["data"])["text"]] if json.loads(e["data"])["worker_id"] == worker["id"] and t.startswith("chunk ")]  # fmt: skip
        assert chunks, "no chunk lines from a worker"


def _read_sse(stack: DevStack, out: list[dict[str, Any]]) -> None:
    """A plain HTTP client on the hub's real port: parse Server-Sent Events until ``end``."""
    task_id = threading.current_thread().task_id  # type: ignore[attr-defined]
    headers = {"Authorization": f"Bearer {stack.hub.tokens['viewer']}", "Accept": "text/event-stream"}
    event: dict[str, Any] = {}
    with httpx.stream("GET", f"{stack.hub.url}/api/v1/tasks/{task_id}/logs", headers=headers, timeout=httpx.Timeout(10, read=60)) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line:
                if "event" in event:
                    out.append(event)
                    if event["event"] == "end":
                        return
                event = {}
            elif not line.startswith(":"):
                key, _, value = line.partition(":")
                event[key] = value[1:] if value.startswith(" ") else value
