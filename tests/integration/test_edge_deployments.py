"""An edge node as a deployment target end to end (DESIGN §4.2): hub + brokers + the edge process.

The operator uploads a model and deploys it to the node; the hub puts the order in the node's retained
desired document, the edge downloads it from the hub, checks it against the pinned hub key, installs it,
reports its progress, and then answers ``infer`` through the hub's command API.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from tests.integration.devstack import DevStack, create_deployment, upload_artifact, wait_deployment_final
from tests.support import wait_for

MODEL = Path(__file__).parent.parent / "fixtures" / "models" / "mlp-1.0.0.onnx"


def test_a_model_deployed_to_an_edge_node_is_installed_and_answers_infer(stack: DevStack) -> None:
    # Prepare
    x = np.ones((1, 128), dtype=np.float32)
    artifact = upload_artifact(stack, MODEL.read_bytes(), "model", "mlp", "1.0.0", "onnx")

    # Execute
    result = wait_deployment_final(stack, create_deployment(stack, artifact["id"], {"kind": "node", "ids": [stack.node_id]})["id"], 60)
    with stack.hub.client("operator") as api:
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

    wait_for(reports_it, 60, what="the node's reported document listing mlp 1.0.0")
