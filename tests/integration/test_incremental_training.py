"""Cloud training -> device incremental training with differential privacy -> device inference, end to end
(DESIGN §5, standard 7.3.1 d 1 and 6.3.2 c 3): hub + brokers + an edge process + an ``aisynergy device run``
process keeping a local dataset (``--dataset``).

1. The cloud trains a digits classifier (torch) and exports it to ONNX; it is uploaded and deployed (§8.2).
2. The device keeps its own images (seen one pixel off: the cloud model gets ~14 % of them right); only their
   description reaches the hub. An operator gives the device an (ε, δ) budget for them.
3. An ``incremental_training`` task: the hub cuts the model, the device trains the last layer with DP-SGD on
   its data and sends the layer back; the hub publishes ``digits 1.0.1`` and records ε spent.
4. ``digits 1.0.1`` is deployed like any model; the device's ``infer`` command now gets most images right.
"""

from __future__ import annotations

from pathlib import Path

import dp_accounting
import numpy as np
import pytest
from dp_accounting.rdp import RdpAccountant

from tests.dp_support import cloud_model, digits
from tests.integration.devstack import DevStack, api, create_deployment, upload_artifact, wait_deployment_final
from tests.support import AISYNERGY, start, stop, wait_for

FINAL = {"SUCCEEDED", "FAILED", "CANCELED", "TIMED_OUT"}
ROWS = 700


def _infer_accuracy(stack: DevStack, device_id: str, x: np.ndarray, y: np.ndarray) -> tuple[float, str]:
    """The device's ``infer`` command over every row (in messages of 100 rows): top-1 accuracy and the version that answered."""
    right, version = 0, ""
    for start_row in range(0, len(x), 100):
        answer = api(stack, "POST", f"/devices/{device_id}/commands", json={"name": "infer", "args": {"inputs": {"x": x[start_row : start_row + 100].tolist()}}, "timeout_s": 20})
        assert answer["ok"], answer
        logits = np.array(answer["result"]["outputs"]["logits"])
        right += int((logits.argmax(axis=1) == y[start_row : start_row + 100]).sum())
        version = answer["result"]["model"]["version"]
    return right / len(x), version


def _deploy(stack: DevStack, artifact_id: str, device_id: str) -> None:
    deployment = create_deployment(stack, artifact_id, {"ids": [device_id]})
    assert wait_deployment_final(stack, deployment["id"])["state"] == "SUCCEEDED"


def test_cloud_train_then_dp_fine_tune_on_the_device_then_infer(stack: DevStack, tmp_path: Path) -> None:
    d = digits()
    x, y = d.x_device[:ROWS], d.y_device[:ROWS]
    np.savez(tmp_path / "camera.npz", x=x, y=y)

    # the device, started with its local dataset
    device_id = api(stack, "POST", "/devices", json={"node_id": stack.node_id, "name": "cam-1", "model": "test-board"})["id"]
    issued = api(stack, "POST", f"/devices/{device_id}/bootstrap-token", json={})
    acl = stack.data / "devices-broker" / "acl"
    wait_for(lambda: acl.exists() and device_id in acl.read_text(), 60, what="the devices' broker knows the device")
    proc = start([*AISYNERGY, "device", "run", "--device-id", device_id, "--data-dir", str(stack.data / "cam-1"), *stack.enrolment_args(issued),
                  "--dataset", f"camera={tmp_path / 'camera.npz'}"], stack.data / "cam-1.log")  # fmt: skip
    try:
        wait_for(lambda: stack.device_state(device_id) == "ONLINE", 60, what="the device ONLINE")

        # 1. the cloud-trained model, deployed
        model = upload_artifact(stack, cloud_model(), "model", "digits", "1.0.0", "onnx")
        _deploy(stack, model["id"], device_id)
        before, version = _infer_accuracy(stack, device_id, x, y)
        assert version == "1.0.0" and before < 0.3, before

        # 2. the hub knows how many rows the device keeps, never the rows; an operator sets the budget
        twin = lambda: api(stack, "GET", f"/devices/{device_id}/twin", "viewer")["reported"].get("datasets", {})  # noqa: E731
        reported = wait_for(lambda: (t := twin()).get("camera", {}).get("rows") == ROWS and t, 60, what="the dataset reported")
        assert reported == {"camera": {"rows": ROWS, "shape": [64], "dtype": "float32"}}
        api(stack, "PUT", f"/devices/{device_id}/privacy-budgets/camera", json={"epsilon": 10.0, "delta": 1e-5})

        # 3. DP incremental training on the device
        spec = {"model": {"name": "digits"}, "dataset": "camera", "steps": 100, "batch_size": 64, "learning_rate": 0.5, "clip_norm": 1.0, "noise_multiplier": 1.0}
        task = api(stack, "POST", "/tasks", json={"type": "incremental_training", "spec": spec, "placement": {"ids": [device_id]}, "heartbeat_s": 0.5})
        done = wait_for(lambda: (t := api(stack, "GET", f"/tasks/{task['id']}", "viewer"))["state"] in FINAL and t, 120, interval=0.2, what="the training task final")
        assert done["state"] == "SUCCEEDED", done
        outputs = api(stack, "GET", f"/tasks/{task['id']}/outputs", "viewer")
        assert outputs["complete"] and len(outputs["artifacts"]) == 1
        (spend,) = outputs["privacy"]
        accountant = RdpAccountant()
        accountant.compose(dp_accounting.PoissonSampledDpEvent(64 / ROWS, dp_accounting.GaussianDpEvent(1.0)), 100)
        assert spend["state"] == "spent" and spend["steps"] == 100 and spend["epsilon"] == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-12)
        (budget,) = api(stack, "GET", f"/devices/{device_id}/privacy-budgets", "viewer")
        assert budget["spent"] == pytest.approx(spend["epsilon"], rel=1e-12) and budget["spent"] <= budget["epsilon"]
        metrics = api(stack, "GET", f"/tasks/{task['id']}/metrics", "viewer")["totals"]
        assert metrics["steps"] == 100 and metrics["train_accuracy"] > before
        published = api(stack, "GET", f"/artifacts/{outputs['artifacts'][0]}", "viewer")
        assert (published["kind"], published["name"], published["version"]) == ("model", "digits", "1.0.1")

        # 4. the new version rolled out like any model; inference on the device's own data does better
        _deploy(stack, published["id"], device_id)
        after, version = _infer_accuracy(stack, device_id, x, y)
        assert version == "1.0.1"
        assert after > before + 0.3, (before, after)
    finally:
        stop(proc)
