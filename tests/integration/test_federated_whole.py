"""Whole-model federated rounds with users' algorithms, end to end (issue 19): hub + brokers + an edge process,
three devices in this process that are training sites with their own digits (``device.datasets``).

* Heterogeneous frameworks in one job: two participants run the PyTorch example, one (labelled ``fw=numpy``, a
  variant of the task) the numpy example; each uploads its update through its edge's relay; the hub fuses them
  tensor by tensor, by name. The published parameters equal FedAvg of the three stored updates computed here with
  numpy (weights: the examples each fit reported) within 1e-6, and each participant's last update stays stored.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load, save

from device.algorithm.package import build
from examples.algorithms.digits import write_digits
from tests.integration.devstack import DevStack, api, upload_artifact
from tests.support import wait_for

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "algorithms"
FINAL = {"SUCCEEDED", "FAILED", "CANCELED", "TIMED_OUT"}


def _upload_algorithm(stack: DevStack, source: Path, tmp_path: Path) -> dict[str, Any]:
    manifest = json.loads((source / "algorithm.json").read_text())
    package = build(source, tmp_path / f"built-{source.name}")
    return upload_artifact(stack, package.read_bytes(), "algorithm", manifest["name"], manifest["version"], "zip")


def _initial_parameters(stack: DevStack, tmp_path: Path) -> dict[str, Any]:
    """The numpy example's initial parameters (the PyTorch example has the same names and shapes), as a model."""
    import sys

    sys.path.insert(0, str(EXAMPLES / "numpy_cnn"))
    try:
        from numpy_cnn.client import NumpyCNN
    finally:
        sys.path.remove(str(EXAMPLES / "numpy_cnn"))
    train, _ = write_digits(tmp_path / "init-data")
    initial = NumpyCNN({"seed": 0, "epochs": 1, "learning_rate": 0.05, "batch_size": 32}, {"train": train}).initial_parameters()
    return upload_artifact(stack, save(initial), "model", "digits-cnn-initial", "1.0.0", "safetensors")


def _content(stack: DevStack, artifact_id: str) -> bytes:
    with stack.hub.client("viewer") as client:
        r = client.get(f"/artifacts/{artifact_id}/content")
        assert r.status_code == 200, r.text
        return r.content


def test_two_pytorch_sites_and_a_numpy_one_train_one_network_and_the_hub_fuses_it_by_name_as_numpy_does(stack: DevStack, tmp_path: Path) -> None:
    # Prepare: both examples stored; three devices with shards of different sizes; one labelled for the numpy variant
    torch_alg = _upload_algorithm(stack, EXAMPLES / "torch_cnn", tmp_path)
    numpy_alg = _upload_algorithm(stack, EXAMPLES / "numpy_cnn", tmp_path)
    initial = _initial_parameters(stack, tmp_path)
    devices, sizes = [], {}
    for k, fraction in enumerate((0.2, 0.5, 0.7)):
        train, test = write_digits(tmp_path / f"site-{k}", test_fraction=fraction, seed=k)
        device = stack.add_device(f"site-{k}")
        device.datasets.add("digits-train", train)
        device.datasets.add("digits-test", test)
        devices.append(device)
        sizes[device.device_id] = len(np.load(train)["y"])
    numpy_site = devices[2].device_id
    api(stack, "PATCH", f"/devices/{numpy_site}", json={"labels": {"fw": "numpy"}})
    for device in devices:
        wait_for(lambda d=device: stack.device_state(d.device_id) == "ONLINE", 60, what="the device ONLINE")

    # Execute: one whole-model FedAvg round over the three
    spec = {
        "algorithm": {"name": torch_alg["name"], "version": torch_alg["version"]},
        "variants": [{"selector": "fw=numpy", "algorithm": {"name": numpy_alg["name"], "version": numpy_alg["version"]}}],
        "datasets": {"train": "digits-train", "test": "digits-test"}, "config": {"epochs": 1}, "initial_parameters": initial["id"],
        "rounds": 1, "min_participants": 3, "round_timeout_s": 240, "strategy": "fedavg",
    }  # fmt: skip
    task = api(stack, "POST", "/tasks", json={"type": "federated_training", "spec": spec, "heartbeat_s": 0.5,
                                             "placement": {"target": "device", "ids": [d.device_id for d in devices]}})  # fmt: skip
    done = wait_for(lambda: (t := api(stack, "GET", f"/tasks/{task['id']}", "viewer"))["state"] in FINAL and t, 300, interval=0.5, what="the task final")

    # Assert: SUCCEEDED; the published parameters are FedAvg of the three updates, by name
    logs = [line["text"] for line in api(stack, "GET", f"/tasks/{task['id']}/logs?limit=500", "viewer")["items"]]
    assert done["state"] == "SUCCEEDED", (done, logs[-30:])
    outputs = api(stack, "GET", f"/tasks/{task['id']}/outputs", "viewer")
    (published_id,) = outputs["artifacts"]
    published = api(stack, "GET", f"/artifacts/{published_id}", "viewer")
    assert (published["name"], published["version"], published["format"]) == (f"{torch_alg['name']}-parameters", torch_alg["version"], "safetensors")
    updates = {}
    for device in devices:
        (stored,) = api(stack, "GET", f"/artifacts?name=fl-update.{task['id']}.{device.device_id}", "viewer")["items"]
        updates[device.device_id] = load(_content(stack, stored["id"]))
    fused = load(_content(stack, published_id))
    total = sum(sizes.values())
    assert set(fused) == {"conv1.weight", "conv1.bias", "fc.weight", "fc.bias"}
    for name, array in fused.items():
        expected = sum(sizes[d] * updates[d][name].astype(np.float64) for d in updates) / total
        assert array.dtype == np.float32 and np.abs(array - expected).max() <= 1e-6, name
    # each site ran its own framework (the hub logs which algorithm each update came from), and the updates differ
    ran = {d.device_id: [line for line in logs if f"the update of {d.device_id} is in" in line] for d in devices}
    assert all(len(lines) == 1 for lines in ran.values()), ran
    assert numpy_alg["name"] in ran[numpy_site][0] and all(torch_alg["name"] in ran[d.device_id][0] for d in devices[:2]), ran
    assert not np.allclose(updates[devices[0].device_id]["fc.weight"], updates[numpy_site]["fc.weight"])
    rounds = api(stack, "GET", f"/tasks/{task['id']}/metrics?worker_id=hub", "viewer")
    assert rounds, rounds
