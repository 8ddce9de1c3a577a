"""Whole-model federated training in the hub (``federated_training`` with ``algorithm``; DESIGN §5): admission checks
the algorithms, their configurations and the initial parameters, orders carry each participant's package and a grant
for its update of the round attempt, updates arrive by reference to uploaded artefacts, are read through before a
round closes, fused tensor by tensor by name, and the parameters are published after the last round.

No participant trains here: the test stores each update as the artefact its grant names and sends the ``fl.update``
event through the ingest, as an edge would relay it. Every fused tensor is checked against numpy.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load, save
from sqlmodel import Session

from cloud.artifacts import create_artifact, read_blob
from cloud.db import make_engine
from cloud.fl import whole
from cloud.ingest import StatusIngest
from cloud.scheduler import TaskController
from cloud.tables import Artifact, FlPlan, Node
from device.algorithm.package import build
from interfaces.auth import Role
from interfaces.deployments import ArtifactCreate
from interfaces.messages import ConnectionState, EventBody, HeartbeatBody, StateBody, envelope
from interfaces.tasks import FL_UPDATE_EVENT, FederatedTrainingOrder, FlUpdate
from tests.hub.conftest import assert_problem
from tests.hub.tasks_support import TaskFleet, resources, running_task_fleet
from tests.hub.test_federated import closed_rounds, stored_updates
from tests.hub.test_federated import plan_of as stored_plan

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "algorithms"
TORCH, NUMPY = EXAMPLES / "torch_cnn", EXAMPLES / "numpy_cnn"
TORCH_REF = {"name": "digits-torch-cnn", "version": "1.0.0"}
NUMPY_REF = {"name": "digits-numpy-cnn", "version": "1.0.0"}
FRAMEWORKS = {"torch": "2.3.0", "numpy": "2.1.0", "onnx": "1.17.0"}
TIMEOUT = 60.0
SHAPES = {"conv1.weight": (8, 1, 3, 3), "conv1.bias": (8,), "fc.weight": (10, 32), "fc.bias": (10,)}
Tensors = dict[str, np.ndarray]


@pytest.fixture
def fleet(database_url: str, tmp_path: Path) -> Iterator[TaskFleet]:
    yield from running_task_fleet(database_url, tmp_path)


@pytest.fixture
def sqlite_fleet(sqlite_url: str, tmp_path: Path) -> Iterator[TaskFleet]:
    yield from running_task_fleet(sqlite_url, tmp_path)


@pytest.fixture(scope="module")
def packages(tmp_path_factory: pytest.TempPathFactory) -> dict[Path, bytes]:
    """Both examples built once: source directory -> the package's bytes."""
    out = tmp_path_factory.mktemp("packages")
    return {source: build(source, out / source.name).read_bytes() for source in (TORCH, NUMPY)}


# --- artefacts, sites, the task --------------------------------------------------------------------


def upload_algorithm(fleet: TaskFleet, packages: dict[Path, bytes], source: Path) -> dict[str, Any]:
    manifest = json.loads((source / "algorithm.json").read_text())
    r = fleet.hub.request("POST", "/artifacts", Role.OPERATOR, data={"kind": "algorithm", "name": manifest["name"], "version": manifest["version"], "format": "zip"},
                          files={"file": ("a.zip", packages[source], "application/zip")})  # fmt: skip
    assert r.status_code == 201, r.text
    return r.json()  # type: ignore[no-any-return]


def store(fleet: TaskFleet, name: str, version: str, data: bytes, kind: str = "model", fmt: str = "safetensors") -> Artifact:
    body = ArtifactCreate(kind=kind, name=name, version=version, format=fmt)  # type: ignore[arg-type]
    with Session(fleet.engine, expire_on_commit=False) as session, fleet.blobs.writer() as writer:
        writer.write(data)
        return create_artifact(session, fleet.controller.signing, fleet.blobs, body, writer)


def parameters(seed: int, shapes: dict[str, tuple[int, ...]] = SHAPES) -> Tensors:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def initial(fleet: TaskFleet) -> Artifact:
    return store(fleet, "digits-cnn-initial", "1.0.0", save(parameters(0)))


def with_frameworks(fleet: TaskFleet, target_id: str, frameworks: dict[str, str] = FRAMEWORKS) -> None:
    """The target's heartbeat reports ``frameworks`` (a device's through its edge)."""
    fleet.seq += 1
    beat = HeartbeatBody(seq=fleet.seq, agent_version="test", uptime_s=1, resources=resources().model_copy(update={"frameworks": frameworks}))
    if target_id in fleet.node_of:
        fleet.ingest.offer(target_id, beat, kind="device", via=fleet.node_of[target_id])
    else:
        fleet.ingest.offer(target_id, beat)
    fleet.ingest.flush()


def site_device(fleet: TaskFleet, node: str, labels: dict[str, str] | None = None, frameworks: dict[str, str] = FRAMEWORKS) -> str:
    """A device that trains with the frameworks it reports (no installed model, no dataset reported)."""
    device_id = fleet.device(node, installed=None, labels=labels)
    with_frameworks(fleet, device_id, frameworks)
    return device_id


def site_node(fleet: TaskFleet, name: str, labels: dict[str, str] | None = None) -> str:
    node_id: str = fleet.hub.register(name, labels=labels)["node"]["id"]
    fleet.ingest.offer(node_id, StateBody(state=ConnectionState.ONLINE))
    fleet.ingest.flush()
    with_frameworks(fleet, node_id)
    return node_id


def whole_body(ids: list[str], target: str = "device", **spec: Any) -> dict[str, Any]:
    spec = {"algorithm": TORCH_REF, "rounds": 2, "round_timeout_s": TIMEOUT, **spec}
    return {
        "type": "federated_training", "spec": spec, "placement": {"target": target, "ids": ids}, "worker_timeout_s": 3600,
        "retry": {"backoff_s": 0, "max_attempts": 3},
    }  # fmt: skip


def federate(fleet: TaskFleet, ids: list[str], target: str = "device", **spec: Any) -> dict[str, Any]:
    r = fleet.hub.request("POST", "/tasks", Role.OPERATOR, json=whole_body(ids, target, **spec))
    assert r.status_code == 201, r.text
    return r.json()  # type: ignore[no-any-return]


def plan_of(fleet: TaskFleet, task_id: str) -> FlPlan:
    plan = stored_plan(fleet, task_id)
    assert plan is not None
    return plan


def workers_of(fleet: TaskFleet, task_id: str) -> dict[str, dict[str, Any]]:
    """target id -> the task's active worker on it."""
    return {w["target_id"]: w for w in fleet.workers(task_id) if w["state"] in ("QUEUED", "RUNNING")}


def order_for(fleet: TaskFleet, worker: dict[str, Any]) -> FederatedTrainingOrder:
    orders = fleet.orders(worker["target_id"], Node) if worker["target_kind"] == "node" else fleet.orders(worker["target_id"])
    (order,) = [o for o in orders if o.worker_id == worker["id"]]
    assert isinstance(order, FederatedTrainingOrder)
    return order


def content(fleet: TaskFleet, artifact_id: str) -> bytes:
    with Session(fleet.engine) as session:
        row = session.get(Artifact, artifact_id)
        assert row is not None
        return read_blob(fleet.blobs, row.sha256)


def started(fleet: TaskFleet, task_id: str, at: datetime | None = None) -> dict[str, dict[str, Any]]:
    """Round 1 open, every worker RUNNING; target id -> worker."""
    fleet.tick(at)
    workers = workers_of(fleet, task_id)
    for w in workers.values():
        fleet.report(w, "RUNNING")
    assert plan_of(fleet, task_id).attempt == 1
    return workers


# --- updates ---------------------------------------------------------------------------------------


def identity(task_id: str, target_id: str, round_: int, attempt: int = 1) -> tuple[str, str]:
    """The update a participant's grant names (written out here, not taken from the hub)."""
    return f"fl-update.{task_id}.{target_id}", f"{round_}.{attempt}"


def upload_update(fleet: TaskFleet, worker: dict[str, Any], round_: int, tensors: Tensors | bytes, attempt: int = 1, fmt: str = "safetensors",
                  version: str | None = None) -> Artifact:  # fmt: skip
    """What a participant uploads with its grant at the end of its local fits."""
    name, granted = identity(worker["task_id"], worker["target_id"], round_, attempt)
    return store(fleet, name, version or granted, tensors if isinstance(tensors, bytes) else save(tensors), fmt=fmt)


def send_update(fleet: TaskFleet, worker: dict[str, Any], round_: int, artifact_id: str, n: int, attempt: int = 1, metrics: dict[str, float] | None = None) -> None:
    data = FlUpdate(task_id=worker["task_id"], worker_id=worker["id"], round=round_, attempt=attempt, contributors=[worker["target_id"]],
                    num_examples=n, parameters=artifact_id, metrics=metrics or {})  # fmt: skip
    fleet.send(worker["target_id"], FL_UPDATE_EVENT, data)


def answer(fleet: TaskFleet, workers: dict[str, dict[str, Any]], round_: int, updates: dict[str, tuple[Tensors, int]]) -> dict[str, str]:
    """Each participant uploads and announces its update; target id -> artefact id."""
    ids = {}
    for target, (tensors, n) in updates.items():
        ids[target] = upload_update(fleet, workers[target], round_, tensors).id
        send_update(fleet, workers[target], round_, ids[target], n)
    return ids


def send_raw(fleet: TaskFleet, worker: dict[str, Any], data: dict[str, Any]) -> None:
    """An ``fl.update`` as a device could send it, unchecked by the wire model."""
    message = envelope(worker["target_id"], EventBody(type=FL_UPDATE_EVENT, data=data))
    fleet.ingest.offer_event(fleet.node_of[worker["target_id"]], worker["target_id"], message)
    fleet.ingest.flush()


def fedavg(pairs: list[tuple[Tensors, int]]) -> Tensors:
    total = sum(n for _, n in pairs)
    return {k: (np.sum([n * t[k].astype(np.float64) for t, n in pairs], axis=0) / total).astype(np.float32) for k in SHAPES}


def assert_tensors(got: Tensors, expected: Tensors) -> None:
    assert set(got) == set(SHAPES) and all(got[k].dtype == np.float32 and got[k].shape == SHAPES[k] for k in got)
    for k in SHAPES:
        np.testing.assert_allclose(got[k], expected[k], rtol=0, atol=1e-6)


def global_after(fleet: TaskFleet, task_id: str, round_: int) -> tuple[dict[str, Any], Tensors]:
    """The next round's global parameters (the artefact the plan holds once the tick stored it) and their tensors."""
    plan = plan_of(fleet, task_id)
    assert plan.round == round_ and plan.weights_artifact_id is not None, (plan.round, plan.weights_artifact_id)
    art = fleet.hub.get(f"/artifacts/{plan.weights_artifact_id}").json()
    return art, load(content(fleet, art["id"]))


def counters(fleet: TaskFleet) -> dict[str, int]:
    return {k: v for k, v in fleet.ingest.counters.items() if k.startswith("task_update_") and v}


def log_lines(fleet: TaskFleet, task_id: str) -> list[dict[str, Any]]:
    return fleet.hub.get(f"/tasks/{task_id}/logs", params={"limit": 500}).json()["items"]  # type: ignore[no-any-return]


# --- admission -------------------------------------------------------------------------------------


def test_what_a_whole_model_task_cannot_run_with_is_refused_and_nothing_is_stored(sqlite_fleet: TaskFleet, packages: dict[Path, bytes]) -> None:
    # Prepare: the torch example stored (not the numpy one); initial parameters, and artefacts that are not
    fleet = sqlite_fleet
    gw = fleet.node()
    device = site_device(fleet, gw)
    upload_algorithm(fleet, packages, TORCH)
    start = initial(fleet).id
    onnx_model = store(fleet, "digits-onnx", "1.0.0", b"not checked", fmt="onnx").id
    dataset = store(fleet, "digits-data", "1", save({"x": np.zeros((4, 2), np.float32)}), kind="dataset").id
    garbage = store(fleet, "digits-garbage", "1.0.0", b"\x00" * 64).id
    ints = store(fleet, "digits-ints", "1.0.0", save({**parameters(1), "steps": np.zeros(1, np.int64)})).id
    ghost = {"name": "ghost", "version": "1.0.0"}
    last_layer_spec = {"model": {"name": "digits"}, "dataset": "camera", "rounds": 1}
    last_layer = {"type": "federated_training", "spec": last_layer_spec, "placement": {"ids": [device]}}
    before = fleet.hub.snapshot()
    cases: list[tuple[dict[str, Any], str]] = [
        (whole_body([device], algorithm=ghost, initial_parameters=start), "algorithm ghost 1.0.0 is not an artefact of this hub"),
        (whole_body([device], initial_parameters=start, variants=[{"selector": "fw=numpy", "algorithm": NUMPY_REF}]),
         "algorithm digits-numpy-cnn 1.0.0 is not an artefact of this hub"),
        (whole_body([device], initial_parameters=onnx_model), "it must be a model in safetensors"),
        (whole_body([device], initial_parameters=dataset), "it must be a model in safetensors"),
        (whole_body([device], initial_parameters=garbage), "is no safetensors file"),
        (whole_body([device], initial_parameters=ints), "only floating-point tensors aggregate; steps are not"),
        (whole_body([device]), "a whole-model task starts from initial_parameters"),
        (whole_body([device], initial_parameters=start, local_steps=5), "local_steps: last-layer fields"),
        (whole_body([device], initial_parameters=start, dataset="camera"), "dataset: last-layer fields"),
        (whole_body([device], initial_parameters=start, model={"name": "digits"}), "give either model"),
        (whole_body([device], initial_parameters=start, topology="hierarchical", secure_aggregation=True), "hierarchical whole-model rounds (each edge sends its devices' weighted mean) do not go with secure_aggregation"),
        (whole_body([device], initial_parameters=start, topology="hierarchical", compression="int8"), "do not go with compression int8"),
        (whole_body([device], initial_parameters=start, topology="hierarchical", strategy="median"), "do not go with strategy median"),
        (whole_body([device], initial_parameters=start, topology="hierarchical", sync="async"), "do not go with sync async"),
        (whole_body([device], initial_parameters=start, topology="hierarchical", datasets={"train": "digits"}, dp={"clip_norm": 1.0}), "do not go with dp"),
        (whole_body([gw], "node", initial_parameters=start, topology="hierarchical"),
         "hierarchical whole-model rounds combine devices' updates on their edge: placement.target device"),
        (whole_body([device], initial_parameters=start, dp={"clip_norm": 1.0}), "dp charges each participant's privacy budget of the datasets it trains on"),
        (whole_body([device], initial_parameters=start, variants=[{"selector": "fw in (", "algorithm": TORCH_REF}]), "variant selector 'fw in ('"),
        ({**last_layer, "spec": {**last_layer_spec, "local_fits": 2}}, "local_fits: whole-model fields"),
        ({**last_layer, "spec": {**last_layer_spec, "cross_evaluation": True}}, "cross_evaluation: whole-model fields"),
        ({**last_layer, "placement": {"target": "node"}}, "does not run on nodes"),
        ({**last_layer, "spec": {**last_layer_spec, "sync": "async"}}, "async rounds are for whole models"),
        (whole_body([device], initial_parameters=start, buffer_size=2), "buffer_size is for sync async"),
        (whole_body([device], initial_parameters=start, sync="async", buffer_size=0), "buffer_size"),
    ]  # fmt: skip

    # Execute / Assert: each a 422 naming the problem
    for body, text in cases:
        r = fleet.hub.request("POST", "/tasks", Role.OPERATOR, json=body)
        assert r.status_code == 422 and text in r.text, (body["spec"], r.text)
        assert_problem(r, 422, "validation_failed")

    # Execute / Assert: initial parameters that are not stored: 404, as any task input the hub does not have
    r = fleet.hub.request("POST", "/tasks", Role.OPERATOR, json=whole_body([device], initial_parameters="art-" + "0" * 26))
    assert "does not exist" in assert_problem(r, 404, "not_found")["detail"]

    # Execute / Assert: a configuration failing the algorithm's config_schema, the failing path named
    r = fleet.hub.request("POST", "/tasks", Role.OPERATOR, json=whole_body([device], initial_parameters=start, config={"epochs": 0}))
    doc = assert_problem(r, 422, "validation_failed")
    assert [e["loc"] for e in doc["errors"]] == [["body", "spec", "config", "epochs"]] and "digits-torch-cnn 1.0.0" in doc["detail"], doc
    assert fleet.hub.snapshot() == before
    # a variant's own configuration is checked against its own schema
    upload_algorithm(fleet, packages, NUMPY)
    before = fleet.hub.snapshot()
    variant = {"selector": "fw=numpy", "algorithm": NUMPY_REF, "config": {"batch_size": 0}}
    doc = assert_problem(fleet.hub.request("POST", "/tasks", Role.OPERATOR, json=whole_body([device], initial_parameters=start, variants=[variant])), 422, "validation_failed")
    assert [e["loc"] for e in doc["errors"]] == [["body", "spec", "config", "batch_size"]] and "digits-numpy-cnn 1.0.0" in doc["detail"], doc
    assert fleet.hub.snapshot() == before


# --- placement and orders --------------------------------------------------------------------------


def test_a_whole_model_task_on_devices_orders_each_participants_algorithm_and_a_grant_for_its_update(sqlite_fleet: TaskFleet, packages: dict[Path, bytes]) -> None:
    fleet = sqlite_fleet
    # Prepare: both examples; two torch devices, one labelled for the numpy variant, one that lacks torch
    gw = fleet.node()
    torch_alg, numpy_alg = upload_algorithm(fleet, packages, TORCH), upload_algorithm(fleet, packages, NUMPY)
    start = initial(fleet)
    t1, t2 = site_device(fleet, gw), site_device(fleet, gw)
    np1 = site_device(fleet, gw, labels={"fw": "numpy"}, frameworks={"numpy": "2.1.0", "onnx": "1.17.0"})
    bare = site_device(fleet, gw, frameworks={"numpy": "2.1.0"})
    variants = [{"selector": "fw=numpy", "algorithm": NUMPY_REF}]

    # Execute
    task = federate(fleet, [t1, t2, np1, bare], initial_parameters=start.id, variants=variants, config={"epochs": 2}, local_fits=3)
    plan = plan_of(fleet, task["id"])
    fleet.tick()

    # Assert: the output pinned as a training task's; round 1 starts from the initial parameters' artefact itself
    assert task["spec"]["output"] == {"name": "digits-torch-cnn", "version": "1.0.0"} and task["spec"]["algorithm"] == TORCH_REF
    assert (plan.round, plan.attempt, plan.weights_artifact_id, plan.body_artifact_id, plan.model_artifact_id) == (1, 0, start.id, start.id, torch_alg["id"])
    opened = plan_of(fleet, task["id"])
    assert (opened.round, opened.attempt, sorted(opened.participants)) == (1, 1, sorted([t1, t2, np1]))
    workers = workers_of(fleet, task["id"])
    assert sorted(workers) == sorted([t1, t2, np1])  # bare lacks torch: left out
    assert fleet.orders(bare) == []

    # Assert: each order runs its participant's algorithm from the initial parameters, granted exactly its round-1 update
    for target, w in workers.items():
        order = order_for(fleet, w)
        fl = order.fl
        assert fl is not None and fl.run is not None and (order.type, fl.round, fl.attempt, fl.via_edge, fl.participant) == ("federated_training", 1, 1, False, target)
        assert fl.body is None and fl.feature is None and fl.weights.artifact_id == start.id
        assert fl.weights.signed_manifest.manifest.sha256 == hashlib.sha256(save(parameters(0))).hexdigest()
        expected = numpy_alg if target == np1 else torch_alg
        package = fl.run.package.signed_manifest.manifest
        assert (fl.run.package.artifact_id, package.kind.value, package.name, fl.run.manifest.name) == (expected["id"], "algorithm", expected["name"], expected["name"])
        name, version = identity(task["id"], target, 1)
        assert (fl.run.publish.names, fl.run.publish.version) == ([name], version)
        claims = fleet.controller.signing.verify_publish_token(fl.run.publish.token)
        assert (claims.task_id, claims.worker_id, claims.target_id, claims.names, claims.version) == (task["id"], w["id"], target, [name], version)
    # the grant opens an upload of that update only
    token = order_for(fleet, workers[t1]).fl.run.publish.token  # type: ignore[union-attr]

    def start_upload(name: str, version: str) -> Any:
        data = save(parameters(9))
        body = {"kind": "model", "name": name, "version": version, "format": "safetensors", "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        return fleet.hub.client.post("/api/v1/artifacts/uploads", json=body, headers={"Authorization": f"Bearer {token}"})

    assert start_upload(*identity(task["id"], t1, 1)).status_code == 201
    assert_problem(start_upload(*identity(task["id"], t2, 1)), 403, "forbidden")
    assert_problem(start_upload(*identity(task["id"], t1, 2)), 403, "forbidden")


def test_a_whole_model_task_on_sites_runs_on_edge_nodes(sqlite_fleet: TaskFleet, packages: dict[Path, bytes]) -> None:
    fleet = sqlite_fleet
    # Prepare: two sites (edge nodes) with the frameworks, one labelled for the numpy variant
    torch_alg, numpy_alg = upload_algorithm(fleet, packages, TORCH), upload_algorithm(fleet, packages, NUMPY)
    start = initial(fleet)
    a, b = site_node(fleet, "a"), site_node(fleet, "b", labels={"fw": "numpy"})

    # Execute
    task = federate(fleet, [a, b], target="node", initial_parameters=start.id, variants=[{"selector": "fw=numpy", "algorithm": NUMPY_REF}], min_participants=2)
    fleet.tick()

    # Assert: a worker on each node; the orders (the nodes') carry the right package and grant
    workers = workers_of(fleet, task["id"])
    assert sorted(workers) == sorted([a, b]) and all(w["target_kind"] == "node" for w in workers.values())
    for target, expected in ((a, torch_alg), (b, numpy_alg)):
        fl = order_for(fleet, workers[target]).fl
        assert fl is not None and fl.run is not None and fl.participant == target and fl.weights.artifact_id == start.id
        assert fl.run.package.artifact_id == expected["id"]
        assert (fl.run.publish.names, fl.run.publish.version) == ([f"fl-update.{task['id']}.{target}"], "1.1")

    # Execute: both sites answer round 1 (their events come from the nodes themselves)
    for w in workers.values():
        fleet.report(w, "RUNNING")
    answer(fleet, workers, 1, {a: (parameters(1), 12), b: (parameters(2), 36)})
    fleet.tick()
    fleet.tick()

    # Assert: round 1 closed with both; the FedAvg of the two by name (a site reports no dataset rows: not clamped)
    assert counters(fleet) == {"task_update_accepted": 2}
    (closed,) = closed_rounds(fleet, task["id"])
    assert (closed.contributors, closed.reason, closed.metrics["examples"]) == (2, "every participant answered", 48.0)
    assert_tensors(global_after(fleet, task["id"], 2)[1], fedavg([(parameters(1), 12), (parameters(2), 36)]))
    ran = [line["text"] for line in log_lines(fleet, task["id"]) if "the update of" in line["text"]]
    assert any(f"the update of {a} is in (digits-torch-cnn 1.0.0" in t for t in ran) and any(f"the update of {b} is in (digits-numpy-cnn 1.0.0" in t for t in ran), ran


# --- updates by reference ----------------------------------------------------------------------------


@pytest.mark.parametrize(("strategy", "params"), [("fedavg", {}), ("fedprox", {"mu": 0.1}), ("median", {}), ("trimmed_mean", {"beta": 0.34})])
def test_a_round_fuses_the_uploaded_updates_tensor_by_tensor_into_the_next_global_parameters(
    sqlite_fleet: TaskFleet, packages: dict[Path, bytes], strategy: str, params: dict[str, float],
) -> None:  # fmt: skip
    fleet = sqlite_fleet
    # Prepare: three devices, two rounds
    gw = fleet.node()
    upload_algorithm(fleet, packages, TORCH)
    start = initial(fleet)
    devices = [site_device(fleet, gw) for _ in range(3)]
    task = federate(fleet, devices, initial_parameters=start.id, strategy=strategy, strategy_params=params, min_participants=3)
    workers = started(fleet, task["id"])
    updates = {d: (parameters(10 + k), n) for k, (d, n) in enumerate(zip(devices, (10, 30, 60), strict=True))}

    # Execute: every participant answers round 1; the next ticks close it and open round 2
    ids = answer(fleet, workers, 1, updates)
    assert counters(fleet) == {"task_update_accepted": 3}
    fleet.tick()
    fleet.tick()

    # Assert: the round closed with everyone; round 2's global parameters are the strategy's over the three, by name
    (closed,) = closed_rounds(fleet, task["id"])
    assert (closed.round, closed.participants, closed.contributors, closed.reason) == (1, 3, 3, "every participant answered")
    assert closed.metrics["examples"] == 100.0
    art, got = global_after(fleet, task["id"], 2)
    assert (art["kind"], art["name"], art["format"]) == ("model", "digits-torch-cnn.fl", "safetensors") and art["version"].endswith(".r2")
    stacked = {k: np.stack([t[k] for t, _ in updates.values()]).astype(np.float64) for k in SHAPES}
    if strategy in ("fedavg", "fedprox"):  # FedProx fuses as FedAvg (its term is the participants')
        expected = fedavg(list(updates.values()))
    elif strategy == "median":
        expected = {k: np.median(v, axis=0).astype(np.float32) for k, v in stacked.items()}
    else:  # floor(0.34 * 3) = 1 value dropped at each end of every coordinate
        expected = {k: np.sort(v, axis=0)[1:2].mean(axis=0).astype(np.float32) for k, v in stacked.items()}
    assert_tensors(got, expected)
    # round 2's orders start from them and grant the round-2 updates
    for d in devices:
        fl = order_for(fleet, workers[d]).fl
        assert fl is not None and fl.run is not None and (fl.round, fl.attempt, fl.weights.artifact_id) == (2, 1, art["id"])
        assert (fl.run.publish.names, fl.run.publish.version) == ([f"fl-update.{task['id']}.{d}"], "2.1")
    assert [u.artifact_id for u in stored_updates(fleet, task["id"])] == [ids[d] for d in devices]


def test_updates_that_name_the_wrong_artefact_are_refused_and_not_counted(sqlite_fleet: TaskFleet, packages: dict[Path, bytes]) -> None:
    fleet = sqlite_fleet
    # Prepare: a, b, c; k = 2
    gw = fleet.node()
    upload_algorithm(fleet, packages, TORCH)
    start = initial(fleet)
    a, b, c = (site_device(fleet, gw) for _ in range(3))
    task = federate(fleet, [a, b, c], initial_parameters=start.id, min_participants=2)
    t0 = datetime.now(UTC)
    workers = started(fleet, task["id"], t0)
    b_update = upload_update(fleet, workers[b], 1, parameters(2))

    # Execute: a names b's update; a names its own of another round; c names its own in another format
    send_update(fleet, workers[a], 1, b_update.id, 10)
    wrong_round = upload_update(fleet, workers[a], 1, parameters(1), version="2.1")
    send_update(fleet, workers[a], 1, wrong_round.id, 10)
    onnx_update = upload_update(fleet, workers[c], 1, parameters(3), fmt="onnx")
    send_update(fleet, workers[c], 1, onnx_update.id, 10)
    send_update(fleet, workers[a], 1, "art-" + "0" * 26, 10)  # nothing stored under that id
    # updates the wire model refuses: both an inline layer and parameters, or neither
    with pytest.raises(ValueError, match="either data .* or parameters"):
        FlUpdate(task_id=task["id"], worker_id=workers[a]["id"], round=1, attempt=1, contributors=[a], num_examples=10)
    base = {"task_id": task["id"], "worker_id": workers[a]["id"], "round": 1, "attempt": 1, "contributors": [a], "num_examples": 10}
    send_raw(fleet, workers[a], {**base, "data": "AAAA", "parameters": b_update.id})
    send_raw(fleet, workers[a], base)

    # Assert: refused, none stored; the reasons in the task's log
    assert counters(fleet) == {"task_update_refused": 4, "task_update_malformed": 2}
    assert stored_updates(fleet, task["id"]) == []
    warnings = [line["text"] for line in log_lines(fleet, task["id"]) if line["level"] == "warning"]
    a_name, c_name = identity(task["id"], a, 1)[0], identity(task["id"], c, 1)[0]
    assert any(f"not the update {a_name} 1.1" in t and f"{identity(task['id'], b, 1)[0]} 1.1 (safetensors)" in t for t in warnings), warnings
    assert any(f"{a_name} 2.1 (safetensors), not the update {a_name} 1.1" in t for t in warnings), warnings
    assert any(f"{c_name} 1.1 (onnx), not the update {c_name} 1.1 (safetensors)" in t for t in warnings), warnings
    assert any("is not stored" in t for t in warnings), warnings

    # Execute: a and b answer properly; c cannot (its grant's identity is taken); the deadline passes
    a_update = upload_update(fleet, workers[a], 1, parameters(1))
    send_update(fleet, workers[a], 1, a_update.id, 10)
    send_update(fleet, workers[b], 1, b_update.id, 30)
    fleet.tick(t0 + timedelta(seconds=TIMEOUT - 1))
    assert plan_of(fleet, task["id"]).round == 1  # 2 of 3: the deadline is not moved
    fleet.tick(t0 + timedelta(seconds=TIMEOUT + 1))
    fleet.tick(t0 + timedelta(seconds=TIMEOUT + 2))

    # Assert: round 1 closed with a and b only: their FedAvg
    (closed,) = closed_rounds(fleet, task["id"])
    assert (closed.contributors, closed.reason) == (2, "deadline with k of n")
    assert_tensors(global_after(fleet, task["id"], 2)[1], fedavg([(parameters(1), 10), (parameters(2), 30)]))


def test_fedadams_moments_carry_from_round_to_round_in_the_plans_state_file(sqlite_fleet: TaskFleet, packages: dict[Path, bytes]) -> None:
    from interfaces.aggregation import ClientUpdate, FedAdam

    fleet = sqlite_fleet
    # Prepare: two devices, FedAdam, three rounds
    gw = fleet.node()
    upload_algorithm(fleet, packages, TORCH)
    start = initial(fleet)
    a, b = site_device(fleet, gw), site_device(fleet, gw)
    params = {"eta": 0.05, "beta_1": 0.8, "beta_2": 0.95, "tau": 1e-3}
    task = federate(fleet, [a, b], rounds=3, initial_parameters=start.id, strategy="fedadam", strategy_params=params)
    workers = started(fleet, task["id"])
    reference, x = FedAdam(**params), [parameters(0)]
    rounds = [{a: (parameters(10 * r + 1), 10), b: (parameters(10 * r + 2), 30)} for r in (1, 2)]
    states: list[str | None] = []

    for number, updates in enumerate(rounds, start=1):
        # Execute: both answer the round
        answer(fleet, workers, number, updates)
        fleet.tick()
        fleet.tick()

        # Assert: the next global parameters are what one FedAdam over the rounds so far gives
        x.append(reference.aggregate(x[-1], [ClientUpdate(dict(t), n) for t, n in updates.values()]))
        assert_tensors(global_after(fleet, task["id"], number + 1)[1], x[-1])
        states.append(whole.WholePlan.of(plan_of(fleet, task["id"])).state_sha256)
    # the moments live in one file at a time: the round before's is deleted once the plan moved on
    assert None not in states and states[0] != states[1]
    assert (fleet.blobs.exists(states[0]), fleet.blobs.exists(states[1])) == (False, True)
    forgetful = FedAdam(**params).aggregate(x[1], [ClientUpdate(dict(t), n) for t, n in rounds[1].values()])  # a hub that lost m and v
    assert max(float(np.abs(forgetful[k] - x[2][k]).max()) for k in SHAPES) > 1e-3


def test_a_round_short_of_k_runs_again_and_its_orders_grant_the_next_attempts_update(sqlite_fleet: TaskFleet, packages: dict[Path, bytes]) -> None:
    fleet = sqlite_fleet
    # Prepare: a and b, k = 2; only a answers attempt 1
    gw = fleet.node()
    upload_algorithm(fleet, packages, TORCH)
    start = initial(fleet)
    a, b = site_device(fleet, gw), site_device(fleet, gw)
    task = federate(fleet, [a, b], rounds=1, initial_parameters=start.id, min_participants=2)
    t0 = datetime.now(UTC)
    workers = started(fleet, task["id"], t0)
    (first,) = answer(fleet, workers, 1, {a: (parameters(1), 10)}).values()

    # Execute: the deadline passes
    fleet.tick(t0 + timedelta(seconds=TIMEOUT + 1))

    # Assert: attempt 2 from the same parameters; each order grants <round>.2
    plan = plan_of(fleet, task["id"])
    assert (plan.round, plan.attempt, plan.weights_artifact_id) == (1, 2, start.id)
    for target, w in workers.items():
        fl = order_for(fleet, w).fl
        assert fl is not None and fl.run is not None and (fl.attempt, fl.run.publish.names, fl.run.publish.version) == (2, [identity(task["id"], target, 1)[0]], "1.2")

    # Execute: a names its attempt-1 update for attempt 2 (refused); both upload attempt 2's
    send_update(fleet, workers[a], 1, first, 10, attempt=2)
    updates = {a: (parameters(3), 10), b: (parameters(4), 30)}
    for target, (tensors, n) in updates.items():
        send_update(fleet, workers[target], 1, upload_update(fleet, workers[target], 1, tensors, attempt=2).id, n, attempt=2)
    for _ in range(3):
        fleet.tick(t0 + timedelta(seconds=TIMEOUT + 2))

    # Assert: SUCCEEDED with attempt 2's FedAvg published
    assert counters(fleet) == {"task_update_accepted": 3, "task_update_refused": 1}
    assert fleet.task(task["id"])["state"] == "SUCCEEDED"
    (closed,) = closed_rounds(fleet, task["id"])
    assert (closed.attempts, closed.contributors) == (2, 2)
    assert_tensors(load(content(fleet, plan_of(fleet, task["id"]).published_artifact_id)), fedavg(list(updates.values())))  # type: ignore[arg-type]


def test_an_update_that_does_not_fit_the_model_is_dropped_when_the_round_closes_and_the_others_fuse(sqlite_fleet: TaskFleet, packages: dict[Path, bytes]) -> None:
    fleet = sqlite_fleet
    # Prepare: five devices, k = 2; two good updates, one with a NaN, one lacking a tensor, one of another shape
    gw = fleet.node()
    upload_algorithm(fleet, packages, TORCH)
    start = initial(fleet)
    good1, good2, nan, missing, shape = (site_device(fleet, gw) for _ in range(5))
    task = federate(fleet, [good1, good2, nan, missing, shape], initial_parameters=start.id, min_participants=2)
    workers = started(fleet, task["id"])
    with_nan = parameters(3)
    with_nan["fc.bias"][4] = np.nan
    lacking = {k: v for k, v in parameters(4).items() if k != "conv1.bias"}
    reshaped = {**parameters(5), "fc.weight": np.zeros((32, 10), np.float32)}
    updates = {good1: (parameters(1), 20), good2: (parameters(2), 60), nan: (with_nan, 10), missing: (lacking, 10), shape: (reshaped, 10)}

    # Execute: all five answer (the ingest checks only their identity)
    ids = answer(fleet, workers, 1, updates)
    assert counters(fleet) == {"task_update_accepted": 5}
    fleet.tick()

    # Assert: the three are dropped with the reasons in the task's log; the round closes with the other two
    (closed,) = closed_rounds(fleet, task["id"])
    assert (closed.participants, closed.contributors, closed.reason) == (5, 2, "deadline with k of n")
    warnings = [line["text"] for line in log_lines(fleet, task["id"]) if line["level"] == "warning"]
    for target, why in ((nan, "tensor 'fc.bias' holds NaN or infinite values"), (missing, "missing ['conv1.bias']"), (shape, "tensor 'fc.weight' is float32 [32, 10]")):
        assert any(f"refused the round 1 update of worker {workers[target]['id']}" in t and why in t for t in warnings), (target, warnings)
    dropped = {workers[t]["id"] for t in (nan, missing, shape)}
    assert sorted((u.worker_id in dropped, u.used_in) for u in stored_updates(fleet, task["id"])) == [(False, 1)] * 2 + [(True, whole.REFUSED)] * 3

    # Execute: the next tick stores round 2's parameters (and sweeps)
    fleet.tick()

    # Assert: the FedAvg of the good two; the dropped updates' artefacts are deleted, the fused ones kept
    assert {u.worker_id: u.artifact_id for u in stored_updates(fleet, task["id"])} == {workers[t]["id"]: ids[t] if t in (good1, good2) else None for t in ids}
    assert_tensors(global_after(fleet, task["id"], 2)[1], fedavg([(parameters(1), 20), (parameters(2), 60)]))
    for target in (nan, missing, shape):
        assert fleet.hub.get(f"/artifacts/{ids[target]}").status_code == 404, target
    for target in (good1, good2):
        assert fleet.hub.get(f"/artifacts/{ids[target]}").status_code == 200, target


# --- the end ---------------------------------------------------------------------------------------


def test_the_last_round_publishes_the_parameters_and_the_sweep_keeps_each_participants_latest_update(sqlite_fleet: TaskFleet, packages: dict[Path, bytes]) -> None:
    fleet = sqlite_fleet
    # Prepare: two devices, two rounds
    gw = fleet.node()
    upload_algorithm(fleet, packages, TORCH)
    start = initial(fleet)
    a, b = site_device(fleet, gw), site_device(fleet, gw)
    task = federate(fleet, [a, b], initial_parameters=start.id)
    workers = started(fleet, task["id"])
    rounds = [{a: (parameters(1), 10), b: (parameters(2), 30)}, {a: (parameters(3), 25), b: (parameters(4), 5)}]

    # Execute: both rounds answered
    ids = []
    for number, updates in enumerate(rounds, start=1):
        ids.append(answer(fleet, workers, number, updates))
        fleet.tick()
        fleet.tick()

    # Assert: SUCCEEDED; the parameters published as <output>-parameters at the pinned version: round 2's FedAvg
    done = fleet.task(task["id"])
    assert done["state"] == "SUCCEEDED", done
    plan = plan_of(fleet, task["id"])
    assert plan.round == 3 and plan.published_artifact_id is not None
    out = fleet.hub.get(f"/tasks/{task['id']}/outputs").json()
    assert out["artifacts"] == [plan.published_artifact_id] and out["complete"] is True
    art = fleet.hub.get(f"/artifacts/{plan.published_artifact_id}").json()
    assert (art["kind"], art["name"], art["version"], art["format"]) == ("model", "digits-torch-cnn-parameters", "1.0.0", "safetensors")
    assert_tensors(load(content(fleet, art["id"])), fedavg(list(rounds[1].values())))
    assert [r.round for r in closed_rounds(fleet, task["id"])] == [1, 2]

    # Assert: round 1's updates were swept; each participant's latest (round 2) stays, as last_updates says
    for target in (a, b):
        assert fleet.hub.get(f"/artifacts/{ids[0][target]}").status_code == 404, target
        assert fleet.hub.get(f"/artifacts/{ids[1][target]}").status_code == 200, target
    with Session(fleet.engine) as session:
        assert whole.last_updates(session, task["id"]) == {a: ids[1][a], b: ids[1][b]}

    # Execute: an upload never announced, then the task deleted; the next tick sweeps
    stray = upload_update(fleet, workers[a], 3, parameters(5))
    assert fleet.hub.request("DELETE", f"/tasks/{task['id']}", Role.OPERATOR).status_code == 204
    fleet.tick()

    # Assert: every update artefact of the deleted task is gone; the published parameters and the initial ones stay
    for artifact_id in (ids[1][a], ids[1][b], stray.id):
        assert fleet.hub.get(f"/artifacts/{artifact_id}").status_code == 404, artifact_id
    listed = fleet.hub.get("/artifacts", params={"limit": 200}).json()["items"]
    assert [x["name"] for x in listed if x["name"].startswith("fl-update.")] == []
    for artifact_id in (plan.published_artifact_id, start.id):
        assert fleet.hub.get(f"/artifacts/{artifact_id}").status_code == 200, artifact_id


# --- a hub restarted mid-round ---------------------------------------------------------------------


def test_updates_stored_before_a_restart_count_once_in_the_round_the_restarted_hub_closes(fleet: TaskFleet, database_url: str, packages: dict[Path, bytes]) -> None:
    # Prepare: two devices; a answers round 1 before the restart
    gw = fleet.node()
    upload_algorithm(fleet, packages, TORCH)
    start = initial(fleet)
    a, b = site_device(fleet, gw), site_device(fleet, gw)
    task = federate(fleet, [a, b], initial_parameters=start.id)
    workers = started(fleet, task["id"])
    (a_id,) = answer(fleet, workers, 1, {a: (parameters(1), 10)}).values()

    # Execute: a new hub process on the same database and blobs; a's update delivered again, then b's
    engine = make_engine(database_url)
    try:
        fleet.controller = TaskController(engine, fleet.controller.signing, blobs=fleet.blobs)
        fleet.ingest = StatusIngest(engine)
        fleet.tick()
        assert (plan_of(fleet, task["id"]).round, plan_of(fleet, task["id"]).attempt) == (1, 1)
        send_update(fleet, workers[a], 1, a_id, 10)
        b_id = upload_update(fleet, workers[b], 1, parameters(2)).id
        send_update(fleet, workers[b], 1, b_id, 30)
        fleet.tick()
        fleet.tick()
    finally:
        engine.dispose()

    # Assert: a counted once; round 1 closed with both; round 2 from their FedAvg
    assert counters(fleet) == {"task_update_duplicate": 1, "task_update_accepted": 1}
    assert [(u.artifact_id, u.used_in) for u in stored_updates(fleet, task["id"])] == [(a_id, 1), (b_id, 1)]
    (closed,) = closed_rounds(fleet, task["id"])
    assert (closed.round, closed.contributors, closed.metrics["examples"]) == (1, 2, 40.0)
    assert_tensors(global_after(fleet, task["id"], 2)[1], fedavg([(parameters(1), 10), (parameters(2), 30)]))


# --- what a whole-model task holds on to -------------------------------------------------------------


def test_the_algorithms_of_a_whole_model_task_cannot_be_deleted_while_it_exists(sqlite_fleet: TaskFleet, packages: dict[Path, bytes]) -> None:
    fleet = sqlite_fleet
    # Prepare: a task of the torch example with a numpy variant, round 1 open
    gw = fleet.node()
    torch_alg, numpy_alg = upload_algorithm(fleet, packages, TORCH), upload_algorithm(fleet, packages, NUMPY)
    start = initial(fleet)
    a, b = site_device(fleet, gw), site_device(fleet, gw, labels={"fw": "numpy"})
    task = federate(fleet, [a, b], initial_parameters=start.id, variants=[{"selector": "fw=numpy", "algorithm": NUMPY_REF}])
    workers = started(fleet, task["id"])

    # Execute / Assert: each algorithm is in use, as the initial parameters are
    for artifact_id in (torch_alg["id"], numpy_alg["id"], start.id):
        doc = assert_problem(fleet.hub.request("DELETE", f"/artifacts/{artifact_id}", Role.OPERATOR), 409, "artifact_in_use")
        assert task["id"] in doc["detail"], doc

    # and the rounds go on
    answer(fleet, workers, 1, {a: (parameters(1), 10), b: (parameters(2), 10)})
    fleet.tick()
    fleet.tick()
    assert plan_of(fleet, task["id"]).attempt == 1 and plan_of(fleet, task["id"]).round == 2


def test_fedadams_state_files_do_not_outlive_the_task(sqlite_fleet: TaskFleet, packages: dict[Path, bytes]) -> None:
    fleet = sqlite_fleet
    # Prepare: two devices, FedAdam, two rounds answered
    gw = fleet.node()
    upload_algorithm(fleet, packages, TORCH)
    start = initial(fleet)
    a, b = site_device(fleet, gw), site_device(fleet, gw)
    task = federate(fleet, [a, b], initial_parameters=start.id, strategy="fedadam")
    workers = started(fleet, task["id"])
    states = []
    for number in (1, 2):
        answer(fleet, workers, number, {a: (parameters(10 * number + 1), 10), b: (parameters(10 * number + 2), 30)})
        fleet.tick()
        fleet.tick()
        states.append(whole.WholePlan.of(plan_of(fleet, task["id"])).state_sha256)
    assert fleet.task(task["id"])["state"] == "SUCCEEDED" and None not in states and states[0] != states[1]

    # Execute: the task is deleted; the next tick sweeps
    assert fleet.hub.request("DELETE", f"/tasks/{task['id']}", Role.OPERATOR).status_code == 204
    fleet.tick()

    # Assert: no state file of it is left in the blob store
    assert [fleet.blobs.exists(sha256) for sha256 in states if sha256 is not None] == [False, False]


# --- secure aggregation ----------------------------------------------------------------------------


def test_secure_aggregation_of_whole_models_fuses_the_plain_mean_and_recovers_a_dropout_after_masking(
    sqlite_fleet: TaskFleet, packages: dict[Path, bytes],
) -> None:  # fmt: skip
    # Prepare: three devices with X25519 keys; no round opens before each running worker sent its key
    import base64

    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    from interfaces import secagg
    from interfaces.tasks import FL_KEY_EVENT, FL_REVEAL_EVENT, FlKey, FlReveal

    fleet = sqlite_fleet
    gw = fleet.node()
    upload_algorithm(fleet, packages, TORCH)
    start = initial(fleet)
    devices = [site_device(fleet, gw) for _ in range(3)]
    task = federate(fleet, devices, initial_parameters=start.id, min_participants=2, secure_aggregation=True)
    t0 = datetime.now(UTC)
    fleet.tick(t0)
    workers = workers_of(fleet, task["id"])
    for w in workers.values():
        fleet.report(w, "RUNNING")
    fleet.tick(t0)
    assert plan_of(fleet, task["id"]).attempt == 0
    keys = {d: X25519PrivateKey.generate() for d in devices}
    for d in devices:
        public = keys[d].public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        fleet.send(d, FL_KEY_EVENT, FlKey(task_id=task["id"], worker_id=workers[d]["id"], public_key=base64.b64encode(public).decode()))
    fleet.tick(t0)
    examples = dict(zip(devices, (100, 200, 300), strict=True))

    def masked(d: str, round_: int, tensors: Tensors) -> bytes:
        """What the participant uploads: its parameters times its share, fixed point, masked with the others' seeds."""
        fl = order_for(fleet, workers[d]).fl
        assert fl is not None and fl.secure and fl.weight is not None and fl.total_examples is not None and fl.round == round_
        round_id = f"{task['id']}/{fl.round}/{fl.attempt}"
        seeds = {p: secagg.pair_seed(keys[d].exchange(X25519PublicKey.from_public_bytes(base64.b64decode(k))), round_id, d, p) for p, k in fl.peers.items() if p != d}
        encoded = {k: secagg.encode(v.astype(np.float64) * fl.weight / fl.total_examples) for k, v in tensors.items()}
        return save(secagg.mask(encoded, d, seeds))

    def send_masked(d: str, round_: int, tensors: Tensors) -> None:
        artifact = upload_update(fleet, workers[d], round_, masked(d, round_, tensors))
        data = FlUpdate(task_id=task["id"], worker_id=workers[d]["id"], round=round_, attempt=1, contributors=[d], num_examples=examples[d],
                        parameters=artifact.id, masked=True)  # fmt: skip
        fleet.send(d, FL_UPDATE_EVENT, data)

    # Execute 1: every participant masks and uploads round 1 (no counts known yet: each weighs 1)
    fl = order_for(fleet, workers[devices[0]]).fl
    assert fl is not None and set(fl.peers) == set(devices) and (fl.total_examples, fl.weight) == (3, 1)
    first = {d: parameters(20 + k) for k, d in enumerate(devices)}
    for d in devices:
        send_masked(d, 1, first[d])
    fleet.tick()
    fleet.tick()

    # Assert 1: no single upload is its parameters; their unmasked sum is the plain mean
    one = load(content(fleet, stored_updates(fleet, task["id"])[0].artifact_id))  # type: ignore[arg-type]
    assert one["fc.weight"].dtype == np.uint32
    _, got = global_after(fleet, task["id"], 2)
    plain = fedavg([(t, 1) for t in first.values()])
    for k in SHAPES:
        np.testing.assert_allclose(got[k], plain[k], rtol=0, atol=3 / secagg.DEFAULT_SCALE)

    # Execute 2: round 2 weighs each by the examples it counted; the third participant drops after masking
    fl = order_for(fleet, workers[devices[2]]).fl
    assert fl is not None and fl.total_examples == 600 and fl.weight == 300 and fl.round == 2
    second = {d: parameters(30 + k) for k, d in enumerate(devices)}
    masked(devices[2], 2, second[devices[2]])  # derived its seeds and masked; its upload never comes
    for d in devices[:2]:
        send_masked(d, 2, second[d])
    t1 = datetime.now(UTC) + timedelta(seconds=TIMEOUT + 1)
    fleet.tick(t1)

    # Assert 2: the survivors are asked for their seeds with it, and only they
    for d in devices:
        fl = order_for(fleet, workers[d]).fl
        assert fl is not None and fl.reveal == [devices[2]]

    # Execute 3: they reveal them
    round_id = f"{task['id']}/2/1"
    for d in devices[:2]:
        peer_key = X25519PublicKey.from_public_bytes(keys[devices[2]].public_key().public_bytes(Encoding.Raw, PublicFormat.Raw))
        seed = secagg.pair_seed(keys[d].exchange(peer_key), round_id, d, devices[2])
        fleet.send(d, FL_REVEAL_EVENT, FlReveal(task_id=task["id"], worker_id=workers[d]["id"], round=2, attempt=1, seeds={devices[2]: base64.b64encode(seed).decode()}))
    for _ in range(3):
        fleet.tick(t1 + timedelta(seconds=1))

    # Assert 3: the published parameters are the survivors' FedAvg by their examples; the log says who dropped
    assert fleet.task(task["id"])["state"] == "SUCCEEDED"
    published = load(content(fleet, plan_of(fleet, task["id"]).published_artifact_id))  # type: ignore[arg-type]
    expected = fedavg([(second[devices[0]], 100), (second[devices[1]], 200)])
    for k in SHAPES:
        np.testing.assert_allclose(published[k], expected[k], rtol=0, atol=3 / secagg.DEFAULT_SCALE)
    closed = closed_rounds(fleet, task["id"])
    assert [(c.round, c.contributors, c.participants) for c in closed] == [(1, 3, 3), (2, 2, 3)]
    assert any(f"round 2: {devices[2]} dropped after masking; the 2 others reveal their seeds with it" in line["text"] for line in log_lines(fleet, task["id"]))


def test_secure_aggregation_of_whole_models_refuses_what_it_cannot_mask(sqlite_fleet: TaskFleet, packages: dict[Path, bytes]) -> None:
    fleet = sqlite_fleet
    device = site_device(fleet, fleet.node())
    upload_algorithm(fleet, packages, TORCH)
    start = initial(fleet).id
    before = fleet.hub.snapshot()
    for extra, text in [
        ({"compression": "int8"}, "secure aggregation masks the full-precision parameters: compression none"),
        ({"sync": "async"}, "secure aggregation cannot fold an update of an earlier round"),
        ({"strategy": "median"}, "secure aggregation reveals only the sum"),
    ]:
        r = fleet.hub.request("POST", "/tasks", Role.OPERATOR, json=whole_body([device], initial_parameters=start, secure_aggregation=True, **extra))
        assert r.status_code == 422 and text in r.text, (extra, r.text)
    assert fleet.hub.snapshot() == before


# --- differential privacy (DP-FedAvg) --------------------------------------------------------------


def test_dp_fedavg_on_whole_models_clips_each_update_adds_the_noise_and_charges_each_devices_budget(sqlite_fleet: TaskFleet, packages: dict[Path, bytes]) -> None:
    # Prepare: three devices with budgets for the dataset the task trains on; one too small at first
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    fleet = sqlite_fleet
    gw = fleet.node()
    upload_algorithm(fleet, packages, TORCH)
    start = initial(fleet)
    devices = [site_device(fleet, gw) for _ in range(3)]

    def budget(device_id: str, epsilon: float) -> None:
        r = fleet.hub.request("PUT", f"/devices/{device_id}/privacy-budgets/digits", Role.OPERATOR, json={"epsilon": epsilon, "delta": 1e-5})
        assert r.status_code == 200, r.text

    for d, eps in zip(devices, (50.0, 50.0, 0.5), strict=True):
        budget(d, eps)
    z, clip = 2.0, 1.0
    dp = {"clip_norm": clip, "noise_multiplier": z}
    body = whole_body(devices, initial_parameters=start.id, datasets={"train": "digits"}, dp=dp, min_participants=3)

    # Execute / Assert 1: refused while one budget cannot afford the rounds (409 naming it), and where DP cannot hold
    node = site_node(fleet, "site-a")
    before = fleet.hub.snapshot()
    r = fleet.hub.request("POST", "/tasks", Role.OPERATOR, json=body)
    assert r.status_code == 409 and r.json()["code"] == "privacy_budget_exceeded" and [t["device_id"] for t in r.json()["targets"]] == [devices[2]], r.text
    for other, text in [
        ({**body, "placement": {"target": "node", "ids": [node]}}, "which devices keep: placement.target device"),
        (whole_body(devices, initial_parameters=start.id, dp=dp), "name them (datasets)"),
        ({**body, "spec": {**body["spec"], "secure_aggregation": True}}, "does not go with secure_aggregation"),
        ({**body, "spec": {**body["spec"], "strategy": "median"}}, "does not go with strategy median"),
    ]:
        r = fleet.hub.request("POST", "/tasks", Role.OPERATOR, json=other)
        assert r.status_code == 422 and text in r.text, (other["spec"], r.text)
    assert fleet.hub.snapshot() == before

    # Execute 2: every budget affords it; round 1's updates move the model by norms 0.5, 4 and 40
    budget(devices[2], 50.0)
    r = fleet.hub.request("POST", "/tasks", Role.OPERATOR, json=body)
    assert r.status_code == 201, r.text
    task = r.json()
    workers = started(fleet, task["id"])
    x = parameters(0)
    size = sum(int(np.prod(s)) for s in SHAPES.values())
    rng = np.random.default_rng(7)
    deltas = {}
    for d, norm in zip(devices, (0.5, 4.0, 40.0), strict=True):
        direction = {k: rng.standard_normal(s) for k, s in SHAPES.items()}
        length = np.sqrt(sum(float(np.sum(v**2)) for v in direction.values()))
        deltas[d] = {k: v * norm / length for k, v in direction.items()}
    answer(fleet, workers, 1, {d: ({k: (x[k] + deltas[d][k]).astype(np.float32) for k in SHAPES}, 100) for d in devices})
    fleet.tick()
    fleet.tick()

    # Assert 2: the new model is x plus the mean of the clipped deltas (norms 0.5, 1, 1) and noise of std z C / 3
    _, got = global_after(fleet, task["id"], 2)
    factors = {d: min(1.0, clip / n) for d, n in zip(devices, (0.5, 4.0, 40.0), strict=True)}
    mean = {k: x[k].astype(np.float64) + sum(deltas[d][k] * factors[d] for d in devices) / 3 for k in SHAPES}
    noise = np.concatenate([(got[k].astype(np.float64) - mean[k]).ravel() for k in SHAPES])
    assert noise.size == size and abs(noise.std() - z * clip / 3) < 0.15 * z * clip / 3, noise.std()
    assert abs(noise.mean()) < 5 * z * clip / 3 / np.sqrt(size)
    (closed,) = closed_rounds(fleet, task["id"])
    assert closed.metrics["dp_noise_std"] == pytest.approx(z * clip / 3)

    # Execute 3: round 2, then the task ends
    answer(fleet, workers, 2, {d: (got, 100) for d in devices})
    for _ in range(3):
        fleet.tick()

    # Assert 3: SUCCEEDED; each device charged 2 rounds of the Gaussian mechanism, epsilon as the accountant says
    assert fleet.task(task["id"])["state"] == "SUCCEEDED"
    outputs = fleet.hub.get(f"/tasks/{task['id']}/outputs").json()
    assert sorted((s["device_id"], s["state"], s["steps"]) for s in outputs["privacy"]) == sorted((d, "spent", 2) for d in devices)
    accountant = RdpAccountant()
    accountant.compose(dp_accounting.GaussianDpEvent(z), 2)
    for spend in outputs["privacy"]:
        assert spend["epsilon"] == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-3)


# --- after the last round: the ONNX export, the cross-site evaluation ------------------------------


def test_after_the_last_round_the_export_and_the_evaluation_each_wait_until_their_deadline_and_the_task_succeeds(
    sqlite_fleet: TaskFleet, packages: dict[Path, bytes],
) -> None:  # fmt: skip
    # Prepare: two devices, one round, then_deploy and cross_evaluation
    from interfaces.tasks import FL_EVALUATION_EVENT, TASK_TRAINED_EVENT, FlEvaluation, FlScore, TrainedModel

    fleet = sqlite_fleet
    gw = fleet.node()
    upload_algorithm(fleet, packages, TORCH)
    start = initial(fleet)
    a, b = sorted(site_device(fleet, gw) for _ in range(2))
    then = {"target": {"kind": "device", "ids": [a, b]}, "strategy": {"type": "canary", "percent": 50}}
    task = federate(fleet, [a, b], rounds=1, initial_parameters=start.id, min_participants=2, then_deploy=then, cross_evaluation=True)
    workers = started(fleet, task["id"])
    answer(fleet, workers, 1, {a: (parameters(1), 10), b: (parameters(2), 30)})
    for _ in range(3):
        fleet.tick()

    # Assert 1: the model is published; only the first participant is asked to export it, with a grant for the ONNX model
    plan = plan_of(fleet, task["id"])
    assert plan.published_artifact_id is not None and fleet.task(task["id"])["state"] == "RUNNING"
    export = order_for(fleet, workers[a]).export
    assert export is not None and export.parameters.artifact_id == plan.published_artifact_id
    assert (export.run.publish.names, export.run.publish.version) == (["digits-torch-cnn"], "1.0.0")
    assert order_for(fleet, workers[b]).export is None

    # Execute 2: its algorithm has no export (the report says so); the evaluation opens; only b scores
    fleet.send(a, TASK_TRAINED_EVENT, TrainedModel(task_id=task["id"], worker_id=workers[a]["id"], parameters=plan.published_artifact_id, onnx=None, steps=1,
                                                   resumed_from=0, num_examples=0, loss=0.0))  # fmt: skip
    fleet.tick()
    evaluation = order_for(fleet, workers[b]).evaluation
    assert evaluation is not None and set(evaluation.models) == {"global", a, b}
    score = FlScore(loss=0.4, num_examples=50, metrics={"accuracy": 0.8})
    fleet.send(b, FL_EVALUATION_EVENT, FlEvaluation(task_id=task["id"], worker_id=workers[b]["id"], scores={m: score for m in evaluation.models}))
    fleet.send(b, FL_EVALUATION_EVENT, FlEvaluation(task_id=task["id"], worker_id=workers[b]["id"], scores={"global": score}))
    fleet.tick()
    assert fleet.task(task["id"])["state"] == "RUNNING"  # a has not scored: the evaluation waits for it until its deadline
    assert order_for(fleet, workers[a]).evaluation is not None
    for _ in range(2):
        fleet.tick(datetime.now(UTC) + timedelta(seconds=TIMEOUT + 1))

    # Assert 2: SUCCEEDED without a deployment (logged why); the matrix holds b's row; a second report was a duplicate
    assert fleet.task(task["id"])["state"] == "SUCCEEDED"
    outputs = fleet.hub.get(f"/tasks/{task['id']}/outputs").json()
    assert outputs["deployments"] == [] and outputs["artifacts"] == [plan.published_artifact_id]
    assert sorted((s["evaluator"], s["model"]) for s in outputs["evaluation"]) == sorted((b, m) for m in ("global", a, b))
    assert counters(fleet).get("task_update_accepted") == 2 and fleet.ingest.counters["task_evaluation_duplicate"] == 1
    lines = [line["text"] for line in log_lines(fleet, task["id"])]
    assert any("not deployed: digits-torch-cnn of" in line and "has no export" in line for line in lines), lines[-10:]
    assert any("cross-site evaluation done: 1 of 2 participants scored the 3 models" in line for line in lines), lines[-10:]


# --- evaluate_every: the global model checked every N rounds, the best round published ------------------


def _score(fleet: TaskFleet, worker: dict[str, Any], round_: int | None, accuracy: float, n: int) -> None:
    from interfaces.tasks import FL_EVALUATION_EVENT, FlEvaluation, FlScore

    score = FlScore(loss=1 - accuracy, num_examples=n, metrics={"accuracy": accuracy})
    fleet.send(worker["target_id"], FL_EVALUATION_EVENT, FlEvaluation(task_id=worker["task_id"], worker_id=worker["id"], scores={"global": score}, round=round_))


def test_evaluate_every_checks_the_global_model_between_rounds_and_publishes_the_best_rounds(sqlite_fleet: TaskFleet, packages: dict[Path, bytes]) -> None:
    # Prepare: two devices, four rounds, the global model checked every two
    fleet = sqlite_fleet
    gw = fleet.node()
    upload_algorithm(fleet, packages, TORCH)
    start = initial(fleet)
    a, b = sorted(site_device(fleet, gw) for _ in range(2))
    task = federate(fleet, [a, b], rounds=4, initial_parameters=start.id, min_participants=2, evaluate_every=2)
    workers = started(fleet, task["id"])
    fused: dict[int, Tensors] = {}
    for round_ in (1, 2):
        answer(fleet, workers, round_, {a: (parameters(10 * round_), 10), b: (parameters(10 * round_ + 1), 30)})
        fleet.tick()
        fleet.tick()
        fused[round_] = fedavg([(parameters(10 * round_), 10), (parameters(10 * round_ + 1), 30)])

    # Assert 1: after round 2 the check opens before round 3: both are asked to score round 2's model, no round is open
    plan = plan_of(fleet, task["id"])
    assert (plan.round, plan.attempt) == (3, 0), (plan.round, plan.attempt)
    round3_weights = plan.weights_artifact_id
    for target in (a, b):
        order = order_for(fleet, workers[target])
        assert order.fl is None and order.evaluation is not None and order.evaluation.round == 2
        assert set(order.evaluation.models) == {"global"} and order.evaluation.models["global"].artifact_id == round3_weights
    assert_tensors(load(content(fleet, round3_weights)), fused[2])

    # Execute 2: a score for another round is refused; both score round 2's model; round 3 opens
    _score(fleet, workers[a], 1, 0.99, 10)
    assert fleet.ingest.counters.get("task_evaluation_refused") == 1
    _score(fleet, workers[a], 2, 0.90, 10)
    _score(fleet, workers[b], 2, 0.70, 30)
    fleet.tick()
    plan = plan_of(fleet, task["id"])
    assert (plan.round, plan.attempt) == (3, 1)
    assert order_for(fleet, workers[a]).evaluation is None
    for round_ in (3, 4):
        answer(fleet, workers, round_, {a: (parameters(10 * round_), 10), b: (parameters(10 * round_ + 1), 30)})
        fleet.tick()
        fleet.tick()

    # Execute 3: after the last round the last model is checked; it scores worse (b only, a misses the deadline)
    plan = plan_of(fleet, task["id"])
    assert plan.round == 5 and plan.published_artifact_id is None
    last = order_for(fleet, workers[b]).evaluation
    assert last is not None and last.round == 4
    _score(fleet, workers[b], 4, 0.60, 30)
    fleet.tick()
    assert plan_of(fleet, task["id"]).published_artifact_id is None  # a may still score until the deadline
    for _ in range(3):
        fleet.tick(datetime.now(UTC) + timedelta(seconds=TIMEOUT + 1))

    # Assert 3: SUCCEEDED; round 2's model is published (its bytes, under the output's name), kept though two rounds old
    assert fleet.task(task["id"])["state"] == "SUCCEEDED"
    plan = plan_of(fleet, task["id"])
    published = fleet.hub.get(f"/artifacts/{plan.published_artifact_id}").json()
    assert (published["name"], published["version"]) == ("digits-torch-cnn-parameters", "1.0.0")
    assert_tensors(load(content(fleet, published["id"])), fused[2])
    assert fleet.hub.get(f"/artifacts/{round3_weights}").status_code == 200
    outputs = fleet.hub.get(f"/tasks/{task['id']}/outputs").json()
    assert outputs["artifacts"] == [published["id"]] and outputs["best_round"] == 2
    scored = [(r["round"], r["metric"], round(r["value"], 6), r["evaluators"]) for r in outputs["rounds_scored"]]
    assert scored == [(2, "accuracy", round((0.9 * 10 + 0.7 * 30) / 40, 6), 2), (4, "accuracy", 0.6, 1)]
    lines = [line["text"] for line in log_lines(fleet, task["id"])]
    assert any("round 4's global model: accuracy 0.6000 on 1 participants (round 2 stays the best)" in line for line in lines), lines[-10:]
    assert any("publishing round 2's global model, the best of the 2 checked" in line for line in lines), lines[-10:]


def test_evaluate_every_is_a_whole_model_field(sqlite_fleet: TaskFleet) -> None:
    fleet = sqlite_fleet
    body = {"type": "federated_training", "placement": {"target": "device"},
            "spec": {"model": {"name": "m", "version": "1.0.0"}, "dataset": "d", "rounds": 2, "evaluate_every": 1}}  # fmt: skip
    r = fleet.hub.request("POST", "/tasks", Role.OPERATOR, json=body)
    assert r.status_code == 422 and "evaluate_every" in r.text, r.text


def test_a_sites_update_counts_at_most_the_rows_its_node_reported_of_the_tasks_datasets(sqlite_fleet: TaskFleet, packages: dict[Path, bytes]) -> None:
    from interfaces.messages import ReportedBody

    # Prepare: two sites; a reports its training file's rows (an edge describes its .npz datasets), b a folder (nothing)
    fleet = sqlite_fleet
    upload_algorithm(fleet, packages, TORCH)
    start = initial(fleet)
    a, b = sorted((site_node(fleet, "a"), site_node(fleet, "b")))
    fleet.ingest.offer(a, ReportedBody(version=1, status={"datasets": {"digits-train": {"rows": 40, "shape": [1, 8, 8], "dtype": "float32"}}}))
    fleet.ingest.flush()
    task = federate(fleet, [a, b], target="node", initial_parameters=start.id, min_participants=2, datasets={"train": "digits-train"})
    workers = started(fleet, task["id"])

    # Execute: a claims 10,000 examples, b 36
    answer(fleet, workers, 1, {a: (parameters(1), 10_000), b: (parameters(2), 36)})
    fleet.tick()
    fleet.tick()

    # Assert: a counted as its 40 rows (logged), b as it says (no rows reported); the FedAvg is by 40 and 36
    (closed,) = closed_rounds(fleet, task["id"])
    assert closed.metrics["examples"] == 76.0
    assert_tensors(global_after(fleet, task["id"], 2)[1], fedavg([(parameters(1), 40), (parameters(2), 36)]))
    lines = [line["text"] for line in log_lines(fleet, task["id"])]
    assert any("claimed 10000 examples; its contributors reported 40 rows of digits-train: counted as 40" in line for line in lines), lines[-10:]
