"""Shared fixtures: databases (SQLite always, PostgreSQL when AISYNERGY_TEST_POSTGRES_URL is set —
`.ci/run` starts one and sets it, so in CI the PostgreSQL variants never skip)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import Broker, start_broker, stop

PG_ENV = "AISYNERGY_TEST_POSTGRES_URL"


def _postgres_database() -> Iterator[str]:
    base = os.environ.get(PG_ENV)
    if not base:
        if os.environ.get("CI"):
            pytest.fail(f"{PG_ENV} is not set: .ci/run must start PostgreSQL")
        pytest.skip(f"{PG_ENV} not set")
    import psycopg

    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    prefix, _, _ = base.rpartition("/")
    try:
        yield f"{prefix}/{name}"
    finally:
        with psycopg.connect(base, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty database of each kind."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'hub.db'}"
    else:
        yield from _postgres_database()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'hub.db'}"


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    b = start_broker(tmp_path / "stack")
    try:
        yield b
    finally:
        stop(b.proc)
