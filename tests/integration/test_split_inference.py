"""Split inference end to end (DESIGN §5, standard 6.3.2 e and 7.3.1 c 5): hub + brokers + an edge process + a
device (the SDK in this process, so that the test is its application).

The digits CNN is deployed to the device (§8.2); a ``split_inference`` task makes the hub cut it, the device runs
a head worker, the edge a tail worker. The device's application calls its model host as always; requests run
split with the edge (the answer equals the whole model run here), the planner's choice is reported in the task's
metrics. With the edge stopped (SIGSTOP: its process, not the broker), requests still complete, on the device,
and are reported as fallbacks; once the edge is back the requests cross again.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import numpy as np

from device.runtime import open_model
from tests.integration.devstack import DevStack, api, create_deployment, upload_artifact, wait_deployment_final
from tests.support import wait_for

MODEL = Path(__file__).parent.parent / "fixtures" / "models" / "digits-cnn.onnx"


def _device(stack: DevStack, name: str) -> Any:
    """A device registered at the hub and started in this process, ONLINE."""
    dev = stack.add_device(name)
    wait_for(lambda: stack.device_state(dev.device_id) == "ONLINE", 60, what="the device ONLINE")
    return dev


def _metrics(stack: DevStack, task_id: str, role: str) -> dict[str, float]:
    """The latest metrics of the task's worker with ``role``."""
    workers = {w["id"]: w for w in api(stack, "GET", f"/tasks/{task_id}/workers", "viewer")}
    latest = api(stack, "GET", f"/tasks/{task_id}/metrics", "viewer")["workers"]
    for worker_id, sample in latest.items():
        if workers.get(worker_id, {}).get("role") == role:
            return sample["values"]
    return {}


def test_split_inference_answers_like_the_whole_model_and_falls_back_on_the_device_when_the_edge_stops(stack: DevStack) -> None:
    # Prepare: the CNN on the device (§8.2); a split task pinned to a middle cut, int8 activations
    dev = _device(stack, "cam-1")
    model = upload_artifact(stack, MODEL.read_bytes(), "model", "digits", "1.0.0", "onnx")
    deployment = create_deployment(stack, model["id"], {"ids": [dev.device_id]})
    assert wait_deployment_final(stack, deployment["id"])["state"] == "SUCCEEDED"
    spec = {"model": {"name": "digits"}, "timeout_ms": 500, "retry_after_s": 1.0, "report_interval_s": 0.3, "probe_interval_s": 2}
    task = api(stack, "POST", "/tasks", json={"type": "split_inference", "spec": spec, "placement": {"ids": [dev.device_id]}, "heartbeat_s": 0.5})
    assert task["spec"]["model"]["version"] == "1.0.0"
    workers = lambda: api(stack, "GET", f"/tasks/{task['id']}/workers", "viewer")  # noqa: E731

    def both_running() -> list[dict[str, Any]] | None:
        ws = workers()
        return ws if sorted((w["role"], w["state"]) for w in ws) == [("head", "RUNNING"), ("tail", "RUNNING")] else None

    placed = wait_for(both_running, 60, what="head and tail RUNNING")
    (tail,) = [w for w in placed if w["role"] == "tail"]  # type: ignore[attr-defined]
    assert tail["target_id"] == stack.node_id
    # the head calibrated against the edge: its metrics say which cut the planner took
    wait_for(lambda: "estimate_ms" in _metrics(stack, task["id"], "head"), 60, what="the head calibrated")
    reference = open_model(MODEL)
    x = np.random.default_rng(0).standard_normal((1, 1, 8, 8)).astype(np.float32)
    expected = reference.run({"x": x})

    # Execute 1: the application's requests, with the edge up
    answers = [dev.models.infer({"x": x}) for _ in range(20)]

    # Assert 1: the same answer as the whole model; what the planner chose serves them
    for answer in answers:
        for name, value in expected.items():
            np.testing.assert_allclose(answer.outputs[name], value, rtol=1e-4, atol=1e-5)
    routes = {a.route for a in answers}
    assert routes and routes <= {"device", "edge"} | {r for r in routes if r.startswith("split:")}, routes
    assert "fallback" not in routes
    head = wait_for(lambda: (m := _metrics(stack, task["id"], "head")).get("requests", 0) >= 20 and m, 60, what="the head's request count")
    assert head["fallbacks"] == 0 and head["split"] + head["edge"] + head["device"] >= 20, head

    # Execute 2: the task stopped (SUCCEEDED, its tail withdrawn with it); the next ones pin the plan, so that
    # every request crosses the link: a middle cut with int8 activations, then edge-only
    def pinned_task(cut: str, quantize: bool) -> dict[str, Any]:
        created = api(stack, "POST", "/tasks", json={
            "type": "split_inference", "placement": {"ids": [dev.device_id]}, "heartbeat_s": 0.5, "spec": {**spec, "cut": cut, "quantize": quantize},
        })  # fmt: skip
        wait_for(lambda: "estimate_ms" in _metrics(stack, created["id"], "head"), 60, what=f"the head pinned to {cut} calibrated")
        return created

    def stop(task_id: str) -> None:
        api(stack, "POST", f"/tasks/{task_id}/stop")
        wait_for(lambda: api(stack, "GET", f"/tasks/{task_id}", "viewer")["state"] == "SUCCEEDED", 60, what="the task stopped")
        wait_for(lambda: not dev.models.routed("digits"), 60, what="the head's route removed")

    stop(task["id"])
    assert {w["state"] for w in workers()} == {"SUCCEEDED"}
    middle = pinned_task("max_pool2d", quantize=True)
    crossed = [dev.models.infer({"x": x}) for _ in range(5)]
    assert {a.route for a in crossed} == {"split:max_pool2d"}
    for answer in crossed:  # int8 activations: close, the same class
        np.testing.assert_allclose(answer.outputs["logits"], expected["logits"], atol=0.05 * float(np.ptp(expected["logits"])))
        assert answer.outputs["logits"].argmax() == expected["logits"].argmax()
    stop(middle["id"])
    pinned = pinned_task("<edge>", quantize=False)
    crossed = [dev.models.infer({"x": x}) for _ in range(5)]
    assert {a.route for a in crossed} == {"edge"}
    for answer in crossed:
        np.testing.assert_allclose(answer.outputs["logits"], expected["logits"], rtol=1e-4, atol=1e-5)

    # Execute 3: the edge stops (its process, not the devices' broker)
    assert stack.edge is not None
    stack.edge.send_signal(signal.SIGSTOP)
    try:
        during = [dev.models.infer({"x": x}) for _ in range(10)]
    finally:
        stack.edge.send_signal(signal.SIGCONT)

    # Assert 3: every request completed on the device, with the whole model's answer, as a fallback
    assert [a.route for a in during] == ["fallback"] * 10
    for answer in during:
        np.testing.assert_allclose(answer.outputs["logits"], expected["logits"], rtol=1e-4, atol=1e-5)
    wait_for(lambda: _metrics(stack, pinned["id"], "head").get("fallbacks", 0) >= 10, 30, what="the fallbacks reported")

    # Assert 4: the edge back, requests cross again
    def crossing() -> bool:
        return dev.models.infer({"x": x}).route == "edge"

    wait_for(crossing, 30, interval=0.3, what="requests through the edge again")
