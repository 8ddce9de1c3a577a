"""Task run management in the hub (DESIGN §4.3): placement, state machines, fault handling, logs, metrics, outputs.

The scheduler is ticked by the test (with explicit times where time matters); devices report through the
same ingest path that MQTT events relayed by an edge take.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load
from sqlmodel import Session, select

from cloud.tables import TaskChunk
from interfaces.auth import Role
from interfaces.messages import DesiredBody, Envelope
from interfaces.tasks import WorkerAction, WorkerLog
from tests.hub.conftest import assert_problem
from tests.hub.tasks_support import MODEL, TaskFleet, running_task_fleet


@pytest.fixture
def fleet(database_url: str, tmp_path: Path) -> Iterator[TaskFleet]:
    yield from running_task_fleet(database_url, tmp_path)


@pytest.fixture
def sqlite_fleet(sqlite_url: str, tmp_path: Path) -> Iterator[TaskFleet]:
    yield from running_task_fleet(sqlite_url, tmp_path)


def later(seconds: float) -> datetime:
    return datetime.now(UTC) + timedelta(seconds=seconds)


def test_batch_task_is_sharded_by_capability_and_gathered_in_order(fleet: TaskFleet) -> None:
    gw = fleet.node()
    big, small = fleet.device(gw, cores=4), fleet.device(gw, cores=1)
    inputs_id, inputs = fleet.dataset(rows=95)
    task = fleet.batch(inputs_id, chunk_size=10)
    assert task["state"] == "PENDING" and task["progress"]["chunks_total"] == 10 and task["progress"]["items_total"] == 95
    fleet.tick()
    task = fleet.task(task["id"])
    assert task["state"] == "SCHEDULED"
    workers = {w["target_id"]: w for w in fleet.workers(task["id"])}
    assert set(workers) == {big, small} and all(w["state"] == "QUEUED" for w in workers.values())
    # 4 cores to 1: 8 chunks and 2, contiguous
    assert fleet.order_of(workers[big]).chunk_indices() == list(range(8))
    assert fleet.order_of(workers[small]).chunk_indices() == [8, 9]
    order = fleet.order_of(workers[small])
    assert order.items == 95 and order.chunk_size == 10 and order.chunk_bounds(9) == (90, 95)
    assert order.inputs is not None and order.inputs.artifact_id == inputs_id and order.inputs.token
    assert order.spec.model.model_dump() == MODEL and order.action is WorkerAction.RUN

    for w in workers.values():
        fleet.report(w, "RUNNING")
    assert fleet.task(task["id"])["state"] == "RUNNING"
    for w in workers.values():
        fleet.run_chunks(w, inputs)
    assert fleet.task(task["id"])["progress"]["items_done"] == 95
    fleet.tick()
    done = fleet.task(task["id"])
    assert done["state"] == "SUCCEEDED", done
    assert {w["state"] for w in fleet.workers(task["id"])} == {"SUCCEEDED"}
    assert fleet.orders(big) == [] and fleet.orders(small) == []  # withdrawn
    outputs = fleet.hub.get(f"/tasks/{task['id']}/outputs").json()
    assert outputs["complete"] and outputs["tensors"] == [{"name": "probabilities", "dtype": "float32", "shape": [95, 10]}]
    r = fleet.hub.get(f"/tasks/{task['id']}/outputs/content")
    assert r.status_code == 200
    np.testing.assert_array_equal(load(r.content)["probabilities"], inputs[:, :10] * 2)
    history = [h["to_state"] for h in done["history"]]
    assert history == ["PENDING", "SCHEDULED", "RUNNING", "SUCCEEDED"]


def test_locked_and_offline_targets_get_no_workers(fleet: TaskFleet) -> None:
    open_gw, locked_gw = fleet.node("open"), fleet.node("locked")
    ok = fleet.device(open_gw)
    offline = fleet.device(open_gw, online=False)
    gone = fleet.device(open_gw)
    fleet.set_offline(gone)
    locked = fleet.device(locked_gw)
    no_model = fleet.device(open_gw, installed=None)
    fleet.lock(locked_gw)
    inputs_id, _ = fleet.dataset(rows=40)
    task = fleet.batch(inputs_id, chunk_size=10)
    fleet.tick()
    assert [w["target_id"] for w in fleet.workers(task["id"])] == [ok]
    for target in (offline, gone, locked, no_model):
        assert fleet.orders(target) == []
    # naming a device on a LOCKED node is refused outright; nothing is stored
    before = fleet.hub.snapshot()
    r = fleet.hub.request("POST", "/tasks", Role.OPERATOR, json={"type": "batch_inference", "spec": {"model": MODEL, "inputs": inputs_id}, "placement": {"ids": [locked]}})
    assert_problem(r, 409, "target_locked")
    assert fleet.hub.snapshot() == before
    # only LOCKED and OFFLINE targets: the task waits in PENDING and says why
    waiting = fleet.batch(inputs_id, placement={"ids": [offline, gone]})
    fleet.tick()
    waiting = fleet.task(waiting["id"])
    assert waiting["state"] == "PENDING" and "ONLINE" in waiting["reason"]
    assert fleet.workers(waiting["id"]) == []


def test_min_nodes_and_accelerators(fleet: TaskFleet) -> None:
    gw = fleet.node()
    gpu = [{"type": "gpu", "model": "T4", "count": 2, "memory_bytes": 16 << 30, "utilisation": 0.0, "purpose": "inference"}]
    plain = fleet.device(gw)
    card = fleet.device(gw, accelerators=gpu)
    inputs_id, _ = fleet.dataset(rows=20)
    waits = fleet.batch(inputs_id, placement={"min_nodes": 3})
    fleet.tick()
    assert fleet.task(waits["id"])["state"] == "PENDING" and "2 of the 3" in fleet.task(waits["id"])["reason"]
    fleet.act(waits["id"], "cancel")
    first = fleet.batch(inputs_id, placement={"accelerators": [{"type": "gpu", "count": 2, "purpose": "inference"}]})
    fleet.tick()
    assert [w["target_id"] for w in fleet.workers(first["id"])] == [card]
    assert fleet.workers(first["id"])[0]["accelerators"] == [{"type": "gpu", "count": 2, "purpose": "inference", "min_memory_bytes": None}]
    # both cards are reserved by the first task's active worker
    second = fleet.batch(inputs_id, placement={"accelerators": [{"type": "gpu", "count": 1}]})
    fleet.tick()
    assert fleet.task(second["id"])["state"] == "PENDING" and "gpu free" in fleet.task(second["id"])["reason"]
    training = fleet.batch(inputs_id, placement={"accelerators": [{"type": "gpu", "purpose": "training"}]})
    fleet.act(first["id"], "cancel")
    fleet.tick()
    assert [w["target_id"] for w in fleet.workers(second["id"])] == [card]  # freed by the cancel
    assert fleet.task(training["id"])["state"] == "PENDING"  # inference cards only
    assert plain not in {w["target_id"] for w in fleet.workers(second["id"])}


def test_offline_device_is_lost_and_its_chunks_move_without_loss_or_duplicates(fleet: TaskFleet) -> None:
    gw = fleet.node()
    a, b, c = (fleet.device(gw) for _ in range(3))
    inputs_id, inputs = fleet.dataset(rows=90)
    task = fleet.batch(inputs_id, chunk_size=10, retry={"backoff_s": 0})
    fleet.tick()
    workers = {w["target_id"]: w for w in fleet.workers(task["id"])}
    for w in workers.values():
        fleet.report(w, "RUNNING")
    fleet.run_chunks(workers[a], inputs)
    fleet.run_chunks(workers[b], inputs, only=fleet.order_of(workers[b]).chunk_indices()[:1])  # b did 1 of its 3
    owned_b = fleet.order_of(workers[b]).chunk_indices()
    fleet.set_offline(b)
    fleet.tick()
    lost = fleet.worker_row(workers[b]["id"])
    assert lost.state == "LOST" and "OFFLINE" in lost.detail
    assert all(o.worker_id != workers[b]["id"] for o in fleet.orders(b))
    # b's two unfinished chunks went to the active workers (no fresh device exists)
    fleet.tick()
    given = [i for w in (workers[a], workers[c]) for i in fleet.order_of(w).chunk_indices() if i in owned_b]
    assert sorted(given) == owned_b[1:]
    # the lost worker's late copy of a chunk is refused; the new owners' are kept once
    fleet.output(workers[b], owned_b[1], inputs[owned_b[1] * 10 : owned_b[1] * 10 + 10] + 1)
    fleet.run_chunks(workers[a], inputs)
    fleet.run_chunks(workers[c], inputs)
    fleet.run_chunks(workers[c], inputs)  # a resent batch: duplicates
    assert fleet.ingest.counters["task_output_not_owner"] == 1 and fleet.ingest.counters["task_output_duplicate"] >= 1
    fleet.tick()
    assert fleet.task(task["id"])["state"] == "SUCCEEDED"
    r = fleet.hub.get(f"/tasks/{task['id']}/outputs/content")
    np.testing.assert_array_equal(load(r.content)["probabilities"], inputs[:, :10] * 2)
    with Session(fleet.engine) as session:
        chunks = session.execute(select(TaskChunk).where(TaskChunk.task_id == task["id"])).scalars().all()
        assert sorted(ch.index for ch in chunks) == list(range(9)) and all(ch.state == "DONE" for ch in chunks)


def test_a_fresh_device_takes_over_and_reports_go_only_to_the_owner(fleet: TaskFleet) -> None:
    gw = fleet.node()
    a = fleet.device(gw)
    inputs_id, inputs = fleet.dataset(rows=30)
    task = fleet.batch(inputs_id, chunk_size=10, retry={"backoff_s": 0})
    fleet.tick()
    (wa,) = fleet.workers(task["id"])
    fleet.report(wa, "RUNNING")
    b = fleet.device(gw)
    # device b cannot speak for a's worker
    fleet.output(wa, 0, inputs[:10], from_target=b)
    assert fleet.ingest.counters["task_output_wrong_target"] == 1
    fleet.set_offline(a)
    fleet.tick()
    fleet.tick()
    wb = next(w for w in fleet.workers(task["id"]) if w["target_id"] == b)
    assert fleet.order_of(wb).chunk_indices() == [0, 1, 2] and wb["attempt"] == 2
    fleet.report(wb, "RUNNING")
    fleet.run_chunks(wb, inputs)
    fleet.tick()
    assert fleet.task(task["id"])["state"] == "SUCCEEDED"


def test_pause_resume_cancel_and_illegal_transitions(fleet: TaskFleet) -> None:
    gw = fleet.node()
    d = fleet.device(gw)
    inputs_id, _ = fleet.dataset(rows=20)
    task = fleet.batch(inputs_id, timeout_s=10)
    assert_problem(fleet.hub.request("POST", f"/tasks/{task['id']}/pause", Role.OPERATOR), 409, "illegal_transition")
    fleet.tick()
    (w,) = fleet.workers(task["id"])
    fleet.report(w, "RUNNING")
    deadline = datetime.fromisoformat(fleet.task(task["id"])["deadline_at"])
    assert fleet.act(task["id"], "pause")["state"] == "PAUSED"
    assert fleet.order_of(w).action is WorkerAction.PAUSE
    doc = assert_problem(fleet.hub.request("POST", f"/tasks/{task['id']}/pause", Role.OPERATOR), 409, "illegal_transition")
    assert doc["current_state"] == "PAUSED"
    fleet.tick(later(20))  # paused: past the deadline, but the clock stopped
    assert fleet.task(task["id"])["state"] == "PAUSED"
    resumed = fleet.act(task["id"], "resume")
    assert resumed["state"] == "RUNNING" and datetime.fromisoformat(resumed["deadline_at"]) > deadline
    assert fleet.order_of(w).action is WorkerAction.RUN
    for action in ("resume", "retry", "start"):
        doc = assert_problem(fleet.hub.request("POST", f"/tasks/{task['id']}/{action}", Role.OPERATOR), 409, "illegal_transition")
        assert doc["current_state"] == "RUNNING"
    assert_problem(fleet.hub.request("DELETE", f"/tasks/{task['id']}", Role.OPERATOR), 409, "illegal_transition")
    assert fleet.hub.request("POST", f"/tasks/{task['id']}/cancel", Role.VIEWER).status_code == 403
    canceled = fleet.act(task["id"], "cancel")
    assert canceled["state"] == "CANCELED"
    assert fleet.worker_row(w["id"]).state == "CANCELED" and fleet.orders(d) == []
    assert_problem(fleet.hub.request("POST", f"/tasks/{task['id']}/cancel", Role.OPERATOR), 409, "illegal_transition")
    assert fleet.hub.request("DELETE", f"/tasks/{task['id']}", Role.OPERATOR).status_code == 204
    assert_problem(fleet.hub.get(f"/tasks/{task['id']}"), 404, "not_found")


def test_held_task_waits_for_start(fleet: TaskFleet) -> None:
    gw = fleet.node()
    fleet.device(gw)
    inputs_id, _ = fleet.dataset(rows=20)
    task = fleet.batch(inputs_id, start=False)
    assert task["held"] is True
    fleet.tick()
    assert fleet.task(task["id"])["state"] == "PENDING" and fleet.workers(task["id"]) == []
    assert fleet.act(task["id"], "start")["held"] is False
    fleet.tick()
    assert fleet.task(task["id"])["state"] == "SCHEDULED"


def test_task_timeout_then_retry_keeps_finished_chunks(fleet: TaskFleet) -> None:
    gw = fleet.node()
    d = fleet.device(gw)
    inputs_id, inputs = fleet.dataset(rows=30)
    task = fleet.batch(inputs_id, chunk_size=10, timeout_s=60)
    fleet.tick()
    (w,) = fleet.workers(task["id"])
    fleet.report(w, "RUNNING")
    fleet.run_chunks(w, inputs, only=[0])
    fleet.tick(later(61))
    timed_out = fleet.task(task["id"])
    assert timed_out["state"] == "TIMED_OUT" and "timeout_s=60" in timed_out["reason"]
    assert fleet.worker_row(w["id"]).state == "CANCELED" and fleet.orders(d) == []
    retried = fleet.act(task["id"], "retry")
    assert retried["state"] == "PENDING" and retried["attempt"] == 2 and retried["progress"]["chunks_done"] == 1
    fleet.tick()
    w2 = next(x for x in fleet.workers(task["id"]) if x["state"] == "QUEUED")
    assert fleet.order_of(w2).chunk_indices() == [1, 2]


def test_silent_worker_times_out_and_failing_chunks_end_the_task(fleet: TaskFleet) -> None:
    gw = fleet.node()
    fleet.device(gw)
    inputs_id, _ = fleet.dataset(rows=10)
    task = fleet.batch(inputs_id, chunk_size=10, worker_timeout_s=20, heartbeat_s=5, retry={"max_attempts": 2, "backoff_s": 0})
    fleet.tick()
    (w1,) = fleet.workers(task["id"])
    fleet.report(w1, "RUNNING")
    fleet.tick(later(10))
    assert fleet.worker_row(w1["id"]).state == "RUNNING"
    fleet.tick(later(25))
    silent = fleet.worker_row(w1["id"])
    assert silent.state == "TIMED_OUT" and "stopped reporting" in silent.detail
    fleet.tick(later(26))  # rescheduled on the same (only) device: a new worker
    w2 = next(w for w in fleet.workers(task["id"]) if w["id"] != w1["id"])
    assert w2["state"] == "QUEUED" and w2["attempt"] == 2
    fleet.report(w2, "FAILED", detail="RuntimeError: out of memory")
    fleet.tick(later(27))
    failed = fleet.task(task["id"])
    assert failed["state"] == "FAILED" and "failed 2 times" in failed["reason"] and "out of memory" in failed["reason"]


def test_worker_backoff_delays_the_next_attempt(fleet: TaskFleet) -> None:
    gw = fleet.node()
    fleet.device(gw)
    inputs_id, _ = fleet.dataset(rows=10)
    task = fleet.batch(inputs_id, chunk_size=10, retry={"max_attempts": 3, "backoff_s": 30})
    fleet.tick()
    (w1,) = fleet.workers(task["id"])
    fleet.report(w1, "FAILED", detail="boom")
    fleet.tick()
    assert len(fleet.workers(task["id"])) == 1  # still in its back-off
    fleet.tick(later(31))
    assert len(fleet.workers(task["id"])) == 2


def test_inference_service_runs_on_each_target_and_replaces_a_lost_one(fleet: TaskFleet) -> None:
    gw = fleet.node()
    a, b = fleet.device(gw), fleet.device(gw)
    task = fleet.create("inference", {"model": MODEL, "report_interval_s": 1}, placement={"max_nodes": 1}, retry={"backoff_s": 0})
    fleet.tick()
    (w,) = fleet.workers(task["id"])
    fleet.report(w, "RUNNING")
    fleet.metrics(w, requests=10, requests_per_s=2.5)
    fleet.set_offline(w["target_id"])
    fleet.tick()
    fleet.tick()
    ws = fleet.workers(task["id"])
    assert [x["state"] for x in ws] == ["LOST", "QUEUED"] and {x["target_id"] for x in ws} == {a, b}
    fleet.report(ws[1], "RUNNING")
    fleet.metrics(ws[1], requests=4, requests_per_s=1.0)
    m = fleet.hub.get(f"/tasks/{task['id']}/metrics", params={"series": "true"}).json()
    assert m["totals"] == {"requests": 14, "requests_per_s": 3.5} and len(m["series"]) == 2
    stopped = fleet.act(task["id"], "stop")
    assert stopped["state"] == "SUCCEEDED"
    assert fleet.worker_row(ws[1]["id"]).state == "SUCCEEDED"


def test_logs_page_and_stream_in_order(sqlite_fleet: TaskFleet) -> None:
    fleet = sqlite_fleet
    gw = fleet.node()
    fleet.device(gw)
    inputs_id, inputs = fleet.dataset(rows=10)
    task = fleet.batch(inputs_id, chunk_size=10)
    fleet.tick()
    (w,) = fleet.workers(task["id"])
    fleet.report(w, "RUNNING")
    message = fleet.log(w, "line 1", "line 2")
    fleet.log(w, "line 3")
    # an edge resending the same event: kept once
    fleet.ingest.counters.clear()
    fleet.send(w["target_id"], "task.log", WorkerLog(worker_id=w["id"], task_id=task["id"], lines=[{"ts": datetime.now(UTC), "text": "x"}]))
    page = fleet.hub.get(f"/tasks/{task['id']}/logs", params={"limit": 500}).json()
    worker_lines = [line["text"] for line in page["items"] if not line["text"].startswith("[hub]")]
    assert worker_lines == ["line 1", "line 2", "line 3", "x"]
    assert any(line["text"].startswith("[hub] created") for line in page["items"])
    ids = [line["id"] for line in page["items"]]
    assert ids == sorted(ids) and message
    second = fleet.hub.get(f"/tasks/{task['id']}/logs", params={"after": ids[1], "limit": 2}).json()
    assert [line["id"] for line in second["items"]] == ids[2:4] and second["next_cursor"] == str(ids[3])
    fleet.run_chunks(w, inputs)
    fleet.tick()
    assert fleet.task(task["id"])["state"] == "SUCCEEDED"
    headers = {**fleet.hub.auth(Role.VIEWER), "Accept": "text/event-stream", "Last-Event-ID": str(ids[0])}
    with fleet.hub.client.stream("GET", f"/api/v1/tasks/{task['id']}/logs", headers=headers) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        body = "".join(r.iter_text())
    events = [block for block in body.split("\n\n") if block.strip()]
    log_ids = [int(line[4:]) for block in events for line in block.splitlines() if line.startswith("id: ")]
    assert log_ids == sorted(log_ids) and log_ids[0] == ids[1]
    assert "event: state" in body and events[-1].startswith("event: end")


def test_validation_errors(fleet: TaskFleet) -> None:
    gw = fleet.node()
    fleet.device(gw)
    model_id, _ = fleet.dataset(rows=5, name="other")
    before = fleet.hub.snapshot()
    r = fleet.hub.request("POST", "/tasks", Role.OPERATOR, json={"type": "batch_inference", "spec": {"model": MODEL}})
    doc = assert_problem(r, 422, "validation_failed")
    assert any("inputs" in e["loc"] for e in doc["errors"])
    assert_problem(fleet.hub.request("POST", "/tasks", Role.OPERATOR, json={"type": "federated_training", "spec": {}}), 422, "validation_failed")
    assert_problem(fleet.hub.request("POST", "/tasks", Role.OPERATOR, json={"type": "batch_inference", "spec": {"model": MODEL, "inputs": "art-nope"}}), 404, "not_found")
    assert_problem(fleet.hub.request("POST", "/tasks", Role.OPERATOR, json={"type": "inference", "spec": {"model": MODEL}, "placement": {"selector": "a b"}}), 400, "invalid_selector")
    assert_problem(fleet.hub.request("POST", "/tasks", Role.OPERATOR, json={"type": "inference", "spec": {"model": MODEL}, "heartbeat_s": 40, "worker_timeout_s": 30}), 422, "validation_failed")
    assert_problem(fleet.hub.request("POST", "/tasks", Role.OPERATOR, json={"type": "inference", "spec": {"model": MODEL}, "placement": {"ids": ["dev-nope"]}}), 422, "validation_failed")
    assert_problem(fleet.hub.request("POST", "/tasks", Role.VIEWER, json={"type": "inference", "spec": {"model": MODEL}}), 403, "forbidden")
    assert fleet.hub.snapshot() == before


def test_hub_restart_resumes_the_task(fleet: TaskFleet) -> None:
    gw = fleet.node()
    a, b = fleet.device(gw), fleet.device(gw)
    inputs_id, inputs = fleet.dataset(rows=40)
    task = fleet.batch(inputs_id, chunk_size=10, retry={"backoff_s": 0})
    fleet.tick()
    workers = {w["target_id"]: w for w in fleet.workers(task["id"])}
    for w in workers.values():
        fleet.report(w, "RUNNING")
    fleet.run_chunks(workers[a], inputs)
    fleet.controller = fleet.fresh_controller()  # what a restarted hub runs
    fleet.tick()
    assert fleet.task(task["id"])["state"] == "RUNNING" and len(fleet.workers(task["id"])) == 2
    fleet.run_chunks(workers[b], inputs)
    fleet.tick()
    assert fleet.task(task["id"])["state"] == "SUCCEEDED"


def test_orders_reach_the_desired_document(fleet: TaskFleet) -> None:
    from cloud.desired import DesiredPublisher

    gw = fleet.node()
    d = fleet.device(gw)
    inputs_id, _ = fleet.dataset(rows=10)
    fleet.batch(inputs_id)
    fleet.tick()
    pending = {p.row_id: p for p in DesiredPublisher(fleet.engine).pending()}
    doc = Envelope[DesiredBody].model_validate_json(pending[d].payload)
    assert doc.body.tasks_version >= 1 and len(doc.body.tasks) == 1 and doc.body.tasks[0].inputs is not None
    DesiredPublisher(fleet.engine).mark_published([pending[d]])
    assert d not in {p.row_id for p in DesiredPublisher(fleet.engine).pending()}


def test_edge_nodes_as_targets_skip_locked_and_offline_ones(fleet: TaskFleet) -> None:
    from sqlalchemy import update

    from cloud.tables import Node
    from interfaces.messages import ConnectionState, StateBody
    from tests.hub.tasks_support import INSTALLED

    ok, locked, offline, never = fleet.node("ok"), fleet.node("locked"), fleet.node("offline"), fleet.node("never", online=False)
    with Session(fleet.engine) as session:
        session.execute(update(Node).values(reported={"installed": INSTALLED}))
        session.commit()
    fleet.lock(locked)
    fleet.ingest.offer(offline, StateBody(state=ConnectionState.OFFLINE, reason="will"))
    fleet.ingest.flush()
    task = fleet.create("inference", {"model": MODEL}, placement={"target": "node"})
    fleet.tick()
    assert [w["target_id"] for w in fleet.workers(task["id"])] == [ok]
    assert [o.worker_id for o in fleet.orders(ok, Node)] == [fleet.workers(task["id"])[0]["id"]]
    for other in (locked, offline, never):
        assert fleet.orders(other, Node) == []
    # the worker's report comes from the node itself (its own events, not relayed for a device)
    (w,) = fleet.workers(task["id"])
    fleet.report(w, "RUNNING")
    assert fleet.task(task["id"])["state"] == "RUNNING"


def test_a_type_that_goes_on_with_the_rest_does_not_replace_a_lost_worker(fleet: TaskFleet, monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    from interfaces import tasks as contract

    # the federated type's rule (k of n), applied to the serving program that runs today
    monkeypatch.setitem(contract.TASK_TYPES, contract.TaskType.INFERENCE, dataclasses.replace(contract.TASK_TYPES[contract.TaskType.INFERENCE], on_lost="continue"))
    gw = fleet.node()
    a, b, c = (fleet.device(gw) for _ in range(3))
    task = fleet.create("inference", {"model": MODEL}, placement={"max_nodes": 2}, retry={"backoff_s": 0})
    fleet.tick()
    placed = fleet.workers(task["id"])
    for w in placed:
        fleet.report(w, "RUNNING")
    fleet.set_offline(placed[0]["target_id"])
    fleet.tick()
    fleet.tick()
    states = [w["state"] for w in fleet.workers(task["id"])]
    assert states == ["LOST", "RUNNING"] and fleet.task(task["id"])["state"] == "RUNNING"
    assert {a, b, c} - {w["target_id"] for w in placed}  # a free target existed, and was not used


def test_a_dataset_in_use_by_a_task_cannot_be_deleted(fleet: TaskFleet) -> None:
    gw = fleet.node()
    fleet.device(gw)
    inputs_id, _ = fleet.dataset(rows=10)
    task = fleet.batch(inputs_id)
    doc = assert_problem(fleet.hub.request("DELETE", f"/artifacts/{inputs_id}", Role.OPERATOR), 409, "artifact_in_use")
    assert task["id"] in doc["detail"]
    fleet.act(task["id"], "cancel")
    assert fleet.hub.request("DELETE", f"/tasks/{task['id']}", Role.OPERATOR).status_code == 204
    assert fleet.hub.request("DELETE", f"/artifacts/{inputs_id}", Role.OPERATOR).status_code == 204
    # and a deployment of a dataset is refused
    other, _ = fleet.dataset(rows=10, name="other")
    assert_problem(fleet.hub.request("POST", "/deployments", Role.OPERATOR, json={"artifact_id": other, "target": {"selector": "a=b"}}), 422, "validation_failed")


def test_a_task_paused_before_its_workers_start_runs_after_resume(fleet: TaskFleet) -> None:
    gw = fleet.node()
    fleet.device(gw)
    inputs_id, _ = fleet.dataset(rows=10)
    task = fleet.batch(inputs_id)
    fleet.tick()
    fleet.act(task["id"], "pause")
    (w,) = fleet.workers(task["id"])
    fleet.report(w, "RUNNING", paused=True)
    assert fleet.task(task["id"])["state"] == "PAUSED"
    assert fleet.act(task["id"], "resume")["state"] == "RUNNING"


def test_tasks_placed_one_after_another_spread_over_equal_devices(fleet: TaskFleet) -> None:
    gw = fleet.node()
    devices = [fleet.device(gw) for _ in range(3)]
    for _ in range(6):
        fleet.create("inference", {"model": MODEL}, placement={"max_nodes": 1})
        fleet.tick()
    with Session(fleet.engine) as session:
        from cloud.tables import TaskWorker

        per_device = [session.execute(select(TaskWorker).where(TaskWorker.target_id == d)).all() for d in devices]
    assert [len(rows) for rows in per_device] == [2, 2, 2]


def test_a_full_target_takes_no_more_workers_and_a_bad_document_blocks_no_other(fleet: TaskFleet, monkeypatch: pytest.MonkeyPatch) -> None:
    from sqlalchemy import update

    from cloud import placement
    from cloud.desired import DesiredPublisher
    from cloud.tables import Device

    monkeypatch.setattr(placement, "MAX_WORKERS_PER_TARGET", 2)
    gw = fleet.node()
    d = fleet.device(gw)
    tasks = [fleet.create("inference", {"model": MODEL}) for _ in range(3)]
    fleet.tick()
    assert [len(fleet.workers(t["id"])) for t in tasks] == [1, 1, 0]
    assert "already runs 2 workers" in fleet.task(tasks[2]["id"])["reason"]
    fleet.act(tasks[0]["id"], "cancel")
    fleet.tick()
    assert len(fleet.workers(tasks[2]["id"])) == 1  # a slot came free
    # a document the contract refuses (here: 65 orders written behind the scheduler's back) is skipped, alone
    other = fleet.device(gw)
    with Session(fleet.engine) as session:
        row = session.get(Device, d)
        assert row is not None
        session.execute(update(Device).where(Device.id == d).values(tasks=row.tasks * 65, tasks_version=row.tasks_version + 1))
        session.commit()
    fleet.batch(fleet.dataset(rows=10)[0], placement={"ids": [other]})
    fleet.tick()
    pending = {p.row_id for p in DesiredPublisher(fleet.engine).pending()}
    assert other in pending and d not in pending
