"""Task workers on the edge node itself: the node's desired document deploys a model and orders a batch
task; the real NodeDeployments installs the model, fetches the dataset from the hub (the artefact server)
with the pinned key, and its workers' events leave through the node's upstream path (here: a list)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load as load_frame

from cloud.signing import SigningKey
from edge.deployments import NodeDeployments
from interfaces.deployments import EXECUTION_EVENT, ArtifactFormat, ArtifactKind, ArtifactManifest
from interfaces.messages import DesiredBody, Envelope, EventBody
from interfaces.tasks import (
    TASK_OUTPUT_EVENT,
    TASK_WORKER_EVENT,
    InputRef,
    TaskType,
    WorkerOutput,
    WorkerReport,
    worker_order,
)
from interfaces.topics import NODE_EVENTS, Topic
from tests.device.ota_support import TOKEN, V1, blob_server, make_order


def test_the_node_runs_a_batch_task_on_the_model_its_document_deploys(tmp_path: Path) -> None:
    with blob_server() as server:
        # Prepare: the dataset served by the "hub"; a document with the model's order and the task's
        signing = SigningKey.load_or_create(tmp_path / "hub-pki")
        x = np.random.default_rng(3).standard_normal((40, 128)).astype(np.float32)
        np.save(tmp_path / "x.npy", x)
        data = (tmp_path / "x.npy").read_bytes()
        sha = hashlib.sha256(data).hexdigest()
        manifest = ArtifactManifest(name="inputs", version="1.0.0", kind=ArtifactKind.DATASET, format=ArtifactFormat.NPY, sha256=sha, size=len(data), created_at=datetime.now(UTC))
        ref = InputRef(artifact_id="art-inputs", signed_manifest=signing.sign_manifest(manifest), path="/artifacts/art-inputs/content", token=TOKEN)
        server.blobs[ref.path] = data
        spec = {"model": {"name": "classifier"}, "inputs": "art-inputs", "chunk_size": 16}
        order = worker_order(worker_id="wk-edge", task_id="tk-1", type=TaskType.BATCH_INFERENCE, spec=spec, heartbeat_s=0.2, inputs=ref, items=40, chunk_size=16, chunks=[(0, 3)])
        deploy = make_order(signing, server, V1, "1.0.0")
        sent: list[tuple[str, EventBody]] = []

        def send_up(topic: str, payload: bytes, kind: Topic[Any]) -> bool:
            if kind is NODE_EVENTS:
                sent.append((topic, Envelope[EventBody].model_validate_json(payload).body))
            return True

        def events(type: str) -> list[dict[str, Any]]:
            return [b.data for _, b in sent if b.type == type]

        async def scenario() -> None:
            node = NodeDeployments("nd-1", tmp_path / "node", signing.public_key, server.url, send_up)
            worker = asyncio.create_task(node.run())
            try:
                # Execute: the task arrives with the model's deployment; later it is withdrawn
                node.offer(DesiredBody(version=1, deployments=[deploy], deployments_version=1, tasks=[order], tasks_version=1))
                await _until(lambda: len(events(TASK_OUTPUT_EVENT)) == 3)
                node.offer(DesiredBody(version=1, deployments=[deploy], deployments_version=1, tasks=[], tasks_version=2))
                await _until(lambda: node.tasks.workers() == [])
            finally:
                worker.cancel()
                await asyncio.gather(worker, return_exceptions=True)
                await node.close()
            # Assert (the models still loaded)
            outputs = {o.chunk: load_frame(base64.b64decode(o.data))["probabilities"] for o in map(WorkerOutput.model_validate, events(TASK_OUTPUT_EVENT))}
            direct = node.models.infer({"x": x}).outputs["probabilities"]
            np.testing.assert_allclose(np.concatenate([outputs[i] for i in range(3)]), direct, rtol=1e-5, atol=1e-7)

        asyncio.run(scenario())

    # Assert: the model went ACTIVE before the worker ran; seqs grow in the order the events were stored
    states = [d["state"] for d in events(EXECUTION_EVENT)]
    assert states[-1] == "ACTIVE"
    reports = [WorkerReport.model_validate(d) for d in events(TASK_WORKER_EVENT)]
    assert reports and {r.state for r in reports} == {"RUNNING"}
    first_task = next(i for i, (_, b) in enumerate(sent) if b.type.startswith("task."))
    assert all(b.type == EXECUTION_EVENT for _, b in sent[:first_task])
    seqs = [b.seq for _, b in sent]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert {topic for topic, _ in sent} == {NODE_EVENTS.topic(node_id="nd-1")}
    assert server.paths().count(ref.path) == 1
    json.dumps([b.data for _, b in sent])  # everything JSON-serialisable


async def _until(check: Any, timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.05)
