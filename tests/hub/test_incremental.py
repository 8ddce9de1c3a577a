"""DP incremental training in the hub (DESIGN §5): privacy budgets, admission, the step limit, settling what
workers spent, and the new model version published from a trained layer.

The scheduler is ticked by the test; devices report through the ingest as MQTT events relayed by an edge
would arrive. Every ε is checked against dp_accounting's RDP accountant computed here, independently.
"""

from __future__ import annotations

import base64
import math
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import dp_accounting
import numpy as np
import onnxruntime as ort
import pytest
from dp_accounting.rdp import RdpAccountant
from safetensors.numpy import save
from sqlalchemy import update
from sqlmodel import Session

from cloud.artifacts import create_artifact, read_blob
from cloud.incremental import surgery
from cloud.tables import Artifact, Device
from device.ota.verify import verify_manifest
from interfaces.auth import Role
from interfaces.deployments import ArtifactCreate, SignedManifest
from interfaces.tasks import TASK_OUTPUT_EVENT, WorkerOutput
from tests.dp_support import cloud_model
from tests.hub.conftest import assert_problem, hub_settings, running_hub
from tests.hub.tasks_support import TaskFleet, running_task_fleet

DATASET, ROWS, DELTA = "camera", 700, 1e-5


@pytest.fixture
def fleet(database_url: str, tmp_path: Path) -> Iterator[TaskFleet]:
    yield from running_task_fleet(database_url, tmp_path)


@pytest.fixture
def sqlite_fleet(sqlite_url: str, tmp_path: Path) -> Iterator[TaskFleet]:
    yield from running_task_fleet(sqlite_url, tmp_path)


def reference_epsilon(q: float, sigma: float, steps: int, delta: float) -> float:
    accountant = RdpAccountant()
    accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    return float(accountant.get_epsilon(delta))


# --- a fleet that keeps data -----------------------------------------------------------------------


def upload_model(fleet: TaskFleet) -> Artifact:
    body = ArtifactCreate(kind="model", name="digits", version="1.0.0", format="onnx")  # type: ignore[arg-type]
    with Session(fleet.engine, expire_on_commit=False) as session, fleet.blobs.writer() as writer:
        writer.write(cloud_model())
        return create_artifact(session, fleet.controller.signing, fleet.blobs, body, writer)


def keeping_device(fleet: TaskFleet, node: str, model: Artifact, rows: int = ROWS, online: bool = True, dataset: str = DATASET) -> str:
    installed = {"model": {"name": model.name, "version": model.version, "sha256": model.sha256, "artifact_id": model.id}}
    device_id = fleet.device(node, installed=installed, online=online)
    with Session(fleet.engine) as session:
        reported = {"installed": installed, "datasets": {dataset: {"rows": rows, "shape": [64], "dtype": "float32"}}}
        session.execute(update(Device).where(Device.id == device_id).values(reported=reported))  # type: ignore[arg-type]
        session.commit()
    return device_id


def set_budget(fleet: TaskFleet, device_id: str, epsilon: float, delta: float = DELTA, dataset: str = DATASET, role: Role = Role.OPERATOR) -> Any:
    return fleet.hub.request("PUT", f"/devices/{device_id}/privacy-budgets/{dataset}", role, json={"epsilon": epsilon, "delta": delta})


def budgets(fleet: TaskFleet, device_id: str) -> dict[str, dict[str, Any]]:
    r = fleet.hub.get(f"/devices/{device_id}/privacy-budgets")
    assert r.status_code == 200, r.text
    return {b["dataset"]: b for b in r.json()}


def train(fleet: TaskFleet, devices: list[str], expect: int = 201, attempts: int = 3, **spec: Any) -> dict[str, Any]:
    spec = {"model": {"name": "digits"}, "dataset": DATASET, "batch_size": 64, "noise_multiplier": 1.1, **spec}
    return fleet.create("incremental_training", spec, expect=expect, placement={"ids": devices}, retry={"backoff_s": 0, "max_attempts": attempts})


def layer_shape() -> tuple[int, int]:
    layer = surgery.find_dense(surgery.load(cloud_model()))
    return layer.features, layer.classes


def trained_layer(seed: int = 0) -> dict[str, np.ndarray]:
    features, classes = layer_shape()
    rng = np.random.default_rng(seed)
    return {"weight": rng.standard_normal((features, classes)).astype(np.float32), "bias": rng.standard_normal(classes).astype(np.float32)}


def send_layer(fleet: TaskFleet, worker: dict[str, Any], steps: int, layer: dict[str, np.ndarray] | None = None) -> None:
    data = base64.b64encode(save(layer or trained_layer())).decode()
    fleet.send(worker["target_id"], TASK_OUTPUT_EVENT, WorkerOutput(worker_id=worker["id"], task_id=worker["task_id"], chunk=0, items=steps, data=data))


def finish(fleet: TaskFleet, worker: dict[str, Any], steps: int, layer: dict[str, np.ndarray] | None = None) -> None:
    """What the device does: RUNNING, the trained layer after ``steps`` steps, SUCCEEDED."""
    fleet.report(worker, "RUNNING", items_done=0)
    send_layer(fleet, worker, steps, layer)
    fleet.report(worker, "SUCCEEDED", items_done=steps)


def outputs(fleet: TaskFleet, task_id: str) -> dict[str, Any]:
    r = fleet.hub.get(f"/tasks/{task_id}/outputs")
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


# --- budgets ---------------------------------------------------------------------------------------


def test_budgets_are_kept_per_device_and_dataset(fleet: TaskFleet, database_url: str, tmp_path: Path) -> None:
    gw = fleet.node()
    model = upload_model(fleet)
    device = keeping_device(fleet, gw, model)
    assert budgets(fleet, device) == {}
    r = set_budget(fleet, device, 3.0)
    assert r.status_code == 200, r.text
    assert r.json() | {"created_at": None, "updated_at": None} == {
        "device_id": device, "dataset": DATASET, "epsilon": 3.0, "delta": DELTA, "spent": 0.0, "reserved": 0.0, "remaining": 3.0, "rows": ROWS,
        "created_at": None, "updated_at": None, "spends": [],
    }  # fmt: skip
    assert set_budget(fleet, device, 5.0, 1e-6).json()["epsilon"] == 5.0  # a PUT replaces
    assert set_budget(fleet, device, 1.0, dataset="other").status_code == 200
    assert_problem(set_budget(fleet, device, 1.0, role=Role.VIEWER), 403, "forbidden")
    assert_problem(set_budget(fleet, device, 0.0), 422, "validation_failed")
    assert_problem(set_budget(fleet, device, 1.0, delta=1.0), 422, "validation_failed")
    assert_problem(set_budget(fleet, device, 1.0, dataset="-x"), 422, "validation_failed")
    assert_problem(set_budget(fleet, "d-00000000000000000000000000", 1.0), 404, "not_found")
    # a second hub replica on the same database reads the same budgets
    for other in running_hub(hub_settings(tmp_path / "replica", database_url)):
        seen = {b["dataset"]: b for b in other.get(f"/devices/{device}/privacy-budgets").json()}
        assert seen[DATASET]["epsilon"] == 5.0 and seen[DATASET]["delta"] == 1e-6 and seen["other"]["epsilon"] == 1.0
        assert seen["other"]["rows"] is None  # the device reports no such dataset


# --- admission, accounting, publication -------------------------------------------------------------


def test_epsilon_spent_is_the_accountants_and_the_trained_layer_is_published(fleet: TaskFleet) -> None:
    # Prepare: a device keeping 700 rows, a budget of epsilon 20
    gw = fleet.node()
    model = upload_model(fleet)
    device = keeping_device(fleet, gw, model)
    set_budget(fleet, device, 20.0)
    q, sigma, steps = 64 / ROWS, 1.1, 150

    # Execute: a task of 150 steps
    task = train(fleet, [device], steps=steps)
    assert task["spec"]["model"] == {"name": "digits", "version": "1.0.0"}  # the version is pinned at admission
    reserved = budgets(fleet, device)[DATASET]
    fleet.tick()
    (worker,) = fleet.workers(task["id"])
    order = fleet.order_of(worker)

    # Assert: what was reserved and ordered is the accountant's for (q, sigma, 150, delta)
    expected = reference_epsilon(q, sigma, steps, DELTA)
    assert reserved["reserved"] == pytest.approx(expected, rel=1e-12) and reserved["spent"] == 0
    assert reserved["remaining"] == pytest.approx(20 - expected, rel=1e-12)
    assert order.training is not None and order.training.max_steps == steps and order.training.sample_rate == pytest.approx(q)
    assert order.training.base_sha256 == model.sha256
    body_manifest = order.training.body.signed_manifest
    verify_manifest(fleet.controller.signing.public_key, body_manifest)
    assert body_manifest.manifest.kind == "model" and body_manifest.manifest.name == "digits.body"

    # Execute: the device trains and sends its layer
    layer = trained_layer()
    finish(fleet, worker, steps, layer)
    fleet.tick()

    # Assert: SUCCEEDED; spent = the accountant's; the layer published as digits 1.0.1, signed
    done = fleet.task(task["id"])
    assert done["state"] == "SUCCEEDED", done
    out = outputs(fleet, task["id"])
    assert out["complete"] and len(out["artifacts"]) == 1
    (spend,) = out["privacy"]
    assert spend["state"] == "spent" and spend["steps"] == steps and spend["epsilon"] == pytest.approx(expected, rel=1e-12)
    after = budgets(fleet, device)[DATASET]
    assert after["spent"] == pytest.approx(expected, rel=1e-12) and after["reserved"] == 0
    assert after["remaining"] == pytest.approx(20 - expected, rel=1e-12)
    r = fleet.hub.get(f"/artifacts/{out['artifacts'][0]}")
    art = r.json()
    assert (art["kind"], art["name"], art["version"], art["format"]) == ("model", "digits", "1.0.1", "onnx")
    verify_manifest(fleet.controller.signing.public_key, SignedManifest.model_validate(art["signed_manifest"]))
    # the published model is the original with the layer replaced
    with Session(fleet.engine) as session:
        stored = session.get(Artifact, art["id"])
        assert stored is not None
        published = read_blob(fleet.blobs, stored.sha256)
    x = np.random.default_rng(1).random((20, 64), dtype=np.float32)
    original = surgery.load(cloud_model())
    cut = surgery.find_dense(original)
    body = ort.InferenceSession(surgery.body(original, cut).SerializeToString())
    features = body.run([cut.feature], {"x": x})[0]
    logits = ort.InferenceSession(published).run(None, {"x": x})[0]
    np.testing.assert_allclose(logits, features @ layer["weight"] + layer["bias"], rtol=1e-5, atol=1e-5)
    meta = {p.key: p.value for p in surgery.load(published).metadata_props}
    assert meta["aisynergy.trained_from"] == "digits 1.0.0" and meta["aisynergy.device"] == device and meta["aisynergy.dp_steps"] == str(steps)
    assert float(meta["aisynergy.dp_epsilon"]) == pytest.approx(expected, rel=1e-5)


def test_a_task_a_budget_cannot_afford_is_refused_and_nothing_is_stored(fleet: TaskFleet) -> None:
    gw = fleet.node()
    model = upload_model(fleet)
    rich, poor, none = (keeping_device(fleet, gw, model) for _ in range(3))
    set_budget(fleet, rich, 50.0)
    set_budget(fleet, poor, 3.0)
    before = fleet.hub.snapshot()
    r = fleet.hub.request("POST", "/tasks", Role.OPERATOR, json={
        "type": "incremental_training", "spec": {"model": {"name": "digits"}, "dataset": DATASET, "steps": 200, "noise_multiplier": 1.1},
        "placement": {"ids": [rich, poor]},
    })  # fmt: skip
    problem = assert_problem(r, 409, "privacy_budget_exceeded")
    (refused,) = problem["targets"]
    assert refused["device_id"] == poor and refused["requested_steps"] == 200
    assert refused["requested_epsilon"] == pytest.approx(reference_epsilon(64 / ROWS, 1.1, 200, DELTA), rel=1e-9)
    assert refused["remaining_epsilon"] == 3.0 and 0 < refused["affordable_steps"] < 200
    assert reference_epsilon(64 / ROWS, 1.1, refused["affordable_steps"], DELTA) <= 3.0 < reference_epsilon(64 / ROWS, 1.1, refused["affordable_steps"] + 1, DELTA)
    # the message says what to do: every device short, the steps it affords, and the ways out
    assert f"{poor} / {DATASET}: 200 steps cost epsilon" in problem["detail"] and f"it affords {refused['affordable_steps']} steps" in problem["detail"]
    assert rich not in problem["detail"] and "noise_multiplier" in problem["detail"] and "privacy-budgets" in problem["detail"]
    assert fleet.hub.snapshot() == before
    # no budget at all is no budget to spend
    r = fleet.hub.request("POST", "/tasks", Role.OPERATOR, json={
        "type": "incremental_training", "spec": {"model": {"name": "digits"}, "dataset": DATASET, "epochs": 1}, "placement": {"ids": [none]},
    })  # fmt: skip
    assert assert_problem(r, 409, "privacy_budget_exceeded")["targets"][0]["reason"] == "no privacy budget is set for this dataset"
    assert fleet.hub.snapshot() == before


def test_training_stops_before_the_budget_is_spent(fleet: TaskFleet) -> None:
    # Prepare: budget epsilon 2; the task asks for 100 epochs but may spend at most epsilon 2
    gw = fleet.node()
    model = upload_model(fleet)
    device = keeping_device(fleet, gw, model)
    set_budget(fleet, device, 2.0)
    q, sigma = 64 / ROWS, 1.1

    # Execute
    task = train(fleet, [device], epochs=100, epsilon=2.0)
    fleet.tick()
    (worker,) = fleet.workers(task["id"])
    order = fleet.order_of(worker)

    # Assert: max_steps is the last step within epsilon 2 by the accountant, far below 100 epochs (1,094 steps)
    assert order.training is not None
    k = order.training.max_steps
    assert 0 < k < 1094
    assert reference_epsilon(q, sigma, k, DELTA) <= 2.0 < reference_epsilon(q, sigma, k + 1, DELTA)
    finish(fleet, worker, k)
    fleet.tick()
    assert fleet.task(task["id"])["state"] == "SUCCEEDED"
    spent = budgets(fleet, device)[DATASET]
    assert spent["spent"] <= 2.0 and spent["spent"] == pytest.approx(reference_epsilon(q, sigma, k, DELTA), rel=1e-12)
    # nothing is left for another step: the next task is refused
    again = fleet.hub.request("POST", "/tasks", Role.OPERATOR, json={
        "type": "incremental_training", "spec": {"model": {"name": "digits"}, "dataset": DATASET, "steps": 1, "noise_multiplier": 1.1}, "placement": {"ids": [device]},
    })  # fmt: skip
    assert assert_problem(again, 409, "privacy_budget_exceeded")["targets"][0]["affordable_steps"] == 0


def test_concurrent_admissions_cannot_overspend_a_budget(fleet: TaskFleet) -> None:
    gw = fleet.node()
    model = upload_model(fleet)
    device = keeping_device(fleet, gw, model)
    one = reference_epsilon(64 / ROWS, 1.1, 100, DELTA)
    set_budget(fleet, device, one * 1.2)  # room for one such task, not two
    barrier, answers = threading.Barrier(4), []

    def post() -> None:
        barrier.wait()
        answers.append(fleet.hub.request("POST", "/tasks", Role.OPERATOR, json={
            "type": "incremental_training", "spec": {"model": {"name": "digits"}, "dataset": DATASET, "steps": 100, "noise_multiplier": 1.1},
            "placement": {"ids": [device]},
        }))  # fmt: skip

    threads = [threading.Thread(target=post) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(r.status_code for r in answers) == [201, 409, 409, 409], [r.text for r in answers]
    budget = budgets(fleet, device)[DATASET]
    assert [s["state"] for s in budget["spends"]] == ["reserved"] and budget["remaining"] > 0


def test_a_lost_device_is_charged_its_reservation_and_retried_while_the_budget_allows(sqlite_fleet: TaskFleet) -> None:
    fleet = sqlite_fleet
    gw = fleet.node()
    model = upload_model(fleet)
    device = keeping_device(fleet, gw, model)
    q, sigma, steps = 64 / ROWS, 1.1, 100
    set_budget(fleet, device, reference_epsilon(q, sigma, 2 * steps, DELTA) * 1.01)  # two runs of 100 steps, not three
    task = train(fleet, [device], steps=steps)
    fleet.tick()
    (first,) = fleet.workers(task["id"])
    fleet.report(first, "RUNNING", items_done=30)

    # the device vanishes mid-training: LOST, charged all 100 reserved steps (it may have taken them), reserved again
    fleet.set_offline(device)
    fleet.tick()
    spends = budgets(fleet, device)[DATASET]["spends"]
    assert [(s["state"], s["steps"], s["worker_id"]) for s in spends] == [("spent", 100, first["id"]), ("reserved", 100, None)]
    fleet.set_online(device)
    fleet.tick(datetime.now(UTC) + timedelta(seconds=1))
    second = [w for w in fleet.workers(task["id"]) if w["id"] != first["id"]]
    assert [(w["target_id"], w["attempt"]) for w in second] == [(device, 2)]
    assert fleet.order_of(second[0]).training.max_steps == 100  # type: ignore[union-attr]
    finish(fleet, second[0], 100)
    fleet.tick()
    assert fleet.task(task["id"])["state"] == "SUCCEEDED"
    after = budgets(fleet, device)[DATASET]
    assert [s["state"] for s in after["spends"]] == ["spent", "spent"]
    assert after["spent"] == pytest.approx(reference_epsilon(q, sigma, 2 * steps, DELTA), rel=1e-12) and after["spent"] <= after["epsilon"]

    # a second task on the same device: the remaining budget does not allow its 100 steps
    refused = fleet.hub.request("POST", "/tasks", Role.OPERATOR, json={
        "type": "incremental_training", "spec": {"model": {"name": "digits"}, "dataset": DATASET, "steps": 100, "noise_multiplier": 1.1}, "placement": {"ids": [device]},
    })  # fmt: skip
    assert_problem(refused, 409, "privacy_budget_exceeded")


def test_rejected_and_canceled_workers_release_what_they_did_not_spend(sqlite_fleet: TaskFleet) -> None:
    fleet = sqlite_fleet
    gw = fleet.node()
    model = upload_model(fleet)
    a, b, offline = keeping_device(fleet, gw, model), keeping_device(fleet, gw, model), keeping_device(fleet, gw, model, online=False)
    for device in (a, b, offline):
        set_budget(fleet, device, 30.0)
    task = train(fleet, [a, b, offline], steps=100)
    fleet.tick()
    workers = {w["target_id"]: w for w in fleet.workers(task["id"])}
    assert set(workers) == {a, b}  # the offline device gets no worker
    fleet.report(workers[a], "REJECTED", detail="no dataset camera on this device")
    fleet.report(workers[b], "RUNNING", items_done=40)
    fleet.tick()
    assert [(s["state"], s["steps"]) for s in budgets(fleet, a)[DATASET]["spends"]] == [("released", 0)]
    assert fleet.worker_row(workers[a]["id"]).replaced_by == "-"  # REJECTED: not tried again
    fleet.act(task["id"], "cancel")
    assert [(s["state"], s["steps"]) for s in budgets(fleet, b)[DATASET]["spends"]] == [("spent", 40)]  # what it reported doing
    assert [(s["state"], s["steps"]) for s in budgets(fleet, offline)[DATASET]["spends"]] == [("released", 0)]
    assert budgets(fleet, offline)[DATASET]["remaining"] == 30.0


def test_admission_refuses_what_cannot_be_trained(sqlite_fleet: TaskFleet) -> None:
    fleet = sqlite_fleet
    gw = fleet.node()
    model = upload_model(fleet)
    keeps, plain = keeping_device(fleet, gw, model), fleet.device(gw)
    other = keeping_device(fleet, gw, model)
    for device in (keeps, other):
        set_budget(fleet, device, 10.0)
    cases = [
        ({"placement": {"ids": [keeps, plain]}}, "reports no dataset camera"),
        ({"spec": {"output": {"version": "2.0.0"}}, "placement": {"ids": [keeps, other]}}, "each publishes its own"),
        ({"spec": {"model": {"name": "digits", "version": "9.9.9"}}}, "not an artefact of this hub"),
        ({"spec": {"layer": "x"}}, "does not feed the last dense layer"),
        ({"spec": {"steps": 10, "epochs": 1}}, "not both"),
        ({"placement": {"target": "node"}}, "does not run on nodes"),
    ]
    for change, text in cases:
        spec = {"model": {"name": "digits"}, "dataset": DATASET, "steps": 10, **change.get("spec", {})}
        if "epochs" in spec:
            spec["epochs"] = 1
        body = {"type": "incremental_training", "spec": spec, "placement": change.get("placement", {"ids": [keeps]})}
        r = fleet.hub.request("POST", "/tasks", Role.OPERATOR, json=body)
        assert r.status_code == 422 and text in r.text, (change, r.text)


def test_a_layer_of_the_wrong_shape_or_too_many_steps_is_refused(sqlite_fleet: TaskFleet) -> None:
    fleet = sqlite_fleet
    gw = fleet.node()
    model = upload_model(fleet)
    device = keeping_device(fleet, gw, model)
    set_budget(fleet, device, 30.0)
    task = train(fleet, [device], steps=50, attempts=1)
    fleet.tick()
    (worker,) = fleet.workers(task["id"])
    fleet.report(worker, "RUNNING")
    features, classes = layer_shape()
    send_layer(fleet, worker, 50, {"weight": np.zeros((features, classes + 1), np.float32), "bias": np.zeros(classes + 1, np.float32)})
    send_layer(fleet, worker, 51)
    assert fleet.ingest.counters["task_output_malformed"] == 2
    fleet.report(worker, "SUCCEEDED", items_done=50)  # without an accepted layer: FAILED, nothing published
    fleet.tick()
    done = fleet.task(task["id"])
    assert done["state"] == "FAILED" and outputs(fleet, task["id"])["artifacts"] == []
    assert fleet.workers(task["id"])[0]["detail"] == "reported SUCCEEDED but its trained layer never arrived"
    assert [(s["state"], s["steps"]) for s in budgets(fleet, device)[DATASET]["spends"]] == [("spent", 50)]



def test_retry_reserves_again_and_deleting_a_task_keeps_what_it_spent(sqlite_fleet: TaskFleet) -> None:
    fleet = sqlite_fleet
    gw = fleet.node()
    model = upload_model(fleet)
    device = keeping_device(fleet, gw, model)
    q, sigma = 64 / ROWS, 1.1
    set_budget(fleet, device, reference_epsilon(q, sigma, 150, DELTA))  # 100 steps, then 50 more at most
    task = train(fleet, [device], steps=100, attempts=1)
    fleet.tick()
    (worker,) = fleet.workers(task["id"])
    fleet.report(worker, "RUNNING", items_done=60)
    fleet.report(worker, "FAILED", detail="out of memory", items_done=60)
    fleet.tick()
    assert fleet.task(task["id"])["state"] == "FAILED"
    assert [(s["state"], s["steps"]) for s in budgets(fleet, device)[DATASET]["spends"]] == [("spent", 60)]

    # a retry asks for its 100 steps again: 60 + 100 exceed the budget, refused, the task stays FAILED
    before = fleet.hub.snapshot()
    assert_problem(fleet.hub.request("POST", f"/tasks/{task['id']}/retry", Role.OPERATOR), 409, "privacy_budget_exceeded")
    assert fleet.hub.snapshot() == before
    # with a larger budget the retry reserves and runs
    set_budget(fleet, device, 30.0)
    assert fleet.act(task["id"], "retry")["state"] == "PENDING"
    fleet.tick()
    second = [w for w in fleet.workers(task["id"]) if w["id"] != worker["id"]]
    assert len(second) == 1 and fleet.order_of(second[0]).training.max_steps == 100  # type: ignore[union-attr]
    finish(fleet, second[0], 100)
    fleet.tick()
    assert fleet.task(task["id"])["state"] == "SUCCEEDED"
    spent = budgets(fleet, device)[DATASET]
    assert [(s["state"], s["steps"]) for s in spent["spends"]] == [("spent", 60), ("spent", 100)]

    # the artefacts the task trains with stay while it exists; deleting it removes its records, never what it spent
    assert_problem(fleet.hub.request("DELETE", f"/artifacts/{model.id}", Role.OPERATOR), 409, "artifact_in_use")
    assert fleet.hub.request("DELETE", f"/tasks/{task['id']}", Role.OPERATOR).status_code == 204
    after = budgets(fleet, device)[DATASET]
    assert after["spent"] == pytest.approx(spent["spent"]) and [s["task_id"] for s in after["spends"]] == [task["id"]] * 2
    assert fleet.hub.request("DELETE", f"/artifacts/{model.id}", Role.OPERATOR).status_code == 204


def test_a_task_whose_own_epsilon_cuts_its_epochs_says_so_in_its_state_and_log(fleet: TaskFleet) -> None:
    gw = fleet.node()
    model = upload_model(fleet)
    device = keeping_device(fleet, gw, model)
    set_budget(fleet, device, 50.0)

    # 20 epochs ask for ceil(20 / q) steps; an epsilon of 2 affords fewer
    r = fleet.hub.request("POST", "/tasks", Role.OPERATOR, json={
        "type": "incremental_training", "spec": {"model": {"name": "digits"}, "dataset": DATASET, "epochs": 20, "epsilon": 2.0, "noise_multiplier": 1.1},
        "placement": {"ids": [device]},
    })  # fmt: skip
    assert r.status_code == 201, r.text
    task = r.json()
    asked = math.ceil(20 / (64 / ROWS))
    assert task["reason"].startswith("its epsilon 2 cuts the 20 epochs it asks for: ") and f"{device} trains " in task["reason"], task["reason"]
    assert f"of the {asked} steps" in task["reason"]
    logs = fleet.hub.get(f"/tasks/{task['id']}/logs").json()["items"]
    assert any("cuts the 20 epochs" in line["text"] and line["level"] == "warning" for line in logs)
