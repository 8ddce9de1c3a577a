"""Schemathesis against a live hub: the CLI, every check, positive and negative cases, all four phases
(examples, coverage, fuzzing, stateful with the links it infers), sent over real connections to the hub behind
uvicorn. Used by tests/hub/test_schemathesis.py (the CI-sized run) and bench/fuzz_api.py (the long run).

The settings and the reason for each are in tests/hub/schemathesis.toml; the hooks in tests/hub/fuzz_hooks.py.
The server side counts every answer by status, so that "no 5xx" is read at the hub, not only in the report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

import interfaces
from interfaces.auth import Role
from tests.hub.conftest import HubUnderTest, hub_settings, running_hub
from tests.hub.live import serve

ROOT = Path(__file__).resolve().parents[2]
CONFIG = Path(__file__).with_name("schemathesis.toml")
COMMITTED_SCHEMA = Path(interfaces.__file__).parent / "openapi.json"
PHASES = "examples,coverage,fuzzing,stateful"


class StatusCounter:
    """ASGI wrapper: counts the status of every answer the app gives."""

    def __init__(self, app: ASGIApp) -> None:
        self.app, self.statuses = app, Counter[int]()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.statuses[message["status"]] += 1
            await send(message)

        await self.app(scope, receive, counted if scope["type"] == "http" else send)


@dataclass
class LiveHub:
    hub: HubUnderTest
    url: str
    counter: StatusCounter

    @property
    def server_errors(self) -> int:
        return sum(n for status, n in self.counter.statuses.items() if status >= 500)


@contextmanager
def live_hub(data_dir: Path, **settings: Any) -> Iterator[LiveHub]:
    """The hub on SQLite in ``data_dir``, behind uvicorn on a free port (``settings``: e.g. a real broker's
    ``enable_mqtt``/``broker_url``)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    for hub in running_hub(hub_settings(data_dir, f"sqlite:///{data_dir / 'hub.db'}", **settings)):
        counter = StatusCounter(hub.app)
        with serve(counter) as url:
            yield LiveHub(hub, url, counter)


def seed(hub: HubUnderTest) -> dict[str, list[str]]:
    """Nodes (one locked) and devices (some with a desired twin) for generated path ids to reach."""
    nodes = [hub.register(f"seed-{i}", {"zone": "a" if i % 2 else "b", "tier": "edge"})["node"]["id"] for i in range(4)]
    devices = [hub.add_device(nodes[i % 3], labels={"kind": "camera"})["id"] for i in range(6)]
    for device_id in devices[:3]:
        hub.request("PUT", f"/devices/{device_id}/twin", json={"desired": {"fps": 10}})
    hub.request("PUT", f"/nodes/{nodes[0]}/admin-state", json={"admin_state": "LOCKED"})
    return {"node_id": nodes, "device_id": devices}


@dataclass
class FuzzResult:
    command: list[str]
    returncode: int
    wall_s: float
    cases: int
    failures: dict[str, int]  # "ST202 Schema-valid request rejected" -> count
    errors: int
    report: dict[str, Any] = field(repr=False)
    output: str = field(repr=False)

    def failed(self, *words: str) -> int:
        """Failures whose title names any of ``words`` (e.g. "schema")."""
        return sum(n for title, n in self.failures.items() if any(w.lower() in title.lower() for w in words))


def run(live: LiveHub, seeded: dict[str, list[str]], *, max_examples: int, seed_value: int, report: Path, timeout_s: float,
        phases: str = PHASES, schema: Path = COMMITTED_SCHEMA) -> FuzzResult:  # fmt: skip
    """Run the schemathesis CLI once against ``live``; its JSON report lands at ``report``, its output beside it (.txt)."""
    command = [
        str(Path(sys.executable).with_name("schemathesis")), "--config-file", str(CONFIG), "--no-color", "run", str(schema),
        "--url", live.url, "--checks", "all", "--mode", "all", "--phases", phases, "--max-examples", str(max_examples),
        "--seed", str(seed_value), "--report", "json", "--report-json-path", str(report),
    ]  # fmt: skip
    env = {
        **os.environ, "AISYNERGY_FUZZ_TOKEN": live.hub.tokens[Role.ADMIN], "AISYNERGY_FUZZ_SEEDED": json.dumps(seeded),
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }  # fmt: skip
    started = time.monotonic()
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, check=False)
    wall_s = time.monotonic() - started
    report.with_suffix(".txt").write_text(done.stdout + done.stderr)
    doc = json.loads(report.read_text()) if report.exists() else {}
    failures = {f"{f.get('code', '')} {f.get('title', f.get('type'))}".strip(): int(f.get("count", 1)) for f in doc.get("failures", [])}
    errors = len(doc.get("errors", []))
    return FuzzResult(command, done.returncode, wall_s, int(doc.get("test_cases", {}).get("generated", 0)), failures, errors, doc, done.stdout + done.stderr)
