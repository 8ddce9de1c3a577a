"""A hub whose task scheduler the test drives (``tick()``), with devices that report through the ingest
exactly as MQTT events relayed by an edge would arrive (state, heartbeats with resources, task events)."""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy import select, update
from sqlmodel import Session

from cloud.artifacts import create_artifact
from cloud.ingest import StatusIngest
from cloud.scheduler import TaskController
from cloud.tables import Artifact, Device, Node, TaskWorker
from cloud.tasks.lifecycle import encode_chunk
from interfaces.auth import Role
from interfaces.deployments import ArtifactCreate
from interfaces.messages import ConnectionState, EventBody, HeartbeatBody, StateBody, envelope
from interfaces.resources import Resources
from interfaces.tasks import (
    ORDER_ADAPTER,
    TASK_LOG_EVENT,
    TASK_METRICS_EVENT,
    TASK_OUTPUT_EVENT,
    TASK_WORKER_EVENT,
    WorkerLog,
    WorkerMetrics,
    WorkerOrder,
    WorkerOutput,
    WorkerReport,
)  # fmt: skip
from tests.hub.conftest import HubUnderTest, hub_settings, running_hub

MODEL = {"name": "mlp", "version": "1.0.0"}
INSTALLED = {"model": {"name": "mlp", "version": "1.0.0", "sha256": "a" * 64}}


def resources(cores: int = 4, utilisation: float = 0.0, accelerators: list[dict[str, Any]] | None = None) -> Resources:
    return Resources.model_validate({
        "cpu": {"cores": cores, "utilisation": utilisation}, "memory": {"total_bytes": 8 << 30, "available_bytes": 4 << 30},
        "disk": {"path": "/", "total_bytes": 1 << 40, "free_bytes": 1 << 39}, "network": {"bytes_sent": 0, "bytes_received": 0},
        "accelerators": accelerators or [],
    })  # fmt: skip


@dataclass
class TaskFleet:
    hub: HubUnderTest
    blobs: Any
    controller: TaskController
    ingest: StatusIngest
    node_of: dict[str, str] = field(default_factory=dict)
    seq: int = 0

    @property
    def engine(self) -> Any:
        return self.hub.engine

    def tick(self, at: datetime | None = None) -> int:
        return self.controller.tick(at)

    def fresh_controller(self) -> TaskController:
        return TaskController(self.engine, self.controller.signing, blobs=self.blobs)

    # --- targets -----------------------------------------------------------------------------------

    def node(self, name: str = "gw", online: bool = True) -> str:
        node_id: str = self.hub.register(name)["node"]["id"]
        if online:
            self.ingest.offer(node_id, StateBody(state=ConnectionState.ONLINE))
            self.ingest.flush()
        return node_id

    def device(self, node_id: str, cores: int = 4, online: bool = True, installed: dict[str, Any] | None = INSTALLED,
               labels: dict[str, str] | None = None, accelerators: list[dict[str, Any]] | None = None) -> str:  # fmt: skip
        device_id: str = self.hub.add_device(node_id, labels=labels)["id"]
        self.node_of[device_id] = node_id
        if online:
            self.set_online(device_id, cores=cores, accelerators=accelerators)
        if installed is not None:
            with Session(self.engine) as session:
                session.execute(update(Device).where(Device.id == device_id).values(reported={"installed": installed}))
                session.commit()
        return device_id

    def set_online(self, device_id: str, cores: int = 4, accelerators: list[dict[str, Any]] | None = None) -> None:
        via = self.node_of[device_id]
        self.ingest.offer(device_id, StateBody(state=ConnectionState.ONLINE), kind="device", via=via)
        self.seq += 1
        beat = HeartbeatBody(seq=self.seq, agent_version="test", uptime_s=1, resources=resources(cores, accelerators=accelerators))
        self.ingest.offer(device_id, beat, kind="device", via=via)
        self.ingest.flush()

    def set_offline(self, device_id: str) -> None:
        self.ingest.offer(device_id, StateBody(state=ConnectionState.OFFLINE, reason="will"), kind="device", via=self.node_of[device_id])
        self.ingest.flush()

    def lock(self, node_id: str) -> None:
        r = self.hub.request("PUT", f"/nodes/{node_id}/admin-state", Role.OPERATOR, json={"admin_state": "LOCKED"})
        assert r.status_code == 200, r.text

    # --- tasks -------------------------------------------------------------------------------------

    def dataset(self, rows: int = 100, features: int = 128, name: str = "inputs", fmt: str = "npy", seed: int = 0) -> tuple[str, np.ndarray]:
        data = np.random.default_rng(seed).standard_normal((rows, features)).astype(np.float32)
        if fmt == "npy":
            buf = io.BytesIO()
            np.save(buf, data, allow_pickle=False)
            payload = buf.getvalue()
        else:
            from safetensors.numpy import save

            payload = save({"x": data})
        body = ArtifactCreate(kind="dataset", name=name, version="1", format=fmt)  # type: ignore[arg-type]
        with Session(self.engine, expire_on_commit=False) as session, self.blobs.writer() as writer:
            writer.write(payload)
            artifact: Artifact = create_artifact(session, self.controller.signing, self.blobs, body, writer)
        return artifact.id, data

    def create(self, type_: str = "batch_inference", spec: dict[str, Any] | None = None, expect: int = 201, **body: Any) -> dict[str, Any]:
        r = self.hub.request("POST", "/tasks", Role.OPERATOR, json={"type": type_, "spec": spec or {}, **body})
        assert r.status_code == expect, r.text
        return r.json()  # type: ignore[no-any-return]

    def batch(self, inputs: str, chunk_size: int = 10, **body: Any) -> dict[str, Any]:
        return self.create("batch_inference", {"model": MODEL, "inputs": inputs, "chunk_size": chunk_size}, **body)

    def act(self, task_id: str, action: str, expect: int = 200) -> dict[str, Any]:
        r = self.hub.request("POST", f"/tasks/{task_id}/{action}", Role.OPERATOR)
        assert r.status_code == expect, r.text
        return r.json()  # type: ignore[no-any-return]

    def task(self, task_id: str) -> dict[str, Any]:
        r = self.hub.get(f"/tasks/{task_id}")
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]

    def workers(self, task_id: str) -> list[dict[str, Any]]:
        r = self.hub.get(f"/tasks/{task_id}/workers")
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]

    def orders(self, target_id: str, table: Any = Device) -> list[WorkerOrder]:
        with Session(self.engine) as session:
            row = session.get(table, target_id)
            assert row is not None
            return [ORDER_ADAPTER.validate_python(o) for o in row.tasks]

    def order_of(self, worker: dict[str, Any]) -> WorkerOrder:
        return next(o for o in self.orders(worker["target_id"]) if o.worker_id == worker["id"])

    def tasks_versions(self) -> dict[str, int]:
        with Session(self.engine) as session:
            rows = session.execute(select(Device.id, Device.tasks_version)).all() + session.execute(select(Node.id, Node.tasks_version)).all()
            return dict(rows)  # type: ignore[arg-type]

    def worker_row(self, worker_id: str) -> TaskWorker:
        with Session(self.engine) as session:
            row = session.get(TaskWorker, worker_id)
            assert row is not None
            return row

    # --- what workers send -------------------------------------------------------------------------

    def send(self, target_id: str, type_: str, data: Any, flush: bool = True, at: datetime | None = None) -> str:
        """An event of ``target_id`` as the hub receives it, ``at`` (default: now; a test that moves time by ticking
        at given times stamps the events it sends on the same clock)."""
        message = envelope(target_id, EventBody(type=type_, data=data.model_dump(mode="json")))
        if target_id in self.node_of:
            self.ingest.offer_event(self.node_of[target_id], target_id, message, at)
        else:
            self.ingest.offer_node_event(target_id, message, at)
        if flush:
            self.ingest.flush()
        return message.id

    def report(self, worker: dict[str, Any], state: str = "RUNNING", detail: str = "", **kw: Any) -> None:
        self.send(worker["target_id"], TASK_WORKER_EVENT, WorkerReport(worker_id=worker["id"], task_id=worker["task_id"], state=state, detail=detail, **kw))  # type: ignore[arg-type]

    def log(self, worker: dict[str, Any], *texts: str) -> str:
        lines = [{"ts": datetime.now(UTC), "level": "info", "text": t} for t in texts]
        return self.send(worker["target_id"], TASK_LOG_EVENT, WorkerLog(worker_id=worker["id"], task_id=worker["task_id"], lines=lines))  # type: ignore[arg-type]

    def metrics(self, worker: dict[str, Any], **values: float) -> None:
        self.send(worker["target_id"], TASK_METRICS_EVENT, WorkerMetrics(worker_id=worker["id"], task_id=worker["task_id"], ts=datetime.now(UTC), values=values))

    def output(self, worker: dict[str, Any], chunk: int, rows: np.ndarray, from_target: str | None = None) -> None:
        """The worker's outputs for ``chunk``: here 2 * the inputs' first 10 columns (the test's "model")."""
        out = {"probabilities": (rows[:, :10] * 2).astype(np.float32)}
        data = WorkerOutput(worker_id=worker["id"], task_id=worker["task_id"], chunk=chunk, items=len(rows), data=encode_chunk(out))
        self.send(from_target or worker["target_id"], TASK_OUTPUT_EVENT, data)

    def run_chunks(self, worker: dict[str, Any], inputs: np.ndarray, only: list[int] | None = None) -> list[int]:
        """Process every chunk the worker's order lists (or ``only`` those); returns the chunk indices sent."""
        order = self.order_of(worker)
        done = []
        for i in order.chunk_indices():
            if only is not None and i not in only:
                continue
            start, end = order.chunk_bounds(i)
            self.output(worker, i, inputs[start:end])
            done.append(i)
        return done


def running_task_fleet(database_url: str, tmp_path: Path) -> Iterator[TaskFleet]:
    """The hub with its background scheduler slowed to once an hour: the test ticks a controller itself."""
    for hub in running_hub(hub_settings(tmp_path, database_url, scheduler_interval_s=3600)):
        background, deadline = hub.state.scheduler, time.monotonic() + 30
        while background.counters["ticks"] < 1:  # its start-up tick is over before a test writes
            assert time.monotonic() < deadline, "the scheduler loop never ticked"
            time.sleep(0.01)
        hub.state.wake_scheduler = lambda: None  # API calls must not wake the background loop mid-test
        blobs = hub.state.blobs
        yield TaskFleet(hub, blobs, TaskController(hub.engine, hub.state.signing, blobs=blobs), StatusIngest(hub.engine))

