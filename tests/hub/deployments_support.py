"""A hub whose rollout controller the test drives (``tick()``), artefacts, a fleet of devices, and targets
that report execution progress through the same ingest path as MQTT events relayed by an edge."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import select, update
from sqlmodel import Session

from cloud.artifacts import create_artifact, installed_of
from cloud.ingest import StatusIngest
from cloud.rollout import RolloutController
from cloud.tables import Artifact, Device, Execution, Node
from interfaces.auth import Role
from interfaces.deployments import EXECUTION_EVENT, ArtifactCreate, ExecutionProgress, ExecutionState, InstalledArtifact
from interfaces.messages import EventBody, envelope
from tests.hub.conftest import HubUnderTest, hub_settings, running_hub


@dataclass
class Fleet:
    hub: HubUnderTest
    blobs: Any
    controller: RolloutController
    ingest: StatusIngest
    node_of: dict[str, str] = field(default_factory=dict)

    @property
    def engine(self) -> Any:
        return self.hub.engine

    def fresh_controller(self) -> RolloutController:
        """What a restarted hub would run: a new controller over the same database."""
        return RolloutController(self.engine, self.controller.signing, self.blobs)

    def tick(self, at: datetime | None = None) -> int:
        return self.controller.tick(at)

    def artifact(self, version: str = "1.0.0", name: str = "detector", kind: str = "model", data: bytes | None = None) -> Artifact:
        body = ArtifactCreate(kind=kind, name=name, version=version, format="onnx" if kind == "model" else "bin")  # type: ignore[arg-type]
        payload = data if data is not None else f"{kind} {name} {version} ".encode() * 64
        with Session(self.engine, expire_on_commit=False) as session, self.blobs.writer() as writer:
            writer.write(payload)
            return create_artifact(session, self.controller.signing, self.blobs, body, writer)

    def devices(self, n: int, labels: dict[str, str] | None = None, node_name: str = "gw") -> list[str]:
        node_id = self.hub.register(node_name)["node"]["id"]
        ids = []
        for _ in range(n):
            device_id = self.hub.add_device(node_id, labels=labels)["id"]
            self.node_of[device_id] = node_id
            ids.append(device_id)
        return ids

    def set_installed(self, device_id: str, artifact: Artifact) -> None:
        """The device reports (``reported["installed"]``) that it runs ``artifact``."""
        with Session(self.engine) as session:
            entry = installed_of(artifact).model_dump(mode="json")
            session.execute(update(Device).where(Device.id == device_id).values(reported={"installed": {artifact.kind: entry}}))
            session.commit()

    def deploy(self, artifact_id: str, ids: list[str] | None = None, selector: str | None = None, kind: str = "device", **body: Any) -> dict[str, Any]:
        target: dict[str, Any] = {"kind": kind, **({"ids": ids} if ids is not None else {"selector": selector})}
        r = self.hub.request("POST", "/deployments", Role.OPERATOR, json={"artifact_id": artifact_id, "target": target, **body})
        assert r.status_code == 201, r.text
        return r.json()  # type: ignore[no-any-return]

    def detail(self, deployment_id: str) -> dict[str, Any]:
        r = self.hub.get(f"/deployments/{deployment_id}")
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]

    def executions(self, deployment_id: str) -> dict[str, dict[str, Any]]:
        """target id -> execution document."""
        return {e["target_id"]: e for e in self.detail(deployment_id)["executions"]}

    def report(self, target_id: str, execution_id: str, state: ExecutionState | str, detail: str = "",
               installed: InstalledArtifact | None = None, node: bool = False) -> None:  # fmt: skip
        """The target reports its latest state, as an EXECUTION_EVENT through the hub's ingest."""
        progress = ExecutionProgress(execution_id=execution_id, state=ExecutionState(state), detail=detail, installed=installed)
        self.report_raw(target_id, progress.model_dump(mode="json"), node=node)

    def report_raw(self, target_id: str, data: dict[str, Any], node: bool = False) -> None:
        message = envelope(target_id, EventBody(type=EXECUTION_EVENT, data=data))
        if node:
            self.ingest.offer_node_event(target_id, message)
        else:
            self.ingest.offer_event(self.node_of[target_id], target_id, message)
        self.ingest.flush()

    def orders(self, target_id: str, table: Any = Device) -> tuple[list[dict[str, Any]], int]:
        with Session(self.engine) as session:
            row = session.get(table, target_id)
            assert row is not None
            return list(row.orders), row.orders_version

    def all_orders_versions(self) -> dict[str, tuple[int, int]]:
        with Session(self.engine) as session:
            rows = session.execute(select(Device.id, Device.orders_version, Device.orders_published)).all()
            rows += session.execute(select(Node.id, Node.orders_version, Node.orders_published)).all()
            return {i: (v, p) for i, v, p in rows}

    def released_at(self, deployment_id: str) -> dict[str, datetime | None]:
        with Session(self.engine) as session:
            return dict(session.execute(select(Execution.id, Execution.released_at).where(Execution.deployment_id == deployment_id)).all())  # type: ignore[arg-type]


def running_fleet(database_url: str, tmp_path: Path) -> Iterator[Fleet]:
    """The hub with its background rollout loop slowed to once an hour (``hub_settings``): the test ticks
    the controller itself."""
    for hub in running_hub(hub_settings(tmp_path, database_url)):
        blobs = hub.state.blobs
        yield Fleet(hub, blobs, RolloutController(hub.engine, hub.state.rollout.signing, blobs), StatusIngest(hub.engine))
