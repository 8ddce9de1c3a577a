"""The operators' everyday commands against a running stack (issue 20): ``aisynergy node|device
list|get|create|label|lock|unlock|token|delete``, ``aisynergy artifact list|get|download|delete``, ``deploy create
--dry-run``, ``deploy upload --kind dataset`` and ``deploy rollback`` waiting for ROLLED_BACK; the hub and token from
``AISYNERGY_HUB_URL`` and ``AISYNERGY_TOKEN`` as the README names them."""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
from pathlib import Path

import numpy as np

from tests.integration.devstack import DevStack, api, create_deployment, upload_artifact, wait_deployment_final
from tests.support import AISYNERGY

MODELS = Path(__file__).resolve().parents[1] / "fixtures" / "models"


def cli(stack: DevStack, *args: str, role: str = "admin", ok: bool = True) -> str:
    env = {**os.environ, "AISYNERGY_HUB_URL": stack.hub.url, "AISYNERGY_TOKEN": stack.hub.tokens[role]}
    done = subprocess.run([*AISYNERGY, *args], env=env, capture_output=True, text=True, timeout=180, check=False)
    assert (done.returncode == 0) == ok, (args, done.returncode, done.stdout, done.stderr)
    return done.stdout + done.stderr


def test_nodes_devices_and_artefacts_from_the_command_line(stack: DevStack, tmp_path: Path) -> None:
    # nodes: the stack's edge ONLINE; create, label, lock, unlock, a bootstrap token, delete
    assert stack.node_id in cli(stack, "node", "list") and "ONLINE" in cli(stack, "node", "list", "--state", "ONLINE")
    assert "last heartbeat" in cli(stack, "node", "get", stack.node_id)
    created = cli(stack, "node", "create", "gw-cli", "--label", "zone=a", "--label", "tier=small", role="operator")
    new_node = created.splitlines()[0].strip()
    assert "bootstrap_token=bst_" in created
    assert "tier=small,zone=a" in cli(stack, "node", "list", "--selector", "zone=a")
    cli(stack, "node", "label", new_node, "zone=b", "tier-", role="operator")
    assert api(stack, "GET", f"/nodes/{new_node}", "viewer")["labels"] == {"zone": "b"}
    assert "LOCKED" in cli(stack, "node", "lock", new_node, role="operator")
    assert api(stack, "GET", f"/nodes/{new_node}", "viewer")["admin_state"] == "LOCKED"
    cli(stack, "node", "unlock", new_node, role="operator")
    assert "bootstrap_token=bst_" in cli(stack, "node", "token", new_node)
    assert "403 forbidden" in cli(stack, "node", "delete", new_node, "--yes", role="viewer", ok=False)
    cli(stack, "node", "delete", new_node, "--yes")
    assert "404 not_found" in cli(stack, "node", "get", new_node, ok=False)

    # devices: create behind the edge, label, list by selector and by node, token (an empty body is fine), delete
    device = cli(stack, "device", "create", "cam-cli", "--node", stack.node_id, "--label", "site=b", role="operator").split()[0]
    cli(stack, "device", "label", device, "stack=local", role="operator")
    listed = cli(stack, "device", "list", "--selector", "stack=local")
    assert device in listed and "site=b,stack=local" in listed
    assert device in cli(stack, "device", "list", "--node", stack.node_id)
    assert f"tls_server_name={stack.node_id}" in cli(stack, "device", "token", device, role="operator")
    assert "1 device match" in cli(stack, "deploy", "create", "--artifact", "art-x", "--selector", "site=b", "--dry-run", role="viewer")
    assert "0 devices match 'site=zz'; label them with: aisynergy device label" in cli(stack, "deploy", "create", "--artifact", "art-x", "--selector", "site=zz", "--dry-run")
    cli(stack, "device", "delete", device, "--yes")

    # artefacts: a dataset uploaded by the CLI, listed by kind and name, downloaded byte for byte, deleted
    rows = io.BytesIO()
    np.save(rows, np.zeros((4, 128), np.float32), allow_pickle=False)
    (tmp_path / "x.npy").write_bytes(rows.getvalue())
    uploaded = cli(stack, "deploy", "upload", str(tmp_path / "x.npy"), "--kind", "dataset", "--name", "cli-rows", "--version", "1", "--format", "npy", role="operator")
    art = uploaded.split()[0]
    assert art in cli(stack, "artifact", "list", "--kind", "dataset", "--name", "cli-rows") and art not in cli(stack, "artifact", "list", "--kind", "model")
    cli(stack, "artifact", "download", art, "--out", str(tmp_path / "back.npy"), role="viewer")
    assert hashlib.sha256((tmp_path / "back.npy").read_bytes()).digest() == hashlib.sha256(rows.getvalue()).digest()
    assert '"signed_manifest"' in cli(stack, "artifact", "get", art, role="viewer")
    cli(stack, "artifact", "delete", art)
    assert art not in cli(stack, "artifact", "list")


def test_a_rollback_from_the_command_line_ends_rolled_back(stack: DevStack) -> None:
    device = stack.add_device("cam-rollback")
    v1 = upload_artifact(stack, (MODELS / "mlp-1.0.0.onnx").read_bytes(), "model", "mlp", "1.0.0", "onnx")
    v2 = upload_artifact(stack, (MODELS / "mlp-1.1.0.onnx").read_bytes(), "model", "mlp", "1.1.0", "onnx")
    for artifact in (v1, v2):
        done = create_deployment(stack, artifact["id"], {"ids": [device.device_id]})
        assert wait_deployment_final(stack, done["id"])["state"] == "SUCCEEDED"
    out = cli(stack, "deploy", "rollback", done["id"], "--timeout", "120", role="operator")
    assert out.strip().splitlines()[-1] == f"{done['id']} ROLLED_BACK", out
