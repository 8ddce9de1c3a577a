"""Cases: see conformance/catalogue.py.

8.3 task run management (DESIGN §4.3) and the clauses of the standard that task placement answers
(6.1.2 b 3, 6.1.2 e, 6.2.2 g, 6.3.2 f, 7.2 c 1, 7.2 c 4, 7.2 d 4, 7.3.1 c, 7.3.2 b). Every task runs on
targets the case made (``placement.ids`` or a selector on the case's own labels), never on the stack's
other agents. The simulated agents carry out the orders (``conformance.agents.Endpoint``); a sharded
``batch_inference`` worker, which the simulated agent lacks, is played here (:func:`batch_worker`): it
fetches the dataset with the order's token, answers every chunk with a safetensors frame (written with the
standard library) and reports SUCCEEDED.
"""

from __future__ import annotations

import base64
import json
import struct
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from itertools import count
from typing import Any

import httpx

from conformance.agents import Endpoint, SimEdge, resources
from conformance.cases.common import PATIENCE_S, new_device, new_edge, node_status, wait_node
from conformance.hub import problem
from conformance.runner import Check, case
from interfaces.deployments import DOWNLOAD_TOKEN_HEADER, ArtifactPublic, DeploymentDetail, DeploymentState
from interfaces.errors import ErrorCode
from interfaces.nodes import Twin
from interfaces.pagination import Page
from interfaces.resources import Accelerator, AcceleratorType
from interfaces.tasks import (
    TASK_LOG_EVENT,
    TASK_METRICS_EVENT,
    TASK_OUTPUT_EVENT,
    TASK_WORKER_EVENT,
    InferenceSpec,
    LogLine,
    TaskDetail,
    TaskLogLine,
    TaskMetrics,
    TaskOutputs,
    TaskPublic,
    WorkerAction,
    WorkerLog,
    WorkerMetrics,
    WorkerOrder,
    WorkerOutput,
    WorkerPublic,
    WorkerReport,
    WorkerState,
)  # fmt: skip

_seq = count(1)
GiB = 1024**3
FAST = {"heartbeat_s": 0.5, "worker_timeout_s": 5, "retry": {"max_attempts": 3, "backoff_s": 0, "max_backoff_s": 0}}
"""small timings for every task a case makes (worker reports twice a second; silent 5 s: TIMED_OUT)"""
SETTLE_S = 2.5
"""how long a case watches a task that must not move (the hub's scheduler ticks every second or sooner)"""


# ---- helpers -----------------------------------------------------------------------------------------


def _name(check: Check, what: str) -> str:
    return f"conf-{check.target.run_id}-{what}{next(_seq)}"


def get_task(check: Check, task_id: str) -> TaskDetail:
    return check.target.ok("GET", f"/tasks/{task_id}", TaskDetail)  # type: ignore[no-any-return]


def workers(check: Check, task_id: str) -> list[WorkerPublic]:
    return [WorkerPublic.model_validate(w) for w in check.target.ok("GET", f"/tasks/{task_id}/workers")]


def wait_task(check: Check, task_id: str, states: str | set[str], timeout: float = PATIENCE_S) -> TaskDetail:
    wanted = {states} if isinstance(states, str) else states
    return check.wait(lambda: (t := get_task(check, task_id)).state.value in wanted and t, timeout, f"task {task_id} in {sorted(wanted)}")  # type: ignore[no-any-return]


def wait_workers(check: Check, task_id: str, predicate: Callable[[list[WorkerPublic]], bool], what: str, timeout: float = PATIENCE_S) -> list[WorkerPublic]:
    return check.wait(lambda: (ws := workers(check, task_id)) and predicate(ws) and ws, timeout, what)  # type: ignore[no-any-return]


def _discard(check: Check, task_id: str) -> None:
    """Clean-up: cancel if still active, then delete."""
    check.target.call("POST", f"/tasks/{task_id}/cancel")
    r = check.target.call("DELETE", f"/tasks/{task_id}")
    if r.status_code not in (204, 404):
        raise RuntimeError(f"DELETE /tasks/{task_id}: HTTP {r.status_code} {r.text[:200]}")


def new_task(check: Check, type_: str, spec: dict[str, Any], placement: dict[str, Any], **options: Any) -> TaskDetail:
    """``POST /tasks`` (201, a TaskDetail); cancelled and deleted after the case."""
    body = {"name": _name(check, "t"), "type": type_, "spec": spec, "placement": placement, **FAST, **options}
    r = check.target.call("POST", "/tasks", json=body)
    if r.status_code != 201:
        check.fail(f"POST /tasks ({type_}): expected 201, got {r.status_code}: {r.text[:400]}")
    task = TaskDetail.model_validate(r.json())
    check.cleanup(f"discard task {task.id}", lambda: _discard(check, task.id))
    return task


def act(check: Check, task_id: str, action: str) -> TaskPublic:
    return check.target.ok("POST", f"/tasks/{task_id}/{action}", TaskPublic)  # type: ignore[no-any-return]


def refused(check: Check, task_id: str, action: str, state: str) -> None:
    """``action`` on a task in ``state`` is a 409 ``illegal_transition`` and the task stays in ``state``."""
    r = check.target.call("DELETE", f"/tasks/{task_id}") if action == "delete" else check.target.call("POST", f"/tasks/{task_id}/{action}")
    doc = problem(r, 409, ErrorCode.ILLEGAL_TRANSITION)
    after = get_task(check, task_id).state.value
    check.check(after == state, f"{action} in {state}: 409 illegal_transition ({doc.detail}); the task stays {after}")


def still(check: Check, task_id: str, state: str, seconds: float = SETTLE_S, idle: bool = True) -> TaskDetail:
    """The task stays in ``state`` for ``seconds`` (scheduler ticks) and (``idle``) has no active worker.

    A task the scheduler drives is watched from the moment it says why it is where it is (``reason``, which a
    PENDING task gets when the scheduler finds no target for it): the watch cannot pass only because the
    scheduler had not looked at the task yet. A held task has nothing to say; it is watched from the start."""
    if not get_task(check, task_id).held:
        check.wait(lambda: get_task(check, task_id).reason, PATIENCE_S, f"task {task_id}: the reason it is {state}")
    deadline = time.monotonic() + seconds
    while True:
        task = get_task(check, task_id)
        if task.state.value != state:
            check.fail(f"task {task_id} should stay {state}, went {task.state.value} ({task.reason})")
        active = [w for w in workers(check, task_id) if w.state in (WorkerState.QUEUED, WorkerState.RUNNING)] if idle else []
        if active:
            check.fail(f"task {task_id} should have no active worker while {state}; has {[(w.target_id, w.state.value) for w in active]}")
        if time.monotonic() >= deadline:
            check.note(f"task {task_id} stayed {state} for {seconds:g} s with no active worker ({task.reason!r})")
            return task
        time.sleep(0.3)


def same_workers(check: Check, task_id: str, seen: list[WorkerPublic], seconds: float = SETTLE_S) -> list[WorkerPublic]:
    """No worker joins or leaves ``seen`` (the task's workers once placed) for ``seconds`` of scheduler ticks;
    the workers as last read."""
    ids = sorted(w.id for w in seen)
    deadline = time.monotonic() + seconds
    while True:
        ws = workers(check, task_id)
        if sorted(w.id for w in ws) != ids:
            check.fail(f"task {task_id}: its workers should stay {ids}, are {[(w.id, w.target_id) for w in ws]}")
        if time.monotonic() >= deadline:
            check.note(f"task {task_id}: the same {len(ids)} worker(s) for {seconds:g} s")
            return ws
        time.sleep(0.3)


def active_on(ws: list[WorkerPublic], state: WorkerState = WorkerState.RUNNING) -> dict[str, WorkerPublic]:
    return {w.target_id: w for w in ws if w.state is state}


def gpu(kind: str = "gpu", purpose: str | None = None, count_: int = 1) -> Accelerator:
    return Accelerator(type=AcceleratorType(kind), model=f"sim-{kind}", count=count_, memory_bytes=8 * GiB, utilisation=0.0, purpose=purpose)


def edge_with(check: Check, memory: int = 2 * GiB, accelerators: list[Accelerator] | None = None, labels: dict[str, str] | None = None) -> SimEdge:
    """A simulated edge whose heartbeats report these readings; waits until its status shows them."""
    edge = new_edge(check, start=False, labels=labels)
    edge.node.resources = resources(memory_available=memory, accelerators=accelerators)
    edge.start()
    wait_node(check, edge.node_id, "ONLINE", PATIENCE_S)
    want = edge.node.resources
    check.wait(lambda: (s := node_status(check.target, edge.node_id)).resources is not None and s.resources.memory == want.memory
               and s.resources.accelerators == want.accelerators, PATIENCE_S, f"node {edge.node_id} status shows its readings")  # fmt: skip
    return edge


def _multipart_upload(check: Check, kind: str, name: str, version: str, fmt: str, data: bytes) -> ArtifactPublic:
    art = check.target.ok("POST", "/artifacts", ArtifactPublic, data={"kind": kind, "name": name, "version": version, "format": fmt},
                          files={"file": (f"{name}.{fmt}", data, "application/octet-stream")})  # fmt: skip
    check.cleanup(f"delete artefact {art.id}", lambda: check.target.call("DELETE", f"/artifacts/{art.id}"))
    return art  # type: ignore[no-any-return]


def install_model(check: Check, kind: str, targets: list[Endpoint], version: str = "1.0.0") -> dict[str, str]:
    """Upload a model artefact (the hub stores bytes; it does not parse ONNX at upload or task creation), deploy it
    to ``targets`` (all at once), wait for the deployment to SUCCEED and for every target's reported document
    to show it installed; the ``ModelRef`` for a task spec."""
    name = _name(check, "model")
    art = _multipart_upload(check, "model", name, version, "onnx", b"conformance model " + name.encode() * 8)
    dep = check.target.ok("POST", "/deployments", DeploymentDetail,
                          json={"artifact_id": art.id, "target": {"kind": kind, "ids": [t.ident for t in targets]}, "timeout_s": 60})  # fmt: skip
    check.wait(lambda: (d := check.target.ok("GET", f"/deployments/{dep.id}", DeploymentDetail)).state is DeploymentState.SUCCEEDED and d,
               PATIENCE_S, f"deployment {dep.id} of {name} SUCCEEDED")  # fmt: skip
    path = "/devices" if kind == "device" else "/nodes"
    for t in targets:
        check.wait(lambda t=t: (check.target.ok("GET", f"{path}/{t.ident}/twin", Twin).reported.get("installed") or {}).get("model", {}).get("name") == name,
                   PATIENCE_S, f"{t.ident} reports {name} installed")  # fmt: skip
    check.note(f"model {name} {version} ({art.id}) installed on {[t.ident for t in targets]} by deployment {dep.id}")
    return {"name": name, "version": version}


def inference(model: dict[str, str], **more: Any) -> dict[str, Any]:
    return {"model": model, "report_interval_s": 0.5, **more}


def history(task: TaskDetail) -> list[tuple[str | None, str]]:
    return [(h.from_state, h.to_state) for h in task.history]


def order_for(ep: Endpoint, worker_id: str) -> WorkerOrder | None:
    """The order the target holds now for ``worker_id`` (from the last desired document it got)."""
    return ep.workers.get(worker_id)


# ---- a sharded worker the simulated agent does not have ---------------------------------------------------


def npy_f32(rows: list[list[float]]) -> bytes:
    """A version 1.0 .npy file of float32 ``rows`` (little endian), written with the standard library."""
    header = f"{{'descr': '<f4', 'fortran_order': False, 'shape': ({len(rows)}, {len(rows[0])}), }}"
    header += " " * ((64 - (10 + len(header) + 1) % 64) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode() + b"".join(struct.pack(f"<{len(r)}f", *r) for r in rows)


def read_npy_f32(data: bytes) -> list[list[float]]:
    assert data[:8] == b"\x93NUMPY\x01\x00", "not a version 1.0 npy file"
    (hlen,) = struct.unpack("<H", data[8:10])
    header = data[10 : 10 + hlen].decode()
    shape = tuple(int(x) for x in header.split("'shape': (")[1].split(")")[0].split(",") if x.strip())
    values = struct.unpack(f"<{shape[0] * shape[1]}f", data[10 + hlen :])
    return [list(values[i * shape[1] : (i + 1) * shape[1]]) for i in range(shape[0])]


def safetensors_f32(name: str, column: list[float]) -> bytes:
    """A safetensors frame with one F32 tensor ``name`` of shape [len(column), 1]."""
    header = json.dumps({name: {"dtype": "F32", "shape": [len(column), 1], "data_offsets": [0, 4 * len(column)]}}, separators=(",", ":"))
    header += " " * ((8 - len(header) % 8) % 8)
    return struct.pack("<Q", len(header)) + header.encode() + struct.pack(f"<{len(column)}f", *column)


def read_safetensors(data: bytes) -> dict[str, tuple[str, list[int], bytes]]:
    (hlen,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + hlen])
    body = data[8 + hlen :]
    return {k: (v["dtype"], v["shape"], body[v["data_offsets"][0] : v["data_offsets"][1]]) for k, v in header.items() if k != "__metadata__"}


def batch_worker(ep: Endpoint, gate: Callable[[int], None] | None = None) -> None:
    """Make ``ep`` run ``batch_inference`` orders: fetch the dataset with the order's token, answer each chunk it
    owns with the row sums (output ``y``, one ``task.output`` event per chunk; ``gate(i)`` is called before
    chunk ``i``), then report SUCCEEDED. Other orders run as the simulated agent runs them."""
    plain = ep._work

    def work(order: WorkerOrder) -> None:
        if order.type.value != "batch_inference":
            plain(order)
            return
        report = WorkerReport(worker_id=order.worker_id, task_id=order.task_id, state=WorkerState.RUNNING)  # type: ignore[arg-type]
        ep.event(TASK_WORKER_EVENT, report.model_dump(mode="json"))
        assert order.inputs is not None
        with ep.edge.target.client(token=None) as c:
            r = c.get(order.inputs.path, headers={DOWNLOAD_TOKEN_HEADER: order.inputs.token})
        rows = read_npy_f32(r.content)
        done = 0
        for index in order.chunk_indices():
            if gate is not None:
                gate(index)
            if order.worker_id not in ep.workers:
                return  # withdrawn
            start, end = order.chunk_bounds(index)
            frame = safetensors_f32("y", [sum(row) for row in rows[start:end]])
            out = WorkerOutput(worker_id=order.worker_id, task_id=order.task_id, chunk=index, items=end - start, data=base64.b64encode(frame).decode())
            ep.event(TASK_OUTPUT_EVENT, out.model_dump(mode="json"))
            done += end - start
            ep.event(TASK_WORKER_EVENT, WorkerReport(worker_id=order.worker_id, task_id=order.task_id, state=WorkerState.RUNNING,  # type: ignore[arg-type]
                                                     items_done=done).model_dump(mode="json"))  # fmt: skip
        ep.event(TASK_WORKER_EVENT, WorkerReport(worker_id=order.worker_id, task_id=order.task_id, state=WorkerState.SUCCEEDED,  # type: ignore[arg-type]
                                                 items_done=done).model_dump(mode="json"))  # fmt: skip

    ep._work = work  # type: ignore[method-assign]


def metrics_event(ep: Endpoint, w: WorkerPublic, values: dict[str, float]) -> None:
    sample = WorkerMetrics(worker_id=w.id, task_id=w.task_id, ts=datetime.now(UTC), values=values)
    ep.event(TASK_METRICS_EVENT, sample.model_dump(mode="json"))


def log_event(ep: Endpoint, w: WorkerPublic, *texts: str, level: str = "info") -> None:
    lines = [LogLine(ts=datetime.now(UTC), level=level, text=t) for t in texts]  # type: ignore[arg-type]
    ep.event(TASK_LOG_EVENT, WorkerLog(worker_id=w.id, task_id=w.task_id, lines=lines).model_dump(mode="json"))


def _metrics_caught_up(m: TaskMetrics, worker_id: str, samples: int) -> TaskMetrics | None:
    """``m`` if its series has ``samples`` samples and ``worker_id``'s latest is the series' last, else None."""
    latest = m.workers.get(worker_id)
    return m if len(m.series) >= samples and latest is not None and latest == m.series[-1] else None


def log_lines(check: Check, task_id: str) -> list[TaskLogLine]:
    out: list[TaskLogLine] = []
    after = 0
    while True:
        page = Page[TaskLogLine].model_validate(check.target.ok("GET", f"/tasks/{task_id}/logs", params={"after": after, "limit": 200}))
        out += page.items
        if not page.next_cursor:
            return out
        after = int(page.next_cursor)


def sse_events(check: Check, task_id: str, until: Callable[[list[tuple[str, str]]], bool], timeout: float = PATIENCE_S) -> list[tuple[str, str]]:
    """Read ``GET /tasks/{id}/logs`` with ``Accept: text/event-stream`` until ``until(events)`` or ``timeout``;
    the (event, data) pairs seen."""
    events: list[tuple[str, str]] = []
    deadline = time.monotonic() + timeout
    with check.target.client(timeout=httpx.Timeout(timeout)) as c, c.stream("GET", f"/tasks/{task_id}/logs", headers={"Accept": "text/event-stream"}) as r:
        media = r.headers.get("content-type", "").split(";")[0].strip()
        check.equal((r.status_code, media), (200, "text/event-stream"), "GET /tasks/{id}/logs with Accept: text/event-stream")
        event, data = "message", []
        try:
            for line in r.iter_lines():
                if line == "":
                    if data:
                        events.append((event, "\n".join(data)))
                        if until(events):
                            break
                    event, data = "message", []
                elif line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:"):
                    data.append(line[5:].lstrip())
                if time.monotonic() > deadline:
                    break
        except httpx.ReadTimeout:
            pass
    return events


# ---- 8.3.1 submission ----------------------------------------------------------------------------------------


@case("8.3.1", "POST /tasks refuses an unknown type, a bad spec, a bad placement or heartbeat_s >= worker_timeout_s with 422 and stores nothing; a valid one is 201")
def submission(check: Check) -> None:
    edge = new_edge(check)
    node = {"target": "node", "ids": [edge.node_id]}
    model = {"name": _name(check, "m"), "version": "1.0.0"}

    def listed() -> list[TaskPublic]:
        out: list[TaskPublic] = []
        cursor = None
        while True:
            page = Page[TaskPublic].model_validate(check.target.ok("GET", "/tasks", params={"limit": 200, **({"cursor": cursor} if cursor else {})}))
            out += page.items
            cursor = page.next_cursor
            if not cursor:
                return out

    before = {t.id for t in listed()}
    bad_name = _name(check, "refused")
    good = {"name": bad_name, "type": "inference", "spec": inference(model), "placement": node, "heartbeat_s": 0.5, "worker_timeout_s": 5, "start": False}
    refusals: list[tuple[str, dict[str, Any], int, str]] = [
        ("unknown type", {**good, "type": "teleportation"}, 422, ErrorCode.VALIDATION_FAILED),
        ("spec without its model", {**good, "spec": {"duration_s": 1}}, 422, ErrorCode.VALIDATION_FAILED),
        ("spec with an unknown field", {**good, "spec": {**inference(model), "warp": 9}}, 422, ErrorCode.VALIDATION_FAILED),
        ("spec with a negative duration", {**good, "spec": inference(model, duration_s=-1)}, 422, ErrorCode.VALIDATION_FAILED),
        ("placement with ids and selector", {**good, "placement": {**node, "selector": "a=b"}}, 422, ErrorCode.VALIDATION_FAILED),
        ("placement max_nodes below min_nodes", {**good, "placement": {**node, "min_nodes": 2, "max_nodes": 1}}, 422, ErrorCode.VALIDATION_FAILED),
        ("placement on an unknown target id", {**good, "placement": {"target": "node", "ids": ["n-doesnotexist0000000000000000"]}}, 422, ErrorCode.VALIDATION_FAILED),
        ("placement of a device-only type on a node", {**good, "type": "split_inference", "spec": {"model": model}}, 422, ErrorCode.VALIDATION_FAILED),
        ("heartbeat_s equal to worker_timeout_s", {**good, "heartbeat_s": 5, "worker_timeout_s": 5}, 422, ErrorCode.VALIDATION_FAILED),
        ("heartbeat_s above worker_timeout_s", {**good, "heartbeat_s": 10, "worker_timeout_s": 2}, 422, ErrorCode.VALIDATION_FAILED),
        ("timeout_s of 0", {**good, "timeout_s": 0}, 422, ErrorCode.VALIDATION_FAILED),
        ("unknown top-level field", {**good, "priority": 1}, 422, ErrorCode.VALIDATION_FAILED),
    ]
    for what, body, status, code in refusals:
        doc = problem(check.target.call("POST", "/tasks", json=body), status, code)
        check.note(f"ok: {what}: {status} {code} ({doc.detail[:120]})")
    doc = problem(check.target.call("POST", "/tasks", token=None, json=good), 401, ErrorCode.UNAUTHENTICATED)
    check.note(f"ok: no bearer token: 401 unauthenticated ({doc.detail[:80]})")
    after = listed()
    check.check({t.id for t in after} == before and not any(t.name == bad_name for t in after),
                f"after {len(refusals) + 1} refused submissions GET /tasks lists the same {len(before)} tasks and none named {bad_name}")  # fmt: skip

    r = check.target.call("POST", "/tasks", json={**good, "name": _name(check, "valid")})
    check.equal(r.status_code, 201, "POST /tasks with a valid inference task")
    task = TaskDetail.model_validate(r.json())
    check.cleanup(f"discard task {task.id}", lambda: _discard(check, task.id))
    check.equal((task.state.value, task.held, task.attempt, task.type.value), ("PENDING", True, 1, "inference"), "the new task (state, held, attempt, type)")
    check.equal(task.placement.ids, [edge.node_id], "its placement as submitted")
    again = get_task(check, task.id)
    check.equal((again.id, again.state.value, again.spec["model"]), (task.id, "PENDING", model), "GET /tasks/{id} returns it")
    check.check(task.id in {t.id for t in listed()} - before, "GET /tasks lists it")
    problem(check.target.call("GET", "/tasks/task-doesnotexist0000000000000"), 404, ErrorCode.NOT_FOUND)
    check.note("ok: GET /tasks/{unknown}: 404 not_found")


# ---- 8.3.2 lifecycle and control -----------------------------------------------------------------------------


@case("8.3.2", "PENDING (held) -> start -> RUNNING <-> PAUSED (orders say pause) -> cancel -> retry -> stop; retry from FAILED; DELETE; illegal moves 409")
def lifecycle(check: Check) -> None:
    edge = new_edge(check)
    model = install_model(check, "node", [edge.node])
    placement = {"target": "node", "ids": [edge.node_id]}
    task = new_task(check, "inference", inference(model), placement, start=False)
    check.equal((task.state.value, task.held), ("PENDING", True), "created with start=false")
    still(check, task.id, "PENDING", 1.5)
    check.equal(workers(check, task.id), [], "a held task has no workers")
    for action in ("pause", "resume", "retry", "delete"):
        refused(check, task.id, action, "PENDING")

    started = act(check, task.id, "start")
    check.equal((started.state.value, started.held), ("PENDING", False), "start releases the hold")
    doc = problem(check.target.call("POST", f"/tasks/{task.id}/start"), 409, ErrorCode.ILLEGAL_TRANSITION)
    check.note(f"ok: start again: 409 illegal_transition ({doc.detail})")
    running = wait_task(check, task.id, "RUNNING")
    moves = history(running)
    check.check(("PENDING", "SCHEDULED") in moves and ("SCHEDULED", "RUNNING") in moves, f"history PENDING -> SCHEDULED -> RUNNING: {moves}")
    (w,) = wait_workers(check, task.id, lambda ws: len(ws) == 1 and ws[0].state is WorkerState.RUNNING, "its one worker RUNNING")
    check.equal((w.target_id, w.state.value), (edge.node_id, "RUNNING"), "its worker")
    refused(check, task.id, "resume", "RUNNING")
    refused(check, task.id, "delete", "RUNNING")

    act(check, task.id, "pause")
    check.equal(get_task(check, task.id).state.value, "PAUSED", "after pause")
    check.wait(lambda: (o := order_for(edge.node, w.id)) is not None and o.action is WorkerAction.PAUSE, PATIENCE_S, "the worker's order says pause")
    check.wait(lambda: any(r.worker_id == w.id and r.paused for r in edge.node.worker_reports), PATIENCE_S, "the worker reports paused")
    refused(check, task.id, "pause", "PAUSED")
    act(check, task.id, "resume")
    check.equal(get_task(check, task.id).state.value, "RUNNING", "after resume (the worker had run)")
    check.wait(lambda: (o := order_for(edge.node, w.id)) is not None and o.action is WorkerAction.RUN, PATIENCE_S, "the worker's order says run again")

    act(check, task.id, "cancel")
    canceled = get_task(check, task.id)
    check.equal(canceled.state.value, "CANCELED", "after cancel")
    check.wait(lambda: order_for(edge.node, w.id) is None, PATIENCE_S, "the canceled worker's order is withdrawn")
    check.equal(workers(check, task.id)[0].state.value, "CANCELED", "the worker after cancel")
    for action in ("cancel", "stop", "pause", "resume", "start"):
        refused(check, task.id, action, "CANCELED")

    retried = act(check, task.id, "retry")
    check.equal((retried.state.value, retried.attempt), ("PENDING", 2), "retry from CANCELED: PENDING, attempt 2")
    wait_task(check, task.id, "RUNNING")
    ws = wait_workers(check, task.id, lambda ws: len(ws) == 2 and ws[1].state is WorkerState.RUNNING, "the retry's worker RUNNING")
    check.check(len(ws) == 2 and ws[1].state is WorkerState.RUNNING and ws[1].id != w.id, f"the retry runs a new worker: {[(x.id, x.state.value) for x in ws]}")
    act(check, task.id, "stop")
    check.equal(get_task(check, task.id).state.value, "SUCCEEDED", "stop ends a service (inference) task SUCCEEDED")
    for action in ("stop", "retry", "start"):
        refused(check, task.id, action, "SUCCEEDED")
    r = check.target.call("DELETE", f"/tasks/{task.id}")
    check.equal(r.status_code, 204, "DELETE a finished task")
    problem(check.target.call("GET", f"/tasks/{task.id}"), 404, ErrorCode.NOT_FOUND)
    problem(check.target.call("GET", f"/tasks/{task.id}/workers"), 404, ErrorCode.NOT_FOUND)
    check.note("ok: the deleted task and its workers are 404")

    # retry from FAILED: the only target's worker fails, one attempt allowed
    edge.node.worker_mode = "fail"
    failing = new_task(check, "inference", inference(model), placement, retry={"max_attempts": 1, "backoff_s": 0, "max_backoff_s": 0})
    failed = wait_task(check, failing.id, {"FAILED", "SUCCEEDED", "CANCELED", "TIMED_OUT"})
    check.equal(failed.state.value, "FAILED", "a task whose only worker FAILED (max_attempts 1)")
    check.equal([x.state.value for x in workers(check, failing.id)], ["FAILED"], "its worker")
    edge.node.worker_mode = "run"
    check.equal(act(check, failing.id, "retry").state.value, "PENDING", "retry from FAILED")
    wait_task(check, failing.id, "RUNNING")
    check.note("ok: the retried task RUNNING once the target's worker runs")
    act(check, failing.id, "cancel")
    problem(check.target.call("POST", "/tasks/task-doesnotexist0000000000000/start"), 404, ErrorCode.NOT_FOUND)


# ---- 8.3.3 workers, metrics, logs, outputs ------------------------------------------------------------------


@case("8.3.3", "One worker per target; metrics and logs from the workers in GET /tasks/{id}/metrics and /logs (also as SSE); outputs gathered")
def workers_metrics_logs_outputs(check: Check) -> None:
    edge = new_edge(check)
    d1, d2 = new_device(check, edge), new_device(check, edge)
    model = install_model(check, "device", [d1, d2])
    task = new_task(check, "inference", inference(model), {"target": "device", "ids": [d1.ident, d2.ident]})
    ws = wait_workers(check, task.id, lambda ws: len(active_on(ws)) == 2, "two RUNNING workers")
    check.equal(sorted((w.target_kind.value, w.target_id, w.role) for w in ws), sorted([("device", d1.ident, "worker"), ("device", d2.ident, "worker")]),
                "one worker per target and role")  # fmt: skip
    check.equal(len(ws), 2, "workers in all")
    w1, w2 = active_on(ws)[d1.ident], active_on(ws)[d2.ident]
    check.check(d1.workers.keys() == {w1.id} and d2.workers.keys() == {w2.id}, "each device's desired document carries only its own worker's order")

    # the forged sample goes first, on the same connection: once the later ones are in, it has been handled
    metrics_event(d2, w1, {"requests": 1000})  # d2 speaks for d1's worker: must be refused
    metrics_event(d1, w1, {"requests": 5, "latency_ms": 12.5})
    metrics_event(d2, w2, {"requests": 3})
    m = check.wait(lambda: (x := check.target.ok("GET", f"/tasks/{task.id}/metrics", TaskMetrics)).workers.keys() == {w1.id, w2.id} and x, PATIENCE_S,
                   "both workers' samples in GET /tasks/{id}/metrics")  # fmt: skip
    check.equal(m.workers[w1.id].values, {"requests": 5, "latency_ms": 12.5}, "worker 1's latest sample")
    check.equal((m.workers[w1.id].target_id, m.workers[w2.id].target_id), (d1.ident, d2.ident), "samples carry their targets")
    check.equal(m.totals.get("requests"), 8.0, "totals sum the workers' latest samples (the forged sample from another device is not kept)")
    series = check.target.ok("GET", f"/tasks/{task.id}/metrics", TaskMetrics, params={"series": "true"}).series
    check.equal(sorted(s.values.get("requests", 0) for s in series), [3.0, 5.0], "series=true: the two samples kept")

    marker = f"conf-log-{check.target.run_id}-{next(_seq)}"
    log_event(d2, w1, f"{marker} forged")  # first, as the forged sample above
    log_event(d1, w1, f"{marker} first", f"{marker} second")
    log_event(d2, w2, f"{marker} from two", level="warning")

    def marked() -> list[TaskLogLine] | None:
        found = [x for x in log_lines(check, task.id) if marker in x.text]
        return found if len(found) >= 3 and any(x.text == f"{marker} from two" for x in found) else None

    lines = check.wait(marked, PATIENCE_S, "the workers' log lines in GET /tasks/{id}/logs, the last one sent among them")
    mine = [(x.worker_id, x.target_id, x.level, x.text) for x in lines]
    check.equal(mine, [(w1.id, d1.ident, "info", f"{marker} first"), (w1.id, d1.ident, "info", f"{marker} second"), (w2.id, d2.ident, "warning", f"{marker} from two")],
                "the lines, in order, with worker, target and level; the forged line is not kept")  # fmt: skip
    ids = [x.id for x in log_lines(check, task.id)]
    check.check(ids == sorted(ids) and len(set(ids)) == len(ids), "line ids increase")
    page = Page[TaskLogLine].model_validate(check.target.ok("GET", f"/tasks/{task.id}/logs", params={"after": lines[0].id}))
    check.check(lines[0].id not in [x.id for x in page.items] and lines[1].id in [x.id for x in page.items], "?after= pages past a line id")

    events = sse_events(check, task.id, lambda ev: any(e == "log" and f"{marker} from two" in d for e, d in ev) and any(e == "state" for e, _ in ev))
    logged = [TaskLogLine.model_validate_json(d) for e, d in events if e == "log"]
    check.check([x.text for x in logged if marker in x.text] == [f"{marker} first", f"{marker} second", f"{marker} from two"],
                f"SSE: the same lines as event: log ({len(logged)} log events)")  # fmt: skip
    check.check(any(e == "state" and json.loads(d).get("state") == "RUNNING" for e, d in events), "SSE: an event: state with the task RUNNING")
    with check.target.client() as c, c.stream("GET", f"/tasks/{task.id}/logs", headers={"Accept": "text/event-stream", "Last-Event-ID": str(lines[-1].id)}) as r:
        first_log = None
        event = ""
        for line in r.iter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:") and event in ("log", "state"):
                if event == "log":
                    first_log = TaskLogLine.model_validate_json(line[5:].lstrip())
                break
        check.check(first_log is None or first_log.id > lines[-1].id, f"SSE with Last-Event-ID {lines[-1].id} resumes after it")

    outs = check.target.ok("GET", f"/tasks/{task.id}/outputs", TaskOutputs)
    check.equal((outs.task_id, outs.state.value, outs.content_url), (task.id, "RUNNING", None), "GET /tasks/{id}/outputs of a service task")
    act(check, task.id, "stop")
    check.equal(sorted(x.state.value for x in workers(check, task.id)), ["SUCCEEDED", "SUCCEEDED"], "stop: both RUNNING workers SUCCEEDED")

    # outputs of a sharded task: 5 inputs in chunks of 2 over the two devices; gathered in input order
    for d in (d1, d2):
        batch_worker(d)
    rows = [[float(i), float(10 * i)] for i in range(1, 6)]
    dataset = _multipart_upload(check, "dataset", _name(check, "data"), "1.0.0", "npy", npy_f32(rows))
    batch = new_task(check, "batch_inference", {"model": model, "inputs": dataset.id, "chunk_size": 2}, {"target": "device", "ids": [d1.ident, d2.ident]})
    check.equal((batch.progress.items_total, batch.progress.chunks_total), (5, 3), "items and chunks of the batch task")
    done = wait_task(check, batch.id, {"SUCCEEDED", "FAILED", "CANCELED", "TIMED_OUT"})
    check.equal(done.state.value, "SUCCEEDED", "the batch task")
    outs = check.target.ok("GET", f"/tasks/{batch.id}/outputs", TaskOutputs)
    check.equal((outs.complete, outs.items_done, [(t.name, t.shape) for t in outs.tensors]), (True, 5, [("y", [5, 1])]), "its outputs (complete, items, tensors)")
    check.check(outs.content_url is not None, "a content URL")
    r = check.target.call("GET", f"/tasks/{batch.id}/outputs/content")
    check.equal(r.status_code, 200, "GET /tasks/{id}/outputs/content")
    dtype, shape, raw = read_safetensors(r.content)["y"]
    got = list(struct.unpack(f"<{shape[0]}f", raw))
    check.equal((dtype, shape, got), ("F32", [5, 1], [sum(row) for row in rows]), "the gathered outputs, in input order")
    placed = workers(check, batch.id)
    check.check({w.target_id for w in placed} <= {d1.ident, d2.ident} and sum(w.items_assigned or 0 for w in placed) >= 5, "the chunks went to the placed devices")


# ---- 8.3.4 timeouts -----------------------------------------------------------------------------------------


@case("8.3.4", "timeout_s (paused time excluded) ends the task TIMED_OUT; a worker that never reports is TIMED_OUT after worker_timeout_s")
def timeouts(check: Check) -> None:
    edge = new_edge(check)
    model = install_model(check, "node", [edge.node])
    placement = {"target": "node", "ids": [edge.node_id]}
    task = new_task(check, "inference", inference(model), placement, timeout_s=3)
    wait_task(check, task.id, "RUNNING")
    act(check, task.id, "pause")
    still_paused = still(check, task.id, "PAUSED", 3.5, idle=False)  # longer than timeout_s: the scheduler checks the deadline meanwhile
    check.equal(still_paused.state.value, "PAUSED", "a task paused past its timeout_s is not TIMED_OUT (paused time excluded)")
    act(check, task.id, "resume")
    resumed = time.monotonic()
    ended = wait_task(check, task.id, {"TIMED_OUT", "SUCCEEDED", "FAILED", "CANCELED"})
    check.equal(ended.state.value, "TIMED_OUT", "the task after timeout_s of running time")
    check.check(time.monotonic() - resumed > 0.2, "it ran on after the resume before timing out")
    check.equal([x.state.value for x in workers(check, task.id)], ["CANCELED"], "its running worker is ended (CANCELED)")
    check.wait(lambda: not edge.node.workers, PATIENCE_S, "the worker's order withdrawn")
    check.equal(act(check, task.id, "retry").state.value, "PENDING", "retry from TIMED_OUT")
    act(check, task.id, "cancel")

    edge.node.worker_mode = "silent"
    silent = new_task(check, "inference", inference(model), placement, heartbeat_s=0.5, worker_timeout_s=1,
                      retry={"max_attempts": 1, "backoff_s": 0, "max_backoff_s": 0})  # fmt: skip
    # it may be TIMED_OUT by the time it is first seen (worker_timeout_s=1): its history says it was QUEUED and never ran
    ws = wait_workers(check, silent.id, lambda ws: len(ws) == 1 and ws[0].state is not WorkerState.QUEUED, "the silent task's one worker ended")
    check.equal(ws[0].state.value, "TIMED_OUT", "a worker that never reports, after worker_timeout_s=1")
    check.equal(([h.to_state for h in ws[0].history][:1], ws[0].started_at), (["QUEUED"], None), "it was QUEUED and never started (first state, started_at)")
    ended = wait_task(check, silent.id, {"FAILED", "TIMED_OUT", "SUCCEEDED", "CANCELED"})
    check.equal(ended.state.value, "FAILED", "the task with no worker left to try (max_attempts 1)")
    check.wait(lambda: not edge.node.workers, PATIENCE_S, "the timed-out worker's order withdrawn")


# ---- the standard's clauses -------------------------------------------------------------------------------


@case("7.2.c.1", "A node of a running task goes OFFLINE (last will): its worker LOST, the task goes on and the work is placed on the spare target")
def fault_tolerance(check: Check) -> None:
    edges = [new_edge(check) for _ in range(3)]
    model = install_model(check, "node", [e.node for e in edges])
    task = new_task(check, "inference", inference(model), {"target": "node", "ids": [e.node_id for e in edges], "max_nodes": 2})
    ws = wait_workers(check, task.id, lambda ws: len(active_on(ws)) == 2, "two RUNNING workers")
    wait_task(check, task.id, "RUNNING")
    by_node = {e.node_id: e for e in edges}
    victim_worker = ws[0]
    victim = by_node[victim_worker.target_id]
    spare = next(e for e in edges if e.node_id not in {w.target_id for w in ws})
    survivor = next(e for e in edges if e is not victim and e is not spare)
    check.note(f"workers on {[w.target_id for w in ws]}; {victim.node_id} goes away, {spare.node_id} is spare")
    victim.node.heartbeats.clear()  # the agent vanishes: its worker stops reporting with it
    victim.running.clear()
    victim.peer.disconnect(with_will=True)
    wait_node(check, victim.node_id, "OFFLINE", PATIENCE_S)
    lost = wait_workers(check, task.id, lambda ws: any(w.id == victim_worker.id and w.state is WorkerState.LOST for w in ws), "the worker on the OFFLINE node LOST")
    check.note(f"ok: worker {victim_worker.id} LOST ({next(w.detail for w in lost if w.id == victim_worker.id)})")
    ws = wait_workers(check, task.id, lambda ws: spare.node_id in active_on(ws), "a new worker RUNNING on the spare target")
    new = active_on(ws)[spare.node_id]
    check.check(new.attempt == victim_worker.attempt + 1, f"the replacement is attempt {new.attempt}")
    check.check(survivor.node_id in active_on(ws), "the other worker runs on undisturbed")
    task_now = get_task(check, task.id)
    check.equal(task_now.state.value, "RUNNING", "the task")
    check.check(not any(to in ("FAILED", "CANCELED", "TIMED_OUT") for _f, to in history(task_now)), f"the task never ended: {history(task_now)}")


@case("7.2.c.4", "A target's one GPU is allocated to the task that asked for it; a second task asking for it waits PENDING until it is free")
def accelerators_allocated(check: Check) -> None:
    edge = edge_with(check, accelerators=[gpu()])
    model = install_model(check, "node", [edge.node])
    placement = {"target": "node", "ids": [edge.node_id], "accelerators": [{"type": "gpu", "count": 1}]}
    first = new_task(check, "inference", inference(model), placement)
    ws = wait_workers(check, first.id, lambda ws: len(active_on(ws)) == 1, "the first task's worker RUNNING")
    check.equal([(a.type.value, a.count) for a in ws[0].accelerators], [("gpu", 1)], "the worker holds the GPU")
    second = new_task(check, "inference", inference(model), placement)
    still(check, second.id, "PENDING")
    too_many = new_task(check, "inference", inference(model), {**placement, "accelerators": [{"type": "gpu", "count": 2}]})
    still(check, too_many.id, "PENDING", 0.5)
    check.note("ok: a request for 2 GPUs on a target with 1 waits too")
    act(check, first.id, "cancel")
    ws = wait_workers(check, second.id, lambda ws: len(active_on(ws)) == 1, "the second task placed once the GPU is free")
    check.equal([(a.type.value, a.count) for a in ws[0].accelerators], [("gpu", 1)], "the second task's worker holds the GPU")
    check.equal(get_task(check, too_many.id).state.value, "PENDING", "the 2-GPU request")


@case("7.2.d.4", "Placement follows reported capability: min_memory_bytes picks the target with enough available memory, and follows a change")
def capability_memory(check: Check) -> None:
    small, big = edge_with(check, memory=1 * GiB), edge_with(check, memory=3 * GiB)
    model = install_model(check, "node", [small.node, big.node])
    ids = [small.node_id, big.node_id]
    task = new_task(check, "inference", inference(model), {"target": "node", "ids": ids, "min_memory_bytes": 2 * GiB})
    ws = wait_workers(check, task.id, lambda ws: len(active_on(ws)) >= 1, "a worker RUNNING")
    ws = same_workers(check, task.id, ws)
    check.equal([w.target_id for w in ws], [big.node_id], "the only worker is on the target reporting 3 GiB available (the other reports 1 GiB)")
    greedy = new_task(check, "inference", inference(model), {"target": "node", "ids": ids, "min_memory_bytes": 5 * GiB})
    still(check, greedy.id, "PENDING")
    small.node.resources = resources(memory_available=6 * GiB)
    ws = wait_workers(check, greedy.id, lambda ws: len(active_on(ws)) == 1, "the 5 GiB task placed once a target reports 6 GiB")
    check.equal(ws[0].target_id, small.node_id, "it runs on the target whose readings changed")


@case("6.1.2.e", "Accelerators of different types (GPU, NPU) on different targets are pooled: each request lands on the matching type")
def heterogeneous_pool(check: Check) -> None:
    g, n = edge_with(check, accelerators=[gpu("gpu")]), edge_with(check, accelerators=[gpu("npu")])
    for e, kind in ((g, "gpu"), (n, "npu")):
        status = node_status(check.target, e.node_id)
        check.equal([a.type.value for a in status.resources.accelerators] if status.resources else None, [kind], f"status of {e.node_id} shows its {kind}")
    model = install_model(check, "node", [g.node, n.node])
    ids = [g.node_id, n.node_id]
    placed = {}
    for kind in ("npu", "gpu"):
        task = new_task(check, "inference", inference(model), {"target": "node", "ids": ids, "accelerators": [{"type": kind}]})
        ws = wait_workers(check, task.id, lambda ws: len(active_on(ws)) == 1, f"the {kind} task's worker RUNNING")
        placed[kind] = ws
    for kind, e in (("gpu", g), ("npu", n)):
        ws = same_workers(check, placed[kind][0].task_id, placed[kind])
        check.equal([(w.target_id, [a.type.value for a in w.accelerators]) for w in ws], [(e.node_id, [kind])], f"the {kind} request's only worker")
    tpu = new_task(check, "inference", inference(model), {"target": "node", "ids": ids, "accelerators": [{"type": "tpu"}]})
    still(check, tpu.id, "PENDING", 1.0)
    check.note("ok: a TPU request, which no pooled target has, waits")


@case("6.2.2.g", "An edge node runs a task placed on node targets: its worker RUNNING there, then SUCCEEDED")
def edge_runs_tasks(check: Check) -> None:
    edge = new_edge(check)
    model = install_model(check, "node", [edge.node])
    task = new_task(check, "inference", inference(model, duration_s=2), {"target": "node", "ids": [edge.node_id]})
    ws = wait_workers(check, task.id, lambda ws: len(active_on(ws)) == 1, "the node's worker RUNNING")
    check.equal((ws[0].target_kind.value, ws[0].target_id), ("node", edge.node_id), "the worker's target")
    check.check(ws[0].id in edge.node.workers and edge.node.workers[ws[0].id].task_id == task.id, "the order arrived in the node's own desired document")
    check.equal(wait_task(check, task.id, "RUNNING").started_at is not None, True, "started_at set once the worker ran")
    done = wait_task(check, task.id, {"SUCCEEDED", "FAILED", "CANCELED", "TIMED_OUT"})
    check.equal(done.state.value, "SUCCEEDED", "after duration_s")
    check.equal([w.state.value for w in workers(check, task.id)], ["SUCCEEDED"], "the node's worker")


@case("6.3.2.f", "A task placed by selector on several relayed devices of one edge gets one worker per matching device, none elsewhere")
def several_terminals(check: Check) -> None:
    edge = new_edge(check)
    fleet = f"f{check.target.run_id}{next(_seq)}"
    devices = [new_device(check, edge, labels={"fleet": fleet}) for _ in range(3)]
    other = new_device(check, edge, labels={"fleet": fleet + "x"})
    model = install_model(check, "device", [*devices, other])
    task = new_task(check, "inference", inference(model), {"target": "device", "selector": f"fleet={fleet}"})
    ws = wait_workers(check, task.id, lambda ws: len(active_on(ws)) == 3, "three RUNNING workers")
    ws = same_workers(check, task.id, ws)
    check.equal(sorted(w.target_id for w in ws), sorted(d.ident for d in devices), "one worker per matching device, none on the other")
    for d in devices:
        mine = [w.id for w in ws if w.target_id == d.ident]
        check.check(list(d.workers) == mine, f"device {d.ident} holds exactly its own order")
    check.equal(other.workers, {}, "the non-matching device got no order")
    check.equal(get_task(check, task.id).progress.workers.get(WorkerState.RUNNING), 3, "progress counts 3 RUNNING workers")


@case("7.3.1.c", "A model artefact deployed to a device, then an inference task on it: RUNNING, then SUCCEEDED; a device without it gets no worker")
def cloud_train_device_infer(check: Check) -> None:
    edge = new_edge(check)
    with_model, without = new_device(check, edge), new_device(check, edge)
    model = install_model(check, "device", [with_model], version="1.2.0")
    wrong = new_task(check, "inference", inference({**model, "version": "9.9.9"}), {"target": "device", "ids": [with_model.ident]})
    task = new_task(check, "inference", inference(model, duration_s=2), {"target": "device", "ids": [with_model.ident, without.ident]})
    wait_task(check, task.id, "RUNNING")
    ws = workers(check, task.id)
    check.equal([(w.target_id, w.state.value) for w in ws], [(with_model.ident, "RUNNING")], "the only worker, on the device that runs the model")
    spec = with_model.workers[ws[0].id].spec
    check.equal(spec.model.model_dump() if isinstance(spec, InferenceSpec) else spec, model, "the order names the installed model")
    done = wait_task(check, task.id, {"SUCCEEDED", "FAILED", "CANCELED", "TIMED_OUT"})
    check.equal(done.state.value, "SUCCEEDED", "the inference task after duration_s")
    check.equal(without.workers, {}, "the device without the model got no order")
    still(check, wrong.id, "PENDING", 0.5)
    check.note("ok: a task naming a version no device runs waits")


@case("7.3.2.b", "Training cards and inference cards: a request with purpose inference (training) lands only on a card of that purpose (or both)")
def training_and_inference_cards(check: Check) -> None:
    train = edge_with(check, accelerators=[gpu(purpose="training")])
    infer = edge_with(check, accelerators=[gpu(purpose="inference")])
    both = edge_with(check, accelerators=[gpu(purpose="both")])
    model = install_model(check, "node", [train.node, infer.node, both.node])
    cases = [("inference", [train, infer], infer), ("training", [infer, train], train), ("inference", [train], None)]
    tasks = []
    for purpose, pool, expect in cases:
        req = {"type": "gpu", "purpose": purpose}
        t = new_task(check, "inference", inference(model), {"target": "node", "ids": [e.node_id for e in pool], "accelerators": [req]})
        tasks.append((t, purpose, expect))
    for t, purpose, expect in tasks:
        if expect is None:
            still(check, t.id, "PENDING", 1.0)
            check.note(f"ok: purpose {purpose} over a training card only waits")
            continue
        ws = wait_workers(check, t.id, lambda ws: len(active_on(ws)) == 1, f"the {purpose} task's worker RUNNING")
        check.equal([w.target_id for w in ws], [expect.node_id], f"purpose {purpose}: the card of that purpose")
    t = new_task(check, "inference", inference(model), {"target": "node", "ids": [train.node_id, both.node_id], "accelerators": [{"type": "gpu", "purpose": "inference"}]})
    ws = wait_workers(check, t.id, lambda ws: len(active_on(ws)) == 1, "the inference task over training + both cards")
    check.equal([w.target_id for w in ws], [both.node_id], "purpose inference: the card for both")
    mixed = edge_with(check, accelerators=[gpu(purpose="training"), gpu(purpose="inference")])
    model = install_model(check, "node", [mixed.node])
    hold = new_task(check, "inference", inference(model), {"target": "node", "ids": [mixed.node_id], "accelerators": [{"type": "gpu", "purpose": "training"}]})
    wait_workers(check, hold.id, lambda ws: len(active_on(ws)) == 1, "a worker holding the training card of a target with one card of each purpose")
    t = new_task(check, "inference", inference(model), {"target": "node", "ids": [mixed.node_id], "accelerators": [{"type": "gpu", "purpose": "inference"}]})
    ws = wait_workers(check, t.id, lambda ws: len(active_on(ws)) == 1, "an inference worker beside it")
    check.equal([w.target_id for w in ws], [mixed.node_id], "the target's inference card is free while its training card is held")


@case("6.1.2.b.3", "A running task's progress (chunks and items done, worker counts) and metrics series are visible through its REST views")
def progress_visible(check: Check) -> None:
    edge = new_edge(check)
    dev = new_device(check, edge)
    model = install_model(check, "device", [dev])
    release = threading.Event()
    seen_first = threading.Event()

    def gate(index: int) -> None:
        if index == 1:
            seen_first.set()
            release.wait(10 * PATIENCE_S)  # the case (or its clean-up) releases it

    batch_worker(dev, gate)
    rows = [[float(i), 1.0] for i in range(6)]
    dataset = _multipart_upload(check, "dataset", _name(check, "data"), "1.0.0", "npy", npy_f32(rows))
    task = new_task(check, "batch_inference", {"model": model, "inputs": dataset.id, "chunk_size": 2}, {"target": "device", "ids": [dev.ident]})
    check.cleanup("release the worker", release.set)
    check.wait(seen_first.is_set, PATIENCE_S, "the worker finished its first chunk")
    (w,) = wait_workers(check, task.id, lambda ws: len(active_on(ws)) == 1, "the worker RUNNING")
    metrics_event(dev, w, {"items_per_s": 4.0, "loss": 0.9})
    metrics_event(dev, w, {"items_per_s": 6.0, "loss": 0.5})
    mid = check.wait(lambda: (t := get_task(check, task.id)).progress.chunks_done == 1 and t, PATIENCE_S, "progress shows 1 chunk done")
    check.equal((mid.state.value, mid.progress.items_total, mid.progress.items_done, mid.progress.chunks_total), ("RUNNING", 6, 2, 3),
                "while it runs: state, items total/done, chunks total")  # fmt: skip
    check.equal(mid.progress.workers.get(WorkerState.RUNNING), 1, "progress counts the RUNNING worker")
    listed = Page[TaskPublic].model_validate(check.target.ok("GET", "/tasks", params={"state": "RUNNING", "type": "batch_inference", "limit": 200}))
    check.check(any(t.id == task.id and t.progress.chunks_done == 1 for t in listed.items), "GET /tasks?state=RUNNING lists it with its progress")
    # The view is read by two queries (each worker's latest sample, then the series); wait for an answer in which
    # both have seen the two samples: the series holds them and the worker's latest is the series' last.
    m = check.wait(lambda: _metrics_caught_up(check.target.ok("GET", f"/tasks/{task.id}/metrics", TaskMetrics, params={"series": "true"}), w.id, 2),
                   PATIENCE_S, f"the metrics series of 2 samples and worker {w.id}'s latest sample")  # fmt: skip
    check.equal([s.values.get("loss") for s in m.series], [0.9, 0.5], "series in order, newest last")
    check.equal(m.workers[w.id].values.get("loss"), 0.5, "the latest sample")
    outs = check.target.ok("GET", f"/tasks/{task.id}/outputs", TaskOutputs)
    check.equal((outs.complete, outs.items_done), (False, 2), "outputs while running: incomplete, 2 items")
    problem(check.target.call("GET", f"/tasks/{task.id}/outputs/content"), 409, ErrorCode.CONFLICT)
    check.note("ok: the gathered content is 409 while incomplete")
    release.set()
    done = wait_task(check, task.id, {"SUCCEEDED", "FAILED", "CANCELED", "TIMED_OUT"})
    check.equal((done.state.value, done.progress.items_done, done.progress.chunks_done), ("SUCCEEDED", 6, 3), "at the end")
