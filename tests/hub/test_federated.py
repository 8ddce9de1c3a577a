"""Federated training in the hub (DESIGN §5): admission cuts the model's last dense layer, the scheduler opens and
closes rounds, updates are kept or refused, the strategy fuses them, and the trained model is published.

The scheduler is ticked by the test (time moves by passing ``at=`` to ``tick``); devices and edge aggregators
send their ``fl.update`` events through the ingest exactly as MQTT events relayed by an edge would arrive. Every
fused layer is checked against a FedAvg / FedAdam computed here with numpy, independently of the hub.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from safetensors.numpy import load, save
from sqlalchemy import select
from sqlmodel import Session

from cloud.artifacts import create_artifact, read_blob
from cloud.db import make_engine
from cloud.incremental import surgery
from cloud.ingest import StatusIngest
from cloud.scheduler import TaskController
from cloud.tables import Artifact, Device, FlPlan, FlRoundRow, FlUpdateRow, Node, Task, TaskMetric
from device.ota.verify import verify_manifest
from interfaces.auth import Role
from interfaces.deployments import DOWNLOAD_TOKEN_HEADER, ArtifactCreate
from interfaces.tasks import FL_AGGREGATOR, FL_UPDATE_EVENT, MAX_FL_UPDATE_BYTES, FlUpdate, InputRef, WorkerOrder
from tests.hub.conftest import assert_problem
from tests.hub.tasks_support import TaskFleet, running_task_fleet

MODEL_BYTES = (Path(__file__).resolve().parents[1] / "fixtures" / "models" / "digits-mlp.onnx").read_bytes()
DATASET, TIMEOUT = "camera", 60.0
Layer = dict[str, np.ndarray]


@pytest.fixture
def fleet(database_url: str, tmp_path: Path) -> Iterator[TaskFleet]:
    yield from running_task_fleet(database_url, tmp_path)


@pytest.fixture
def sqlite_fleet(sqlite_url: str, tmp_path: Path) -> Iterator[TaskFleet]:
    yield from running_task_fleet(sqlite_url, tmp_path)


def later(seconds: float) -> datetime:
    return datetime.now(UTC) + timedelta(seconds=seconds)


# --- the model, the devices, the task --------------------------------------------------------------


def dense() -> surgery.DenseLayer:
    return surgery.find_dense(surgery.load(MODEL_BYTES))


def model_layer() -> Layer:
    """The model's last dense layer as the hub sends it: weight [features, classes], bias [classes] (computed with onnx here)."""
    graph = onnx.load_from_string(MODEL_BYTES).graph
    inits = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    cut = dense()
    weight = inits[cut.weight].T if cut.transposed else inits[cut.weight]
    return {"weight": np.ascontiguousarray(weight, dtype=np.float32), "bias": inits[cut.bias].astype(np.float32)}


def wide_model(features: int, classes: int) -> bytes:
    """x [N, 64] -> Gemm -> Relu -> Gemm (the last dense layer, ``features`` x ``classes``) -> logits."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((64, features)).astype(np.float32), "w1"), numpy_helper.from_array(np.zeros(features, np.float32), "b1"),
        numpy_helper.from_array(rng.standard_normal((features, classes)).astype(np.float32), "head.weight"),
        numpy_helper.from_array(np.zeros(classes, np.float32), "head.bias"),
    ]  # fmt: skip
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h"]), helper.make_node("Relu", ["h"], ["feature"]),
        helper.make_node("Gemm", ["feature", "head.weight", "head.bias"], ["logits"]),
    ]  # fmt: skip
    graph = helper.make_graph(
        nodes, "wide", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 64])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", classes])], inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model.SerializeToString()


def upload_model(fleet: TaskFleet, name: str = "digits", version: str = "1.0.0", data: bytes = MODEL_BYTES) -> Artifact:
    body = ArtifactCreate(kind="model", name=name, version=version, format="onnx")  # type: ignore[arg-type]
    with Session(fleet.engine, expire_on_commit=False) as session, fleet.blobs.writer() as writer:
        writer.write(data)
        return create_artifact(session, fleet.controller.signing, fleet.blobs, body, writer)


def keeping_device(fleet: TaskFleet, node: str, model: Artifact | None, dataset: str | None = DATASET, rows: int = 300) -> str:
    """A device under ``node`` that runs ``model`` and keeps ``dataset`` (as its reported document says)."""
    installed = {"model": {"name": model.name, "version": model.version, "sha256": model.sha256, "artifact_id": model.id}} if model else None
    device_id = fleet.device(node, installed=installed)
    reported: dict[str, Any] = {"installed": installed} if installed else {}
    if dataset is not None:
        reported["datasets"] = {dataset: {"rows": rows, "shape": [64], "dtype": "float32"}}
    with Session(fleet.engine) as session:
        row = session.get(Device, device_id)
        assert row is not None
        row.reported = reported
        session.add(row)
        session.commit()
    return device_id


def fl_body(devices: list[str], **spec: Any) -> dict[str, Any]:
    spec = {"model": {"name": "digits"}, "dataset": DATASET, "rounds": 3, "topology": "flat", "round_timeout_s": TIMEOUT, **spec}
    return {
        "type": "federated_training", "spec": spec, "placement": {"ids": devices}, "worker_timeout_s": 3600,
        "retry": {"backoff_s": 0, "max_attempts": 3},
    }  # fmt: skip


def federate(fleet: TaskFleet, devices: list[str], **spec: Any) -> dict[str, Any]:
    r = fleet.hub.request("POST", "/tasks", Role.OPERATOR, json=fl_body(devices, **spec))
    assert r.status_code == 201, r.text
    return r.json()  # type: ignore[no-any-return]


def plan_of(fleet: TaskFleet, task_id: str) -> FlPlan | None:
    with Session(fleet.engine, expire_on_commit=False) as session:
        plan = session.get(FlPlan, task_id)
        if plan is not None:
            session.expunge(plan)
        return plan


def closed_rounds(fleet: TaskFleet, task_id: str) -> list[FlRoundRow]:
    with Session(fleet.engine, expire_on_commit=False) as session:
        rows = list(session.execute(select(FlRoundRow).where(FlRoundRow.task_id == task_id).order_by(FlRoundRow.round)).scalars())  # type: ignore[arg-type]
        session.expunge_all()
        return rows


def stored_updates(fleet: TaskFleet, task_id: str) -> list[FlUpdateRow]:
    with Session(fleet.engine, expire_on_commit=False) as session:
        rows = list(session.execute(select(FlUpdateRow).where(FlUpdateRow.task_id == task_id).order_by(FlUpdateRow.id)).scalars())  # type: ignore[arg-type]
        session.expunge_all()
        return rows


def by_role(fleet: TaskFleet, task_id: str) -> dict[str, dict[str, dict[str, Any]]]:
    """role -> target id -> the worker (active ones)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for w in fleet.workers(task_id):
        if w["state"] in ("QUEUED", "RUNNING"):
            out.setdefault(w["role"], {})[w["target_id"]] = w
    return out


def devices_of(fleet: TaskFleet, task_id: str) -> dict[str, dict[str, Any]]:
    return by_role(fleet, task_id).get("worker", {})


def order_for(fleet: TaskFleet, worker: dict[str, Any]) -> WorkerOrder:
    orders = fleet.orders(worker["target_id"], Node) if worker["target_kind"] == "node" else fleet.orders(worker["target_id"])
    (order,) = [o for o in orders if o.worker_id == worker["id"]]
    return order


def fetch(fleet: TaskFleet, ref: InputRef, target_id: str) -> bytes:
    """The ref's manifest is signed by the hub's key and its token lets ``target_id`` fetch the bytes; returns them."""
    verify_manifest(fleet.controller.signing.public_key, ref.signed_manifest)
    assert ref.path == f"/artifacts/{ref.artifact_id}/content"
    stored = fleet.hub.get(f"/artifacts/{ref.artifact_id}").json()
    assert (stored["sha256"], stored["name"], stored["version"]) == (ref.signed_manifest.manifest.sha256, ref.signed_manifest.manifest.name, ref.signed_manifest.manifest.version)
    grant = fleet.controller.signing.verify_download_token(ref.token, ref.artifact_id)
    assert (grant.target_id, grant.sha256) == (target_id, ref.signed_manifest.manifest.sha256)
    r = fleet.hub.request("GET", ref.path, None, headers={DOWNLOAD_TOKEN_HEADER: ref.token})
    assert r.status_code == 200, r.text
    assert hashlib.sha256(r.content).hexdigest() == ref.signed_manifest.manifest.sha256
    return r.content


def global_layer(fleet: TaskFleet, worker: dict[str, Any]) -> Layer:
    """The round's global layer, fetched as the worker would from its order."""
    order = order_for(fleet, worker)
    assert order.fl is not None
    return load(fetch(fleet, order.fl.weights, worker["target_id"]))


def run_all(fleet: TaskFleet, workers: dict[str, dict[str, Any]]) -> None:
    for w in workers.values():
        fleet.report(w, "RUNNING")


# --- updates ---------------------------------------------------------------------------------------


def trained(seed: int) -> Layer:
    rng = np.random.default_rng(seed)
    cut = dense()
    return {"weight": rng.standard_normal((cut.features, cut.classes)).astype(np.float32), "bias": rng.standard_normal(cut.classes).astype(np.float32)}


def encode(layer: Layer) -> str:
    return base64.b64encode(save(layer)).decode()


def send_update(
    fleet: TaskFleet, worker: dict[str, Any], round_: int, layer: Layer | str, n: int, attempt: int = 1, contributors: list[str] | None = None,
    metrics: dict[str, float] | None = None, from_target: str | None = None, at: datetime | None = None,
) -> None:  # fmt: skip
    """What a device (or an edge's aggregator) sends at the end of its local training: an ``fl.update`` event."""
    data = FlUpdate(
        task_id=worker["task_id"], worker_id=worker["id"], round=round_, attempt=attempt, contributors=contributors or [worker["target_id"]],
        num_examples=n, data=layer if isinstance(layer, str) else encode(layer), metrics=metrics or {},
    )  # fmt: skip
    fleet.send(from_target or worker["target_id"], FL_UPDATE_EVENT, data, at=at)


def fedavg(pairs: list[tuple[Layer, float]]) -> Layer:
    total = sum(n for _, n in pairs)
    return {k: (sum(n * layer[k].astype(np.float64) for layer, n in pairs) / total).astype(np.float32) for k in ("weight", "bias")}


def assert_layer(got: Layer, expected: Layer) -> None:
    assert set(got) == {"weight", "bias"} and all(got[k].dtype == np.float32 for k in got)
    for k in ("weight", "bias"):
        np.testing.assert_allclose(got[k], expected[k], rtol=0, atol=1e-6)


def counters(fleet: TaskFleet) -> dict[str, int]:
    return {k: v for k, v in fleet.ingest.counters.items() if k.startswith("task_update_")}


def delete_artifact(fleet: TaskFleet, artifact_id: str) -> Any:
    return fleet.hub.request("DELETE", f"/artifacts/{artifact_id}", Role.OPERATOR)


# --- admission -------------------------------------------------------------------------------------


def test_admission_pins_the_version_cuts_the_body_and_stores_the_plan(fleet: TaskFleet) -> None:
    # Prepare: two devices that run digits 1.0.0 and keep the dataset
    gw = fleet.node()
    model = upload_model(fleet)
    devices = [keeping_device(fleet, gw, model) for _ in range(2)]

    # Execute: no version given
    task = federate(fleet, devices, min_participants=2)

    # Assert: the version is pinned; the plan holds the model, the body and the model's last layer; no round is open
    assert task["state"] == "PENDING" and task["type"] == "federated_training"
    assert task["spec"]["model"] == {"name": "digits", "version": "1.0.0"}
    plan = plan_of(fleet, task["id"])
    assert plan is not None
    assert (plan.model_artifact_id, plan.round, plan.attempt, plan.participants) == (model.id, 1, 0, [])
    assert plan.weights_artifact_id is None and plan.published_artifact_id is None and plan.deadline_at is None
    assert_layer(load(plan.weights), model_layer())
    body = fleet.hub.get(f"/artifacts/{plan.body_artifact_id}").json()
    assert (body["kind"], body["name"], body["version"], body["format"]) == ("model", "digits.body", "1.0.0", "onnx")
    with Session(fleet.engine) as session:
        stored = session.get(Artifact, plan.body_artifact_id)
        assert stored is not None
        body_graph = onnx.load_from_string(read_blob(fleet.blobs, stored.sha256))
    assert [o.name for o in body_graph.graph.output] == [dense().feature]  # the body ends at the last layer's input


def test_what_cannot_be_federated_is_refused_and_nothing_is_stored(sqlite_fleet: TaskFleet) -> None:
    fleet = sqlite_fleet
    gw = fleet.node()
    model = upload_model(fleet)
    a, b = keeping_device(fleet, gw, model), keeping_device(fleet, gw, model)
    no_data = keeping_device(fleet, gw, model, dataset=None)  # runs the model, keeps no dataset
    other_data = keeping_device(fleet, gw, model, dataset="other")
    ghost = {"name": "ghost", "version": "1.0.0", "sha256": "b" * 64}
    unstored = fleet.device(gw, installed=None)  # runs a model that was never uploaded
    with Session(fleet.engine) as session:
        row = session.get(Device, unstored)
        assert row is not None
        row.reported = {"installed": {"model": ghost}, "datasets": {DATASET: {"rows": 10, "shape": [64], "dtype": "float32"}}}
        session.add(row)
        session.commit()
    before = fleet.hub.snapshot()
    cases: list[tuple[dict[str, Any], str]] = [
        (fl_body([a, b, no_data, other_data], min_participants=3), "min_participants is 3"),
        (fl_body([a], strategy="fedprox", strategy_params={"eta": 0.1}), "unknown: ['eta']"),
        (fl_body([a], strategy="fedadam", strategy_params={"eta": -1.0}), "eta must be"),
        (fl_body([a], model={"name": "digits", "version": "2.0.0"}), "not an artefact of this hub"),
        (fl_body([unstored], model={"name": "ghost"}), "not an artefact of this hub"),
        (fl_body([a], rounds=0), "rounds"),
        ({**fl_body([a]), "placement": {"target": "node"}}, "does not run on nodes"),
    ]
    for body, text in cases:
        r = fleet.hub.request("POST", "/tasks", Role.OPERATOR, json=body)
        assert r.status_code == 422 and text in r.text, (body["spec"], r.text)
        doc = assert_problem(r, 422, "validation_failed")
        if "min_participants" in text:
            assert sorted(doc["able_ids"]) == sorted([a, b])
    assert fleet.hub.snapshot() == before


def test_a_model_whose_layer_cannot_travel_in_an_update_is_refused(sqlite_fleet: TaskFleet) -> None:
    # Prepare: a model whose last dense layer is 512 x 100 float32 (200 KiB): larger than an FlUpdate carries
    fleet = sqlite_fleet
    gw = fleet.node()
    model = upload_model(fleet, "wide", data=wide_model(512, 100))
    device = keeping_device(fleet, gw, model)
    frame = save({"weight": np.zeros((512, 100), np.float32), "bias": np.zeros(100, np.float32)})
    assert len(frame) > MAX_FL_UPDATE_BYTES
    with pytest.raises(ValueError, match="data"):  # what every device would send is malformed
        FlUpdate(task_id="t", worker_id="w", round=1, attempt=1, contributors=[device], num_examples=1, data=encode(load(frame)))

    # Execute
    r = fleet.hub.request("POST", "/tasks", Role.OPERATOR, json=fl_body([device], model={"name": "wide"}))

    # Assert: refused at admission, as incremental training refuses a layer its order cannot carry
    assert r.status_code == 422, r.text


def test_a_trimmed_mean_that_could_close_a_round_with_too_few_updates_is_refused(sqlite_fleet: TaskFleet) -> None:
    # Prepare: trimmed mean with beta 0.25 needs 4 updates per round; k = 1
    fleet = sqlite_fleet
    gw = fleet.node()
    model = upload_model(fleet)
    a, b = keeping_device(fleet, gw, model), keeping_device(fleet, gw, model)

    # Execute
    r = fleet.hub.request("POST", "/tasks", Role.OPERATOR, json=fl_body([a, b], strategy="trimmed_mean", strategy_params={"beta": 0.25}))

    # Assert: refused (with k = 1 a round of 2 updates would close and trimmed_mean.aggregate refuse it on every tick)
    assert r.status_code == 422, r.text


# --- placement and orders --------------------------------------------------------------------------


def test_a_flat_task_runs_device_workers_whose_orders_carry_round_one_and_the_models_layer(sqlite_fleet: TaskFleet) -> None:
    fleet = sqlite_fleet
    # Prepare: gw_a with two devices keeping the dataset, gw_b with one, and one under gw_a that keeps none
    gw_a, gw_b = fleet.node("a"), fleet.node("b")
    model = upload_model(fleet)
    a1, a2, b1 = keeping_device(fleet, gw_a, model), keeping_device(fleet, gw_a, model), keeping_device(fleet, gw_b, model)
    bare = keeping_device(fleet, gw_a, model, dataset=None)
    task = federate(fleet, [a1, a2, b1, bare], min_participants=2)
    plan = plan_of(fleet, task["id"])
    assert plan is not None

    # Execute
    opened = datetime.now(UTC)
    fleet.tick()
    fleet.tick()  # a second tick places nothing more

    # Assert: a worker on each device that keeps the dataset, nothing on the edges
    workers = fleet.workers(task["id"])
    assert sorted((w["target_kind"], w["target_id"], w["role"]) for w in workers) == sorted(("device", d, "worker") for d in (a1, a2, b1))
    assert fleet.orders(gw_a, Node) == [] and fleet.orders(gw_b, Node) == [] and fleet.orders(bare) == []
    opened_plan = plan_of(fleet, task["id"])
    assert opened_plan is not None and opened_plan.weights_artifact_id is not None
    assert (opened_plan.round, opened_plan.attempt, sorted(opened_plan.participants)) == (1, 1, sorted([a1, a2, b1]))
    for w in workers:
        order = order_for(fleet, w)
        assert (order.type, order.role, order.spec.model.model_dump()) == ("federated_training", "worker", {"name": "digits", "version": "1.0.0"})
        fl = order.fl
        assert fl is not None
        assert (fl.round, fl.attempt, fl.via_edge, fl.participants) == (1, 1, False, [])
        assert timedelta(seconds=TIMEOUT - 5) < fl.deadline_at - opened < timedelta(seconds=TIMEOUT + 5)
        assert fl.base_sha256 == model.sha256 and fl.feature == dense().feature
        assert [r.artifact_id for r in order.input_refs()] == [opened_plan.weights_artifact_id, plan.body_artifact_id]
        manifest = fl.weights.signed_manifest.manifest
        assert (manifest.kind, manifest.format, manifest.name) == ("model", "safetensors", "digits.fl") and manifest.version.endswith(".r1")
        assert_layer(load(fetch(fleet, fl.weights, w["target_id"])), model_layer())
        body = onnx.load_from_string(fetch(fleet, fl.body, w["target_id"]))
        assert [o.name for o in body.graph.output] == [fl.feature]

    # the workers report; the task runs
    for w in workers:
        fleet.report(w, "RUNNING")
    assert fleet.task(task["id"])["state"] == "RUNNING"


def test_a_hierarchical_task_puts_an_aggregator_on_each_edge_with_participants_unless_the_strategy_cannot_combine(sqlite_fleet: TaskFleet) -> None:
    fleet = sqlite_fleet
    # Prepare: gw_a with two devices, gw_b with one, gw_c whose only device keeps no dataset
    gw_a, gw_b, gw_c = fleet.node("a"), fleet.node("b"), fleet.node("c")
    model = upload_model(fleet)
    a1, a2, b1 = keeping_device(fleet, gw_a, model), keeping_device(fleet, gw_a, model), keeping_device(fleet, gw_b, model)
    c1 = keeping_device(fleet, gw_c, model, dataset=None)

    # Execute: hierarchical FedAvg
    task = federate(fleet, [a1, a2, b1, c1], topology="hierarchical", strategy="fedavg")
    fleet.tick()
    fleet.tick()

    # Assert: one aggregator per edge node with a participant under it; devices send via their edge
    roles = by_role(fleet, task["id"])
    assert set(roles) == {"worker", FL_AGGREGATOR}
    assert sorted(roles["worker"]) == sorted([a1, a2, b1]) and sorted(roles[FL_AGGREGATOR]) == sorted([gw_a, gw_b])
    assert all(w["target_kind"] == "node" for w in roles[FL_AGGREGATOR].values())
    assert fleet.orders(gw_c, Node) == []
    for node, under in ((gw_a, [a1, a2]), (gw_b, [b1])):
        order = order_for(fleet, roles[FL_AGGREGATOR][node])
        assert order.role == FL_AGGREGATOR and order.fl is not None
        assert (order.fl.round, order.fl.attempt, order.fl.via_edge) == (1, 1, True)
        assert sorted(order.fl.participants) == sorted(under)
        assert_layer(global_layer(fleet, roles[FL_AGGREGATOR][node]), model_layer())
    for w in roles["worker"].values():
        order = order_for(fleet, w)
        assert order.fl is not None and order.fl.via_edge is True and order.fl.participants == []

    # Execute: the same devices, hierarchical but with a strategy that needs every device's update
    median = federate(fleet, [a1, a2, b1], topology="hierarchical", strategy="median")
    fleet.tick()

    # Assert: no aggregator; the devices send to the hub
    roles = by_role(fleet, median["id"])
    assert set(roles) == {"worker"} and sorted(roles["worker"]) == sorted([a1, a2, b1])
    for w in roles["worker"].values():
        order = order_for(fleet, w)
        assert order.fl is not None and order.fl.via_edge is False
    assert {o.task_id for o in fleet.orders(gw_a, Node)} == {task["id"]}  # the first task's aggregator only


# --- rounds ----------------------------------------------------------------------------------------


def test_a_round_closes_once_every_participant_answered_and_the_next_opens_with_the_fedavg(fleet: TaskFleet) -> None:
    # Prepare: three devices, flat FedAvg
    gw = fleet.node()
    model = upload_model(fleet)
    devices = [keeping_device(fleet, gw, model) for _ in range(3)]
    task = federate(fleet, devices, rounds=3)
    fleet.tick()
    workers = devices_of(fleet, task["id"])
    run_all(fleet, workers)
    first = plan_of(fleet, task["id"])
    assert first is not None and first.deadline_at is not None
    updates = [(trained(i), n) for i, n in enumerate((10, 30, 60))]

    # Execute: two of three answer; a tick closes nothing
    for (layer, n), d in zip(updates[:2], devices, strict=False):
        send_update(fleet, workers[d], 1, layer, n)
    fleet.tick()
    assert plan_of(fleet, task["id"]).round == 1  # type: ignore[union-attr]
    send_update(fleet, workers[devices[2]], 1, updates[2][0], updates[2][1])

    # Assert: the third answer moves the deadline to now
    assert counters(fleet) == {"task_update_accepted": 3}
    moved = plan_of(fleet, task["id"])
    assert moved is not None and moved.deadline_at is not None and moved.deadline_at < first.deadline_at

    # Execute: the next tick, long before the original deadline
    fleet.tick()

    # Assert: round 1 closed with everyone; round 2 opened with the FedAvg of the updates
    (closed,) = closed_rounds(fleet, task["id"])
    assert (closed.round, closed.attempts, closed.participants, closed.contributors, closed.reason) == (1, 1, 3, 3, "every participant answered")
    plan = plan_of(fleet, task["id"])
    assert plan is not None and (plan.round, plan.attempt, sorted(plan.participants)) == (2, 1, sorted(devices))
    assert plan.weights_artifact_id not in (None, first.weights_artifact_id)
    expected = fedavg(updates)
    for d in devices:
        order = order_for(fleet, workers[d])
        assert order.fl is not None and (order.fl.round, order.fl.attempt) == (2, 1)
        assert order.fl.weights.artifact_id == plan.weights_artifact_id and order.fl.weights.signed_manifest.manifest.version.endswith(".r2")
        assert_layer(global_layer(fleet, workers[d]), expected)
    assert [u.used_in for u in stored_updates(fleet, task["id"])] == [1, 1, 1]
    assert fleet.task(task["id"])["state"] == "RUNNING"


def test_at_the_deadline_k_of_n_close_fewer_run_the_round_again_and_then_the_task_fails(sqlite_fleet: TaskFleet) -> None:
    # Prepare: three devices, k = 2, two attempts per round
    fleet = sqlite_fleet
    gw = fleet.node()
    model = upload_model(fleet)
    a, b, c = (keeping_device(fleet, gw, model) for _ in range(3))
    task = federate(fleet, [a, b, c], rounds=3, min_participants=2, max_round_attempts=2)
    t0 = datetime.now(UTC)
    fleet.tick(t0)
    workers = devices_of(fleet, task["id"])
    run_all(fleet, workers)
    round1 = plan_of(fleet, task["id"])
    assert round1 is not None

    # Execute: only a answers round 1; the deadline passes
    send_update(fleet, workers[a], 1, trained(1), 10)
    fleet.tick(t0 + timedelta(seconds=TIMEOUT - 1))
    assert plan_of(fleet, task["id"]).attempt == 1  # type: ignore[union-attr]
    t1 = t0 + timedelta(seconds=TIMEOUT + 1)
    fleet.tick(t1)

    # Assert: 1 < k: round 1 runs again as attempt 2, from the same global layer, nothing fused
    again = plan_of(fleet, task["id"])
    assert again is not None and (again.round, again.attempt, sorted(again.participants)) == (1, 2, sorted([a, b, c]))
    assert again.weights_artifact_id == round1.weights_artifact_id and again.weights == round1.weights
    assert closed_rounds(fleet, task["id"]) == []
    for d in (a, b, c):
        order = order_for(fleet, workers[d])
        assert order.fl is not None and (order.fl.round, order.fl.attempt) == (1, 2) and order.fl.weights.artifact_id == round1.weights_artifact_id
        assert order.fl.deadline_at == t1 + timedelta(seconds=TIMEOUT)

    # Execute: an update for attempt 1 is late now; a and b answer attempt 2; c never does
    send_update(fleet, workers[c], 1, trained(3), 10)
    assert counters(fleet) == {"task_update_accepted": 1, "task_update_late": 1}
    updates = {a: (trained(11), 20), b: (trained(12), 60)}
    for d, (layer, n) in updates.items():
        send_update(fleet, workers[d], 1, layer, n, attempt=2, metrics={"loss": 1.0 if d == a else 2.0})
    fleet.tick(t1 + timedelta(seconds=TIMEOUT - 1))
    assert plan_of(fleet, task["id"]).round == 1  # type: ignore[union-attr]  # 2 of 3 wait for the deadline
    t2 = t1 + timedelta(seconds=TIMEOUT + 1)
    fleet.tick(t2)

    # Assert: round 1 closed at its deadline with 2 of 3 (the attempt-2 updates only); c still takes part in round 2
    (closed,) = closed_rounds(fleet, task["id"])
    assert (closed.round, closed.attempts, closed.participants, closed.contributors, closed.reason) == (1, 2, 3, 2, "deadline with k of n")
    assert closed.metrics["loss"] == pytest.approx((20 * 1.0 + 60 * 2.0) / 80)
    plan = plan_of(fleet, task["id"])
    assert plan is not None and (plan.round, plan.attempt, sorted(plan.participants)) == (2, 1, sorted([a, b, c]))
    assert_layer(load(plan.weights), fedavg(list(updates.values())))
    order = order_for(fleet, workers[c])
    assert order.fl is not None and (order.fl.round, order.fl.attempt) == (2, 1)
    assert_layer(global_layer(fleet, workers[c]), fedavg(list(updates.values())))

    # Execute: round 2 gets one update in each of its two attempts
    send_update(fleet, workers[c], 2, trained(21), 10)
    t3 = t2 + timedelta(seconds=TIMEOUT + 1)
    fleet.tick(t3)
    assert (plan_of(fleet, task["id"]).round, plan_of(fleet, task["id"]).attempt) == (2, 2)  # type: ignore[union-attr]
    send_update(fleet, workers[c], 2, trained(22), 10, attempt=2)
    fleet.tick(t3 + timedelta(seconds=TIMEOUT + 1))

    # Assert: after max_round_attempts the task FAILS; nothing is published
    done = fleet.task(task["id"])
    assert done["state"] == "FAILED" and "round 2 got 1 of the k=2 updates needed in each of 2 attempts" in done["reason"], done
    assert [r.round for r in closed_rounds(fleet, task["id"])] == [1]
    assert plan_of(fleet, task["id"]).published_artifact_id is None  # type: ignore[union-attr]
    assert fleet.hub.get(f"/tasks/{task['id']}/outputs").json()["artifacts"] == []


def test_updates_that_do_not_count_are_refused_and_nobody_is_counted_twice(sqlite_fleet: TaskFleet) -> None:
    # Prepare: hierarchical FedAvg; gw_a with a1, a2, gw_b with b1
    fleet = sqlite_fleet
    gw_a, gw_b = fleet.node("a"), fleet.node("b")
    model = upload_model(fleet)
    a1, a2, b1 = keeping_device(fleet, gw_a, model), keeping_device(fleet, gw_a, model), keeping_device(fleet, gw_b, model)
    task = federate(fleet, [a1, a2, b1], topology="hierarchical", rounds=2)
    fleet.tick()
    roles = by_role(fleet, task["id"])
    devices, aggregators = roles["worker"], roles[FL_AGGREGATOR]
    run_all(fleet, {**devices, **aggregators})
    cut, good = dense(), trained(1)

    # Execute: updates that must not count
    send_update(fleet, devices[a1], 1, good, 10, from_target=a2)  # a2 speaks for a1's worker
    assert counters(fleet) == {"task_update_wrong_target": 1}
    send_update(fleet, devices[a1], 1, good, 10, contributors=[a2])  # a1 claims a2's training
    send_update(fleet, devices[a1], 1, good, 10, contributors=[a1, a2])
    send_update(fleet, aggregators[gw_a], 1, good, 10, contributors=[a1, b1])  # b1 is not under gw_a
    send_update(fleet, aggregators[gw_b], 1, good, 10, contributors=[a1])
    bad_layers: list[Layer | str] = [
        {"weight": np.zeros((cut.features, cut.classes + 1), np.float32), "bias": np.zeros(cut.classes + 1, np.float32)},
        {"weight": np.zeros((cut.classes, cut.features), np.float32), "bias": np.zeros(cut.classes, np.float32)},
        {"weight": np.full((cut.features, cut.classes), np.nan, np.float32), "bias": np.zeros(cut.classes, np.float32)},
        {"weight": good["weight"], "bias": np.array([np.inf] * cut.classes, np.float32)},
        {"weight": good["weight"].astype(np.float64), "bias": good["bias"].astype(np.float64)},
        {"weight": good["weight"].astype(np.float16), "bias": good["bias"]},
        {"weight": good["weight"]},
        {**good, "extra": good["bias"]},
        "bm90IGEgc2FmZXRlbnNvcnMgZnJhbWU=",  # base64, not safetensors
        "not base64!",
    ]
    for bad in bad_layers:
        send_update(fleet, devices[a1], 1, bad, 10)
    send_update(fleet, devices[a1], 2, good, 10)  # a round that has not opened
    send_update(fleet, devices[a1], 1, good, 10, attempt=2)  # an attempt that has not opened

    # Assert: every one refused, nothing stored, the round still open
    assert counters(fleet) == {"task_update_wrong_target": 1, "task_update_refused": 4 + len(bad_layers) + 2}
    assert stored_updates(fleet, task["id"]) == []
    fleet.tick()
    assert plan_of(fleet, task["id"]).round == 1  # type: ignore[union-attr]

    # Execute: a1 directly, then again (a repeat), then gw_a combining a1 and a2 (a1 again), then gw_a for a2, gw_b for b1
    layers = {a1: (trained(11), 10), a2: (trained(12), 30), b1: (trained(13), 40)}
    send_update(fleet, devices[a1], 1, *layers[a1])
    send_update(fleet, devices[a1], 1, *layers[a1])
    send_update(fleet, aggregators[gw_a], 1, trained(99), 40, contributors=[a1, a2])
    send_update(fleet, aggregators[gw_a], 1, *layers[a2], contributors=[a2])
    assert plan_of(fleet, task["id"]).round == 1  # type: ignore[union-attr]
    send_update(fleet, aggregators[gw_b], 1, *layers[b1], contributors=[b1])
    send_update(fleet, devices[b1], 1, trained(98), 5)  # b1 once more, directly

    # Assert: three accepted, the repeats refused as duplicates; the fusion counts each device once
    got = counters(fleet)
    assert (got["task_update_accepted"], got["task_update_duplicate"]) == (3, 3), got
    assert [(u.worker_id, u.contributors) for u in stored_updates(fleet, task["id"])] == [
        (devices[a1]["id"], [a1]), (aggregators[gw_a]["id"], [a2]), (aggregators[gw_b]["id"], [b1]),
    ]  # fmt: skip
    fleet.tick()
    (closed,) = closed_rounds(fleet, task["id"])
    assert (closed.contributors, closed.metrics["examples"]) == (3, 80.0)
    assert_layer(load(plan_of(fleet, task["id"]).weights), fedavg(list(layers.values())))  # type: ignore[union-attr]


def test_late_updates_are_dropped(sqlite_fleet: TaskFleet) -> None:
    # Prepare: two devices, k = 1, late updates dropped (the default)
    fleet = sqlite_fleet
    gw = fleet.node()
    model = upload_model(fleet)
    a, b = keeping_device(fleet, gw, model), keeping_device(fleet, gw, model)
    task = federate(fleet, [a, b], rounds=2, min_participants=1)
    t0 = datetime.now(UTC)
    fleet.tick(t0)
    workers = devices_of(fleet, task["id"])
    run_all(fleet, workers)
    send_update(fleet, workers[a], 1, trained(1), 10)
    fleet.tick(t0 + timedelta(seconds=TIMEOUT + 1))  # round 1 closes with a alone
    assert [r.contributors for r in closed_rounds(fleet, task["id"])] == [1]

    # Execute: b's round-1 update arrives late; both answer round 2
    send_update(fleet, workers[b], 1, trained(2), 1000)
    round2 = {a: (trained(21), 10), b: (trained(22), 30)}
    for d, (layer, n) in round2.items():
        send_update(fleet, workers[d], 2, layer, n)
    fleet.tick()

    # Assert: dropped, not stored; round 2's fusion is its own updates only
    assert counters(fleet) == {"task_update_accepted": 3, "task_update_late": 1}
    assert all(not u.stale for u in stored_updates(fleet, task["id"])) and len(stored_updates(fleet, task["id"])) == 3
    closed = closed_rounds(fleet, task["id"])
    assert [(r.round, r.stale) for r in closed] == [(1, 0), (2, 0)]
    assert_layer(load(plan_of(fleet, task["id"]).weights), fedavg(list(round2.values())))  # type: ignore[union-attr]


def test_stale_updates_are_fused_into_the_next_round_at_a_reduced_weight(sqlite_fleet: TaskFleet) -> None:
    # Prepare: two devices, k = 1, stale updates kept at most one round
    fleet = sqlite_fleet
    gw = fleet.node()
    model = upload_model(fleet)
    a, b = keeping_device(fleet, gw, model), keeping_device(fleet, gw, model)
    task = federate(fleet, [a, b], rounds=3, min_participants=1, late_updates="stale", max_staleness=1)
    t0 = datetime.now(UTC)
    fleet.tick(t0)
    workers = devices_of(fleet, task["id"])
    run_all(fleet, workers)
    send_update(fleet, workers[a], 1, trained(1), 10)
    t1 = t0 + timedelta(seconds=TIMEOUT + 1)
    fleet.tick(t1)  # round 1 closes with a alone

    # Execute: b's round-1 update (40 examples) arrives during round 2; a answers round 2, which closes at its deadline
    late = trained(2)
    send_update(fleet, workers[b], 1, late, 40, metrics={"loss": 100.0})
    round2 = {a: (trained(21), 10, 1.0)}
    for d, (layer, n, loss) in round2.items():
        send_update(fleet, workers[d], 2, layer, n, metrics={"loss": loss})
    t1 += timedelta(seconds=TIMEOUT + 1)
    fleet.tick(t1)

    # Assert: stored as stale; fused into round 2 at weight 40 / (1 + 1) = 20
    assert counters(fleet) == {"task_update_accepted": 2, "task_update_stale": 1}
    stale = [u for u in stored_updates(fleet, task["id"]) if u.stale]
    assert [(u.round, u.num_examples, u.used_in) for u in stale] == [(1, 40, 2)]
    closed = closed_rounds(fleet, task["id"])
    assert [(r.round, r.contributors, r.stale) for r in closed] == [(1, 1, 0), (2, 1, 1)]
    assert closed[1].metrics["examples"] == 10.0 and closed[1].metrics["stale"] == 1.0
    assert closed[1].metrics["loss"] == pytest.approx(1.0)  # the round's own participants' losses
    expected = fedavg([(round2[a][0], 10), (late, 40 / 2)])
    assert_layer(load(plan_of(fleet, task["id"]).weights), expected)  # type: ignore[union-attr]

    # Execute: round 3 open; an update from round 1 (two rounds old) arrives, then the round closes with a and b
    send_update(fleet, workers[b], 1, trained(3), 40)
    round3 = {a: (trained(31), 10), b: (trained(32), 10)}
    for d, (layer, n) in round3.items():
        send_update(fleet, workers[d], 3, layer, n)
    fleet.tick(t1 + timedelta(seconds=2))

    # Assert: older than max_staleness: late, not stored; the round-1 stale update is not used again
    assert counters(fleet)["task_update_late"] == 1
    assert len([u for u in stored_updates(fleet, task["id"]) if u.stale]) == 1
    assert closed_rounds(fleet, task["id"])[2].stale == 0
    published = plan_of(fleet, task["id"])
    assert published is not None and published.round == 4
    assert fleet.task(task["id"])["state"] == "SUCCEEDED"


def test_an_update_already_fused_is_not_fused_again_as_stale(sqlite_fleet: TaskFleet) -> None:
    # Prepare: two devices, stale updates kept; both answer round 1
    fleet = sqlite_fleet
    gw = fleet.node()
    model = upload_model(fleet)
    a, b = keeping_device(fleet, gw, model), keeping_device(fleet, gw, model)
    task = federate(fleet, [a, b], rounds=2, late_updates="stale")
    fleet.tick()
    workers = devices_of(fleet, task["id"])
    run_all(fleet, workers)
    first = trained(1)
    send_update(fleet, workers[a], 1, first, 10)
    send_update(fleet, workers[b], 1, trained(2), 10)
    fleet.tick()
    assert plan_of(fleet, task["id"]).round == 2  # type: ignore[union-attr]

    # Execute: a's round-1 update is delivered again (an MQTT redelivery after a reconnect); round 2 is answered
    send_update(fleet, workers[a], 1, first, 10)
    round2 = {a: (trained(21), 10), b: (trained(22), 30)}
    for d, (layer, n) in round2.items():
        send_update(fleet, workers[d], 2, layer, n)
    fleet.tick()

    # Assert: a's round-1 training, already in round 1's fusion, is not counted a second time
    assert fleet.ingest.counters["task_update_stale"] == 0
    assert_layer(load(plan_of(fleet, task["id"]).weights), fedavg(list(round2.values())))  # type: ignore[union-attr]


def test_a_device_that_sends_one_plus_max_staleness_updates_casts_one_vote(sqlite_fleet: TaskFleet) -> None:
    # Prepare: a, b, c; k = 1, stale updates kept two rounds; rounds 1 and 2 close at their deadline with a alone
    fleet = sqlite_fleet
    gw = fleet.node()
    model = upload_model(fleet)
    a, b, c = (keeping_device(fleet, gw, model) for _ in range(3))
    task = federate(fleet, [a, b, c], rounds=3, min_participants=1, late_updates="stale", max_staleness=2, strategy="fedavg")
    at = datetime.now(UTC)
    fleet.tick(at)
    workers = devices_of(fleet, task["id"])
    run_all(fleet, workers)
    for number in (1, 2):
        send_update(fleet, workers[a], number, trained(number), 10)
        at += timedelta(seconds=TIMEOUT + 1)
        fleet.tick(at)
    assert plan_of(fleet, task["id"]).round == 3  # type: ignore[union-attr]

    # Execute: in round 3, b sends its round-1, round-2 and round-3 updates; c its round-1 and round-2 ones; a answers
    for number in (1, 2):
        send_update(fleet, workers[b], number, trained(10 + number), 20)
        send_update(fleet, workers[c], number, trained(20 + number), 40)
    fresh = {a: (trained(3), 10), b: (trained(13), 20)}
    for d, (layer, n) in fresh.items():
        send_update(fleet, workers[d], 3, layer, n)
    at += timedelta(seconds=TIMEOUT + 1)
    fleet.tick(at)

    # Assert: b votes once (its round-3 update), c once (its newest, round 2, at 40 / (1 + 1)); the rest is kept, unused
    assert counters(fleet)["task_update_stale"] == 4
    closed = closed_rounds(fleet, task["id"])[2]
    assert (closed.contributors, closed.stale, closed.metrics["outvoted"]) == (2, 1, 3.0)
    expected = fedavg([(fresh[a][0], 10), (fresh[b][0], 20), (trained(22), 40 / 2)])
    assert_layer(load(plan_of(fleet, task["id"]).weights), expected)  # type: ignore[union-attr]
    assert sorted((u.round, u.used_in) for u in stored_updates(fleet, task["id"]) if u.stale) == [(1, 3), (1, 3), (2, 3), (2, 3)]


def test_a_stale_update_counts_only_from_participants_of_its_round(sqlite_fleet: TaskFleet) -> None:
    # Prepare: hierarchical; gw_a with a1, a2 and a3 (a3 not in the task), gw_b with b1; round 1 closes with b1 alone
    fleet = sqlite_fleet
    gw_a, gw_b = fleet.node("a"), fleet.node("b")
    model = upload_model(fleet)
    a1, a2, a3 = (keeping_device(fleet, gw_a, model) for _ in range(3))
    b1 = keeping_device(fleet, gw_b, model)
    task = federate(fleet, [a1, a2, b1], topology="hierarchical", rounds=2, min_participants=1, late_updates="stale", max_staleness=1)
    at = datetime.now(UTC)
    fleet.tick(at)
    roles = by_role(fleet, task["id"])
    run_all(fleet, {**roles["worker"], **roles[FL_AGGREGATOR]})
    send_update(fleet, roles["worker"][b1], 1, trained(1), 10)
    at += timedelta(seconds=TIMEOUT + 1)
    fleet.tick(at)
    assert plan_of(fleet, task["id"]).round == 2  # type: ignore[union-attr]

    # Execute: gw_a's aggregator sends a round-1 update that includes a3's training, then one of a1 and a2 alone
    aggregator = roles[FL_AGGREGATOR][gw_a]
    send_update(fleet, aggregator, 1, trained(2), 20, contributors=[a1, a3])
    send_update(fleet, aggregator, 1, trained(3), 20, contributors=[a1, a2])

    # Assert: the first is late (a3 took no part in round 1), the second kept as stale
    assert (counters(fleet)["task_update_late"], counters(fleet)["task_update_stale"]) == (1, 1)
    assert [u.contributors for u in stored_updates(fleet, task["id"]) if u.stale] == [[a1, a2]]


def test_an_inflated_num_examples_is_clamped_to_the_reported_rows_and_logged(sqlite_fleet: TaskFleet) -> None:
    # Prepare: a reports 300 rows of the dataset, b 100
    fleet = sqlite_fleet
    gw = fleet.node()
    model = upload_model(fleet)
    a, b = keeping_device(fleet, gw, model, rows=300), keeping_device(fleet, gw, model, rows=100)
    task = federate(fleet, [a, b], rounds=1, strategy="fedavg")
    fleet.tick()
    workers = devices_of(fleet, task["id"])
    run_all(fleet, workers)

    # Execute: a claims a billion examples, b the truth
    send_update(fleet, workers[a], 1, trained(1), 10**9)
    send_update(fleet, workers[b], 1, trained(2), 100)
    fleet.tick()

    # Assert: a counts as 300 (stored so, and in FedAvg's weights); the clamp is in the task's log
    assert sorted(u.num_examples for u in stored_updates(fleet, task["id"])) == [100, 300]
    assert_layer(load(plan_of(fleet, task["id"]).weights), fedavg([(trained(1), 300), (trained(2), 100)]))  # type: ignore[union-attr]
    logs = fleet.hub.get(f"/tasks/{task['id']}/logs", params={"limit": 500}).json()["items"]
    assert [line["level"] for line in logs if "claimed 1000000000 examples" in line["text"] and "counted as 300" in line["text"]] == ["warning"]


def test_a_retried_task_runs_the_round_it_failed_in_again(sqlite_fleet: TaskFleet) -> None:
    # Prepare: k = 2 of two devices, one attempt per round; nobody answers round 1: FAILED
    fleet = sqlite_fleet
    gw = fleet.node()
    model = upload_model(fleet)
    a, b = keeping_device(fleet, gw, model), keeping_device(fleet, gw, model)
    task = federate(fleet, [a, b], rounds=2, min_participants=2, max_round_attempts=1)
    t0 = datetime.now(UTC)
    fleet.tick(t0)
    run_all(fleet, devices_of(fleet, task["id"]))
    fleet.tick(t0 + timedelta(seconds=TIMEOUT + 1))
    assert fleet.task(task["id"])["state"] == "FAILED"

    # Execute: retry; the scheduler places it again
    assert fleet.act(task["id"], "retry")["state"] == "PENDING"
    t1 = t0 + timedelta(seconds=TIMEOUT + 2)
    fleet.tick(t1)

    # Assert: round 1 is open again with a deadline ahead, its orders sent
    assert fleet.task(task["id"])["state"] == "SCHEDULED"
    plan = plan_of(fleet, task["id"])
    assert plan is not None and plan.round == 1 and plan.deadline_at is not None and plan.deadline_at.replace(tzinfo=UTC) > t1
    workers = devices_of(fleet, task["id"])
    assert sorted(workers) == sorted([a, b]) and all(order_for(fleet, w).fl is not None for w in workers.values())


# --- hierarchy -------------------------------------------------------------------------------------


def test_an_edges_combined_update_fuses_like_its_devices_updates_flat(sqlite_fleet: TaskFleet) -> None:
    fleet = sqlite_fleet
    # Prepare: gw_a with a1, a2 and gw_b with b1; a hierarchical and a flat FedAvg task over the same devices
    gw_a, gw_b = fleet.node("a"), fleet.node("b")
    model = upload_model(fleet)
    a1, a2, b1 = keeping_device(fleet, gw_a, model), keeping_device(fleet, gw_a, model), keeping_device(fleet, gw_b, model)
    tree = federate(fleet, [a1, a2, b1], topology="hierarchical", rounds=2)
    flat = federate(fleet, [a1, a2, b1], topology="flat", rounds=2)
    fleet.tick()
    tree_roles, flat_workers = by_role(fleet, tree["id"]), devices_of(fleet, flat["id"])
    layers = {a1: (trained(1), 12), a2: (trained(2), 36), b1: (trained(3), 7)}
    metrics = {a1: 0.5, a2: 0.9, b1: 0.7}

    # Execute: gw_a's aggregator sends the sample-weighted mean of a1 and a2 (examples summed) as an edge computes it;
    # b1 sends its own update to the hub directly; the flat task gets the three device updates
    (w1, n1), (w2, n2) = layers[a1], layers[a2]
    combined = {k: ((n1 * w1[k].astype(np.float64) + n2 * w2[k].astype(np.float64)) / (n1 + n2)).astype(np.float32) for k in w1}
    acc = (n1 * metrics[a1] + n2 * metrics[a2]) / (n1 + n2)
    send_update(fleet, tree_roles[FL_AGGREGATOR][gw_a], 1, combined, n1 + n2, contributors=[a2, a1], metrics={"accuracy": acc})
    send_update(fleet, tree_roles["worker"][b1], 1, *layers[b1], metrics={"accuracy": metrics[b1]})
    for d, (layer, n) in layers.items():
        send_update(fleet, flat_workers[d], 1, layer, n, metrics={"accuracy": metrics[d]})
    fleet.tick()

    # Assert: both closed round 1 with every participant; same global layer, the FedAvg of the three devices' updates
    expected = fedavg(list(layers.values()))
    tree_plan, flat_plan = plan_of(fleet, tree["id"]), plan_of(fleet, flat["id"])
    assert tree_plan is not None and flat_plan is not None and tree_plan.round == flat_plan.round == 2
    assert_layer(load(tree_plan.weights), expected)
    assert_layer(load(flat_plan.weights), expected)
    assert_layer(load(tree_plan.weights), load(flat_plan.weights))
    (tree_round,), (flat_round,) = closed_rounds(fleet, tree["id"]), closed_rounds(fleet, flat["id"])
    assert (tree_round.contributors, tree_round.reason) == (flat_round.contributors, flat_round.reason) == (3, "every participant answered")
    total = sum(n for _, n in layers.values())
    assert tree_round.metrics["examples"] == flat_round.metrics["examples"] == total
    assert tree_round.metrics["accuracy"] == pytest.approx(flat_round.metrics["accuracy"], abs=1e-12)
    assert flat_round.metrics["accuracy"] == pytest.approx(sum(layers[d][1] * metrics[d] for d in layers) / total)
    assert_layer(global_layer(fleet, tree_roles[FL_AGGREGATOR][gw_a]), expected)


# --- a hub restarted mid-task ----------------------------------------------------------------------


def test_a_restarted_hub_closes_the_round_it_was_in_and_keeps_fedadams_state(fleet: TaskFleet, database_url: str) -> None:
    from interfaces.aggregation import ClientUpdate, FedAdam

    # Prepare: two devices, FedAdam, three rounds; round 1 answered and closed
    gw = fleet.node()
    model = upload_model(fleet)
    a, b = keeping_device(fleet, gw, model), keeping_device(fleet, gw, model)
    params = {"eta": 0.05, "beta_1": 0.8, "beta_2": 0.95, "tau": 1e-3}
    task = federate(fleet, [a, b], rounds=3, strategy="fedadam", strategy_params=params)
    fleet.tick()
    workers = devices_of(fleet, task["id"])
    run_all(fleet, workers)
    round1 = {a: (trained(1), 10), b: (trained(2), 30)}
    round2 = {a: (trained(21), 25), b: (trained(22), 5)}
    for d, (layer, n) in round1.items():
        send_update(fleet, workers[d], 1, layer, n)
    fleet.tick()
    before = plan_of(fleet, task["id"])
    assert before is not None and (before.round, before.attempt) == (2, 1) and before.strategy_arrays is not None

    # Execute: a new hub process on the same database (its own engine, ingest and scheduler; the same blobs and key)
    engine = make_engine(database_url)
    try:
        fleet.controller = TaskController(engine, fleet.controller.signing, blobs=fleet.blobs)
        fleet.ingest = StatusIngest(engine)
        fleet.tick()  # its first tick: the round stays open
        assert (plan_of(fleet, task["id"]).round, plan_of(fleet, task["id"]).attempt) == (2, 1)  # type: ignore[union-attr]
        for d, (layer, n) in round2.items():
            send_update(fleet, workers[d], 2, layer, n)
        fleet.tick()
    finally:
        engine.dispose()

    # Assert: round 2 closed (not 1, not 3) and round 3 opened
    assert [(r.round, r.contributors) for r in closed_rounds(fleet, task["id"])] == [(1, 2), (2, 2)]
    plan = plan_of(fleet, task["id"])
    assert plan is not None and (plan.round, plan.attempt) == (3, 1)
    assert fleet.ingest.counters["task_update_accepted"] == 2

    # Assert: the round-3 global layer is what one FedAdam over both rounds gives (m and v survived the restart)
    def as_updates(updates: dict[str, tuple[Layer, int]]) -> list[ClientUpdate]:
        return [ClientUpdate(dict(layer), n) for layer, n in updates.values()]

    reference = FedAdam(**params)
    x1 = reference.aggregate(model_layer(), as_updates(round1))
    x2 = reference.aggregate(x1, as_updates(round2))
    assert_layer(global_layer(fleet, workers[a]), x2)
    forgetful = FedAdam(**params).aggregate(x1, as_updates(round2))  # what a hub that lost m and v would compute
    assert np.abs(forgetful["weight"] - x2["weight"]).max() > 1e-3
    # and by hand, Reddi et al.'s update with m, v carried over from round 1
    b1_, b2_, eta, tau = params["beta_1"], params["beta_2"], params["eta"], params["tau"]
    x0 = {k: v.astype(np.float64) for k, v in model_layer().items()}
    d1 = {k: fedavg(list(round1.values()))[k].astype(np.float64) - x0[k] for k in x0}
    m1 = {k: (1 - b1_) * d1[k] for k in x0}
    v1 = {k: (1 - b2_) * d1[k] ** 2 for k in x0}
    x1_hand = {k: (x0[k] + eta * m1[k] / (np.sqrt(v1[k]) + tau)).astype(np.float32) for k in x0}
    mean2 = {k: sum(n * layer[k].astype(np.float64) for layer, n in round2.values()) / 30 for k in x0}
    d2 = {k: mean2[k] - x1_hand[k].astype(np.float64) for k in x0}
    m2 = {k: b1_ * m1[k] + (1 - b1_) * d2[k] for k in x0}
    v2 = {k: b2_ * v1[k] + (1 - b2_) * d2[k] ** 2 for k in x0}
    x2_hand = {k: (x1_hand[k].astype(np.float64) + eta * m2[k] / (np.sqrt(v2[k]) + tau)).astype(np.float32) for k in x0}
    assert_layer(load(plan.weights), x2_hand)


# --- the end ---------------------------------------------------------------------------------------


def test_the_last_round_publishes_the_model_and_the_artefacts_stay_until_the_task_is_deleted(sqlite_fleet: TaskFleet) -> None:
    fleet = sqlite_fleet
    # Prepare: two devices, FedAvg, two rounds
    gw = fleet.node()
    model = upload_model(fleet)
    a, b = keeping_device(fleet, gw, model), keeping_device(fleet, gw, model)
    task = federate(fleet, [a, b], rounds=2)
    plan = plan_of(fleet, task["id"])
    assert plan is not None
    fleet.tick()
    workers = devices_of(fleet, task["id"])
    run_all(fleet, workers)
    rounds = [
        {a: (trained(1), 10, {"loss": 2.0, "accuracy": 0.5}), b: (trained(2), 30, {"loss": 1.0, "accuracy": 0.7})},
        {a: (trained(3), 20, {"loss": 0.5, "accuracy": 0.9}), b: (trained(4), 20, {"loss": 0.3})},
    ]
    round_artefacts = []

    # Execute: both rounds answered
    for number, updates in enumerate(rounds, start=1):
        round_artefacts.append(plan_of(fleet, task["id"]).weights_artifact_id)  # type: ignore[union-attr]
        if number == 2:  # the open round's global layer cannot be deleted while the task runs
            doc = assert_problem(delete_artifact(fleet, round_artefacts[-1]), 409, "artifact_in_use")  # type: ignore[arg-type]
            assert "federated_training" in doc["detail"] and task["id"] in doc["detail"]
        for d, (layer, n, values) in updates.items():
            send_update(fleet, workers[d], number, layer, n, metrics=values)
        fleet.tick()

    # Assert: SUCCEEDED; the model with the fused layer published as digits 1.0.1 and listed in the outputs
    done = fleet.task(task["id"])
    assert done["state"] == "SUCCEEDED", done
    final = plan_of(fleet, task["id"])
    assert final is not None and final.round == 3 and final.published_artifact_id is not None
    fused = fedavg([(layer, n) for layer, n, _ in rounds[1].values()])
    out = fleet.hub.get(f"/tasks/{task['id']}/outputs").json()
    assert out["artifacts"] == [final.published_artifact_id] and out["complete"] is True
    art = fleet.hub.get(f"/artifacts/{final.published_artifact_id}").json()
    assert (art["kind"], art["name"], art["version"], art["format"]) == ("model", "digits", "1.0.1", "onnx")
    with Session(fleet.engine) as session:
        stored = session.get(Artifact, art["id"])
        assert stored is not None
        published = onnx.load_from_string(read_blob(fleet.blobs, stored.sha256))
    inits = {t.name: numpy_helper.to_array(t) for t in published.graph.initializer}
    cut = dense()
    weight = inits[cut.weight].T if cut.transposed else inits[cut.weight]
    assert_layer({"weight": np.ascontiguousarray(weight), "bias": inits[cut.bias]}, fused)
    original = {t.name: numpy_helper.to_array(t) for t in onnx.load_from_string(MODEL_BYTES).graph.initializer}
    assert set(inits) == set(original)
    for name in set(original) - {cut.weight, cut.bias}:  # the body is untouched
        np.testing.assert_array_equal(inits[name], original[name])
    meta = {p.key: p.value for p in published.metadata_props}
    assert meta["aisynergy.trained_from"] == "digits 1.0.0" and meta["aisynergy.task"] == task["id"] and meta["aisynergy.fl_rounds"] == "2"

    # Assert: one metrics sample per round, worker "hub"
    r = fleet.hub.get(f"/tasks/{task['id']}/metrics", params={"series": "true", "worker": "hub"})
    assert r.status_code == 200, r.text
    series = r.json()["series"]
    assert [s["worker_id"] for s in series] == ["hub", "hub"]
    first, second = (s["values"] for s in series)
    assert (first["round"], first["participants"], first["contributors"], first["examples"]) == (1, 2, 2, 40)
    assert first["loss"] == pytest.approx((10 * 2.0 + 30 * 1.0) / 40) and first["accuracy"] == pytest.approx((10 * 0.5 + 30 * 0.7) / 40)
    assert (second["round"], second["participants"], second["contributors"], second["examples"]) == (2, 2, 2, 40)
    assert second["loss"] == pytest.approx((20 * 0.5 + 20 * 0.3) / 40) and "accuracy" not in second  # b reported no accuracy
    assert first["round_s"] >= 0 and second["round_s"] >= 0

    # Assert: the model and the body stay while the task exists; an active task cannot be deleted
    for artifact_id in (model.id, plan.body_artifact_id):
        doc = assert_problem(delete_artifact(fleet, artifact_id), 409, "artifact_in_use")
        assert "federated_training" in doc["detail"] and task["id"] in doc["detail"], doc

    # Execute: delete the task
    assert fleet.hub.request("DELETE", f"/tasks/{task['id']}", Role.OPERATOR).status_code == 204

    # Assert: its plan, updates and rounds are gone; every artefact can be deleted now, the published model stays its own
    with Session(fleet.engine) as session:
        for table in (FlPlan, FlUpdateRow, FlRoundRow, TaskMetric):
            assert session.execute(select(table).where(table.task_id == task["id"])).all() == [], table  # type: ignore[attr-defined]
        assert session.get(Task, task["id"]) is None
    for artifact_id in (*round_artefacts, plan.body_artifact_id, model.id):
        assert delete_artifact(fleet, artifact_id).status_code == 204, artifact_id  # type: ignore[arg-type]
        assert fleet.hub.get(f"/artifacts/{artifact_id}").status_code == 404
    assert fleet.hub.get(f"/artifacts/{final.published_artifact_id}").status_code == 200


# --- privacy, pace, secure aggregation ---------------------------------------------------------------


def set_budget(fleet: TaskFleet, device_id: str, epsilon: float, delta: float = 1e-5) -> None:
    r = fleet.hub.request("PUT", f"/devices/{device_id}/privacy-budgets/{DATASET}", Role.OPERATOR, json={"epsilon": epsilon, "delta": delta})
    assert r.status_code == 200, r.text


def test_a_dp_task_must_fit_every_devices_budget_and_charges_the_rounds_each_took_part_in(sqlite_fleet: TaskFleet) -> None:
    # Prepare: two devices with 300 rows; a budget that affords the task on one of them only
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    fleet = sqlite_fleet
    gw = fleet.node()
    model = upload_model(fleet)
    a, b = keeping_device(fleet, gw, model), keeping_device(fleet, gw, model)
    set_budget(fleet, a, 50.0)
    set_budget(fleet, b, 0.5)
    dp = {"clip_norm": 1.0, "noise_multiplier": 1.1}

    # Execute 1: b's budget cannot afford 3 rounds x 20 steps at q = 32 / 300
    refused = fleet.hub.request("POST", "/tasks", Role.OPERATOR, json=fl_body([a, b], rounds=3, local_steps=20, batch_size=32, dp=dp))

    # Assert 1: 409 naming b; nothing reserved
    assert refused.status_code == 409 and refused.json()["code"] == "privacy_budget_exceeded", refused.text
    assert [t["device_id"] for t in refused.json()["targets"]] == [b]
    assert fleet.hub.get(f"/devices/{a}/privacy-budgets").json()[0]["reserved"] == 0

    # Execute 2: a affordable task; round 1 with a and b, a alone answers; round 2 (b not a participant: stopped)
    set_budget(fleet, b, 50.0)
    task = federate(fleet, [a, b], rounds=2, local_steps=20, batch_size=32, dp=dp, min_participants=1)
    t0 = datetime.now(UTC)
    fleet.tick(t0)
    workers = devices_of(fleet, task["id"])
    run_all(fleet, workers)
    assert order_for(fleet, workers[a]).fl.sample_rate == pytest.approx(32 / 300)  # type: ignore[union-attr]
    # (received on the ticks' clock: "everyone answered" closes a round at the first look after the last update)
    send_update(fleet, workers[a], 1, trained(1), 300, at=t0 + timedelta(seconds=0.5))
    send_update(fleet, workers[b], 1, trained(2), 300, at=t0 + timedelta(seconds=0.5))
    fleet.tick(t0 + timedelta(seconds=1))
    send_update(fleet, workers[a], 2, trained(3), 300, at=t0 + timedelta(seconds=1.5))
    send_update(fleet, workers[b], 2, trained(4), 300, at=t0 + timedelta(seconds=1.5))
    for _ in range(3):
        fleet.tick(t0 + timedelta(seconds=2))

    # Assert 2: SUCCEEDED; each device charged 2 round attempts x 20 steps, epsilon = the accountant's
    assert fleet.task(task["id"])["state"] == "SUCCEEDED"
    outputs = fleet.hub.get(f"/tasks/{task['id']}/outputs").json()
    accountant = RdpAccountant()
    accountant.compose(dp_accounting.PoissonSampledDpEvent(32 / 300, dp_accounting.GaussianDpEvent(1.1)), 40)
    assert sorted((s["device_id"], s["state"], s["steps"]) for s in outputs["privacy"]) == sorted([(a, "spent", 40), (b, "spent", 40)])
    for spend in outputs["privacy"]:
        assert spend["epsilon"] == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-9)


def test_adaptive_sync_sets_the_deadline_from_the_pace_of_complete_rounds(sqlite_fleet: TaskFleet) -> None:
    # Prepare: a slow fixed timeout (60 s), adaptive sync; round 1 completes 2 s after it opened
    fleet = sqlite_fleet
    gw = fleet.node()
    model = upload_model(fleet)
    a, b = keeping_device(fleet, gw, model), keeping_device(fleet, gw, model)
    task = federate(fleet, [a, b], rounds=3, min_participants=1, round_timeout_s=60, sync="adaptive")
    t0 = datetime.now(UTC)
    fleet.tick(t0)
    workers = devices_of(fleet, task["id"])
    run_all(fleet, workers)
    first = plan_of(fleet, task["id"])
    assert first is not None and (first.deadline_at.replace(tzinfo=UTC) - t0).total_seconds() == pytest.approx(60)  # type: ignore[union-attr]

    # Execute: both answer round 1 at t0 + 2 s
    send_update(fleet, workers[a], 1, trained(1), 10, at=t0 + timedelta(seconds=2))
    send_update(fleet, workers[b], 1, trained(2), 10, at=t0 + timedelta(seconds=2))
    fleet.tick(t0 + timedelta(seconds=2))

    # Assert: round 2's deadline is 3 x 2 s away, not 60 s
    second = plan_of(fleet, task["id"])
    assert second is not None and second.round == 2 and second.attempt == 1
    assert (second.deadline_at.replace(tzinfo=UTC) - second.opened_at.replace(tzinfo=UTC)).total_seconds() == pytest.approx(6.0, abs=0.01)  # type: ignore[union-attr]


def test_secure_aggregation_needs_keys_and_unmasks_the_sum_with_the_seeds_of_a_dropout(sqlite_fleet: TaskFleet) -> None:
    # Prepare: three devices with X25519 keys; the round's orders list them
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    from interfaces import secagg
    from interfaces.tasks import FL_KEY_EVENT, FL_REVEAL_EVENT, FlKey, FlReveal

    fleet = sqlite_fleet
    gw = fleet.node()
    model = upload_model(fleet)
    devices = [keeping_device(fleet, gw, model, rows=100 * (k + 1)) for k in range(3)]
    task = federate(fleet, devices, rounds=1, min_participants=2, secure_aggregation=True)
    t0 = datetime.now(UTC)
    fleet.tick(t0)
    workers = devices_of(fleet, task["id"])
    run_all(fleet, workers)
    fleet.tick(t0)
    assert plan_of(fleet, task["id"]).attempt == 0  # type: ignore[union-attr]  # no keys yet: no round
    keys = {d: X25519PrivateKey.generate() for d in devices}
    for d in devices:
        public = keys[d].public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        fleet.send(d, FL_KEY_EVENT, FlKey(task_id=task["id"], worker_id=workers[d]["id"], public_key=base64.b64encode(public).decode()))
    fleet.tick(t0)
    order = order_for(fleet, workers[devices[0]]).fl
    assert order is not None and order.secure and set(order.peers) == set(devices) and order.total_examples == 600

    # Execute: devices 0 and 1 send masked layers; device 2 masked nothing in but drops
    layers = {d: trained(k) for k, d in enumerate(devices)}
    rows = {d: 100 * (k + 1) for k, d in enumerate(devices)}
    round_id = f"{task['id']}/1/1"

    def seed(me: str, peer: str) -> bytes:
        secret = keys[me].exchange(X25519PublicKey.from_public_bytes(base64.b64decode(order.peers[peer])))
        return secagg.pair_seed(secret, round_id, me, peer)

    for d in devices[:2]:
        encoded = {k: secagg.encode(v * rows[d] / 600) for k, v in layers[d].items()}
        masked = secagg.mask(encoded, d, {p: seed(d, p) for p in devices if p != d})
        data = FlUpdate(task_id=task["id"], worker_id=workers[d]["id"], round=1, attempt=1, contributors=[d], num_examples=rows[d],
                        data=base64.b64encode(save(masked)).decode(), masked=True)  # fmt: skip
        fleet.send(d, FL_UPDATE_EVENT, data)
    fleet.tick(t0 + timedelta(seconds=TIMEOUT + 1))

    # Assert 1: the survivors are asked for their seeds with device 2
    assert order_for(fleet, workers[devices[0]]).fl.reveal == [devices[2]]  # type: ignore[union-attr]

    # Execute 2: they reveal them
    for d in devices[:2]:
        reveal = FlReveal(task_id=task["id"], worker_id=workers[d]["id"], round=1, attempt=1, seeds={devices[2]: base64.b64encode(seed(d, devices[2])).decode()})
        fleet.send(d, FL_REVEAL_EVENT, reveal)
    for _ in range(3):
        fleet.tick(t0 + timedelta(seconds=TIMEOUT + 2))

    # Assert 2: the published layer is the survivors' FedAvg (within the fixed-point precision)
    plan = plan_of(fleet, task["id"])
    assert plan is not None and plan.round == 2
    expected = fedavg([(layers[devices[0]], 100), (layers[devices[1]], 200)])
    got = load(plan.weights)
    for k in ("weight", "bias"):
        np.testing.assert_allclose(got[k], expected[k], atol=3 / secagg.DEFAULT_SCALE)
