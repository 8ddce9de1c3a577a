"""Task log streams (Server-Sent Events) over a real HTTP server: a limit per token, a revoked token's stream
ends, and new lines wake the stream instead of a database poll every fraction of a second (DESIGN §4.3, §6)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlmodel import Session

from cloud.api.routes import tasks as task_routes
from cloud.auth import create_api_token, revoke_api_token
from cloud.ingest import StatusIngest
from cloud.scheduler import TaskController
from interfaces import API_PREFIX
from interfaces.auth import Role
from interfaces.errors import PROBLEM_MEDIA_TYPE
from tests.hub.conftest import hub_settings, running_hub
from tests.hub.live import serve
from tests.hub.tasks_support import TaskFleet

STREAMS_PER_TOKEN, POLL_S = 2, 60.0


class Served:
    def __init__(self, fleet: TaskFleet, url: str) -> None:
        self.fleet, self.url = fleet, url

    def token(self, role: Role = Role.VIEWER) -> tuple[str, str]:
        with Session(self.fleet.engine, expire_on_commit=False) as session:
            row, secret = create_api_token(session, role, name="stream-test")
        return row.id, secret

    def open(self, client: httpx.Client, task_id: str, secret: str) -> httpx.Response:
        request = client.build_request("GET", f"{self.url}{API_PREFIX}/tasks/{task_id}/logs",
                                       headers={"Authorization": f"Bearer {secret}", "Accept": "text/event-stream"})  # fmt: skip
        return client.send(request, stream=True)


@pytest.fixture
def served(sqlite_url: str, tmp_path: Path) -> Iterator[Served]:
    """The hub app behind uvicorn on a free port (a real server: streams run side by side)."""
    settings = hub_settings(tmp_path, sqlite_url, scheduler_interval_s=3600, sse_streams_per_token=STREAMS_PER_TOKEN, sse_token_check_s=0.2, sse_poll_s=POLL_S)
    for hub in running_hub(settings):
        hub.state.wake_scheduler = lambda: None
        blobs = hub.state.blobs
        fleet = TaskFleet(hub, blobs, TaskController(hub.engine, hub.state.signing, blobs=blobs), StatusIngest(hub.engine))
        with serve(hub.app) as url:
            yield Served(fleet, url)


def running_task(fleet: TaskFleet) -> tuple[dict[str, Any], dict[str, Any]]:
    """A batch task with one RUNNING worker (the task is not final: its stream stays open)."""
    fleet.device(fleet.node())
    inputs_id, _ = fleet.dataset(rows=20)
    task = fleet.batch(inputs_id, chunk_size=10)
    fleet.tick()
    (worker,) = fleet.workers(task["id"])
    fleet.report(worker, "RUNNING")
    return task, worker


class Events:
    """Reads one open stream in order (the client's read timeout bounds every wait)."""

    def __init__(self, response: httpx.Response) -> None:
        self.chunks = response.iter_text()

    def until(self, wanted: str, within_s: float = 20.0) -> str:
        """The text read from here up to the end of the first event that contains ``wanted``; fails when that takes
        longer than ``within_s`` (seen at the next chunk: a keepalive comment comes every 15 s at the latest)."""
        seen, deadline = "", time.monotonic() + within_s
        for chunk in self.chunks:
            seen += chunk
            if wanted in seen and seen.endswith("\n\n"):
                return seen
            assert time.monotonic() < deadline, f"no {wanted!r} within {within_s} s: {seen[-500:]}"
        raise AssertionError(f"the stream ended without {wanted!r}: {seen[-500:]}")


def test_a_token_holds_at_most_its_limit_of_streams(served: Served) -> None:
    # Prepare
    task, _ = running_task(served.fleet)
    _, secret = served.token()
    _, other = served.token()

    with httpx.Client(timeout=30) as client:
        streams = [served.open(client, task["id"], secret) for _ in range(STREAMS_PER_TOKEN)]
        assert [s.status_code for s in streams] == [200] * STREAMS_PER_TOKEN

        # Execute
        refused = served.open(client, task["id"], secret)
        another = served.open(client, task["id"], other)

        # Assert: 429 problem for the token at its limit; another token is not affected
        assert refused.status_code == 429
        refused.read()
        assert refused.headers["content-type"].split(";")[0] == PROBLEM_MEDIA_TYPE
        assert refused.json()["code"] == "too_many_requests"
        assert another.status_code == 200
        another.close()

        # Execute: one stream closed by its client gives its slot back
        streams.pop().close()
        deadline, status = time.monotonic() + 60, 0
        while time.monotonic() < deadline:
            again = served.open(client, task["id"], secret)
            status = again.status_code
            again.close()
            if status == 200:
                break
            time.sleep(0.1)

        # Assert
        assert status == 200
        for s in streams:
            s.close()


def test_a_revoked_token_ends_its_stream(served: Served) -> None:
    # Prepare: a stream open with a token of its own
    task, _ = running_task(served.fleet)
    token_id, secret = served.token()
    with httpx.Client(timeout=30) as client:
        stream = served.open(client, task["id"], secret)
        assert stream.status_code == 200
        events = Events(stream)
        events.until("event: state")

        # Execute
        with Session(served.fleet.engine) as session:
            assert revoke_api_token(session, token_id) is not None

        # Assert: the stream ends (well before the client's 30 s read timeout) and says why
        tail = events.until("no longer valid")
        assert "event: end" in tail
        stream.close()


def test_a_new_line_wakes_the_stream_and_an_idle_stream_does_not_poll(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: count the stream's database reads
    task, worker = running_task(served.fleet)
    reads: list[float] = []
    read = task_routes._lines_and_state

    def counted(*args: Any) -> Any:
        reads.append(time.monotonic())
        return read(*args)

    monkeypatch.setattr(task_routes, "_lines_and_state", counted)
    _, secret = served.token()
    with httpx.Client(timeout=POLL_S / 2) as client:
        stream = served.open(client, task["id"], secret)
        assert stream.status_code == 200
        events = Events(stream)
        events.until("event: state")

        # Execute: idle a while, then a worker's line arrives
        idle_from = time.monotonic()
        time.sleep(1.5)
        idle_reads = len([t for t in reads if t >= idle_from])
        served.fleet.log(worker, "a line the stream must show")

        # Assert: no read while idle (the fallback poll is 60 s); the line arrives long before the poll would
        # (the client's read timeout is half of it)
        assert idle_reads == 0
        assert "a line the stream must show" in events.until("a line the stream must show")
        stream.close()
