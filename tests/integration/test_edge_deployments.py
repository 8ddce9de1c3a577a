"""An edge node as a deployment target end to end (DESIGN §4.2): hub + brokers + the edge process.

The operator uploads a model and deploys it to the node; the hub puts the order in the node's retained
desired document, the edge downloads it from the hub, checks it against the pinned hub key, installs it,
reports its progress, and then answers ``infer`` through the hub's command API.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from tests.integration.devstack import DevStack, start_devstack
from tests.support import wait_for

MODEL = Path(__file__).parent.parent / "fixtures" / "models" / "mlp-1.0.0.onnx"
FINAL_DEPLOYMENT = {"SUCCEEDED", "FAILED", "CANCELED", "ROLLED_BACK"}


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[DevStack]:
    stack = start_devstack(tmp_path, f"sqlite:///{tmp_path / 'hub.db'}")
    try:
        yield stack
    finally:
        stack.close()


def _wait_final(stack: DevStack, deployment_id: str, timeout: float = 60) -> dict[str, Any]:
    last: dict[str, Any] = {}

    def done() -> bool:
        nonlocal last
        with stack.hub.client("viewer") as api:
            r = api.get(f"/deployments/{deployment_id}")
        if r.status_code != 200:
            return False
        last = r.json()
        return last["state"] in FINAL_DEPLOYMENT

    try:
        wait_for(done, timeout, interval=0.2, what=f"deployment {deployment_id} final")
    except AssertionError:
        raise AssertionError(f"deployment not final in {timeout} s: {last.get('state')} {last.get('executions')}") from None
    return last


def test_a_model_deployed_to_an_edge_node_is_installed_and_answers_infer(stack: DevStack) -> None:
    # Prepare
    x = np.ones((1, 128), dtype=np.float32)
    with stack.hub.client("operator") as api:
        files = {"file": (MODEL.name, MODEL.read_bytes(), "application/octet-stream")}
        r = api.post("/artifacts", data={"kind": "model", "name": "mlp", "version": "1.0.0", "format": "onnx"}, files=files)
        assert r.status_code == 201, r.text
        artifact = r.json()

        # Execute
        r = api.post("/deployments", json={"artifact_id": artifact["id"], "target": {"kind": "node", "ids": [stack.node_id]}})
        assert r.status_code == 201, r.text
        result = _wait_final(stack, r.json()["id"])
        answer = api.post(f"/nodes/{stack.node_id}/commands", json={"name": "infer", "args": {"inputs": {"x": x.tolist()}}})
        listed = api.post(f"/nodes/{stack.node_id}/commands", json={"name": "models"})

    # Assert
    assert result["state"] == "SUCCEEDED", result
    [execution] = result["executions"]
    assert execution["state"] == "ACTIVE", execution
    assert [t["to_state"] for t in execution["history"]][-5:] == ["DOWNLOADING", "DOWNLOADED", "VERIFYING", "INSTALLING", "ACTIVE"]
    assert answer.status_code == 200, answer.text
    reply = answer.json()
    assert reply["ok"], reply
    assert reply["result"]["model"] == {"name": "mlp", "version": "1.0.0"}
    expected = ort.InferenceSession(str(MODEL), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(np.array(reply["result"]["outputs"]["probabilities"]), expected, rtol=1e-6)
    assert [m["version"] for m in listed.json()["result"]["models"]] == ["1.0.0"]

    def reports_it() -> bool:
        with stack.hub.client("viewer") as api:
            node = api.get(f"/nodes/{stack.node_id}/twin").json()
        return node.get("reported", {}).get("installed", {}).get("model", {}).get("version") == "1.0.0"

    wait_for(reports_it, 15, what="the node's reported document listing mlp 1.0.0")
