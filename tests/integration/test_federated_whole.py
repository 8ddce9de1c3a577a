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


def _log_items(stack: DevStack, task_id: str) -> list[dict[str, Any]]:
    """Every log line of the task, oldest first (page after page: a busy site writes more than a page)."""
    items: list[dict[str, Any]] = []
    while True:
        page = api(stack, "GET", f"/tasks/{task_id}/logs?limit=500" + (f"&after={items[-1]['id']}" if items else ""), "viewer")
        items += page["items"]
        if page["next_cursor"] is None:
            return items


def _logs(stack: DevStack, task_id: str) -> list[str]:
    return [line["text"] for line in _log_items(stack, task_id)]


def _digits_sites(stack: DevStack, tmp_path: Path, n: int = 3, test: bool = False) -> list[Any]:
    """``n`` devices ONLINE, each a site keeping its own shuffle of the digits (``digits-train``; ``digits-test`` too)."""
    devices = []
    for k in range(n):
        train, held_out = write_digits(tmp_path / f"site-{k}", seed=k)
        device = stack.add_device(f"site-{k}")
        device.datasets.add("digits-train", train)
        if test:
            device.datasets.add("digits-test", held_out)
        devices.append(device)
    for device in devices:
        _ready(stack, device)
    return devices


def _published(stack: DevStack, algorithm: dict[str, Any], initial: dict[str, Any], devices: list[Any], **spec: Any) -> tuple[str, dict[str, np.ndarray]]:
    """Run a whole-model FedAvg task of ``algorithm`` (one epoch a round, every device a participant, ``spec`` on top)
    to SUCCEEDED: its id and its published parameters."""
    spec = {"algorithm": {"name": algorithm["name"], "version": algorithm["version"]}, "datasets": {"train": "digits-train"}, "config": {"epochs": 1},
            "initial_parameters": initial["id"], "min_participants": len(devices), "round_timeout_s": 120, **spec}  # fmt: skip
    task = api(stack, "POST", "/tasks", json={"type": "federated_training", "spec": spec, "heartbeat_s": 0.5,
                                             "placement": {"target": "device", "ids": [d.device_id for d in devices]}})  # fmt: skip
    done = wait_for(lambda: (t := api(stack, "GET", f"/tasks/{task['id']}", "viewer"))["state"] in FINAL and t, 300, interval=0.5, what="the task final")
    assert done["state"] == "SUCCEEDED", (done, _logs(stack, task["id"])[-30:])
    (artifact_id,) = api(stack, "GET", f"/tasks/{task['id']}/outputs", "viewer")["artifacts"]
    return task["id"], load(_content(stack, artifact_id))


def _ready(stack: DevStack, device: Any) -> None:
    """The device ONLINE, and its heartbeat in: it is placed only once the hub knows it has the algorithm's frameworks."""
    wait_for(lambda: stack.device_state(device.device_id) == "ONLINE", 60, what="the device ONLINE")
    wait_for(lambda: ((api(stack, "GET", f"/devices/{device.device_id}/status", "viewer").get("resources") or {}).get("frameworks") or {}).get("numpy"), 60,
             what="the device's frameworks reported")  # fmt: skip


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
        _ready(stack, device)

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
    logs = _logs(stack, task["id"])
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


def test_a_site_stopped_mid_round_is_not_waited_for_and_rejoins_from_the_new_global_model(stack: DevStack, tmp_path: Path) -> None:
    # Prepare: three numpy sites; the one labelled slow=yes trains for long in its round (a variant's configuration)
    algorithm = _upload_algorithm(stack, EXAMPLES / "numpy_cnn", tmp_path)
    initial = _initial_parameters(stack, tmp_path)
    devices = _digits_sites(stack, tmp_path, test=True)
    slow = devices[2]
    api(stack, "PATCH", f"/devices/{slow.device_id}", json={"labels": {"slow": "yes"}})
    ref = {"name": algorithm["name"], "version": algorithm["version"]}
    spec = {"algorithm": ref, "variants": [{"selector": "slow=yes", "algorithm": ref, "config": {"epochs": 200, "batch_size": 4}}], "datasets": {"train": "digits-train"},
            "config": {"epochs": 1}, "initial_parameters": initial["id"], "rounds": 3, "min_participants": 2, "round_timeout_s": 20}  # fmt: skip

    # Execute: the slow site is stopped while it trains round 1 and loses the label (its next rounds are quick); round 1
    # closes at its deadline without it, and it comes back
    task = api(stack, "POST", "/tasks", json={"type": "federated_training", "spec": spec, "heartbeat_s": 0.5, "retry": {"backoff_s": 0.5, "max_attempts": 5},
                                             "placement": {"target": "device", "ids": [d.device_id for d in devices]}})  # fmt: skip
    logs = lambda: _logs(stack, task["id"])  # noqa: E731
    wait_for(lambda: sum("round 1: the update of" in line for line in logs()) == 2, 120, interval=0.5, what="the two quick sites' round 1 updates")
    slow.stop()
    api(stack, "PATCH", f"/devices/{slow.device_id}", json={"labels": {}})
    wait_for(lambda: any("round 1 closed with 2 of 3 participants" in line for line in logs()), 120, interval=0.5, what="round 1 closed without the slow site")
    stack.restart_device(slow)
    done = wait_for(lambda: (t := api(stack, "GET", f"/tasks/{task['id']}", "viewer"))["state"] in FINAL and t, 240, interval=0.5, what="the task final")

    # Assert: the task went on and SUCCEEDED; the stopped site took part again, from a later round's global model
    lines = logs()
    assert done["state"] == "SUCCEEDED", (done, lines[-30:])
    assert any("round 1 closed with 2 of 3 participants" in line for line in lines), [x for x in lines if x.startswith("[hub]")]
    rejoined = [line for line in lines if f"the update of {slow.device_id} is in" in line]
    assert rejoined and not any("round 1:" in line for line in rejoined), lines[-30:]
    history = [s["values"] for s in api(stack, "GET", f"/tasks/{task['id']}/metrics?series=true&worker=hub", "viewer")["series"]]
    assert [int(r["round"]) for r in history] == [1, 2, 3]
    assert (history[0]["participants"], history[0]["contributors"]) == (3, 2)
    assert any(r["contributors"] == 3 for r in history[1:]), history
    assert all(r["bytes_up"] > 0 and r["bytes_down"] > 0 for r in history), history


def _accuracy(parameters: dict[str, np.ndarray], test: Path) -> float:
    import sys

    sys.path.insert(0, str(EXAMPLES / "numpy_cnn"))
    try:
        from numpy_cnn.client import NumpyCNN
    finally:
        sys.path.remove(str(EXAMPLES / "numpy_cnn"))
    data = np.load(test)
    client = NumpyCNN({"seed": 0, "epochs": 1, "learning_rate": 0.05, "batch_size": 32}, {"train": test})
    return float((client.predict(parameters, data["x"]).argmax(axis=1) == data["y"]).mean())


def test_int8_updates_with_error_feedback_train_as_well_as_fp32_for_far_fewer_bytes(stack: DevStack, tmp_path: Path) -> None:
    # Prepare: three numpy sites with non-IID shards (each mostly a third of the classes); a held-out test set here
    algorithm = _upload_algorithm(stack, EXAMPLES / "numpy_cnn", tmp_path)
    initial = _initial_parameters(stack, tmp_path)
    train, test = write_digits(tmp_path / "all")
    data = np.load(train)
    devices = []
    for k in range(3):
        rows = np.flatnonzero((data["y"] % 3 == k) | (np.arange(len(data["y"])) % 5 == 0))
        np.savez(tmp_path / f"shard-{k}.npz", x=data["x"][rows], y=data["y"][rows])
        device = stack.add_device(f"site-{k}")
        device.datasets.add("digits-train", tmp_path / f"shard-{k}.npz")
        devices.append(device)
    for device in devices:
        _ready(stack, device)

    # Execute: the same task in fp32 and in int8
    results = {}
    for kind in ("none", "int8"):
        spec = {"algorithm": {"name": algorithm["name"], "version": algorithm["version"]}, "datasets": {"train": "digits-train"}, "config": {"epochs": 1},
                "initial_parameters": initial["id"], "rounds": 4, "min_participants": 3, "round_timeout_s": 120, "compression": kind,
                "output": {"name": f"digits-{kind}"}}  # fmt: skip
        task = api(stack, "POST", "/tasks", json={"type": "federated_training", "spec": spec, "heartbeat_s": 0.5,
                                                 "placement": {"target": "device", "ids": [d.device_id for d in devices]}})  # fmt: skip
        done = wait_for(lambda: (t := api(stack, "GET", f"/tasks/{task['id']}", "viewer"))["state"] in FINAL and t, 300, interval=0.5, what="the task final")
        assert done["state"] == "SUCCEEDED", done
        (published,) = api(stack, "GET", f"/tasks/{task['id']}/outputs", "viewer")["artifacts"]
        history = [s["values"] for s in api(stack, "GET", f"/tasks/{task['id']}/metrics?series=true&worker=hub", "viewer")["series"]]
        results[kind] = (_accuracy(load(_content(stack, published)), test), sum(r["bytes_up"] for r in history) / len(history))

    # Assert: within a point of fp32, with about a quarter of the bytes up per round (the files' headers weigh on a model
    # of 2.6k parameters: a third here)
    (fp32, fp32_bytes), (int8, int8_bytes) = results["none"], results["int8"]
    assert fp32 > 0.8, results
    assert abs(int8 - fp32) <= 0.01, results
    assert int8_bytes < 0.4 * fp32_bytes, results


def test_async_rounds_never_wait_for_a_site_ten_times_slower_and_fold_its_late_updates_at_the_documented_weight(stack: DevStack, tmp_path: Path) -> None:
    # Prepare: three numpy sites; the one labelled slow=yes takes about ten times as long a round (a variant's configuration)
    algorithm = _upload_algorithm(stack, EXAMPLES / "numpy_cnn", tmp_path)
    initial = _initial_parameters(stack, tmp_path)
    devices = _digits_sites(stack, tmp_path)
    slow = devices[2]
    api(stack, "PATCH", f"/devices/{slow.device_id}", json={"labels": {"slow": "yes"}})
    ref = {"name": algorithm["name"], "version": algorithm["version"]}
    spec = {"algorithm": ref, "variants": [{"selector": "slow=yes", "algorithm": ref, "config": {"epochs": 50, "batch_size": 8}}], "datasets": {"train": "digits-train"},
            "config": {"epochs": 1}, "initial_parameters": initial["id"], "rounds": 12, "min_participants": 2, "round_timeout_s": 300,
            "sync": "async", "buffer_size": 2, "max_staleness": 12}  # fmt: skip

    # Execute
    task = api(stack, "POST", "/tasks", json={"type": "federated_training", "spec": spec, "heartbeat_s": 0.5,
                                             "placement": {"target": "device", "ids": [d.device_id for d in devices]}})  # fmt: skip
    done = wait_for(lambda: (t := api(stack, "GET", f"/tasks/{task['id']}", "viewer"))["state"] in FINAL and t, 300, interval=0.5, what="the task final")

    # Assert: SUCCEEDED; no round waited for the slow site (each closed far sooner than its round deadline, most without
    # it); each of its updates that made it was folded late at n / sqrt(1 + staleness)
    items = _log_items(stack, task["id"])
    lines = [line["text"] for line in items]
    assert done["state"] == "SUCCEEDED", (done, lines[-30:])
    history = [s["values"] for s in api(stack, "GET", f"/tasks/{task['id']}/metrics?series=true&worker=hub", "viewer")["series"]]
    assert [int(r["round"]) for r in history] == list(range(1, 13))
    fit_s: dict[bool, list[float]] = {True: [], False: []}
    for line in items:
        if line["text"].startswith("round ") and " fit calls on " in line["text"]:
            fit_s[line["target_id"] == slow.device_id].append(float(line["text"].split(" examples in ")[1].split(" s")[0]))
    print(f"fit s quick {sorted(fit_s[False])}, slow {sorted(fit_s[True])}; round s {[round(r['round_s'], 2) for r in history]}")  # the figures, with -s
    assert fit_s[False] and fit_s[True] and min(fit_s[True]) > 3 * np.median(fit_s[False]), fit_s  # process starts weigh on the quick ones
    assert all(r["round_s"] < min(fit_s[True]) for r in history), (history, fit_s)  # no round waited for the slow site
    folded = [line for line in lines if f"folded the update of {slow.device_id}" in line]
    assert folded, [x for x in lines if x.startswith("[hub]")][-40:]
    for line in folded:
        staleness = int(line.split("(staleness ")[1].split(")")[0])
        weight, examples = (int(x) for x in (line.split(" at weight ")[1].split(" of its ")[0], line.split(" of its ")[1].split(" examples")[0]))
        assert staleness >= 1 and weight == max(1, round(examples / (1 + staleness) ** 0.5)), line
    assert sum(r["stale"] for r in history) >= len(folded)


def test_secure_aggregation_over_real_sites_fuses_what_the_same_task_without_it_does(stack: DevStack, tmp_path: Path) -> None:
    # Prepare: three numpy sites with shards of equal size (a first round weighs each the same either way); the example
    # trains deterministically from its seed, so both tasks train the same local models
    algorithm = _upload_algorithm(stack, EXAMPLES / "numpy_cnn", tmp_path)
    initial = _initial_parameters(stack, tmp_path)
    devices = _digits_sites(stack, tmp_path)

    # Execute: the same round with and without secure aggregation
    published, tasks = {}, {}
    for secure in (False, True):
        tasks[secure], published[secure] = _published(stack, algorithm, initial, devices, rounds=1, secure_aggregation=secure,
                                                      output={"name": f"digits-secure-{str(secure).lower()}"})  # fmt: skip

    # Assert: what each secure site uploaded is masked (uint32, not its parameters); the unmasked mean is the plain one
    for device in devices:
        (stored,) = api(stack, "GET", f"/artifacts?name=fl-update.{tasks[True]}.{device.device_id}", "viewer")["items"]
        assert all(array.dtype == np.uint32 for array in load(_content(stack, stored["id"])).values())
    assert set(published[True]) == set(published[False])
    for name, plain in published[False].items():
        assert published[True][name].dtype == plain.dtype and np.abs(published[True][name] - plain).max() <= 1e-4, name
    assert not np.allclose(published[False]["fc.weight"], load(_content(stack, initial["id"]))["fc.weight"])


def test_dp_fedavg_over_real_sites_uploads_clipped_updates_and_charges_each_devices_budget(stack: DevStack, tmp_path: Path) -> None:
    # Prepare: three numpy sites, each with a privacy budget for the dataset it trains on
    algorithm = _upload_algorithm(stack, EXAMPLES / "numpy_cnn", tmp_path)
    initial = _initial_parameters(stack, tmp_path)
    devices = _digits_sites(stack, tmp_path)
    for device in devices:
        api(stack, "PUT", f"/devices/{device.device_id}/privacy-budgets/digits-train", json={"epsilon": 100.0, "delta": 1e-5})
    clip = 0.5

    # Execute: one DP-FedAvg round
    spec = {"algorithm": {"name": algorithm["name"], "version": algorithm["version"]}, "datasets": {"train": "digits-train"}, "config": {"epochs": 1},
            "initial_parameters": initial["id"], "rounds": 1, "min_participants": 3, "round_timeout_s": 120, "dp": {"clip_norm": clip, "noise_multiplier": 0.5}}  # fmt: skip
    task = api(stack, "POST", "/tasks", json={"type": "federated_training", "spec": spec, "heartbeat_s": 0.5,
                                             "placement": {"target": "device", "ids": [d.device_id for d in devices]}})  # fmt: skip
    done = wait_for(lambda: (t := api(stack, "GET", f"/tasks/{task['id']}", "viewer"))["state"] in FINAL and t, 300, interval=0.5, what="the task final")

    # Assert: SUCCEEDED; what each site uploaded moved the initial model by at most the clip norm; each device charged one round
    assert done["state"] == "SUCCEEDED", (done, _logs(stack, task["id"])[-30:])
    start = load(_content(stack, initial["id"]))
    for device in devices:
        (stored,) = api(stack, "GET", f"/artifacts?name=fl-update.{task['id']}.{device.device_id}", "viewer")["items"]
        update = load(_content(stack, stored["id"]))
        norm = np.sqrt(sum(float(np.sum((update[k].astype(np.float64) - start[k]) ** 2)) for k in start))
        assert 0 < norm <= clip * (1 + 1e-4), norm
    outputs = api(stack, "GET", f"/tasks/{task['id']}/outputs", "viewer")
    assert sorted((s["device_id"], s["dataset"], s["state"], s["steps"]) for s in outputs["privacy"]) == sorted((d.device_id, "digits-train", "spent", 1) for d in devices)
    assert all(s["epsilon"] > 0 for s in outputs["privacy"])


def test_the_cross_site_evaluation_scores_the_global_and_every_local_model_on_every_sites_data_and_the_best_checked_round_is_published(
    stack: DevStack, tmp_path: Path,
) -> None:  # fmt: skip
    # Prepare: three numpy sites, each with its own train and test split
    algorithm = _upload_algorithm(stack, EXAMPLES / "numpy_cnn", tmp_path)
    initial = _initial_parameters(stack, tmp_path)
    devices = _digits_sites(stack, tmp_path, test=True)
    ids = sorted(d.device_id for d in devices)

    # Execute: two rounds, the global model checked after each, then the cross-site evaluation
    spec = {"algorithm": {"name": algorithm["name"], "version": algorithm["version"]}, "datasets": {"train": "digits-train", "test": "digits-test"},
            "config": {"epochs": 1}, "initial_parameters": initial["id"], "rounds": 2, "min_participants": 3, "round_timeout_s": 120, "cross_evaluation": True,
            "evaluate_every": 1}  # fmt: skip
    task = api(stack, "POST", "/tasks", json={"type": "federated_training", "spec": spec, "heartbeat_s": 0.5,
                                             "placement": {"target": "device", "ids": ids}})  # fmt: skip
    done = wait_for(lambda: (t := api(stack, "GET", f"/tasks/{task['id']}", "viewer"))["state"] in FINAL and t, 300, interval=0.5, what="the task final")

    # Assert: SUCCEEDED; the matrix has every cell (each site x the global model and each site's last local model)
    logs = _logs(stack, task["id"])
    assert done["state"] == "SUCCEEDED", (done, logs[-30:])
    outputs = api(stack, "GET", f"/tasks/{task['id']}/outputs", "viewer")
    cells = {(s["evaluator"], s["model"]): s for s in outputs["evaluation"]}
    assert set(cells) == {(e, m) for e in ids for m in ["global", *ids]}, sorted(cells)
    assert all(0 <= s["metrics"]["accuracy"] <= 1 and s["num_examples"] > 0 and s["loss"] is not None for s in cells.values())
    assert min(cells[(e, "global")]["metrics"]["accuracy"] for e in ids) > 0.5, cells
    assert any("cross-site evaluation done: 3 of 3 participants scored the 4 models" in line for line in logs), logs[-10:]
    # each round's global model was scored by the three sites; the better one is published, and the evaluation at the
    # end scores that very model: its weighted accuracy over the sites is the check's
    checks = outputs["rounds_scored"]
    assert [(c["round"], c["metric"], c["evaluators"]) for c in checks] == [(1, "accuracy", 3), (2, "accuracy", 3)], checks
    best = max(checks, key=lambda c: (c["value"], c["round"]))
    assert outputs["best_round"] == best["round"]
    (published,) = outputs["artifacts"]
    assert _content(stack, published) == _content(stack, best["artifact_id"])
    final = [cells[(e, "global")] for e in ids]
    weighted = sum(c["metrics"]["accuracy"] * c["num_examples"] for c in final) / sum(c["num_examples"] for c in final)
    assert abs(weighted - best["value"]) < 1e-9, (weighted, checks)
    assert sum("global model: scored 1 model on this site's data" in line for line in logs) == 6, logs[-20:]


def test_then_deploy_exports_the_published_model_as_onnx_and_its_canary_deployment_succeeds(stack: DevStack, tmp_path: Path) -> None:
    # Prepare: three numpy sites (the numpy example exports ONNX)
    algorithm = _upload_algorithm(stack, EXAMPLES / "numpy_cnn", tmp_path)
    initial = _initial_parameters(stack, tmp_path)
    devices = _digits_sites(stack, tmp_path)
    ids = sorted(d.device_id for d in devices)

    # Execute: one round, then the export and a canary deployment of it to the three devices
    then = {"target": {"kind": "device", "ids": ids}, "strategy": {"type": "canary", "percent": 34}, "timeout_s": 120}
    spec = {"algorithm": {"name": algorithm["name"], "version": algorithm["version"]}, "datasets": {"train": "digits-train"}, "config": {"epochs": 1},
            "initial_parameters": initial["id"], "rounds": 1, "min_participants": 3, "round_timeout_s": 120, "then_deploy": then, "output": {"name": "digits-deployed"}}  # fmt: skip
    task = api(stack, "POST", "/tasks", json={"type": "federated_training", "spec": spec, "heartbeat_s": 0.5, "placement": {"target": "device", "ids": ids}})
    done = wait_for(lambda: (t := api(stack, "GET", f"/tasks/{task['id']}", "viewer"))["state"] in FINAL and t, 300, interval=0.5, what="the task final")

    # Assert: SUCCEEDED; the outputs list the parameters, the ONNX export and the deployment, which SUCCEEDS
    logs = _logs(stack, task["id"])
    assert done["state"] == "SUCCEEDED", (done, logs[-30:])
    outputs = api(stack, "GET", f"/tasks/{task['id']}/outputs", "viewer")
    models = {a: api(stack, "GET", f"/artifacts/{a}", "viewer") for a in outputs["artifacts"]}
    assert sorted((m["name"], m["format"]) for m in models.values()) == [("digits-deployed", "onnx"), ("digits-deployed-parameters", "safetensors")]
    (deployment_id,) = outputs["deployments"]
    assert any(f"deployment {deployment_id}" in line and "canary" in line for line in logs), logs[-10:]
    deployment = wait_for(lambda: (d := api(stack, "GET", f"/deployments/{deployment_id}", "viewer"))["state"] in {"SUCCEEDED", "FAILED", "CANCELED", "ROLLED_BACK"} and d,
                          240, interval=0.5, what="the deployment final")  # fmt: skip
    assert deployment["state"] == "SUCCEEDED", deployment
    onnx = next(a for a, m in models.items() if m["format"] == "onnx")
    assert deployment["artifact_id"] == onnx and deployment["batches"] == 2, deployment


def test_fedprox_hands_its_mu_to_the_sites_algorithm_which_keeps_each_update_near_the_global_model(stack: DevStack, tmp_path: Path) -> None:
    # Prepare: two numpy sites (the example adds mu/2 ||w - w_global||^2 to its loss when fit's config has proximal_mu)
    algorithm = _upload_algorithm(stack, EXAMPLES / "numpy_cnn", tmp_path)
    initial = _initial_parameters(stack, tmp_path)
    start = load(_content(stack, initial["id"]))
    ids = sorted(d.device_id for d in _digits_sites(stack, tmp_path, n=2))

    # Execute: the same round as FedAvg and as FedProx with a large mu
    moved = {}
    for strategy, params in (("fedavg", {}), ("fedprox", {"mu": 20.0})):
        spec = {"algorithm": {"name": algorithm["name"], "version": algorithm["version"]}, "datasets": {"train": "digits-train"}, "config": {"epochs": 1},
                "initial_parameters": initial["id"], "rounds": 1, "min_participants": 2, "round_timeout_s": 120, "strategy": strategy, "strategy_params": params,
                "output": {"name": f"digits-{strategy}"}}  # fmt: skip
        task = api(stack, "POST", "/tasks", json={"type": "federated_training", "spec": spec, "heartbeat_s": 0.5, "placement": {"target": "device", "ids": ids}})
        done = wait_for(lambda t=task: (d := api(stack, "GET", f"/tasks/{t['id']}", "viewer"))["state"] in FINAL and d, 300, interval=0.5, what="the task final")
        assert done["state"] == "SUCCEEDED", (done, _logs(stack, task["id"])[-20:])
        (published,) = api(stack, "GET", f"/tasks/{task['id']}/outputs", "viewer")["artifacts"]
        fused = load(_content(stack, published))
        moved[strategy] = float(np.sqrt(sum(float(((fused[k].astype(np.float64) - start[k]) ** 2).sum()) for k in start)))

    # Assert: FedProx's round moved the global model far less than FedAvg's (both fuse as FedAvg: the difference is mu)
    assert moved["fedprox"] < 0.5 * moved["fedavg"], moved


def test_hierarchical_rounds_hand_the_devices_updates_to_their_edge_which_uploads_one_weighted_mean_equal_to_the_flat_fusion(
    stack: DevStack, tmp_path: Path
) -> None:
    # Prepare: three numpy sites behind the stack's edge, shards of different sizes (the mean is weighted); the example
    # trains deterministically from its seed, so the flat and the hierarchical task train the same local models
    algorithm = _upload_algorithm(stack, EXAMPLES / "numpy_cnn", tmp_path)
    initial = _initial_parameters(stack, tmp_path)
    devices = []
    for k, fraction in enumerate((0.2, 0.5, 0.7)):
        train, _ = write_digits(tmp_path / f"site-{k}", test_fraction=fraction, seed=k)
        device = stack.add_device(f"site-{k}")
        device.datasets.add("digits-train", train)
        devices.append(device)
    for device in devices:
        _ready(stack, device)

    # Execute: two rounds flat, then the same two rounds hierarchical
    published, tasks = {}, {}
    for topology in ("flat", "hierarchical"):
        tasks[topology], published[topology] = _published(stack, algorithm, initial, devices, rounds=2, topology=topology, output={"name": f"digits-{topology}"})

    # Assert: hierarchical, no device's update reached the hub: one upload a round from the edge's aggregator, naming
    # the three devices and their examples in all; the published model is the flat task's (float32 rounding apart)
    hier = tasks["hierarchical"]
    assert api(stack, "GET", f"/artifacts?name=fl-update.{hier}.{devices[0].device_id}", "viewer")["items"] == []
    (combined,) = api(stack, "GET", f"/artifacts?name=fl-update.{hier}.{stack.node_id}", "viewer")["items"]  # the last round's (earlier ones swept)
    assert combined["version"] == "2.1"
    logs = _logs(stack, hier)
    means = [line for line in logs if f"the weighted mean of 3 devices under {stack.node_id} is in" in line]
    assert len(means) == 2, logs[-40:]
    assert not [line for line in logs if "the update of" in line and " is in (" in line], logs[-40:]
    workers = api(stack, "GET", f"/tasks/{hier}/workers", "viewer")
    assert sorted(w["role"] for w in workers).count("aggregator") == 1, workers
    assert set(published["hierarchical"]) == set(published["flat"])
    for name, flat in published["flat"].items():
        assert published["hierarchical"][name].dtype == flat.dtype and np.abs(published["hierarchical"][name] - flat).max() <= 1e-5, name
    assert not np.allclose(published["flat"]["fc.weight"], load(_content(stack, initial["id"]))["fc.weight"])
