"""Rotating the hub's keys while the fleet runs (DESIGN §6): ``aisynergy hub rotate signing-key`` and
``aisynergy hub rotate broker-certificate`` against a serving hub, its two brokers, an edge and devices.

After a signing-key rotation the edge and a device enrolled before it install what the new key signed (they follow
the hand-over the old key signed, and pin the new key), the device downloading through its edge with a token the
new key signed; a device enrolled after it installs what the old key signed. After a broker-certificate rotation
both brokers serve the new certificate to new connections, and agents connect with it.
"""

from __future__ import annotations

import socket
import ssl
import subprocess
from pathlib import Path
from typing import Any

import httpx
from cryptography import x509

from device.ota.verify import TrustedKeys
from tests.integration.devstack import DevStack, create_deployment, upload_artifact, wait_deployment_final
from tests.support import AISYNERGY, restart_hub, stop, wait_for

MODELS = Path(__file__).parent.parent / "fixtures" / "models"
V1, V2 = MODELS / "mlp-1.0.0.onnx", MODELS / "mlp-1.1.0.onnx"


def _rotate(stack: DevStack, what: str) -> str:
    done = subprocess.run([*AISYNERGY, "hub", "rotate", what, "--data-dir", str(stack.data)], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _deploy(stack: DevStack, artifact: dict[str, Any], target: dict[str, Any]) -> dict[str, Any]:
    return wait_deployment_final(stack, create_deployment(stack, artifact["id"], target)["id"], 90)


def _pinned(data_dir: Path) -> list[str]:
    return TrustedKeys.from_pem((data_dir / "identity" / "signing.pub").read_text()).ids()


def _served_certificate(port: int) -> x509.Certificate:
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE  # only to read what the broker presents
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, ctx.wrap_socket(raw) as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der)


def test_targets_enrolled_before_a_signing_key_rotation_follow_it_and_later_ones_verify_older_artefacts(stack: DevStack) -> None:
    # Prepare: a device enrolled and an artefact signed before the rotation
    early = stack.add_device("cam-early")
    wait_for(lambda: stack.device_state(early.device_id) == "ONLINE", 30, what="early device ONLINE")
    v1 = upload_artifact(stack, V1.read_bytes(), "model", "mlp", "1.0.0", "onnx")
    old_key = v1["signed_manifest"]["key_id"]
    assert _pinned(stack.data / "edge") == [old_key] and _pinned(early.data_dir) == [old_key]

    # Execute: rotate while everything runs
    said = _rotate(stack, "signing-key")
    new_key = said.split()[-1]
    assert said == f"signing key {old_key} -> {new_key}"

    # Assert: the hub announces and signs with the new key, and publishes the hand-over
    with httpx.Client(base_url=stack.hub.url) as anonymous:
        wait_for(lambda: anonymous.get("/api/v1/signing-key.pub").headers["x-key-id"] == new_key, 10, what="the hub serving the new key")
        transitions = anonymous.get("/api/v1/signing-key/transitions").json()
    assert transitions["current_key_id"] == new_key
    assert [(t["transition"]["old_key_id"], t["transition"]["new_key_id"]) for t in transitions["transitions"]] == [(old_key, new_key)]
    v2 = upload_artifact(stack, V2.read_bytes(), "model", "mlp", "1.1.0", "onnx")
    assert v2["signed_manifest"]["key_id"] == new_key

    # Execute + Assert: the edge, enrolled before, installs what the new key signed and pins the new key
    on_node = _deploy(stack, v2, {"kind": "node", "ids": [stack.node_id]})
    assert on_node["state"] == "SUCCEEDED", on_node["executions"]
    assert _pinned(stack.data / "edge") == [new_key, old_key]

    # Execute + Assert: so does the device enrolled before, downloading through its edge with a new-key token
    on_early = _deploy(stack, v2, {"ids": [early.device_id]})
    assert on_early["state"] == "SUCCEEDED", on_early["executions"]
    assert early.models.get("mlp").version == "1.1.0"
    assert _pinned(early.data_dir) == [new_key, old_key]

    # Execute + Assert: a device enrolled after the rotation pins both keys and installs what the old key signed
    late = stack.add_device("cam-late")
    wait_for(lambda: stack.device_state(late.device_id) == "ONLINE", 30, what="late device ONLINE")
    assert _pinned(late.data_dir) == [new_key, old_key]
    on_late = _deploy(stack, v1, {"ids": [late.device_id]})
    assert on_late["state"] == "SUCCEEDED", on_late["executions"]
    assert late.models.get("mlp").version == "1.0.0"

    # Execute + Assert: the hub restarted keeps the new key and the hand-over
    stop(stack.hub.proc)
    stack.hub = restart_hub(stack.hub)
    with httpx.Client(base_url=stack.hub.url) as anonymous:
        assert anonymous.get("/api/v1/signing-key.pub").headers["x-key-id"] == new_key
        assert anonymous.get("/api/v1/signing-key/transitions").json() == transitions


def test_both_brokers_serve_a_rotated_certificate_to_new_connections_and_agents_connect_with_it(stack: DevStack) -> None:
    # Prepare
    before = {b.port: _served_certificate(b.port).serial_number for b in (stack.upstream, stack.downstream)}

    # Execute
    said = _rotate(stack, "broker-certificate")
    serial = int(said.split()[3].rstrip(","), 16)

    # Assert: both brokers reloaded it (the edge's devices' broker shares the PKI)
    for broker in (stack.upstream, stack.downstream):
        wait_for(lambda b=broker: _served_certificate(b.port).serial_number == serial, 15, what=f"broker :{broker.port} serving the new certificate")
        assert before[broker.port] != serial

    # Assert: agents connect through the new certificate (the edge restarted, a new device)
    assert stack.edge is not None
    stop(stack.edge)
    with stack.hub.client("viewer") as api:
        wait_for(lambda: api.get(f"/nodes/{stack.node_id}/status").json()["state"] == "OFFLINE", 20, what="node OFFLINE")
        stack.start_edge()
        wait_for(lambda: api.get(f"/nodes/{stack.node_id}/status").json()["state"] == "ONLINE", 30, what="node ONLINE again")
    dev = stack.add_device("cam-after-rotation")
    wait_for(lambda: stack.device_state(dev.device_id) == "ONLINE", 30, what="device ONLINE")
