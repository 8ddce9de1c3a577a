"""Over-the-air model updates through the real Device class and a real Mosquitto: the order arrives in the
retained desired document, progress leaves as events with seq numbers, the model answers ``infer``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from cloud.signing import SigningKey
from device.agent import Device
from device.identity import IdentityStore
from interfaces.deployments import EXECUTION_EVENT, INSTALLED_KEY
from interfaces.ids import new_id
from interfaces.messages import CommandBody, DesiredBody, envelope
from interfaces.topics import DEVICE_DESIRED
from tests.device.conftest import DeviceBroker, EdgeObserver, ThrowawayCA
from tests.device.ota_support import V1, V2, BlobServer, blob_server, make_order

pytestmark = pytest.mark.broker


@pytest.fixture
def server() -> Iterator[BlobServer]:
    with blob_server() as s:
        yield s


def test_an_order_in_the_desired_document_installs_and_serves_a_model(
    tmp_path: Path, test_ca: ThrowawayCA, device_broker: DeviceBroker, server: BlobServer
) -> None:
    # Prepare: a device enrolled through the artefact server's URL, with the hub's signing key pinned
    signing = SigningKey.load_or_create(tmp_path / "hub-pki")
    device_id, store = new_id("dv"), IdentityStore(tmp_path / "device")
    issued = test_ca.issue(store.make_csr(device_id), device_id, device_broker.url, heartbeat_s=1.0)
    store.save(issued.model_copy(update={"signing_key_pem": signing.public_pem}), server.url)
    edge = EdgeObserver(device_broker, device_id)
    v1, v2 = make_order(signing, server, V1, "1.0.0"), make_order(signing, server, V2, "1.1.0")
    x = np.ones((1, 128), dtype=np.float32)

    def desire(version: int, orders_version: int, orders: list) -> None:  # type: ignore[type-arg]
        body = DesiredBody(version=version, spec={"rate": 1}, deployments=orders, deployments_version=orders_version)
        edge.publish(DEVICE_DESIRED.topic(device_id=device_id), envelope("edge", body).model_dump_json().encode(), retain=True)

    try:
        with Device(device_id, store.data_dir) as dev:
            # Execute
            desire(1, 1, [v1])
            active = _progress(edge, v1.execution_id, "ACTIVE")
            _, report = edge.expect("reported", timeout=60, version=1)
            desire(1, 2, [v2])  # only the orders change
            _progress(edge, v2.execution_id, "ACTIVE")
            _, second = edge.expect("reported", timeout=60, version=1)
            edge.command(CommandBody(name="infer", args={"inputs": {"x": x.tolist()}}), b"c-infer")
            _, answer = edge.expect("cmd/reply", ok=True)
            edge.command(CommandBody(name="models"), b"c-models")
            _, listed = edge.expect("cmd/reply", ok=True)
            direct = dev.models.infer({"x": x})

        # Assert
        events = [b for b in edge.bodies("events") if b["type"] == EXECUTION_EVENT and b["data"]["execution_id"] == v1.execution_id]
        assert [e["data"]["state"] for e in events] == ["DOWNLOADING", "DOWNLOADED", "VERIFYING", "INSTALLING", "ACTIVE"]
        seqs = [e["seq"] for e in events]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        assert active["data"]["installed"]["version"] == "1.0.0"
        assert report["body"]["status"] == {"rate": 1, INSTALLED_KEY: {"model": _installed(v1)}}
        assert second["body"]["status"] == {"rate": 1, INSTALLED_KEY: {"model": _installed(v2)}}
        expected = ort.InferenceSession(V2, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        assert answer["body"]["result"]["model"] == {"name": "classifier", "version": "1.1.0"}
        np.testing.assert_allclose(np.array(answer["body"]["result"]["outputs"]["probabilities"]), expected, rtol=1e-6)
        np.testing.assert_allclose(direct.outputs["probabilities"], expected, rtol=1e-6)
        assert listed["body"]["result"]["models"][0]["inputs"][0]["name"] == "x"
    finally:
        edge.close()


def _progress(edge: EdgeObserver, execution_id: str, state: str, timeout: float = 30.0) -> dict:  # type: ignore[type-arg]
    """The first execution event of ``execution_id`` in ``state``, waiting for it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for body in edge.bodies("events"):
            if body["type"] == EXECUTION_EVENT and (body["data"]["execution_id"], body["data"]["state"]) == (execution_id, state):
                return body
        time.sleep(0.05)
    raise AssertionError(f"no {state} for {execution_id} within {timeout} s: {edge.bodies('events')}")


def _installed(order) -> dict:  # type: ignore[no-untyped-def,type-arg]
    m = order.signed_manifest.manifest
    return {"name": m.name, "version": m.version, "sha256": m.sha256, "artifact_id": order.artifact_id, "slot": None}
