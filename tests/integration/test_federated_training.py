"""Hierarchical federated training end to end (DESIGN §5, seeds/000; standard 7.3.1 c "edge–device FL"): hub +
brokers + an edge process + three devices (the SDK in this process), each keeping its own images.

The cloud-trained digits classifier is deployed to the devices (§8.2); a ``federated_training`` task makes the
hub cut its last layer, the devices train it on their own data each round and send it to their edge, whose
aggregator combines them into one update for the hub, which fuses the rounds (FedAvg) and publishes the model.
One device is stopped in the middle: its round closes with k of n at the deadline, the task goes on, and the
device takes part again once it is back. With secure aggregation the hub and the edge see only sums of masked
layers; the others had masked with the stopped device, so they reveal those seeds and the round still closes.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save

from device.runtime import open_model
from device.tasks import federated
from tests.dp_support import cloud_model, digits
from tests.integration.devstack import DevStack, api, create_deployment, upload_artifact, wait_deployment_final
from tests.support import wait_for

FINAL = {"SUCCEEDED", "FAILED", "CANCELED", "TIMED_OUT"}
ROUNDS = 7
ROUND_TIMEOUT_S = 6


def _accuracy(model_bytes: bytes, path: Path, x: np.ndarray, y: np.ndarray) -> float:
    path.write_bytes(model_bytes)
    logits = open_model(path).run({"x": x})["logits"]
    return float((logits.argmax(axis=1) == y).mean())


class _Choreography:
    """Puts the stop and the return at fixed points of the rounds, whatever the machine's pace.

    The victim is stopped while it trains round 2 (so that round closes short of it). Until the restarted victim
    trains a round, the others hold each later round until the victim is in it too, or until ``hold_until_s`` before
    the round's deadline (then it goes on with two, and the next round is held the same way).
    """

    def __init__(self, victim: str, hold_until_s: float) -> None:
        self.victim, self.hold_until_s = victim, hold_until_s
        self.in_round_2 = threading.Event()
        self.stopped = threading.Event()
        self.entered: set[int] = set()  # rounds the restarted victim trained in
        self._cond = threading.Condition()
        self._original = federated._Participant._round

    def __call__(self, participant: Any, fl: Any) -> bool:
        w = participant.worker
        if participant.identity == self.victim:
            if fl.round == 2 and not self.in_round_2.is_set():
                self.in_round_2.set()
                while w.checkpoint():  # the test stops this device now: the round never gets its update
                    w.wait(0.05)
                return False
            if self.stopped.is_set():  # the restarted device
                with self._cond:
                    self.entered.add(fl.round)
                    self._cond.notify_all()
        elif self.stopped.is_set() and fl.round > 2 and not self.entered:
            with self._cond:
                self._cond.wait_for(lambda: fl.round in self.entered, timeout=max(0.0, federated._seconds_left(fl) - self.hold_until_s))
        return bool(self._original(participant, fl))


def test_hierarchical_fedavg_with_secure_aggregation_survives_a_participant_that_stops_and_rejoins(stack: DevStack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the plain (unmasked) path of the edge's combining is covered with the real router in tests/device/test_federated_worker.py
    secure = True
    # Prepare: three devices, each with its own share of the (shifted) images, skewed by label
    d = digits()
    x, y = d.x_device, d.y_device
    test_x, test_y = x[-200:], y[-200:]
    shares = [np.flatnonzero((y[:-200] % 3) == k) for k in range(3)]  # non-IID: each device sees a third of the classes mostly
    devices = []
    for k, rows in enumerate(shares):
        dev = stack.add_device(f"cam-{k}")
        dev.datasets.put("camera", x[rows[:250]], y[rows[:250]])
        devices.append(dev)
    for dev in devices:
        wait_for(lambda dev=dev: stack.device_state(dev.device_id) == "ONLINE", 60, what="the devices ONLINE")
    model = upload_artifact(stack, cloud_model(), "model", "digits", "1.0.0", "onnx")
    deployment = create_deployment(stack, model["id"], {"ids": [dev.device_id for dev in devices]})
    assert wait_deployment_final(stack, deployment["id"])["state"] == "SUCCEEDED"
    twin = lambda dev: api(stack, "GET", f"/devices/{dev.device_id}/twin", "viewer")["reported"].get("datasets", {})  # noqa: E731
    for dev in devices:
        wait_for(lambda dev=dev: "camera" in twin(dev), 30, what="the datasets reported")
    before = _accuracy(cloud_model(), tmp_path / "before.onnx", test_x, test_y)
    held_out = upload_artifact(stack, save({"x": test_x, "y": test_y}), "dataset", "camera-held-out", "1.0.0", "safetensors")

    # Execute: the task; in round 2 one device stops, then it comes back
    stopped = devices[2]
    choreography = _Choreography(stopped.device_id, hold_until_s=ROUND_TIMEOUT_S / 2)
    monkeypatch.setattr(federated._Participant, "_round", lambda participant, fl: choreography(participant, fl))
    spec = {"model": {"name": "digits"}, "dataset": "camera", "rounds": ROUNDS, "local_steps": 40, "batch_size": 32, "learning_rate": 0.5,
            "min_participants": 2, "round_timeout_s": ROUND_TIMEOUT_S, "topology": "hierarchical", "eval_inputs": held_out["id"],
            "secure_aggregation": secure}  # fmt: skip
    task = api(stack, "POST", "/tasks", json={"type": "federated_training", "spec": spec, "placement": {"ids": [dev.device_id for dev in devices]},
                                              "heartbeat_s": 0.5, "retry": {"backoff_s": 0.5, "max_attempts": 5}})  # fmt: skip
    assert task["spec"]["model"]["version"] == "1.0.0"
    rounds = lambda: [s["values"] for s in api(stack, "GET", f"/tasks/{task['id']}/metrics?series=true&worker=hub", "viewer")["series"]]  # noqa: E731
    assert choreography.in_round_2.wait(60), "the third device never got round 2"
    stopped.stop()
    choreography.stopped.set()
    back = stack.restart_device(stopped)
    done = wait_for(lambda: (t := api(stack, "GET", f"/tasks/{task['id']}", "viewer"))["state"] in FINAL and t, 180, interval=0.3, what="the task final")

    # Assert: it succeeded and published a model that does better than the cloud's on the devices' images
    assert done["state"] == "SUCCEEDED", done
    series = rounds()
    # round 0: the starting model scored on the held-out set before any training, the first point of the curve
    assert series[0]["round"] == 0 and series[0]["eval_accuracy"] == pytest.approx(before, abs=0.01), series[0]
    history = series[1:]
    assert [r["round"] for r in history] == list(range(1, ROUNDS + 1))
    assert history[1]["contributors"] == 2, f"round 2 closed without the stopped device's update: {history}"
    assert any(r["contributors"] == 3 for r in history[2:]), f"the stopped device never took part again: {history}"
    assert choreography.entered, "the restarted device trained no round"
    assert all(r["examples"] >= 2 * 200 for r in history)
    outputs = api(stack, "GET", f"/tasks/{task['id']}/outputs", "viewer")
    (published,) = outputs["artifacts"]
    meta = api(stack, "GET", f"/artifacts/{published}", "viewer")
    assert (meta["name"], meta["version"]) == ("digits", "1.0.1")
    with stack.hub.client("viewer") as client:
        trained = client.get(f"/artifacts/{published}/content").content
    after = _accuracy(trained, tmp_path / "after.onnx", test_x, test_y)
    assert after > before + 0.3, (before, after)
    # the hub scored every round's global model on the held-out set: the last score is the published model's
    assert history[-1]["eval_accuracy"] == pytest.approx(after, abs=1e-9)
    assert history[-1]["eval_accuracy"] > history[0]["eval_accuracy"] - 0.05
    # the edge combined its devices' updates: the hub received one update per round from the aggregator
    workers = api(stack, "GET", f"/tasks/{task['id']}/workers", "viewer")
    assert any(w["role"] == "aggregator" and w["target_id"] == stack.node_id for w in workers)
    assert back.device_id == stopped.device_id
    if secure:  # a round that closed short of its participants had masks that did not cancel: the survivors revealed their seeds
        logs = [line["text"] for line in api(stack, "GET", f"/tasks/{task['id']}/logs?limit=500", "viewer")["items"]]
        for r in history:
            if r["contributors"] < r["participants"]:
                assert any(f"round {int(r['round'])}: " in text and "dropped after masking" in text for text in logs), (r, logs)
