"""Split inference below the hub (DESIGN §4.4, §5), over a real Mosquitto set up like the hub's (mutual TLS, the
ACL): the device's :class:`InferChannel` (a paho MQTT 5 client with the device's certificate) and the edge's
:class:`TailRouter` (on an ``edge.link.Link`` whose event loop runs on its own thread); then the
``split_inference`` worker programs run by real WorkerHosts on both sides, the tails on the "edge", the heads on
the "device", their parts cut from the digits models and fetched as signed artefacts from an artefact server."""

from __future__ import annotations

import asyncio
import hashlib
import os
import ssl
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from cloud.ml.partition import candidate_cuts, split_model
from cloud.signing import SigningKey
from device.ota.download import Downloader
from device.ota.models import ModelHost
from device.runtime import open_model
from device.session import SessionPlan
from device.split.channel import EdgeError, EdgeTimeout, InferChannel, NotConnected, SplitUnavailable
from device.tasks import InputFetcher, WorkerHost
from edge.link import Link
from edge.split import TailRouter
from interfaces.deployments import ArtifactFormat, ArtifactKind, ArtifactManifest
from interfaces.infer import InferReply, InferRequest
from interfaces.tasks import (
    SPLIT_EDGE_ONLY,
    SPLIT_HEAD,
    SPLIT_TAIL,
    TASK_METRICS_EVENT,
    InputRef,
    SplitInferenceSpec,
    SplitOrder,
    SplitPart,
    TaskType,
    WorkerOrder,
    worker_order,
)  # fmt: skip
from interfaces.topics import DEVICE_INFER, DEVICE_INFER_REPLY
from tests.device.ota_support import TOKEN, BlobServer, blob_server
from tests.device.test_task_worker import Events
from tests.edge.support import Mosquitto, Peer, Pki, edge_acl, needs_mosquitto, wait_until

pytestmark = [pytest.mark.broker, needs_mosquitto]

NODE = "nd-edge1"
DEVICE = "dev-cam1"
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "models"
MLP_TASK, CNN_TASK = "tk-split-mlp", "tk-split-cnn"
CNN_CUT = "max_pool2d"


# ---- the two ends of the channel -------------------------------------------------------------------------
def head_of(task_id: str) -> WorkerOrder:
    return worker_order(worker_id=f"wk-head-{task_id}", task_id=task_id, type=TaskType.SPLIT_INFERENCE, role=SPLIT_HEAD, spec={"model": {"name": "m"}})


class Edge:
    """The edge's end: a :class:`TailRouter` on a downstream :class:`Link` (the node's certificate); the link's
    event loop runs on a thread of its own, so that the test's threads play the device and the workers."""

    def __init__(self, broker: Mosquitto, pki: Pki, attach: bool = True) -> None:
        crt, key = pki.identity(NODE)
        tls = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(pki.ca_path))
        tls.load_cert_chain(str(crt), str(key))
        self.link = Link("downstream", broker.url, tls, SessionPlan(NODE, connect_timeout_s=5))
        self.router = TailRouter(threads=4)
        # what the hub's orders, relayed by the edge, say: the device runs a head of each task these tests ask for
        self.router.learn_orders(DEVICE, [head_of(t) for t in ("tk-echo", "tk-other", "tk-missing", "tk-held", "tk-fragile")])
        if attach:
            self.router.attach(self.link)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="edge-loop", daemon=True)
        self._thread.start()
        self._stop: asyncio.Event | None = None
        self._running: Future[None] | None = None

    def run(self, coroutine: Coroutine[Any, Any, Any], timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def start(self) -> Edge:
        """Connect (again); return once subscribed."""

        async def event() -> asyncio.Event:
            return asyncio.Event()

        self._stop = self.run(event())
        self._running = asyncio.run_coroutine_threadsafe(self.link.run(self._stop), self.loop)
        wait_until(lambda: self.link.client is not None, 60, "the edge's link connected and subscribed")
        return self

    def stop(self) -> None:
        """Disconnect the link (the router keeps its tails)."""
        if self._running is not None and self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
            self._running.result(10)
            self._running = None

    def close(self) -> None:
        self.stop()
        self.run(self.router.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()


class Device:
    """The device's end: an :class:`InferChannel` over a paho MQTT 5 client with the device's certificate,
    wired the way ``device.agent`` wires it (publish as it is; what arrives on ``infer/reply`` to ``on_reply``)."""

    def __init__(self, broker: Mosquitto, pki: Pki, device_id: str = DEVICE) -> None:
        self.channel = InferChannel(device_id, self._publish)
        self.peer = Peer(broker, pki, device_id, [DEVICE_INFER_REPLY.topic(device_id=device_id)], on_message=self._arrived)

    def _publish(self, topic: str, payload: bytes, qos: int, properties: Properties) -> bool:
        client = self.peer.client
        if not client.is_connected():
            return False
        return client.publish(topic, payload, qos=qos, properties=properties).rc == mqtt.MQTT_ERR_SUCCESS

    def _arrived(self, peer: Peer, message: mqtt.MQTTMessage) -> None:
        if message.topic == self.channel.reply_topic:
            self.channel.on_reply(message.payload, message.properties)

    def send_raw(self, topic: str, payload: bytes, correlation: bytes | None, pairs: list[tuple[str, str]]) -> None:
        """Publish what ``InferChannel.call`` would not: any correlation data, any user properties."""
        props = Properties(PacketTypes.PUBLISH)
        props.ResponseTopic = self.channel.reply_topic
        if correlation is not None:
            props.CorrelationData = correlation
        if pairs:
            props.UserProperty = pairs
        self.peer.publish(topic, payload, qos=0, properties=props)


@pytest.fixture
def broker(tmp_path: Path, pki: Pki, cleanup: list[Callable[[], object]]) -> Mosquitto:
    b = Mosquitto(tmp_path / "devices-broker", pki, edge_acl(NODE, [DEVICE])).start()
    cleanup.append(b.stop)
    return b


@pytest.fixture
def edge(broker: Mosquitto, pki: Pki, cleanup: list[Callable[[], object]]) -> Edge:
    e = Edge(broker, pki)
    cleanup.append(e.close)
    return e.start()


@pytest.fixture
def device(broker: Mosquitto, pki: Pki, cleanup: list[Callable[[], object]]) -> Device:
    d = Device(broker, pki)
    cleanup.append(d.peer.close)
    return d


def echo(request: InferRequest, payload: bytes) -> tuple[InferReply, bytes]:
    """An answer function that says which request it answers: the request's cut, then its payload."""
    return InferReply(status="ok", tail_ms=0.5), request.cut.encode() + b"|" + payload


def counted(router: TailRouter, **expected: int) -> dict[str, int]:
    """The router's counters once they say ``expected`` (an answer is counted just after it left)."""
    want = {"requests": 0, "answered": 0, "refused": 0, "dropped": 0, **expected}
    wait_until(lambda: router.counters == want, 60, what=f"router counters {want} (now {router.counters})")
    return router.counters


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    started = time.monotonic()
    return fn(), time.monotonic() - started


def raises(fn: Callable[[], object], kind: type[BaseException]) -> tuple[BaseException, float]:
    started = time.monotonic()
    with pytest.raises(kind) as caught:
        fn()
    return caught.value, time.monotonic() - started


# ---- 1. the channel and the router -------------------------------------------------------------------------
def test_a_request_answers_with_the_answer_of_its_task(edge: Edge, device: Device) -> None:
    # Prepare
    edge.router.serve("tk-echo", echo)

    # Execute
    (reply, payload), seconds = timed(lambda: device.channel.call(InferRequest(task_id="tk-echo", cut="relu"), b"\x00\x01data", 5.0))  # type: ignore[misc]

    # Assert
    assert (reply.status, reply.tail_ms, payload) == ("ok", 0.5, b"relu|\x00\x01data")
    assert seconds < 2.0
    counted(edge.router, requests=1, answered=1)
    assert device.channel.dropped == 0


def test_a_request_for_a_task_without_a_tail_here_is_refused_at_once_naming_the_task(edge: Edge, device: Device) -> None:
    # Prepare: the edge serves another task
    edge.router.serve("tk-other", echo)

    # Execute
    error, seconds = raises(lambda: device.channel.call(InferRequest(task_id="tk-missing", cut="relu"), b"x", 5.0), EdgeError)

    # Assert: an error answer, not a timeout: well under the 5 s the device would have waited
    assert isinstance(error, SplitUnavailable)
    assert "this edge runs no tail of task tk-missing" in str(error)
    assert seconds < 1.0
    counted(edge.router, requests=1, refused=1)
    assert device.channel.dropped == 0


@pytest.mark.parametrize("edge_state", ["no edge connected", "router not attached"])
def test_nobody_answering_is_a_timeout_after_about_the_timeout(
    broker: Mosquitto, pki: Pki, device: Device, cleanup: list[Callable[[], object]], edge_state: str
) -> None:
    # Prepare: either nothing on the edge's side at all, or a link up whose router never took the topic
    if edge_state == "router not attached":
        idle = Edge(broker, pki, attach=False)
        cleanup.append(idle.close)
        idle.start()
        idle.router.serve("tk-echo", echo)

    # Execute
    error, seconds = raises(lambda: device.channel.call(InferRequest(task_id="tk-echo"), b"x", 0.3), EdgeTimeout)

    # Assert
    assert isinstance(error, SplitUnavailable)
    assert "did not answer within 300 ms" in str(error)
    assert 0.29 <= seconds < 1.0


def test_a_device_not_connected_fails_at_once(device: Device) -> None:
    # Prepare
    device.peer.close()

    # Execute
    error, seconds = raises(lambda: device.channel.call(InferRequest(task_id="tk-echo"), b"x", 5.0), NotConnected)

    # Assert
    assert isinstance(error, SplitUnavailable) and seconds < 0.5


def test_requests_without_usable_correlation_data_are_dropped_and_malformed_ones_refused(edge: Edge, device: Device) -> None:
    # Prepare: a task served, whose answer function records its calls
    calls: list[InferRequest] = []

    def answer(request: InferRequest, payload: bytes) -> tuple[InferReply, bytes]:
        calls.append(request)
        return echo(request, payload)

    edge.router.serve("tk-echo", answer)
    topic, reply_topic = DEVICE_INFER.topic(device_id=DEVICE), DEVICE_INFER_REPLY.topic(device_id=DEVICE)
    pairs = InferRequest(task_id="tk-echo", cut="relu").pairs()

    # Execute 1: no correlation data; correlation data longer than the 64 bytes the contract allows
    device.send_raw(topic, b"x", None, pairs)
    device.send_raw(topic, b"x", os.urandom(65), pairs)
    wait_until(lambda: edge.router.counters["requests"] == 2, 60, what="both requests at the edge")

    # Assert 1: dropped, counted; nothing answered, the tail never asked
    assert device.peer.drain(reply_topic, quiet_s=0.5) == []
    counted(edge.router, requests=2, dropped=2)
    assert calls == []

    # Execute 2: correlation data but no request properties
    correlation = os.urandom(16)
    device.send_raw(topic, b"x", correlation, [("unrelated", "1")])
    message = device.peer.expect(reply_topic, 5, where=lambda m: m.properties.CorrelationData == correlation)  # type: ignore[union-attr]

    # Assert 2: an error answer the device can match, naming what is wrong
    reply = InferReply.from_pairs(message.properties.UserProperty)  # type: ignore[union-attr]
    assert reply.status == "error" and "InferRequest" in reply.error and "task_id" in reply.error
    assert message.payload == b""
    counted(edge.router, requests=3, refused=1, dropped=2)
    assert calls == []


def test_answers_matching_no_request_in_flight_are_dropped_and_satisfy_none(edge: Edge, device: Device) -> None:
    # Prepare: a tail that answers only when let go
    let_go = threading.Event()

    def held(request: InferRequest, payload: bytes) -> tuple[InferReply, bytes]:
        assert let_go.wait(10)
        return echo(request, payload)

    edge.router.serve("tk-held", held)
    reply_topic = device.channel.reply_topic
    ok_pairs = InferReply(status="ok").pairs()

    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(device.channel.call, InferRequest(task_id="tk-held", cut="a"), b"mine", 10.0)
        wait_until(lambda: edge.router.counters["requests"] == 1, 60, what="the request at the edge")

        # Execute 1: while it waits, an answer with correlation data of no request, one without any, one malformed
        device.send_raw(reply_topic, b"forged", os.urandom(16), ok_pairs)
        device.send_raw(reply_topic, b"forged", None, ok_pairs)
        device.send_raw(reply_topic, b"forged", os.urandom(16), [("status", "maybe")])
        wait_until(lambda: device.channel.dropped == 3, 60, what="three answers dropped")

        # Assert 1: the request still waits for its own answer, and gets it
        time.sleep(0.1)
        assert not pending.done()
        let_go.set()
        reply, payload = pending.result(5)
    assert (reply.status, payload) == ("ok", b"a|mine")
    assert device.channel.dropped == 3

    # Execute 2: a request that times out; its answer comes late
    let_go.clear()
    raises(lambda: device.channel.call(InferRequest(task_id="tk-held", cut="b"), b"late", 0.2), EdgeTimeout)
    let_go.set()

    # Assert 2: the late answer is dropped too
    wait_until(lambda: device.channel.dropped == 4, 60, what="the late answer dropped")
    wait_until(lambda: edge.router.counters["answered"] == 2, 60, what="both answered")


def test_concurrent_requests_each_get_their_own_answer(edge: Edge, device: Device) -> None:
    # Prepare: an answer that takes a varying time, so answers come back out of order
    def shuffled(request: InferRequest, payload: bytes) -> tuple[InferReply, bytes]:
        time.sleep(0.002 * (int(request.cut.removeprefix("c")) % 5))
        return echo(request, payload)

    edge.router.serve("tk-echo", shuffled)
    n = 24

    def one(i: int) -> bytes:
        return device.channel.call(InferRequest(task_id="tk-echo", cut=f"c{i}"), f"payload-{i}".encode() * (i + 1), 5.0)[1]

    # Execute: from 8 threads
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, range(n)))

    # Assert
    assert answers == [f"c{i}|".encode() + f"payload-{i}".encode() * (i + 1) for i in range(n)]
    counted(edge.router, requests=n, answered=n)
    assert device.channel.dropped == 0


# ---- 5. the router's own rules -----------------------------------------------------------------------------
def test_the_router_takes_one_tail_per_task() -> None:
    # Prepare
    router = TailRouter()
    router.serve("tk-1", echo)

    def other(request: InferRequest, payload: bytes) -> tuple[InferReply, bytes]:
        return echo(request, payload)

    # Execute / Assert: a second tail for the task is refused; the same one again is no change
    with pytest.raises(ValueError, match="task tk-1 already has a tail on this edge"):
        router.serve("tk-1", other)
    router.serve("tk-1", echo)
    router.serve("tk-2", other)
    assert router.serving() == ["tk-1", "tk-2"]
    router.unserve("tk-1", other)  # not its tail: nothing changes
    assert router.serving() == ["tk-1", "tk-2"]
    router.unserve("tk-1", echo)
    assert router.serving() == ["tk-2"]
    router.serve("tk-1", other)  # free again
    assert router.serving() == ["tk-1", "tk-2"]


def test_an_answer_function_that_raises_is_an_error_answer_and_the_router_goes_on(edge: Edge, device: Device) -> None:
    # Prepare
    def fragile(request: InferRequest, payload: bytes) -> tuple[InferReply, bytes]:
        if payload == b"boom":
            raise RuntimeError("the tail broke")
        return echo(request, payload)

    edge.router.serve("tk-fragile", fragile)
    request = InferRequest(task_id="tk-fragile", cut="c")

    # Execute
    error, seconds = raises(lambda: device.channel.call(request, b"boom", 5.0), EdgeError)
    after = device.channel.call(request, b"fine", 5.0)

    # Assert: the device heard why at once; the next request is answered
    assert "RuntimeError: the tail broke" in str(error) and seconds < 1.0
    assert after[1] == b"c|fine"
    counted(edge.router, requests=2, answered=2)


# ---- the worker programs: models cut, signed parts, hosts on both sides --------------------------------------
@dataclass
class Cut:
    """A model and its parts at each of ``cuts``, as signed artefacts the server serves."""

    name: str
    path: Path
    sha256: str
    cuts: list[str]
    heads: dict[str, InputRef] = field(default_factory=dict)
    tails: dict[str, InputRef] = field(default_factory=dict)
    whole: InputRef | None = None

    def run(self, x: np.ndarray) -> dict[str, np.ndarray]:
        return open_model(self.path).run({"x": x})


def model_ref(signing: SigningKey, server: BlobServer, data: bytes, name: str) -> InputRef:
    """``data`` (an ONNX model) as the hub hands a part to a worker: signed manifest, path, token."""
    sha = hashlib.sha256(data).hexdigest()
    manifest = ArtifactManifest(name=name, version="1.0.0", kind=ArtifactKind.MODEL, format=ArtifactFormat.ONNX, sha256=sha, size=len(data), created_at=datetime.now(UTC))
    artifact_id = f"art-{sha[:12]}"
    path = f"/artifacts/{artifact_id}/content"
    server.blobs[path] = data
    return InputRef(artifact_id=artifact_id, signed_manifest=signing.sign_manifest(manifest), path=path, token=TOKEN)


def cut(signing: SigningKey, server: BlobServer, path: Path, name: str, cuts: list[str] | None = None) -> Cut:
    data = path.read_bytes()
    model = onnx.load(str(path))
    chosen = cuts or candidate_cuts(model)
    result = Cut(name, path, hashlib.sha256(data).hexdigest(), chosen)
    for tensor in chosen:
        head, tail = split_model(model, tensor)
        result.heads[tensor] = model_ref(signing, server, head.SerializeToString(), f"{name}-head-{tensor}")
        result.tails[tensor] = model_ref(signing, server, tail.SerializeToString(), f"{name}-tail-{tensor}")
    result.whole = model_ref(signing, server, data, name)
    return result


@pytest.fixture(scope="module")
def signing(tmp_path_factory: pytest.TempPathFactory) -> SigningKey:
    return SigningKey.load_or_create(tmp_path_factory.mktemp("hub-pki"))


@pytest.fixture(scope="module")
def server() -> Iterator[BlobServer]:
    with blob_server() as s:
        yield s


@pytest.fixture(scope="module")
def mlp(signing: SigningKey, server: BlobServer) -> Cut:
    return cut(signing, server, FIXTURES / "digits-mlp.onnx", "digits-mlp")


@pytest.fixture(scope="module")
def cnn(signing: SigningKey, server: BlobServer) -> Cut:
    return cut(signing, server, FIXTURES / "digits-cnn.onnx", "digits-cnn", [CNN_CUT])


def tail_order(model: Cut, task_id: str, worker_id: str = "wk-tail", **overrides: Any) -> WorkerOrder:
    split = SplitOrder(base_sha256=model.sha256, input="x", parts=[SplitPart(cut=c, tail=model.tails[c]) for c in model.cuts], whole=model.whole)
    spec = {"model": {"name": model.name, "version": "1.0.0"}, "report_interval_s": 0.2}
    return worker_order(
        worker_id=worker_id, task_id=task_id, type=TaskType.SPLIT_INFERENCE, role=SPLIT_TAIL, spec=spec, heartbeat_s=0.2, split=split, **overrides
    )


def head_order(model: Cut, task_id: str, worker_id: str, base_sha256: str | None = None, **spec: Any) -> WorkerOrder:
    split = SplitOrder(base_sha256=base_sha256 or model.sha256, input="x", parts=[SplitPart(cut=c, head=model.heads[c]) for c in model.cuts])
    spec = {"model": {"name": model.name, "version": "1.0.0"}, "timeout_ms": 2000, "retry_after_s": 0.5, "report_interval_s": 0.2, **spec}
    SplitInferenceSpec.model_validate(spec)  # what the hub would have checked
    return worker_order(worker_id=worker_id, task_id=task_id, type=TaskType.SPLIT_INFERENCE, role=SPLIT_HEAD, spec=spec, heartbeat_s=0.2, split=split)


def metrics(events: Events, worker_id: str) -> dict[str, float]:
    """The worker's latest metrics sample."""
    samples = events.of(TASK_METRICS_EVENT, worker_id)
    return dict(samples[-1].values) if samples else {}


@dataclass
class Rig:
    edge: Edge
    device: Device
    edge_host: WorkerHost
    edge_events: Events
    device_host: WorkerHost
    device_events: Events
    models: ModelHost
    mlp: Cut
    cnn: Cut
    head_id: str | None = None

    def tails(self, *orders: WorkerOrder) -> None:
        """The edge's orders are ``orders``; wait until the router serves exactly their tasks."""
        self.edge_host.apply(list(orders))
        wanted = sorted({o.task_id for o in orders})
        wait_until(lambda: self.edge.router.serving() == wanted, 60, what=f"the edge serving {wanted}")

    def head(self, model: Cut, task_id: str, **spec: Any) -> WorkerOrder:
        """Replace the device's head worker with one for ``model`` (the previous one withdrawn first: one route
        per model); wait until it calibrated with the edge."""
        self.device_host.apply([])
        wait_until(lambda: not self.models.routed(self.mlp.name) and not self.models.routed(self.cnn.name), 60, what="the old head's route removed")
        order = head_order(model, task_id, f"wk-head-{len(self.device_events.items)}", **spec)
        self.edge.router.learn_orders(DEVICE, [order])  # the order, relayed by the edge, reaches the router too
        self.device_host.apply([order])
        self.head_id = order.worker_id
        self.device_events.wait(
            lambda: "estimate_ms" in metrics(self.device_events, order.worker_id) or any(r.state != "RUNNING" for r in self.device_events.reports(order.worker_id)),
            20, what=f"head {spec} calibrated",
        )  # fmt: skip
        assert [w.state for w in self.device_host.workers()] == ["RUNNING"], self.device_events.lines(order.worker_id)
        return order

    def head_metrics(self, **at_least: float) -> dict[str, float]:
        """The head's metrics once a sample shows at least ``at_least``."""
        assert self.head_id is not None
        return self.device_events.wait(
            lambda: (m := metrics(self.device_events, self.head_id)) and all(m.get(k, -1) >= v for k, v in at_least.items()) and m,  # type: ignore[arg-type]
            10, what=f"head metrics with {at_least}",
        )  # fmt: skip


def fetcher(tmp_path: Path, server: BlobServer, signing: SigningKey, name: str) -> InputFetcher:
    downloader = Downloader(server.base_url, tmp_path / f"{name}-partial", attempts=1)
    return InputFetcher(tmp_path / f"{name}-inputs", lambda: signing.public_key, lambda: downloader)


@pytest.fixture
def rig(
    tmp_path: Path, edge: Edge, device: Device, server: BlobServer, signing: SigningKey, mlp: Cut, cnn: Cut, cleanup: list[Callable[[], object]]
) -> Rig:
    # the edge node: no model of its own, its workers answer through the router
    edge_events = Events()
    edge_host = WorkerHost(tmp_path / "edge-tasks", ModelHost(tmp_path / "edge-models"), edge_events, fetcher(tmp_path, server, signing, "edge"), infer=edge.router)
    # the device: both models installed, its workers ask through the channel
    models = ModelHost(tmp_path / "device-models", threads=1)
    for model in (mlp, cnn):
        models.activate(models.load(model.name, "1.0.0", model.sha256, ArtifactFormat.ONNX, model.path))
    device_events = Events()
    device_host = WorkerHost(tmp_path / "device-tasks", models, device_events, fetcher(tmp_path, server, signing, "device"), infer=device.channel)
    cleanup += [lambda: edge_host.stop(2.0), lambda: device_host.stop(2.0)]  # run before the link and the peer close
    rig = Rig(edge, device, edge_host, edge_events, device_host, device_events, models, mlp, cnn)
    rig.tails(tail_order(mlp, MLP_TASK, "wk-tail-mlp"), tail_order(cnn, CNN_TASK, "wk-tail-cnn"))
    return rig


# ---- 2. end to end through both worker hosts ----------------------------------------------------------------
def test_every_cut_of_the_mlp_and_edge_only_answer_like_the_whole_model(rig: Rig) -> None:
    # Prepare: two rows; what the whole model answers
    x = np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32)
    expected = rig.mlp.run(x)
    assert len(rig.mlp.cuts) >= 3
    asked = 0

    for pinned in [*rig.mlp.cuts, SPLIT_EDGE_ONLY]:
        # Execute: the head pinned to this cut; the application's requests
        rig.head(rig.mlp, MLP_TASK, cut=pinned)
        answers = [rig.models.infer({"x": x}, rig.mlp.name) for _ in range(3)]
        asked += 3

        # Assert: crossed at that cut, the whole model's answer
        route = "edge" if pinned == SPLIT_EDGE_ONLY else f"split:{pinned}"
        assert [a.route for a in answers] == [route] * 3, pinned
        for answer in answers:
            assert set(answer.outputs) == set(expected)
            np.testing.assert_allclose(answer.outputs["logits"], expected["logits"], rtol=1e-5, atol=1e-5)
        head = rig.head_metrics(requests=3)
        kind = "edge" if pinned == SPLIT_EDGE_ONLY else "split"
        assert (head[kind], head["fallbacks"], head["device"], head["errors"]) == (3, 0, 0, 0), head
        assert head["cut_index"] == (0 if pinned == SPLIT_EDGE_ONLY else rig.mlp.cuts.index(pinned) + 1)

    # Assert: the tail answered them all (and the heads' calibration requests and probes besides)
    tail = rig.edge_events.wait(lambda: (m := metrics(rig.edge_events, "wk-tail-mlp")) and m["requests"] >= asked and m, 10, what="tail metrics")
    assert tail["errors"] == 0 and tail["probes"] > 0
    assert rig.edge.router.counters["refused"] == rig.edge.router.counters["dropped"] == 0
    assert rig.device.channel.dropped == 0


def test_a_cnn_cut_answers_like_the_whole_model_and_int8_activations_keep_the_class(rig: Rig) -> None:
    # Prepare: a few inputs the size of the digits images
    x = np.random.default_rng(2).standard_normal((1, 1, 8, 8)).astype(np.float32)
    rows = [np.random.default_rng(10 + i).uniform(0, 16, (1, 1, 8, 8)).astype(np.float32) for i in range(5)]
    expected = rig.cnn.run(x)["logits"]

    # Execute 1: float32 activations
    rig.head(rig.cnn, CNN_TASK, cut=CNN_CUT)
    exact = rig.models.infer({"x": x}, rig.cnn.name)

    # Assert 1
    assert exact.route == f"split:{CNN_CUT}"
    np.testing.assert_allclose(exact.outputs["logits"], expected, rtol=1e-5, atol=1e-5)

    # Execute 2: int8 activations
    rig.head(rig.cnn, CNN_TASK, cut=CNN_CUT, quantize=True)
    quantized = [rig.models.infer({"x": row}, rig.cnn.name) for row in [x, *rows]]

    # Assert 2: close, and the same class
    for row, answer in zip([x, *rows], quantized, strict=True):
        whole = rig.cnn.run(row)["logits"]
        assert answer.route == f"split:{CNN_CUT}"
        assert answer.outputs["logits"].argmax() == whole.argmax()
        np.testing.assert_allclose(answer.outputs["logits"], whole, atol=0.05 * float(np.ptp(whole)))
    head = rig.head_metrics(requests=6)
    assert (head["split"], head["fallbacks"]) == (6, 0), head
    assert any("activations int8" in line for line in rig.device_events.lines(rig.head_id))  # type: ignore[arg-type]


# ---- 3. fallbacks ------------------------------------------------------------------------------------------
def test_with_the_tail_withdrawn_requests_fall_back_to_the_whole_model_and_cross_again_when_it_is_back(rig: Rig) -> None:
    # Prepare: a head pinned to a middle cut, crossing
    x = np.random.default_rng(3).standard_normal((1, 64)).astype(np.float32)
    expected = rig.mlp.run(x)["logits"]
    pinned = rig.mlp.cuts[1]
    rig.head(rig.mlp, MLP_TASK, cut=pinned, retry_after_s=0.5)
    assert rig.models.infer({"x": x}, rig.mlp.name).route == f"split:{pinned}"
    cnn_tail = tail_order(rig.cnn, CNN_TASK, "wk-tail-cnn")

    # Execute 1: the MLP's tail withdrawn
    rig.tails(cnn_tail)
    during = [rig.models.infer({"x": x}, rig.mlp.name) for _ in range(5)]

    # Assert 1: each completed here, with the whole model's answer, as a fallback
    assert [a.route for a in during] == ["fallback"] * 5
    for answer in during:
        np.testing.assert_allclose(answer.outputs["logits"], expected, rtol=1e-5, atol=1e-5)
    head = rig.head_metrics(requests=6)
    assert (head["split"], head["fallbacks"], head["device"]) == (1, 5, 0), head
    assert rig.edge.router.counters["refused"] >= 1

    # Execute 2: the tail back; after retry_after_s
    rig.tails(tail_order(rig.mlp, MLP_TASK, "wk-tail-mlp-2"), cnn_tail)
    time.sleep(0.6)
    after = rig.models.infer({"x": x}, rig.mlp.name)

    # Assert 2: crossing again
    assert after.route == f"split:{pinned}"
    np.testing.assert_allclose(after.outputs["logits"], expected, rtol=1e-5, atol=1e-5)
    head = rig.head_metrics(requests=7)
    assert (head["split"], head["fallbacks"]) == (2, 5), head
    lines = rig.device_events.lines(rig.head_id)  # type: ignore[arg-type]
    assert any(f"this edge runs no tail of task {MLP_TASK}" in line for line in lines), lines


def test_with_the_edge_link_down_requests_fall_back_and_cross_again_once_it_reconnects(rig: Rig) -> None:
    # Prepare: a head crossing edge-only, a short timeout
    x = np.random.default_rng(4).standard_normal((1, 64)).astype(np.float32)
    expected = rig.mlp.run(x)["logits"]
    rig.head(rig.mlp, MLP_TASK, cut=SPLIT_EDGE_ONLY, timeout_ms=300, retry_after_s=0.5)
    assert rig.models.infer({"x": x}, rig.mlp.name).route == "edge"

    # Execute 1: the edge's link disconnects (its tail worker still serves)
    rig.edge.stop()
    during, seconds = timed(lambda: [rig.models.infer({"x": x}, rig.mlp.name) for _ in range(4)])

    # Assert 1: the first waited out the timeout, the others did not wait; all answered here
    assert [a.route for a in during] == ["fallback"] * 4  # type: ignore[attr-defined]
    for answer in during:  # type: ignore[attr-defined]
        np.testing.assert_allclose(answer.outputs["logits"], expected, rtol=1e-5, atol=1e-5)
    assert 0.29 <= seconds < 0.6 * 4
    head = rig.head_metrics(requests=5)
    assert (head["edge"], head["fallbacks"]) == (1, 4), head
    assert rig.edge.router.serving() == [CNN_TASK, MLP_TASK]

    # Execute 2: the link back
    rig.edge.start()
    crossed = wait_until(lambda: (a := rig.models.infer({"x": x}, rig.mlp.name)).route == "edge" and a, 60, what="requests crossing again")

    # Assert 2
    np.testing.assert_allclose(crossed.outputs["logits"], expected, rtol=1e-5, atol=1e-5)  # type: ignore[attr-defined]
    assert rig.head_metrics(edge=2)["edge"] == 2


def test_a_tail_that_fails_makes_the_device_fall_back_and_the_router_keeps_answering(rig: Rig) -> None:
    # Prepare: a head crossing; then the task's tail replaced by one that raises
    x = np.random.default_rng(5).standard_normal((1, 64)).astype(np.float32)
    expected = rig.mlp.run(x)["logits"]
    rig.head(rig.mlp, MLP_TASK, cut=rig.mlp.cuts[0], retry_after_s=0.5)
    rig.tails(tail_order(rig.cnn, CNN_TASK, "wk-tail-cnn"))

    def broken(request: InferRequest, payload: bytes) -> tuple[InferReply, bytes]:
        raise RuntimeError("tail out of memory")

    rig.edge.router.serve(MLP_TASK, broken)

    # Execute
    answer = rig.models.infer({"x": x}, rig.mlp.name)

    # Assert: the whole model answered here; the head heard why; the router still answers the other task
    assert answer.route == "fallback"
    np.testing.assert_allclose(answer.outputs["logits"], expected, rtol=1e-5, atol=1e-5)
    assert rig.head_metrics(fallbacks=1)["fallbacks"] == 1
    rig.device_events.wait(lambda: any("RuntimeError: tail out of memory" in line for line in rig.device_events.lines(rig.head_id)), 5, what="the head's warning")  # type: ignore[arg-type]
    rig.edge.router.unserve(MLP_TASK, broken)
    rig.head(rig.cnn, CNN_TASK, cut=CNN_CUT)
    assert rig.models.infer({"x": np.zeros((1, 1, 8, 8), np.float32)}, rig.cnn.name).route == f"split:{CNN_CUT}"


# ---- 4. orders that cannot run -------------------------------------------------------------------------------
def test_orders_that_cannot_run_are_rejected_with_the_reason(
    tmp_path: Path, rig: Rig, server: BlobServer, signing: SigningKey
) -> None:
    # Prepare: a head order cut from another model; a device host without a channel; a tail whose part a forger
    # signed; a tail order on the device (no router there)
    other = "ab" * 32
    wrong_base = head_order(rig.mlp, MLP_TASK, "wk-head-wrong", base_sha256=other)
    no_channel_events = Events()
    no_channel = WorkerHost(tmp_path / "plain-tasks", rig.models, no_channel_events, lambda ref: pytest.fail("nothing to fetch"))
    forger = SigningKey.load_or_create(tmp_path / "forger")
    forged_tail = SplitPart(cut=rig.mlp.cuts[0], tail=model_ref(forger, server, b"not really a model", "forged"))
    forged = tail_order(rig.mlp, "tk-forged", "wk-tail-forged")
    forged = forged.model_copy(update={"split": forged.split.model_copy(update={"parts": [forged_tail]})})  # type: ignore[union-attr]
    tail_on_device = tail_order(rig.mlp, "tk-tail-dev", "wk-tail-dev")

    # Execute
    rig.device_host.apply([wrong_base, tail_on_device])
    no_channel.apply([head_order(rig.mlp, MLP_TASK, "wk-head-plain")])
    rig.edge_host.apply([tail_order(rig.mlp, MLP_TASK, "wk-tail-mlp"), tail_order(rig.cnn, CNN_TASK, "wk-tail-cnn"), forged])

    # Assert
    try:
        report = rig.device_events.final("wk-head-wrong")
        assert report.state == "REJECTED"
        assert rig.mlp.sha256[:12] in report.detail and other[:12] in report.detail, report.detail
        report = rig.device_events.final("wk-tail-dev")
        assert report.state == "REJECTED" and "serves no split-inference tails" in report.detail
        report = no_channel_events.final("wk-head-plain")
        assert report.state == "REJECTED" and "no infer channel" in report.detail
        report = rig.edge_events.final("wk-tail-forged")
        assert report.state == "REJECTED" and "bad signature" in report.detail, report.detail
        assert rig.edge.router.serving() == [CNN_TASK, MLP_TASK]
        assert not rig.models.routed(rig.mlp.name)
        assert server.paths().count(forged_tail.tail.path) == 0  # type: ignore[union-attr]  # refused before a byte
    finally:
        no_channel.stop(2.0)
