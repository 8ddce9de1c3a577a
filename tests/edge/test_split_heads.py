"""The edge answers a split-inference request only from a device that the hub ordered to run a head of that task
(the ``tasks`` of the device's desired document, relayed by the edge); any other device is refused at once on its
reply channel, and its request never reaches the tail. Over a real Mosquitto with the hub's ACL."""

from __future__ import annotations

import ssl
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from device.session import SessionPlan
from device.split.channel import EdgeError, SplitUnavailable
from edge.link import Link
from edge.relay import DeviceRelay
from edge.split import TailRouter
from edge.store import EdgeStore, LearnedFrom
from interfaces.infer import InferReply, InferRequest
from interfaces.messages import DesiredBody, envelope
from interfaces.tasks import WorkerAction
from interfaces.topics import RELAY_DESIRED
from tests.edge.support import Mosquitto, Peer, Pki, edge_acl, enrol_node, needs_mosquitto, start_edge, stop_edge
from tests.edge.test_split_channel import DEVICE, NODE, Device, Edge, echo, head_of, raises

pytestmark = [pytest.mark.broker, needs_mosquitto]

OTHER = "dev-cam2"


@pytest.fixture
def broker(tmp_path: Path, pki: Pki, cleanup: list[Callable[[], object]]) -> Mosquitto:
    b = Mosquitto(tmp_path / "devices-broker", pki, edge_acl(NODE, [DEVICE, OTHER])).start()
    cleanup.append(b.stop)
    return b


def _device(broker: Mosquitto, pki: Pki, cleanup: list[Callable[[], object]], device_id: str) -> Device:
    d = Device(broker, pki, device_id)
    cleanup.append(d.peer.close)
    return d


def test_only_a_device_ordered_to_run_a_head_of_the_task_is_answered(broker: Mosquitto, pki: Pki, cleanup: list[Callable[[], object]]) -> None:
    # Prepare: the edge serves tk-echo; the test's device runs its head, the other device a head of another task
    edge = Edge(broker, pki)
    cleanup.append(edge.close)
    edge.start()
    calls: list[bytes] = []

    def answer(request: InferRequest, payload: bytes) -> tuple[InferReply, bytes]:
        calls.append(payload)
        return echo(request, payload)

    edge.router.serve("tk-echo", answer)
    edge.router.learn_orders(OTHER, [head_of("tk-else")])
    mine, theirs = _device(broker, pki, cleanup, DEVICE), _device(broker, pki, cleanup, OTHER)

    # Execute
    refused, seconds = raises(lambda: theirs.channel.call(InferRequest(task_id="tk-echo", cut="relu"), b"theirs", 5.0), EdgeError)
    unknown, _ = raises(lambda: theirs.channel.call(InferRequest(task_id="tk-nothing", cut="relu"), b"theirs", 5.0), EdgeError)
    reply, payload = mine.channel.call(InferRequest(task_id="tk-echo", cut="relu"), b"mine", 5.0)
    edge.router.learn_orders(DEVICE, [head_of("tk-echo").model_copy(update={"action": WorkerAction.PAUSE})])
    paused, _ = raises(lambda: mine.channel.call(InferRequest(task_id="tk-echo", cut="relu"), b"mine again", 5.0), EdgeError)
    edge.router.learn_orders(DEVICE, [])  # the head withdrawn
    withdrawn, _ = raises(lambda: mine.channel.call(InferRequest(task_id="tk-echo", cut="relu"), b"mine again", 5.0), EdgeError)

    # Assert: an answer on the reply channel at once (no timeout), the same whether a tail is here or not
    assert f"device {OTHER} runs no head of task tk-echo" in str(refused) and seconds < 1.0
    assert f"device {OTHER} runs no head of task tk-nothing" in str(unknown)
    assert (reply.status, payload) == ("ok", b"relu|mine")
    assert f"device {DEVICE} runs no head of task tk-echo" in str(paused)
    assert f"device {DEVICE} runs no head of task tk-echo" in str(withdrawn)
    assert calls == [b"mine"]  # no refused request reached the tail


def _desired(*task_ids: str) -> bytes:
    return envelope("hub", DesiredBody(version=1, tasks=[head_of(t) for t in task_ids])).model_dump_json().encode()


def test_the_relay_tells_the_router_the_heads_of_stored_documents(tmp_path: Path, pki: Pki) -> None:
    # Prepare: the edge stored desired documents before it restarted
    store = EdgeStore(tmp_path / "edge.db")
    store.store_device_desired([(DEVICE, 1, _desired("tk-a", "tk-b")), (OTHER, 1, _desired())], [], LearnedFrom.DESIRED)
    router = TailRouter()
    crt, key = pki.identity(NODE)
    tls = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(pki.ca_path))
    tls.load_cert_chain(str(crt), str(key))
    link = Link("downstream", "mqtts://127.0.0.1:1", tls, SessionPlan(NODE, connect_timeout_s=5))

    # Execute
    DeviceRelay(NODE, store, link, link, on_task_orders=router.learn_orders)
    store.close()

    # Assert
    assert (router.runs_head(DEVICE, "tk-a"), router.runs_head(DEVICE, "tk-b"), router.runs_head(DEVICE, "tk-c")) == (True, True, False)
    assert not router.runs_head(OTHER, "tk-a")


def test_the_edge_agent_answers_only_the_heads_the_hub_ordered(
    tmp_path: Path, pki: Pki, broker: Mosquitto, cleanup: list[Callable[[], object]]
) -> None:
    # Prepare: the hub's retained documents order DEVICE to run a head of tk-split; OTHER runs none
    hub = Peer(broker, pki, "hub", [])
    cleanup.append(hub.close)
    hub.publish(RELAY_DESIRED.topic(node_id=NODE, device_id=DEVICE), _desired("tk-split"), retain=True)
    hub.publish(RELAY_DESIRED.topic(node_id=NODE, device_id=OTHER), _desired(), retain=True)
    node_dir = enrol_node(tmp_path / "node", pki.ca, NODE, broker.url).data_dir
    edge = start_edge(node_dir, NODE, "--device-listen", "off")
    cleanup.append(lambda: stop_edge(edge))
    mine, theirs = _device(broker, pki, cleanup, DEVICE), _device(broker, pki, cleanup, OTHER)

    # Execute: the edge serves no tail of tk-split, so the head gets "no tail" and the other "no head"
    def refusal(device: Device) -> str:
        for _ in range(100):  # until the edge is up and has the documents (a timeout: not yet)
            try:
                device.channel.call(InferRequest(task_id="tk-split", cut="relu"), b"x", 0.5)
            except EdgeError as exc:
                return str(exc)
            except SplitUnavailable:  # not connected yet, or no answer yet
                time.sleep(0.1)
        raise AssertionError("the edge never answered")

    head_answer, other_answer = refusal(mine), refusal(theirs)

    # Assert
    assert "this edge runs no tail of task tk-split" in head_answer
    assert f"device {OTHER} runs no head of task tk-split" in other_answer
    assert stop_edge(edge) == 0
