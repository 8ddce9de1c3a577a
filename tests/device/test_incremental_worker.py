"""The ``incremental_training`` worker on a device (DESIGN §5): a real WorkerHost, ModelHost, local datasets and
signed body download (InputFetcher over an artefact server), the events validated with the interfaces models."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load as load_frame
from safetensors.numpy import save

from cloud.incremental import surgery
from cloud.signing import SigningKey
from device.local_data import DatasetError, LocalDatasets
from device.ota.download import Downloader
from device.ota.models import ModelHost
from device.tasks import InputFetcher, WorkerHost
from interfaces.deployments import ArtifactFormat, ArtifactKind, ArtifactManifest
from interfaces.ids import new_id
from interfaces.tasks import (
    IncrementalTrainingSpec,
    TASK_METRICS_EVENT,
    InputRef,
    TaskType,
    TrainingOrder,
    WorkerAction,
    WorkerOrder,
    worker_order,
)
from tests.device.ota_support import TOKEN, BlobServer, blob_server
from tests.device.test_task_worker import Events
from tests.dp_support import cloud_model, digits


@pytest.fixture(scope="module")
def signing(tmp_path_factory: pytest.TempPathFactory) -> SigningKey:
    return SigningKey.load_or_create(tmp_path_factory.mktemp("hub-pki"))


@pytest.fixture
def models(tmp_path: Path) -> ModelHost:
    host = ModelHost(tmp_path / "models")
    path = tmp_path / "digits.onnx"
    path.write_bytes(cloud_model())
    host.activate(host.load("digits", "1.0.0", hashlib.sha256(cloud_model()).hexdigest(), ArtifactFormat.ONNX, path))
    return host


@pytest.fixture
def datasets(tmp_path: Path) -> LocalDatasets:
    local = LocalDatasets(tmp_path / "datasets")
    d = digits()
    local.put("camera", d.x_device[:700], d.y_device[:700])
    return local


@pytest.fixture
def server() -> Iterator[BlobServer]:
    with blob_server() as s:
        yield s


@pytest.fixture
def host(tmp_path: Path, models: ModelHost, datasets: LocalDatasets, signing: SigningKey, server: BlobServer) -> Iterator[tuple[WorkerHost, Events]]:
    events = Events()
    downloader = Downloader(server.base_url, tmp_path / "partial", attempts=1)
    fetch = InputFetcher(tmp_path / "inputs", lambda: signing.public_key, lambda: downloader)
    made = WorkerHost(tmp_path / "tasks", models, events, fetch, datasets)
    yield made, events
    made.stop(2.0)


def training_order(signing: SigningKey, server: BlobServer, max_steps: int, **spec: object) -> tuple[WorkerOrder, surgery.DenseLayer]:
    """What the hub would order: the body served as a signed model artefact, the layer inline."""
    model = surgery.load(cloud_model())
    layer = surgery.find_dense(model)
    weight, bias = surgery.layer_arrays(model, layer)
    body = surgery.body(model, layer).SerializeToString()
    manifest = ArtifactManifest(name="digits.body", version="1.0.0", kind=ArtifactKind.MODEL, format=ArtifactFormat.ONNX,
                                sha256=hashlib.sha256(body).hexdigest(), size=len(body), created_at=datetime.now(UTC))  # fmt: skip
    artifact_id = f"art-{manifest.sha256[:12]}"
    server.blobs[f"/artifacts/{artifact_id}/content"] = body
    training = TrainingOrder(
        body=InputRef(artifact_id=artifact_id, signed_manifest=signing.sign_manifest(manifest), path=f"/artifacts/{artifact_id}/content", token=TOKEN),
        base_sha256=hashlib.sha256(cloud_model()).hexdigest(), feature=layer.feature, head=base64.b64encode(save({"weight": weight, "bias": bias})).decode(),
        max_steps=max_steps, sample_rate=64 / 700,
    )  # fmt: skip
    full_spec = {"model": {"name": "digits", "version": "1.0.0"}, "dataset": "camera", "steps": 10_000, "learning_rate": 0.5, **spec}
    order = worker_order(worker_id=new_id("wk"), task_id="tk-train", type=TaskType.INCREMENTAL_TRAINING, spec=full_spec, heartbeat_s=0.2, training=training)
    return order, layer


def test_the_worker_trains_exactly_max_steps_and_sends_the_layer(host: tuple[WorkerHost, Events], signing: SigningKey, server: BlobServer) -> None:
    # Prepare: the spec asks for 10,000 steps; the budget allowed 120
    workers, events = host
    order, layer = training_order(signing, server, max_steps=120)

    # Execute
    workers.apply([order])
    final = events.final(order.worker_id, timeout=60)

    # Assert: SUCCEEDED after exactly max_steps; one output, chunk 0, items = steps, the layer's shapes
    assert final.state == "SUCCEEDED" and final.items_done == 120, final
    (output,) = events.outputs(order.worker_id)
    assert output.chunk == 0 and output.items == 120
    frame = load_frame(base64.b64decode(output.data))
    assert set(frame) == {"weight", "bias"}
    assert frame["weight"].shape == (layer.features, layer.classes) and frame["bias"].shape == (layer.classes,)
    # the trained layer does better on the device's data than the one it started from
    model = surgery.load(cloud_model())
    weight, bias = surgery.layer_arrays(model, layer)
    assert not np.allclose(frame["weight"], weight)
    samples = [m.values for m in events.of(TASK_METRICS_EVENT, order.worker_id)]
    last = samples[-1]
    assert last["steps"] == 120 and last["max_steps"] == 120 and last["train_accuracy"] > 0.5 and "loss" in last and last["step_ms"] > 0
    lines = events.lines(order.worker_id)
    assert any("at most 120 steps" in line for line in lines)
    before, after = (float(v) for v in next(line for line in lines if line.startswith("trained 120 steps")).split("accuracy ")[1].split(";")[0].split(" -> "))
    assert after > before + 0.3
    # the body came from the artefact server, verified; the data never left: no event carries a row of it
    assert [p for p in server.paths() if p.endswith("/content")] == [order.training.body.path]  # type: ignore[union-attr]


def test_a_withdrawn_order_stops_between_steps_without_a_final_report(host: tuple[WorkerHost, Events], signing: SigningKey, server: BlobServer) -> None:
    workers, events = host
    order, _ = training_order(signing, server, max_steps=1_000_000)
    workers.apply([order])
    events.wait(lambda: any(m.values.get("steps", 0) >= 5 for m in events.of(TASK_METRICS_EVENT, order.worker_id)), timeout=60, what="training under way")
    workers.apply([])
    workers.stop(5.0)
    assert [r.state for r in events.reports(order.worker_id)] == ["RUNNING"] * len(events.reports(order.worker_id))
    assert events.outputs(order.worker_id) == []


def test_pause_holds_training_between_steps(host: tuple[WorkerHost, Events], signing: SigningKey, server: BlobServer) -> None:
    workers, events = host
    order, _ = training_order(signing, server, max_steps=1_000_000)
    workers.apply([order])
    events.wait(lambda: any(m.values.get("steps", 0) >= 5 for m in events.of(TASK_METRICS_EVENT, order.worker_id)), timeout=60, what="training under way")
    workers.apply([order.model_copy(update={"action": WorkerAction.PAUSE})])
    events.wait(lambda: any(r.paused for r in events.reports(order.worker_id)), what="a paused heartbeat")
    held = workers.workers()[0].items_done
    events.wait(lambda: len([r for r in events.reports(order.worker_id) if r.paused]) >= 3, what="three paused heartbeats")
    assert workers.workers()[0].items_done == held


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"spec": {"dataset": "elsewhere"}}, "no dataset 'elsewhere'"),
        ({"base_sha256": "0" * 64}, "is not the model the hub cut"),
        ({"max_steps": 0}, "allows no step"),
        ({"head": base64.b64encode(save({"weight": np.zeros((32, 3), np.float32), "bias": np.zeros(3, np.float32)})).decode()}, "the layer has 3 classes"),
    ],
)
def test_orders_it_cannot_run_are_rejected(host: tuple[WorkerHost, Events], signing: SigningKey, server: BlobServer, change: dict, reason: str) -> None:  # type: ignore[type-arg]
    workers, events = host
    order, _ = training_order(signing, server, max_steps=10)
    if "spec" in change:
        order = order.model_copy(update={"spec": IncrementalTrainingSpec.model_validate({**order.spec.model_dump(), **change["spec"]})})
    else:
        order = order.model_copy(update={"training": order.training.model_copy(update=change)})  # type: ignore[union-attr]
    workers.apply([order])
    final = events.final(order.worker_id)
    assert final.state == "REJECTED" and reason in final.detail, final


def test_local_datasets_are_checked_and_described_without_loading(tmp_path: Path) -> None:
    local = LocalDatasets(tmp_path / "datasets")
    changes: list[int] = []
    local.on_change = lambda: changes.append(1)
    x = np.zeros((30, 8, 8), np.float32)
    np.savez(tmp_path / "ok.npz", x=x, y=np.arange(30) % 10)
    info = local.add("cam", tmp_path / "ok.npz")
    assert (info.rows, info.shape, info.dtype) == (30, [8, 8], "float32")
    assert local.describe() == {"cam": {"rows": 30, "shape": [8, 8], "dtype": "float32"}}
    local.add("cam", tmp_path / "ok.npz")  # the same file again: nothing changes
    assert len(changes) == 1
    np.savez(tmp_path / "bad.npz", x=x, y=np.zeros(29, np.int64))
    with pytest.raises(DatasetError, match="30 rows but y 29"):
        local.add("bad", tmp_path / "bad.npz")
    np.savez(tmp_path / "floaty.npz", x=x, y=np.zeros(30))
    with pytest.raises(DatasetError, match="integer labels"):
        local.add("floaty", tmp_path / "floaty.npz")
    with pytest.raises(DatasetError, match="invalid dataset name"):
        local.add("../escape", tmp_path / "ok.npz")
    assert local.names() == ["cam"] and local.remove("cam") and local.describe() == {}
