"""The ``federated_training`` worker programs (DESIGN §5) through a real WorkerHost: a device's participant (real
ModelHost with the digits classifier, local datasets, the body and each round's global layer fetched as signed
artefacts through an InputFetcher) and an edge's aggregator (a real FlRouter fed the way its MQTT intake feeds it),
with and without secure aggregation. Every event is validated with its interfaces model.

Training is made deterministic by a batch size above the rows (Poisson sampling at q = 1: every step is one
full-batch gradient step, no DP noise), so the layer a worker sends can be compared with a HeadTrainer run here."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from pydantic import BaseModel
from safetensors.numpy import load as load_frame
from safetensors.numpy import save

from cloud.incremental import surgery
from cloud.signing import SigningKey
from device.fl import FlChannel
from device.local_data import LocalDatasets
from device.ota.download import Downloader
from device.ota.models import ModelHost
from device.tasks import InputFetcher, WorkerHost
from device.tasks.federated import EDGE_MARGIN
from device.training.dpsgd import HeadTrainer, cross_entropy
from device.training.features import body_features
from edge.fl import FlRouter
from interfaces import secagg
from interfaces.aggregation import ClientUpdate, combine
from interfaces.deployments import ArtifactFormat, ArtifactKind, ArtifactManifest
from interfaces.messages import FlUpdateBody, envelope
from interfaces.tasks import (
    FL_AGGREGATOR,
    FL_KEY_EVENT,
    FL_REVEAL_EVENT,
    FL_UPDATE_EVENT,
    TASK_LOG_EVENT,
    TASK_METRICS_EVENT,
    TASK_OUTPUT_EVENT,
    TASK_WORKER_EVENT,
    FederatedTrainingOrder,
    FederatedTrainingSpec,
    FlKey,
    FlOrder,
    FlReveal,
    FlUpdate,
    InputRef,
    TaskType,
    WorkerLog,
    WorkerMetrics,
    WorkerOrder,
    WorkerOutput,
    WorkerReport,
)  # fmt: skip
from tests.device.ota_support import TOKEN, BlobServer, blob_server
from tests.device.test_task_worker import Events
from tests.dp_support import cloud_model, digits

TASK = "tk-fl"
EDGE = "nd-edge-1"
STEPS = 12
LR = 0.1
EVENT_MODELS: dict[str, type[BaseModel]] = {
    TASK_WORKER_EVENT: WorkerReport, TASK_LOG_EVENT: WorkerLog, TASK_METRICS_EVENT: WorkerMetrics, TASK_OUTPUT_EVENT: WorkerOutput,
    FL_UPDATE_EVENT: FlUpdate, FL_KEY_EVENT: FlKey, FL_REVEAL_EVENT: FlReveal,
}  # fmt: skip
SPEC: dict[str, Any] = {
    "model": {"name": "digits", "version": "1.0.0"}, "dataset": "camera", "rounds": 3, "local_steps": STEPS, "learning_rate": LR,
    "batch_size": 4096,  # above the rows: q = 1, every step a full-batch step (deterministic)
    "topology": "flat", "round_timeout_s": 60,
}  # fmt: skip


# ---- the model cut as the hub cuts it ----------------------------------------------------------------
@dataclass(frozen=True)
class Cut:
    weight: np.ndarray
    bias: np.ndarray
    feature: str
    body: bytes
    base_sha256: str


@lru_cache(maxsize=1)
def cut() -> Cut:
    model = surgery.load(cloud_model())
    layer = surgery.find_dense(model)
    weight, bias = surgery.layer_arrays(model, layer)
    return Cut(weight, bias, layer.feature, surgery.body(model, layer).SerializeToString(), hashlib.sha256(cloud_model()).hexdigest())


def layer_frame(weight: np.ndarray, bias: np.ndarray) -> bytes:
    return save({"weight": np.ascontiguousarray(weight, np.float32), "bias": np.ascontiguousarray(bias, np.float32)})


def served(signing: SigningKey, server: BlobServer, data: bytes, fmt: ArtifactFormat, name: str) -> InputRef:
    """``data`` served by the artefact source as a signed model artefact (the body: ONNX; a global layer: safetensors)."""
    manifest = ArtifactManifest(name=name, version="1.0.0", kind=ArtifactKind.MODEL, format=fmt, sha256=hashlib.sha256(data).hexdigest(),
                                size=len(data), created_at=datetime.now(UTC))  # fmt: skip
    artifact_id = f"art-{manifest.sha256[:12]}"
    path = f"/artifacts/{artifact_id}/content"
    server.blobs[path] = data
    return InputRef(artifact_id=artifact_id, signed_manifest=signing.sign_manifest(manifest), path=path, token=TOKEN)


def features_of(tmp_path: Path, x: np.ndarray) -> np.ndarray:
    """The frozen body's features of ``x`` with the column of ones, as the worker computes them."""
    path = tmp_path / f"body-{len(x)}.onnx"
    path.write_bytes(cut().body)
    return body_features(path, x, cut().feature, with_ones=True)


def trained(features: np.ndarray, y: np.ndarray, steps: int, *, weight: np.ndarray | None = None, bias: np.ndarray | None = None,
            mu: float = 0.0) -> tuple[np.ndarray, np.ndarray, float]:  # fmt: skip
    """The layer after ``steps`` full-batch steps from the global one (what the worker must send), and its accuracy."""
    start_w = cut().weight if weight is None else weight
    start_b = cut().bias if bias is None else bias
    with HeadTrainer(start_w, start_b, features, y, learning_rate=LR, clip_norm=float("inf"), noise_multiplier=0.0, sample_rate=1.0,
                     augmented=True, proximal_mu=mu) as trainer:  # fmt: skip
        for _ in range(steps):
            trainer.step()
        return trainer.weight.copy(), trainer.bias.copy(), trainer.accuracy()


def frame_of(update: FlUpdate) -> dict[str, np.ndarray]:
    return load_frame(base64.b64decode(update.data))


def eventually(check: Callable[[], Any], timeout: float = 60.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while not (result := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or check}")
        time.sleep(0.02)
    return result


def public_b64(key: X25519PrivateKey) -> str:
    return base64.b64encode(key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)).decode("ascii")


# ---- the harness ---------------------------------------------------------------------------------------
class FlEvents(Events):
    """Events, the federated ones included, each validated with its interfaces model; ``at`` their arrival times."""

    def __init__(self) -> None:
        super().__init__()
        self.at: list[float] = []

    def __call__(self, type: str, data: dict[str, Any], severity: str) -> None:
        model = EVENT_MODELS[type].model_validate(json.loads(json.dumps(data)))  # what arrives after the wire
        with self._cond:
            self.items.append((type, model, severity))
            self.at.append(time.monotonic())
            self._cond.notify_all()

    def updates(self, worker_id: str | None = None) -> list[FlUpdate]:
        return self.of(FL_UPDATE_EVENT, worker_id)

    def arrival(self, item: BaseModel) -> float:
        with self._cond:
            return next(t for (_, m, _), t in zip(self.items, self.at, strict=True) if m is item)


def deliver(router: FlRouter, update: FlUpdate) -> None:
    """A device's update reaching its edge: the envelope on ``fl`` through the router's intake (what MQTT hands it)."""
    device = update.contributors[0]
    payload = envelope(device, FlUpdateBody(update=update)).model_dump_json().encode()
    asyncio.run(router._on_update(None, SimpleNamespace(payload=payload), {"device_id": device}))  # type: ignore[arg-type]


@dataclass
class Device:
    identity: str
    host: WorkerHost
    events: FlEvents
    x: np.ndarray
    y: np.ndarray
    published: list[FlUpdate] = field(default_factory=list)
    forward: Callable[[FlUpdate], None] | None = None
    """hierarchical: where the device's ``fl`` messages go (an edge's router)"""

    def publish(self, body: FlUpdateBody) -> None:
        self.published.append(body.update)
        if self.forward is not None:
            self.forward(body.update)


@dataclass
class Edge:
    host: WorkerHost
    events: FlEvents
    router: FlRouter


@pytest.fixture(scope="module")
def signing(tmp_path_factory: pytest.TempPathFactory) -> SigningKey:
    return SigningKey.load_or_create(tmp_path_factory.mktemp("hub-pki"))


@pytest.fixture
def server() -> Iterator[BlobServer]:
    with blob_server() as s:
        yield s


@pytest.fixture
def hosts() -> Iterator[list[WorkerHost]]:
    made: list[WorkerHost] = []
    yield made
    for host in made:
        host.stop(2.0)


@pytest.fixture
def make_device(tmp_path: Path, signing: SigningKey, server: BlobServer, hosts: list[WorkerHost]) -> Callable[..., Device]:
    def make(identity: str = "dv-a", rows: slice = slice(0, 300), *, channel: bool = True, extra: dict[str, tuple[np.ndarray, np.ndarray]] | None = None) -> Device:
        root = tmp_path / identity
        root.mkdir()
        models = ModelHost(root / "models")
        model_path = root / "digits.onnx"
        model_path.write_bytes(cloud_model())
        models.activate(models.load("digits", "1.0.0", cut().base_sha256, ArtifactFormat.ONNX, model_path))
        d = digits()
        x, y = d.x_device[rows], d.y_device[rows]
        datasets = LocalDatasets(root / "datasets")
        datasets.put("camera", x, y)
        for name, (ex, ey) in (extra or {}).items():
            datasets.put(name, ex, ey)
        downloader = Downloader(server.base_url, root / "partial", attempts=1)
        fetch = InputFetcher(root / "inputs", lambda: signing.public_key, lambda: downloader)
        events = FlEvents()
        device = Device(identity, None, events, x, y)  # type: ignore[arg-type]
        fl = FlChannel(identity, device.publish) if channel else None
        device.host = WorkerHost(root / "tasks", models, events, fetch, datasets, fl=fl)
        hosts.append(device.host)
        return device

    return make


@pytest.fixture
def edge(tmp_path: Path, hosts: list[WorkerHost]) -> Edge:
    events = FlEvents()
    router = FlRouter(EDGE)
    host = WorkerHost(tmp_path / "edge" / "tasks", ModelHost(tmp_path / "edge" / "models"), events, lambda ref: pytest.fail("an aggregator fetches nothing"), fl=router)
    hosts.append(host)
    return Edge(host, events, router)


@pytest.fixture
def artefacts(signing: SigningKey, server: BlobServer) -> tuple[InputRef, InputRef]:
    """The body and the first round's global layer (the cloud model's own last layer), served and signed."""
    body = served(signing, server, cut().body, ArtifactFormat.ONNX, "digits.body")
    weights = served(signing, server, layer_frame(cut().weight, cut().bias), ArtifactFormat.SAFETENSORS, "digits.round")
    return body, weights


def fl_order(refs: tuple[InputRef, InputRef], *, round: int = 1, attempt: int = 1, deadline_s: float = 60.0, via_edge: bool = False, **fields: Any) -> FlOrder:
    body, weights = refs
    return FlOrder(
        round=round, attempt=attempt, deadline_at=datetime.now(UTC) + timedelta(seconds=deadline_s), weights=fields.pop("weights", weights), body=body,
        base_sha256=fields.pop("base_sha256", cut().base_sha256), feature=cut().feature, via_edge=via_edge, **fields,
    )  # fmt: skip


def worker_order(worker_id: str, fl: FlOrder | None, *, role: str = "worker", task_id: str = TASK, **spec: Any) -> WorkerOrder:
    return FederatedTrainingOrder(worker_id=worker_id, task_id=task_id, type=TaskType.FEDERATED_TRAINING, role=role, spec=FederatedTrainingSpec.model_validate({**SPEC, **spec}), heartbeat_s=0.2, fl=fl)


def with_fl(order: WorkerOrder, fl: FlOrder) -> WorkerOrder:
    return order.model_copy(update={"fl": fl})


def running(events: FlEvents, worker_id: str) -> None:
    events.wait(lambda: any(r.state == "RUNNING" for r in events.reports(worker_id)), what=f"{worker_id} RUNNING")


def synthetic(contributor: str, n: int, seed: int, *, round: int = 1, attempt: int = 1, loss: float = 1.0, accuracy: float = 0.5) -> FlUpdate:
    """A device's update as the aggregator receives it (a random layer of the model's shapes)."""
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal(cut().weight.shape).astype(np.float32)
    bias = rng.standard_normal(cut().bias.shape).astype(np.float32)
    return FlUpdate(task_id=TASK, worker_id=f"wk-{contributor}", round=round, attempt=attempt, contributors=[contributor], num_examples=n,
                    data=base64.b64encode(layer_frame(weight, bias)).decode("ascii"), metrics={"loss": loss, "accuracy": accuracy})  # fmt: skip


def updated(events: FlEvents, *workers: str) -> bool:
    return all(events.updates(w) for w in workers)


def plain(update: FlUpdate) -> ClientUpdate:
    return ClientUpdate(frame_of(update), update.num_examples, update.metrics, update.contributors[0])


# ---- a participant ------------------------------------------------------------------------------------
def test_a_participant_trains_each_round_attempt_once_from_the_global_layer_and_sends_it_to_the_hub(
    tmp_path: Path, make_device: Callable[..., Device], artefacts: tuple[InputRef, InputRef], signing: SigningKey, server: BlobServer
) -> None:
    # Prepare: a device with 300 rows of its own; its order has no round yet
    device = make_device("dv-a", slice(0, 300))
    events, host = device.events, device.host
    order = worker_order("wk-a", None)
    features = features_of(tmp_path, device.x)
    global_loss = cross_entropy(cut().weight, cut().bias, features[:, :-1], device.y)

    # Execute: no round yet
    host.apply([order])
    running(events, "wk-a")
    events.wait(lambda: any(t.startswith("taking part in 3 rounds on 300 rows of camera (fedavg)") for t in events.lines("wk-a")), what="the start line")
    time.sleep(0.2)  # a window showing absence: no fetch, no update without a round; a worker without one only waits, saying nothing that could mark it

    # Assert: it waits; nothing fetched, nothing sent
    assert events.updates() == [] and server.paths() == []

    # Execute: round 1
    round1 = fl_order(artefacts, round=1)
    host.apply([with_fl(order, round1)])
    (update,) = events.wait(lambda: events.updates("wk-a"), what="round 1's update")

    # Assert: one update of the device's training, to the hub
    assert (update.task_id, update.round, update.attempt, update.masked) == (TASK, 1, 1, False)
    assert update.contributors == ["dv-a"] and update.num_examples == 300
    frame = frame_of(update)
    assert set(frame) == {"weight", "bias"}
    assert frame["weight"].dtype == np.float32 and frame["bias"].dtype == np.float32
    assert frame["weight"].shape == cut().weight.shape and frame["bias"].shape == cut().bias.shape
    assert not np.allclose(frame["weight"], cut().weight)
    # exactly local_steps steps from the global layer (not one fewer or more)
    expected_w, expected_b, expected_acc = trained(features, device.y, STEPS)
    np.testing.assert_allclose(frame["weight"], expected_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(frame["bias"], expected_b, rtol=1e-5, atol=1e-6)
    for other in (STEPS - 1, STEPS + 1):
        assert not np.allclose(frame["weight"], trained(features, device.y, other)[0], rtol=1e-5, atol=1e-6)
    # it does better on the device's data; its metrics say so
    new_loss = cross_entropy(frame["weight"], frame["bias"], features[:, :-1], device.y)
    assert new_loss < global_loss - 0.1
    assert set(update.metrics) == {"loss", "accuracy"}
    assert update.metrics["accuracy"] == pytest.approx(expected_acc, abs=1e-9)
    assert new_loss - 1e-4 <= update.metrics["loss"] < global_loss  # the mean of the last steps' losses, before each step
    body_fetches = [p for p in server.paths() if p == round1.body.path]
    assert body_fetches == [round1.body.path] and round1.weights.path in server.paths()

    # Execute: the same round attempt again (the hub moved its deadline), then attempt 2
    host.apply([with_fl(order, fl_order(artefacts, round=1, deadline_s=90))])
    time.sleep(0.3)  # a window showing absence: no second training of attempt 1; the worker skips an attempt it did without a line or event to wait for
    assert len(events.updates("wk-a")) == 1, "the same round attempt was trained twice"
    host.apply([with_fl(order, fl_order(artefacts, round=1, attempt=2))])
    events.wait(lambda: len(events.updates("wk-a")) == 2, what="attempt 2's update")

    # Assert: attempt 2 starts from the global layer again (a reset, not a continuation of attempt 1)
    retry = events.updates("wk-a")[1]
    assert (retry.round, retry.attempt, retry.contributors) == (1, 2, ["dv-a"])
    np.testing.assert_allclose(frame_of(retry)["weight"], frame["weight"], rtol=1e-5, atol=1e-6)

    # Execute: round 2 from a new global layer (round 1's layer, as the hub would fuse one update)
    weights2 = served(signing, server, layer_frame(frame["weight"], frame["bias"]), ArtifactFormat.SAFETENSORS, "digits.round")
    host.apply([with_fl(order, fl_order(artefacts, round=2, weights=weights2))])
    events.wait(lambda: len(events.updates("wk-a")) == 3, what="round 2's update")

    # Assert: trained from round 2's layer; the body was fetched (and run) once for all rounds
    second = events.updates("wk-a")[2]
    assert (second.round, second.attempt) == (2, 1)
    w2, b2, _ = trained(features, device.y, STEPS, weight=frame["weight"], bias=frame["bias"])
    np.testing.assert_allclose(frame_of(second)["weight"], w2, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(frame_of(second)["bias"], b2, rtol=1e-4, atol=1e-5)
    assert [p for p in server.paths() if p == round1.body.path] == [round1.body.path]
    assert weights2.path in server.paths()
    samples = events.wait(lambda: [m.values for m in events.of(TASK_METRICS_EVENT, "wk-a") if m.values.get("rounds") == 3], what="metrics of 3 rounds")
    assert samples[-1]["round"] == 2 and samples[-1]["examples"] == 300 and samples[-1]["train_s"] > 0

    # Execute: round 3 whose deadline has passed
    host.apply([with_fl(order, fl_order(artefacts, round=3, deadline_s=-1))])
    events.wait(lambda: any("round 3 (attempt 1) is past its deadline" in t for t in events.lines("wk-a")), what="the skip line")

    # Assert: skipped, not sent; the worker goes on
    assert len(events.updates("wk-a")) == 3
    assert {r.state for r in events.reports("wk-a")} == {"RUNNING"}


def test_fedprox_stays_closer_to_the_global_layer_than_fedavg(tmp_path: Path, make_device: Callable[..., Device], artefacts: tuple[InputRef, InputRef]) -> None:
    # Prepare: two workers on the same device, data and global layer; one fedavg, one fedprox with a strong pull (lr·mu = 0.5)
    device = make_device("dv-a", slice(0, 300))
    features = features_of(tmp_path, device.x)
    round1 = fl_order(artefacts)
    avg = worker_order("wk-avg", round1, task_id="tk-avg", strategy="fedavg", local_steps=40)
    prox = worker_order("wk-prox", round1, task_id="tk-prox", strategy="fedprox", strategy_params={"mu": 5.0}, local_steps=40)

    # Execute
    device.host.apply([avg, prox])
    device.events.wait(lambda: updated(device.events, "wk-avg", "wk-prox"), what="both updates")

    # Assert: FedProx moved less; both learnt; FedProx is the proximal step, nothing else
    (u_avg,), (u_prox,) = device.events.updates("wk-avg"), device.events.updates("wk-prox")
    f_avg, f_prox = frame_of(u_avg), frame_of(u_prox)
    moved_avg = np.linalg.norm(f_avg["weight"] - cut().weight)
    moved_prox = np.linalg.norm(f_prox["weight"] - cut().weight)
    assert moved_prox < 0.5 * moved_avg, (moved_prox, moved_avg)
    assert moved_prox > 0
    expected_w, _, _ = trained(features, device.y, 40, mu=5.0)
    np.testing.assert_allclose(f_prox["weight"], expected_w, rtol=1e-5, atol=1e-6)
    global_loss = cross_entropy(cut().weight, cut().bias, features[:, :-1], device.y)
    assert cross_entropy(f_prox["weight"], f_prox["bias"], features[:, :-1], device.y) < global_loss


def test_a_hierarchical_participant_sends_its_update_on_fl_not_as_an_event(make_device: Callable[..., Device], artefacts: tuple[InputRef, InputRef]) -> None:
    # Prepare
    device = make_device("dv-b", slice(300, 500))
    order = worker_order("wk-b", fl_order(artefacts, via_edge=True), topology="hierarchical")

    # Execute
    device.host.apply([order])
    eventually(lambda: device.published, what="the update on fl")
    device.events.wait(lambda: any(t.startswith("round 1:") and t.endswith("sent to the edge") for t in device.events.lines("wk-b")), what="the round line")

    # Assert: the FlChannel got it (what the edge's router accepts: from dv-b, naming only dv-b); the hub no event
    (update,) = device.published
    assert update.contributors == ["dv-b"] and update.worker_id == "wk-b" and update.num_examples == 200 and not update.masked
    router, got = FlRouter(EDGE), []
    router.serve(TASK, got.append)
    deliver(router, update)
    assert got == [update] and router.counters["routed"] == 1 and router.counters["rejected"] == 0
    assert device.events.updates() == []


# ---- refusals -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "case", ["model", "dataset", "labels", "channel", "dp", "aggregator_on_a_device"],
)
def test_orders_a_participant_cannot_run_are_rejected(make_device: Callable[..., Device], artefacts: tuple[InputRef, InputRef], case: str) -> None:
    # Prepare
    d = digits()
    wide = (d.x_device[:50], np.where(np.arange(50) == 7, 10, d.y_device[:50]))  # one label past the layer's 10 classes
    device = make_device("dv-a", slice(0, 100), channel=case != "channel", extra={"wide": wide})
    fl = fl_order(artefacts)
    spec: dict[str, Any] = {}
    role = "worker"
    if case == "model":
        fl = fl_order(artefacts, base_sha256="0" * 64)
    elif case == "dataset":
        spec = {"dataset": "elsewhere"}
    elif case == "labels":
        spec = {"dataset": "wide"}
    elif case == "dp":
        spec = {"dp": {"clip_norm": 1.0, "noise_multiplier": 1.0}}  # and the order has no sample_rate
    elif case == "aggregator_on_a_device":
        role = FL_AGGREGATOR
    order = worker_order("wk-a", fl, role=role, **spec)

    # Execute
    device.host.apply([order])
    final = device.events.final("wk-a")

    # Assert
    reasons = {
        "model": ["is not the model the hub cut", cut().base_sha256[:12], "(000000000000)"],
        "dataset": ["no dataset 'elsewhere'"],
        "labels": ["labels run 0..10; the layer has 10 classes"],
        "channel": ["no federated channel"],
        "dp": ["must carry the sampling rate"],
        "aggregator_on_a_device": ["aggregates no federated updates"],
    }[case]
    assert final.state == "REJECTED" and all(r in final.detail for r in reasons), final
    assert device.events.updates() == [] and device.published == []


# ---- an edge's aggregator -----------------------------------------------------------------------------
def aggregator_order(refs: tuple[InputRef, InputRef], participants: list[str], *, round: int = 1, attempt: int = 1, deadline_s: float = 60.0,
                     round_timeout_s: float = 60.0, **fields: Any) -> WorkerOrder:  # fmt: skip
    fl = fl_order(refs, round=round, attempt=attempt, deadline_s=deadline_s, participants=participants, **fields)
    return worker_order("wk-edge", fl, role=FL_AGGREGATOR, topology="hierarchical", round_timeout_s=round_timeout_s)


def test_the_aggregator_sends_one_combined_update_of_its_round_attempts_participants(edge: Edge, artefacts: tuple[InputRef, InputRef]) -> None:
    # Prepare: participants dv-a and dv-b; the round's deadline far off
    order = aggregator_order(artefacts, ["dv-a", "dv-b"])
    a, b = synthetic("dv-a", 100, 1, loss=2.0, accuracy=0.3), synthetic("dv-b", 300, 2, loss=1.0, accuracy=0.7)

    # Execute
    edge.host.apply([order])
    running(edge.events, "wk-edge")

    # Assert: it registered with the router (the task's one aggregator on this node)
    with pytest.raises(ValueError, match="already has an aggregator"):
        edge.router.serve(TASK, lambda u: None)

    # Execute: a device that is not a participant, dv-a for another attempt, then dv-b
    deliver(edge.router, synthetic("dv-c", 500, 3))
    deliver(edge.router, synthetic("dv-a", 100, 4, attempt=2))
    deliver(edge.router, b)
    time.sleep(0.3)  # a window showing absence: nothing sent on dv-b's update alone; an aggregator that keeps waiting says nothing that could mark it

    # Assert: still waiting for dv-a's update of this attempt
    assert edge.events.updates() == []

    # Execute
    deliver(edge.router, a)
    (sent,) = edge.events.wait(lambda: edge.events.updates("wk-edge"), what="the combined update")

    # Assert: ONE update: the sample-weighted mean of dv-a's and dv-b's (and of nobody else's)
    assert (sent.task_id, sent.round, sent.attempt, sent.masked) == (TASK, 1, 1, False)
    assert sent.contributors == ["dv-a", "dv-b"] and sent.num_examples == 400
    expected = combine([plain(b), plain(a)])
    got = frame_of(sent)
    assert set(got) == {"weight", "bias"} and got["weight"].dtype == np.float32
    for name in ("weight", "bias"):
        np.testing.assert_allclose(got[name], expected.weights[name], rtol=0, atol=1e-6)
    assert sent.metrics == pytest.approx({"loss": 1.25, "accuracy": 0.6})
    edge.events.wait(lambda: "round 1: 2 of 2 devices combined and sent" in edge.events.lines("wk-edge"), what="the line the aggregator logs after sending round 1")
    assert len(edge.events.updates()) == 1, "a non-participant's update was forwarded"

    # Execute: round 2 (the worker's order once apply returns); a late round-1 update arrives, then round 2's
    edge.host.apply([aggregator_order(artefacts, ["dv-a", "dv-b"], round=2)])
    deliver(edge.router, synthetic("dv-a", 100, 5, round=1))
    a2, b2 = synthetic("dv-a", 100, 6, round=2), synthetic("dv-b", 300, 7, round=2)
    deliver(edge.router, a2)
    deliver(edge.router, b2)
    edge.events.wait(lambda: any(u.round == 2 for u in edge.events.updates()), what="round 2's update")

    # Assert: the aggregator sends in order, so anything more of round 1 would have come before round 2's update
    assert [u.round for u in edge.events.updates()] == [1, 2], "a non-participant's update or an update of an older round was sent"
    # round 2's combined update; nothing of round 1's left
    sent2 = edge.events.updates()[1]
    assert (sent2.round, sent2.contributors, sent2.num_examples) == (2, ["dv-a", "dv-b"], 400)
    np.testing.assert_allclose(frame_of(sent2)["weight"], combine([plain(a2), plain(b2)]).weights["weight"], rtol=0, atol=1e-6)
    samples = edge.events.wait(lambda: [m.values for m in edge.events.of(TASK_METRICS_EVENT, "wk-edge") if m.values.get("rounds") == 2], what="metrics")
    assert samples[-1]["forwarded"] == 0

    # Execute: the order is withdrawn
    edge.host.apply([])

    # Assert: it unregistered from the router (another aggregator of the task may serve now)
    eventually(lambda: _serves(edge.router), timeout=60, what="the router free of the withdrawn aggregator")
    assert [r.state for r in edge.events.reports("wk-edge")] == ["RUNNING"] * len(edge.events.reports("wk-edge"))


def _serves(router: FlRouter) -> bool:
    try:
        router.serve(TASK, lambda u: None)
    except ValueError:
        return False
    return True


def test_the_aggregator_sends_what_it_has_at_the_margin_then_forwards_a_late_update(edge: Edge, artefacts: tuple[InputRef, InputRef]) -> None:
    # Prepare: a round of 2 s whose deadline is 1.6 s away: the aggregator sends EDGE_MARGIN * 2 s = 0.4 s before it
    margin = min(2.0, EDGE_MARGIN * 2.0)
    a, b = synthetic("dv-a", 100, 1), synthetic("dv-b", 300, 2)
    deadline = time.monotonic() + 1.6
    order = aggregator_order(artefacts, ["dv-a", "dv-b"], deadline_s=1.6, round_timeout_s=2.0)

    # Execute: only dv-a answers in time
    edge.host.apply([order])
    running(edge.events, "wk-edge")
    deliver(edge.router, a)
    (sent,) = edge.events.wait(lambda: edge.events.updates("wk-edge"), timeout=60, what="dv-a's update alone")

    # Assert: sent at the margin before the deadline, dv-a's layer as it came
    at = edge.events.arrival(sent)
    assert deadline - margin - 0.1 <= at < deadline, (deadline - at)
    assert sent.contributors == ["dv-a"] and sent.num_examples == 100 and sent.data == a.data and sent.metrics == a.metrics

    # Execute: dv-b's update arrives after that
    deliver(edge.router, b)
    edge.events.wait(lambda: len(edge.events.updates()) == 2, what="the forwarded update")

    # Assert: forwarded on its own, once
    late = edge.events.updates()[1]
    assert (late.round, late.attempt, late.contributors, late.num_examples, late.data) == (1, 1, ["dv-b"], 300, b.data)
    deliver(edge.router, b)  # redelivered (QoS 1)
    samples = edge.events.wait(lambda: [m.values for m in edge.events.of(TASK_METRICS_EVENT, "wk-edge") if m.values.get("forwarded") == 1], what="metrics")
    assert samples[-1]["rounds"] == 1
    time.sleep(0.2)  # a window showing absence: the redelivered update is not forwarded again; the aggregator drops it without a line or event to wait for
    assert len(edge.events.updates()) == 2


def test_an_adaptive_round_shorter_than_the_margin_still_combines_its_participants(edge: Edge, artefacts: tuple[InputRef, InputRef]) -> None:
    # Prepare: sync adaptive has shrunk the round to 1.5 s (round_timeout_s stays 60: a margin of min(2, 12) = 2 s)
    a, b = synthetic("dv-a", 100, 1), synthetic("dv-b", 300, 2)
    fl = fl_order(artefacts, deadline_s=1.5, participants=["dv-a", "dv-b"])
    order = worker_order("wk-edge", fl, role=FL_AGGREGATOR, topology="hierarchical", round_timeout_s=60, sync="adaptive")
    edge.host.apply([order])
    running(edge.events, "wk-edge")

    # Execute: both devices answer well within the round, 0.3 s apart
    deliver(edge.router, a)
    time.sleep(0.3)
    deliver(edge.router, b)
    edge.events.wait(lambda: edge.events.updates("wk-edge"), timeout=60, what="an update")
    edge.events.wait(lambda: any(t.startswith("round 1: ") and t.endswith("combined and sent") for t in edge.events.lines("wk-edge")), what="the line the aggregator logs after sending round 1")

    # Assert: one combined update, as when every participant answered in time
    assert [u.contributors for u in edge.events.updates()] == [["dv-a", "dv-b"]]


# ---- secure aggregation -------------------------------------------------------------------------------
def secure_spec() -> dict[str, Any]:
    return {"secure_aggregation": True, "topology": "hierarchical"}


def keys_of(*devices: Device) -> dict[str, str]:
    """Each device's X25519 key from its fl.key event."""
    out = {}
    for device in devices:
        (key,) = device.events.wait(lambda d=device: d.events.of(FL_KEY_EVENT), what=f"{device.identity}'s key")
        assert key.task_id == TASK
        out[device.identity] = key.public_key
    return out


def test_secure_aggregation_the_edge_sums_masked_updates_to_the_weighted_mean(
    tmp_path: Path, make_device: Callable[..., Device], edge: Edge, artefacts: tuple[InputRef, InputRef]
) -> None:
    # Prepare: two devices (200 and 300 rows) whose fl messages reach the edge's router
    dev_a, dev_b = make_device("dv-a", slice(0, 200)), make_device("dv-b", slice(200, 500))
    lock = threading.Lock()

    def to_edge(update: FlUpdate) -> None:
        with lock:
            deliver(edge.router, update)

    dev_a.forward = dev_b.forward = to_edge
    wa, wb = (dev.host for dev in (dev_a, dev_b))
    order_a, order_b = worker_order("wk-a", None, **secure_spec()), worker_order("wk-b", None, **secure_spec())
    wa.apply([order_a])
    wb.apply([order_b])
    peers = keys_of(dev_a, dev_b)
    fl = fl_order(artefacts, via_edge=True, secure=True, peers=peers, total_examples=500)
    edge.host.apply([aggregator_order(artefacts, ["dv-a", "dv-b"], secure=True, peers=peers, total_examples=500)])
    running(edge.events, "wk-edge")

    # Execute
    wa.apply([with_fl(order_a, fl)])
    wb.apply([with_fl(order_b, fl)])
    (total,) = edge.events.wait(lambda: edge.events.updates("wk-edge"), what="the edge's masked sum")

    # Assert: each device sent noise, the edge their plain uint32 sum, and the sum is the weighted mean
    (ua,), (ub,) = dev_a.published, dev_b.published
    assert ua.masked and ub.masked and ua.num_examples == 200 and ub.num_examples == 300
    fa, fb, ft = frame_of(ua), frame_of(ub), frame_of(total)
    assert all(f[n].dtype == np.uint32 for f in (fa, fb, ft) for n in ("weight", "bias"))
    assert total.masked and total.contributors == ["dv-a", "dv-b"] and total.num_examples == 500
    for name in ("weight", "bias"):
        np.testing.assert_array_equal(ft[name], fa[name] + fb[name])  # mod 2^32
    plain_a = trained(features_of(tmp_path, dev_a.x), dev_a.y, STEPS)
    plain_b = trained(features_of(tmp_path, dev_b.x), dev_b.y, STEPS)
    for i, name in enumerate(("weight", "bias")):
        mean = (200 * plain_a[i].astype(np.float64) + 300 * plain_b[i]) / 500
        np.testing.assert_allclose(secagg.decode(ft[name]), mean, rtol=0, atol=2e-5)  # 2 roundings of 2^-17, plus float32
        alone = secagg.decode(fa[name]) - 200 / 500 * plain_a[i]
        assert np.abs(alone).max() > 100, "a single masked update is not noise"
    assert dev_a.events.updates() == [] and dev_b.events.updates() == []


def test_a_participant_whose_key_is_not_in_peers_skips_the_round(make_device: Callable[..., Device], artefacts: tuple[InputRef, InputRef]) -> None:
    # Prepare
    device = make_device("dv-b", slice(0, 200))
    order = worker_order("wk-b", None, **secure_spec())
    device.host.apply([order])
    peers = {**keys_of(device), "dv-a": public_b64(X25519PrivateKey.generate())}
    stale = {**peers, "dv-b": public_b64(X25519PrivateKey.generate())}  # e.g. its previous run's key

    # Execute: the order lists another key for it (and asks for reveals, as if it had masked)
    device.host.apply([with_fl(order, fl_order(artefacts, via_edge=True, secure=True, peers=stale, total_examples=400))])
    time.sleep(0.3)  # a window showing absence: no update with a key the others did not mask with; the worker skips the attempt without a line or event to wait for
    device.host.apply([with_fl(order, fl_order(artefacts, via_edge=True, secure=True, peers=stale, total_examples=400, reveal=["dv-a"]))])
    time.sleep(0.3)  # a window showing absence: no seed revealed for an attempt it did not mask; skipping the reveal leaves no line or event to wait for

    # Assert: no update, no seed revealed (it masked nothing)
    assert device.published == [] and device.events.of(FL_REVEAL_EVENT) == []

    # Execute: the next attempt lists its key
    device.host.apply([with_fl(order, fl_order(artefacts, attempt=2, via_edge=True, secure=True, peers=peers, total_examples=400))])

    # Assert: it takes part
    (update,) = eventually(lambda: device.published, what="attempt 2's update")
    assert (update.attempt, update.masked) == (2, True)


def test_a_participant_that_masked_reveals_its_seed_with_a_dropped_peer_only(
    tmp_path: Path, make_device: Callable[..., Device], artefacts: tuple[InputRef, InputRef]
) -> None:
    # Prepare: dv-a masks with dv-c and dv-d (keys held here; neither sends an update)
    device = make_device("dv-a", slice(0, 200))
    order = worker_order("wk-a", None, **secure_spec())
    device.host.apply([order])
    key_c, key_d = X25519PrivateKey.generate(), X25519PrivateKey.generate()
    peers = {**keys_of(device), "dv-c": public_b64(key_c), "dv-d": public_b64(key_d)}
    fl = fl_order(artefacts, via_edge=True, secure=True, peers=peers, total_examples=400)
    device.host.apply([with_fl(order, fl)])
    (update,) = eventually(lambda: device.published, what="dv-a's masked update")
    public_a = X25519PublicKey.from_public_bytes(base64.b64decode(peers["dv-a"]))
    seed_c = secagg.pair_seed(key_c.exchange(public_a), f"{TASK}/1/1", "dv-c", "dv-a")  # dv-c's side of the exchange
    seed_d = secagg.pair_seed(key_d.exchange(public_a), f"{TASK}/1/1", "dv-d", "dv-a")

    # Execute: dv-c dropped; the order asks for the seeds with it (and with dv-z, which dv-a never masked with)
    device.host.apply([with_fl(order, fl.model_copy(update={"reveal": ["dv-c", "dv-z"]}))])
    (reveal,) = device.events.wait(lambda: device.events.of(FL_REVEAL_EVENT), what="the reveal")
    device.host.apply([with_fl(order, fl.model_copy(update={"reveal": ["dv-c", "dv-z"], "deadline_at": fl.deadline_at + timedelta(seconds=5)}))])
    time.sleep(0.3)  # a window showing absence: no second reveal of the same attempt; the worker passes a reveal it sent without a line or event to wait for

    # Assert: one reveal, of exactly the seed of the X25519 exchange with dv-c (never the one with dv-d, alive)
    assert len(device.events.of(FL_REVEAL_EVENT)) == 1
    assert (reveal.task_id, reveal.worker_id, reveal.round, reveal.attempt) == (TASK, "wk-a", 1, 1)
    assert reveal.seeds == {"dv-c": base64.b64encode(seed_c).decode("ascii")}
    # those are the masks dv-a applied: without them its update is its layer scaled by 200 / 400
    unmasked = secagg.unmask_sum(frame_of(update), {"dv-c": {"dv-a": seed_c}, "dv-d": {"dv-a": seed_d}})
    w, b, _ = trained(features_of(tmp_path, device.x), device.y, STEPS)
    np.testing.assert_allclose(secagg.decode(unmasked["weight"]), w * 200 / 400, rtol=0, atol=1e-5)
    np.testing.assert_allclose(secagg.decode(unmasked["bias"]), b * 200 / 400, rtol=0, atol=1e-5)
