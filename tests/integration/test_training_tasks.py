"""Users' algorithms trained on an edge site through the hub, end to end (issue 18; standard 7.3.1 c/d with user code):
hub + brokers + an ``aisynergy edge run`` process started with its own datasets (``--dataset``), devices in this
process.

* Both example algorithms (PyTorch, numpy) are packaged, uploaded as signed ``algorithm`` artefacts and trained by a
  ``training`` task on the site's digits; the site publishes the ONNX export and the parameters through the chunked
  upload API with its publish grant; the ONNX, deployed to a device (§8.2), answers ``infer`` with the accuracy the
  site reported.
* The site is ``kill -9``ed mid-training and started again: it resumes from its last checkpoint, repeating fewer
  steps than the checkpoint interval, and the task SUCCEEDS.
* Each bad input: a configuration that fails the algorithm's schema (422, nothing stored), a framework no site has
  (PENDING with the reason), a tampered package (REJECTED on the site), an algorithm that raises, hangs, exceeds its
  memory or writes outside its directory (FAILED with the reason; the site keeps serving: a good task after them
  SUCCEEDS).
"""

from __future__ import annotations

import json
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from device.algorithm.package import build
from examples.algorithms.digits import write_digits
from tests.integration.devstack import DevStack, api, create_deployment, start_devstack, upload_artifact, wait_deployment_final
from tests.support import stop, wait_for

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "algorithms"
BEHAVE = ROOT / "tests" / "fixtures" / "algorithms" / "behave"
FINAL = {"SUCCEEDED", "FAILED", "CANCELED", "TIMED_OUT"}


@pytest.fixture
def site(tmp_path: Path) -> Iterator[DevStack]:
    """The stack with an edge that keeps the digits as datasets ``digits-train`` and ``digits-test`` (and a folder)."""
    train, test = write_digits(tmp_path / "site-data")
    s = start_devstack(tmp_path, f"sqlite:///{tmp_path / 'hub.db'}", edge_args=["--dataset", f"digits-train={train}", "--dataset", f"digits-test={test}"])
    try:
        yield s
    finally:
        s.close()


def _upload_algorithm(stack: DevStack, source: Path, tmp_path: Path) -> dict[str, Any]:
    manifest = json.loads((source / "algorithm.json").read_text())
    package = build(source, tmp_path / "built")
    return upload_artifact(stack, package.read_bytes(), "algorithm", manifest["name"], manifest["version"], "zip")


def _create(stack: DevStack, spec: dict[str, Any], **body: Any) -> dict[str, Any]:
    return api(stack, "POST", "/tasks", json={"type": "training", "spec": spec, "placement": {"target": "node"}, "heartbeat_s": 0.5, **body})  # type: ignore[no-any-return]


def _final(stack: DevStack, task_id: str, timeout: float = 240) -> dict[str, Any]:
    return wait_for(lambda: (t := api(stack, "GET", f"/tasks/{task_id}", "viewer"))["state"] in FINAL and t, timeout, interval=0.3, what="the task final")  # type: ignore[return-value]


def _workers(stack: DevStack, task_id: str) -> list[dict[str, Any]]:
    return api(stack, "GET", f"/tasks/{task_id}/workers", "viewer")  # type: ignore[no-any-return]


def _logs(stack: DevStack, task_id: str) -> list[str]:
    return [line["text"] for line in api(stack, "GET", f"/tasks/{task_id}/logs?limit=500", "viewer")["items"]]


def _infer_accuracy(stack: DevStack, device_id: str, x: np.ndarray, y: np.ndarray) -> float:
    right = 0
    for first in range(0, len(x), 100):
        answer = api(stack, "POST", f"/devices/{device_id}/commands", json={"name": "infer", "args": {"inputs": {"x": x[first : first + 100].tolist()}}, "timeout_s": 20})
        assert answer["ok"], answer
        right += int((np.array(answer["result"]["outputs"]["logits"]).argmax(axis=1) == y[first : first + 100]).sum())
    return right / len(x)


@pytest.mark.parametrize("example", ["torch_cnn", "numpy_cnn"])
def test_an_example_algorithm_trains_on_the_site_and_its_onnx_answers_on_a_device_with_the_reported_accuracy(
    site: DevStack, tmp_path: Path, example: str,
) -> None:  # fmt: skip
    # Prepare: the package stored and signed; a device under the edge
    algorithm = _upload_algorithm(site, EXAMPLES / example, tmp_path)
    device = site.add_device("cam-1")
    wait_for(lambda: site.device_state(device.device_id) == "ONLINE", 60, what="the device ONLINE")

    # Execute: train on the site's own digits
    spec = {"algorithm": {"name": algorithm["name"], "version": algorithm["version"]}, "datasets": {"train": "digits-train", "test": "digits-test"},
            "config": {"epochs": 2}, "steps": 4, "checkpoint_every": 2}  # fmt: skip
    task = _create(site, spec)
    assert task["spec"]["output"] == {"name": algorithm["name"], "version": algorithm["version"]}  # pinned at creation
    done = _final(site, task["id"])

    # Assert: SUCCEEDED on the site, published as two signed models, and the ONNX scores on the device as reported
    assert done["state"] == "SUCCEEDED", (done, _workers(site, task["id"]), _logs(site, task["id"])[-20:])
    (worker,) = _workers(site, task["id"])
    assert (worker["target_kind"], worker["target_id"]) == ("node", site.node_id)
    outputs = api(site, "GET", f"/tasks/{task['id']}/outputs", "viewer")
    (trained,) = outputs["trained"]
    assert outputs["complete"] and trained["steps"] == 4 and trained["resumed_from"] == 0
    assert outputs["artifacts"] == [trained["onnx"], trained["parameters"]]
    onnx = api(site, "GET", f"/artifacts/{trained['onnx']}", "viewer")
    parameters = api(site, "GET", f"/artifacts/{trained['parameters']}", "viewer")
    assert (onnx["kind"], onnx["name"], onnx["version"], onnx["format"]) == ("model", algorithm["name"], algorithm["version"], "onnx")
    assert (parameters["name"], parameters["format"]) == (f"{algorithm['name']}-parameters", "safetensors")
    assert onnx["signed_manifest"]["signature"]
    reported = trained["metrics"]["accuracy"]
    assert reported > 0.5, trained
    deployment = create_deployment(site, trained["onnx"], {"ids": [device.device_id]})
    assert wait_deployment_final(site, deployment["id"])["state"] == "SUCCEEDED"
    test = np.load(tmp_path / "site-data" / "test.npz")
    assert abs(_infer_accuracy(site, device.device_id, test["x"], test["y"]) - reported) <= 0.005


def test_a_device_trains_with_its_own_datasets_publishes_through_its_edge_and_its_onnx_answers_as_reported(site: DevStack, tmp_path: Path) -> None:
    # Prepare: a device that keeps the digits as two local datasets (the edge keeps its own; this task does not use them)
    algorithm = _upload_algorithm(site, EXAMPLES / "numpy_cnn", tmp_path)
    train, test = write_digits(tmp_path / "device-data", seed=1)
    device = site.add_device("trainer-1")
    device.datasets.add("train-set", train)
    device.datasets.add("test-set", test)
    wait_for(lambda: site.device_state(device.device_id) == "ONLINE", 60, what="the device ONLINE")

    # Execute
    spec = {"algorithm": {"name": algorithm["name"], "version": algorithm["version"]}, "datasets": {"train": "train-set", "test": "test-set"},
            "config": {"epochs": 2}, "steps": 3, "checkpoint_every": 1}  # fmt: skip
    task = _create(site, spec, placement={"target": "device", "ids": [device.device_id]})
    done = _final(site, task["id"])

    # Assert: trained on the device, published through its edge, deployed back to it and scoring as reported there
    assert done["state"] == "SUCCEEDED", (done, _workers(site, task["id"]), _logs(site, task["id"])[-20:])
    (worker,) = _workers(site, task["id"])
    assert (worker["target_kind"], worker["target_id"]) == ("device", device.device_id)
    (trained,) = api(site, "GET", f"/tasks/{task['id']}/outputs", "viewer")["trained"]
    assert trained["steps"] == 3
    relayed = [line for line in (site.data / "edge.log").read_text().splitlines() if "relayed the commit of upload" in line]
    assert len(relayed) == 2 and all("201" in line for line in relayed), relayed  # the ONNX export and the parameters
    reported = trained["metrics"]["accuracy"]
    deployment = create_deployment(site, trained["onnx"], {"ids": [device.device_id]})
    assert wait_deployment_final(site, deployment["id"])["state"] == "SUCCEEDED"
    held = np.load(test)
    assert abs(_infer_accuracy(site, device.device_id, held["x"], held["y"]) - reported) <= 0.005


def test_a_site_killed_mid_training_resumes_from_its_checkpoint_and_the_task_succeeds(site: DevStack, tmp_path: Path) -> None:
    # Prepare: steps of 0.4 s, a checkpoint every 4
    algorithm = _upload_algorithm(site, BEHAVE, tmp_path)
    steps, every = 16, 4
    task = _create(site, {"algorithm": {"name": "behave", "version": "1.0.0"}, "config": {"delay_s": 0.4}, "steps": steps, "checkpoint_every": every},
                   worker_timeout_s=60)  # fmt: skip
    work = site.data / "edge" / "tasks" / "training" / task["id"] / "work"
    assert algorithm["kind"] == "algorithm"

    # Execute: kill -9 the site once it is past its first checkpoint and between two others, then start it again
    def between_checkpoints() -> bool:  # past the first checkpoint, well before the next (a step takes 0.4 s)
        n = len((work / "fits.log").read_text().split()) if (work / "fits.log").exists() else 0
        return n > every and n % every in (1, 2)

    wait_for(between_checkpoints, 120, interval=0.02, what="training between two checkpoints")
    assert site.edge is not None
    stop(site.edge, signal.SIGKILL)
    fitted = [int(s) for s in (work / "fits.log").read_text().split()]
    kept = work / "checkpoint" if (work / "checkpoint" / "state.json").exists() else work / "checkpoint.old"  # as the runner reads it
    checkpoint = json.loads((kept / "state.json").read_text())["step"]
    site.start_edge()
    done = _final(site, task["id"])

    # Assert: it resumed from the checkpoint it had, repeating fewer steps than the interval, and succeeded
    assert done["state"] == "SUCCEEDED", (done, _workers(site, task["id"]), _logs(site, task["id"])[-20:])
    (trained,) = api(site, "GET", f"/tasks/{task['id']}/outputs", "viewer")["trained"]
    assert trained["resumed_from"] == checkpoint and checkpoint % every == 0 and checkpoint >= every
    repeated = max(fitted) - checkpoint
    assert 0 <= repeated < every, (fitted, checkpoint)
    assert trained["steps"] == steps
    assert any(f"resumed from the checkpoint of step {checkpoint}" in line for line in _logs(site, task["id"]))
    assert not work.exists()  # the site's checkpoints are gone once the result is published


def _variant(tmp_path: Path, name: str, **manifest: Any) -> Path:
    source = tmp_path / name
    shutil.copytree(BEHAVE, source)
    doc = json.loads((source / "algorithm.json").read_text())
    (source / "algorithm.json").write_text(json.dumps({**doc, "name": name, **manifest}))
    return source


def _blob(stack: DevStack, sha256: str) -> Path:
    path = stack.hub.data_dir / "artifacts" / sha256[:2] / sha256[2:]  # the hub's blob store
    assert path.is_file(), path
    return path


def test_each_bad_input_gets_its_answer_end_to_end_and_the_site_keeps_serving(site: DevStack, tmp_path: Path) -> None:
    behave = {"name": "behave", "version": "1.0.0"}
    _upload_algorithm(site, BEHAVE, tmp_path)
    before = len(api(site, "GET", "/tasks", "viewer")["items"])

    # a configuration that fails the algorithm's schema: 422 naming the path, nothing stored
    with site.hub.client("operator") as client:
        r = client.post("/tasks", json={"type": "training", "spec": {"algorithm": behave, "config": {"mode": "dance", "delay_s": 99}, "steps": 2},
                                        "placement": {"target": "node"}})  # fmt: skip
    assert r.status_code == 422, r.text
    assert "config_schema" in r.json()["detail"] and {tuple(e["loc"][-1:]) for e in r.json()["errors"]} == {("mode",), ("delay_s",)}
    assert len(api(site, "GET", "/tasks", "viewer")["items"]) == before

    # a framework no site has: PENDING, saying which site lacks what
    _upload_algorithm(site, _variant(tmp_path, "needs-jax", frameworks={"jax": ">=0.4"}), tmp_path)
    pending = _create(site, {"algorithm": {"name": "needs-jax", "version": "1.0.0"}, "steps": 1})
    waiting = wait_for(lambda: (t := api(site, "GET", f"/tasks/{pending['id']}", "viewer"))["reason"] and t, 30, what="a reason")
    assert waiting["state"] == "PENDING" and "jax >=0.4 (not installed)" in waiting["reason"] and site.node_id in waiting["reason"]
    api(site, "POST", f"/tasks/{pending['id']}/cancel")

    # a tampered package: the site verifies it before use and REJECTS the worker
    tampered = _upload_algorithm(site, _variant(tmp_path, "tampered"), tmp_path)
    blob = _blob(site, tampered["sha256"])
    blob.chmod(0o644)
    blob.write_bytes(blob.read_bytes() + b"\0")
    task = _create(site, {"algorithm": {"name": "tampered", "version": "1.0.0"}, "steps": 1})
    rejected = wait_for(lambda: [w for w in _workers(site, task["id"]) if w["state"] == "REJECTED"], 60, what="the worker REJECTED")
    assert "do not verify" in rejected[0]["detail"], rejected  # type: ignore[index]
    api(site, "POST", f"/tasks/{task['id']}/cancel")

    # an algorithm that misbehaves: FAILED with the reason
    cases = [
        ({"mode": "raise", "at_step": 2}, {}, ["raised: ", "ValueError: the labels do not fit the model"]),
        ({"mode": "hang"}, {"timeout_s": 4}, ["timeout: ", "timeout of 4 s"]),
        ({"mode": "memory"}, {"memory_bytes": 256 << 20}, ["memory: ", "memory limit of 256 MiB"]),
        ({"mode": "write_outside", "path": str(tmp_path / "escaped.txt")}, {}, ["forbidden_write: "]),
    ]
    for config, limits, says in cases:
        task = _create(site, {"algorithm": behave, "config": config, "steps": 3, "limits": limits}, retry={"max_attempts": 1})
        done = _final(site, task["id"], 120)
        (worker,) = _workers(site, task["id"])
        assert done["state"] == "FAILED" and worker["state"] == "FAILED", (config, done, worker)
        assert all(s in worker["detail"] for s in says), (config, worker["detail"])
    assert not (tmp_path / "escaped.txt").exists()

    # the site is unharmed: ONLINE, and a good task after them succeeds
    assert api(site, "GET", f"/nodes/{site.node_id}/status", "viewer")["state"] == "ONLINE"
    good = _create(site, {"algorithm": behave, "steps": 2})
    assert _final(site, good["id"])["state"] == "SUCCEEDED"


def test_the_edge_reports_the_rows_of_its_npz_datasets_which_bound_what_its_updates_may_count(site: DevStack, tmp_path: Path) -> None:
    train = np.load(tmp_path / "site-data" / "train.npz")
    test = np.load(tmp_path / "site-data" / "test.npz")

    def described() -> dict[str, Any] | None:
        reported = api(site, "GET", f"/nodes/{site.node_id}/twin", "viewer")["reported"]
        return reported.get("datasets") or None

    # the node reports with each desired document it is sent (a task placed on it sends one; here: a twin update)
    api(site, "PUT", f"/nodes/{site.node_id}/twin", json={"desired": {"note": "describe yourself"}})
    datasets = wait_for(described, 60, what="the node's reported datasets")
    assert datasets == {"digits-test": {"rows": len(test["y"]), "shape": [1, 8, 8], "dtype": "float32"},
                        "digits-train": {"rows": len(train["y"]), "shape": [1, 8, 8], "dtype": "float32"}}  # fmt: skip
