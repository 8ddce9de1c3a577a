"""The hub in-process: the real FastAPI app behind a TestClient, on a real database (SQLite or PostgreSQL).

``hub`` runs the app's lifespan (Alembic migrations, CA, background loops) and hands out one bearer token
per role; ``snapshot`` reads every row of every table so a test can prove a refused request changed nothing.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import MetaData, select
from sqlalchemy.engine import Engine
from sqlmodel import Session

from cloud.api.app import create_app
from cloud.api.state import HubState, hub_state
from cloud.auth import create_api_token
from cloud.config import Settings
from cloud.pki import make_csr, new_private_key
from interfaces import API_PREFIX
from interfaces.auth import Role
from interfaces.errors import ERROR_TYPE_PREFIX, PROBLEM_MEDIA_TYPE

# Controller bookkeeping that the background liveness loop rewrites on its own schedule.
BOOKKEEPING_TABLES = frozenset({"leases"})


def snapshot(engine: Engine) -> dict[str, list[str]]:
    """Every row of every table (bookkeeping aside), order-independent, for before/after comparison."""
    meta = MetaData()
    meta.reflect(engine)
    with engine.connect() as conn:
        return {
            name: sorted(repr(tuple(row)) for row in conn.execute(select(table)))
            for name, table in sorted(meta.tables.items())
            if name not in BOOKKEEPING_TABLES
        }


def assert_problem(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    """An RFC 9457 problem document with this status and stable code; returns the document."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].split(";")[0] == PROBLEM_MEDIA_TYPE, response.headers
    doc = response.json()
    assert doc["status"] == status
    assert doc["code"] == code, doc
    assert doc["type"] == ERROR_TYPE_PREFIX + code
    assert doc["title"]
    return doc


SQLITE_ONLY = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
"""For a test of request handling that no database dialect changes (parsing, validation, serving bytes): its
PostgreSQL variant would only cost CI time."""


@dataclass
class HubUnderTest:
    app: FastAPI
    client: TestClient
    tokens: dict[Role, str] = field(default_factory=dict)

    @property
    def state(self) -> HubState:
        """The app's shared state (blob store, signing key, controllers, ...)."""
        return hub_state(self.app)

    @property
    def engine(self) -> Engine:
        return self.state.engine

    @property
    def settings(self) -> Settings:
        return self.state.settings

    def auth(self, role: Role = Role.ADMIN) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[role]}"}

    def request(self, method: str, path: str, role: Role | None = Role.ADMIN, **kwargs: Any) -> httpx.Response:
        """``path`` is below /api/v1; ``role=None`` sends no token."""
        headers = {**(self.auth(role) if role else {}), **kwargs.pop("headers", {})}
        return self.client.request(method, API_PREFIX + path, headers=headers, **kwargs)

    def get(self, path: str, role: Role | None = Role.VIEWER, **kwargs: Any) -> httpx.Response:
        return self.request("GET", path, role, **kwargs)

    def register(self, name: str = "gw", labels: dict[str, str] | None = None, **body: Any) -> dict[str, Any]:
        """POST /nodes as operator; returns the NodeRegistered document."""
        r = self.request("POST", "/nodes", Role.OPERATOR, json={"name": name, "labels": labels or {}, **body})
        assert r.status_code == 201, r.text
        return r.json()  # type: ignore[no-any-return]

    def add_device(self, node_id: str, model: str = "rpi-5", labels: dict[str, str] | None = None) -> dict[str, Any]:
        r = self.request("POST", "/devices", Role.OPERATOR, json={"node_id": node_id, "model": model, "labels": labels or {}})
        assert r.status_code == 201, r.text
        return r.json()  # type: ignore[no-any-return]

    def enrol(self, node_id: str, bootstrap_token: str, common_name: str | None = None) -> httpx.Response:
        csr = make_csr(new_private_key(), common_name or node_id)
        return self.request("POST", f"/nodes/{node_id}/certificate", None, json={"csr_pem": csr, "bootstrap_token": bootstrap_token})

    def snapshot(self) -> dict[str, list[str]]:
        return snapshot(self.engine)


def hub_settings(data_dir: Path, database_url: str, **overrides: Any) -> Settings:
    # Liveness and rollout at their slowest: their first tick runs at start-up, the next one after any test
    # here is over (tests of the rollout controller tick it themselves).
    overrides.setdefault("rollout_interval_s", 3600)
    overrides.setdefault("enable_mqtt", False)
    return Settings(data_dir=data_dir, database_url=database_url, liveness_check_interval_s=60, **overrides)


def running_hub(settings: Settings) -> Iterator[HubUnderTest]:
    app = create_app(settings)
    with TestClient(app, raise_server_exceptions=False) as client:
        hub = HubUnderTest(app, client)
        rollout, deadline = hub.state.rollout, time.monotonic() + 30
        while rollout.counters["ticks"] < 1:  # the rollout loop's start-up tick is over before a test writes
            assert time.monotonic() < deadline, "the rollout loop never ticked"
            time.sleep(0.01)
        with Session(hub.engine) as session:
            for role in Role:
                _, hub.tokens[role] = create_api_token(session, role, name=f"test-{role.value}")
        yield hub


@pytest.fixture
def hub(database_url: str, tmp_path: Path) -> Iterator[HubUnderTest]:
    """The hub on each database kind (SQLite always, PostgreSQL where configured)."""
    yield from running_hub(hub_settings(tmp_path, database_url))


@pytest.fixture
def sqlite_hub(sqlite_url: str, tmp_path: Path) -> Iterator[HubUnderTest]:
    yield from running_hub(hub_settings(tmp_path, sqlite_url))
