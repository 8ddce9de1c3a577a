"""Deployment and update end to end (DESIGN §4.2): hub + brokers + an edge process + 20 devices.

The devices run in this process (``device.agent.Device``) and download through their edge's artefact
cache, as on a site where only the edge reaches the hub. One fleet serves every test of this module,
so each test states what it needs the devices to run first (``_deploy_and_wait``).
"""

from __future__ import annotations

import hashlib
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from cloud.signing import SigningKey
from interfaces.deployments import EXECUTION_EVENT
from tests.integration.devstack import DevStack, create_deployment, start_devstack, upload_artifact, wait_deployment_final
from tests.support import start_hub, wait_for

MODELS = Path(__file__).parent.parent / "fixtures" / "models"
V1, V2 = MODELS / "mlp-1.0.0.onnx", MODELS / "mlp-1.1.0.onnx"
FLEET = 20
FULL_PATH = ["QUEUED", "DOWNLOADING", "DOWNLOADED", "VERIFYING", "INSTALLING", "ACTIVE"]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevStack]:
    tmp = tmp_path_factory.mktemp("deploy")
    stack = start_devstack(tmp, f"sqlite:///{tmp / 'hub.db'}")
    try:
        for i in range(FLEET):
            stack.add_device(f"dev-{i:02d}")
        wait_for(lambda: sum(stack.device_state(d.device_id) == "ONLINE" for d in stack.devices) == FLEET, 60, what="20 devices ONLINE")
        stack.artifacts = {}  # type: ignore[attr-defined]
        yield stack
    finally:
        stack.close()


def _upload(stack: DevStack, path: Path, kind: str, name: str, version: str, fmt: str, data: bytes | None = None) -> dict[str, Any]:
    """Upload once per (kind, name, version) for the whole module."""
    cache: dict[tuple[str, str, str], dict[str, Any]] = stack.artifacts  # type: ignore[attr-defined]
    key = (kind, name, version)
    if key not in cache:
        cache[key] = upload_artifact(stack, data if data is not None else path.read_bytes(), kind, name, version, fmt)
    return cache[key]


def _deploy(stack: DevStack, artifact: dict[str, Any], device_ids: list[str], **options: Any) -> dict[str, Any]:
    return create_deployment(stack, artifact["id"], {"ids": device_ids}, **options)


def _wait_final(stack: DevStack, deployment_id: str, timeout: float = 90) -> dict[str, Any]:
    return wait_deployment_final(stack, deployment_id, timeout)


def _deploy_and_wait(stack: DevStack, artifact: dict[str, Any], device_ids: list[str], **options: Any) -> dict[str, Any]:
    return _wait_final(stack, _deploy(stack, artifact, device_ids, **options)["id"])


def _running_version(dev: Any) -> str | None:
    from device.ota.models import NoModel

    try:
        return dev.models.get("mlp").version  # type: ignore[no-any-return]
    except NoModel:
        return None


def _ensure_fleet_runs(stack: DevStack, version: str) -> None:
    """Whatever an earlier test left: every device runs ``mlp`` at ``version``."""
    path = V1 if version == "1.0.0" else V2
    artifact = _upload(stack, path, "model", "mlp", version, "onnx")
    behind = [d.device_id for d in stack.devices if _running_version(d) != version]
    if behind:
        result = _deploy_and_wait(stack, artifact, behind, allow_downgrade=True)
        assert result["state"] == "SUCCEEDED", result["counts"]


def _history(execution: dict[str, Any]) -> list[str]:
    return [t["to_state"] for t in execution["history"]]


def _fleet(stack: DevStack) -> list[Any]:
    return list(stack.devices)


def _pin_foreign_key(stack: DevStack, dev: Any, tmp: Path) -> Any:
    """Restart ``dev`` with another hub key pinned: it must reject everything the real hub signs."""
    dev.stop()
    stack.devices.remove(dev)
    (dev.data_dir / "identity" / "signing.pub").write_text(SigningKey.load_or_create(tmp / f"foreign-{dev.device_id}").public_pem)
    return _restart(stack, dev)


def _restore_key(stack: DevStack, dev: Any) -> Any:
    dev.stop()
    stack.devices.remove(dev)
    (dev.data_dir / "identity" / "signing.pub").write_text((stack.data / "pki" / "signing.pub").read_text())
    return _restart(stack, dev)


def _restart(stack: DevStack, dev: Any) -> Any:
    new = stack.restart_device(dev)  # appended to stack.devices: the fleet stays 20 devices
    wait_for(lambda: new.connected, 60, what=f"{dev.device_id} reconnected")
    return new


def test_canary_then_rolling_batches_reach_all_20_devices(fleet: DevStack) -> None:
    # Prepare
    artifact = _upload(fleet, V1, "model", "mlp", "1.0.0", "onnx")
    ids = [d.device_id for d in _fleet(fleet)]

    # Execute
    result = _deploy_and_wait(fleet, artifact, ids, strategy={"type": "canary", "percent": 10, "then": {"type": "rolling", "batch_size": 5}})

    # Assert: SUCCEEDED, batches 2,5,5,5,3 released one after the other, every history complete
    assert result["state"] == "SUCCEEDED", result["counts"]
    executions = result["executions"]
    assert Counter(e["batch"] for e in executions) == {0: 2, 1: 5, 2: 5, 3: 5, 4: 3}
    for execution in executions:
        assert execution["state"] == "ACTIVE"
        assert _history(execution) == FULL_PATH, execution["history"]
    for batch in range(1, 5):
        released = min(e["released_at"] for e in executions if e["batch"] == batch)
        previous_done = max(e["history"][-1]["at"] for e in executions if e["batch"] == batch - 1)
        assert released >= previous_done, f"batch {batch} released before batch {batch - 1} finished"
    # every device serves the model it was given: the same answer as running the file directly
    x = np.random.default_rng(7).standard_normal((1, 128)).astype(np.float32)
    session = ort.InferenceSession(str(V1), providers=["CPUExecutionProvider"])
    expected = session.run(None, {session.get_inputs()[0].name: x})[0]
    for dev in _fleet(fleet):
        answer = dev.models.infer({session.get_inputs()[0].name: x})
        assert answer.version == "1.0.0"
        np.testing.assert_allclose(next(iter(answer.outputs.values())), expected, rtol=1e-5, atol=1e-6)


def test_failures_over_the_threshold_halt_or_roll_back(fleet: DevStack, tmp_path: Path) -> None:
    # Prepare: everyone on 1.0.0; three devices pin a foreign key, so they REJECT what the hub signs
    _ensure_fleet_runs(fleet, "1.0.0")
    v2 = _upload(fleet, V2, "model", "mlp", "1.1.0", "onnx")
    failing = [_pin_foreign_key(fleet, d, tmp_path) for d in _fleet(fleet)[:3]]
    healthy = [d for d in _fleet(fleet) if d not in failing]
    ids = [d.device_id for d in failing] + [d.device_id for d in healthy]  # the failing ones in the first batch
    try:
        # Execute: rollback policy
        rolled = _deploy_and_wait(fleet, v2, ids, strategy={"type": "rolling", "batch_size": 5}, max_failure_percent=10, failure_policy="rollback")

        # Assert: 3 of 20 failed (15 % > 10 %): the two that installed went back to 1.0.0, the rest never started
        assert rolled["state"] == "ROLLED_BACK", rolled["counts"]
        by_id = {e["target_id"]: e for e in rolled["executions"]}
        assert {by_id[d.device_id]["state"] for d in failing} == {"REJECTED"}
        touched = [e for e in rolled["executions"] if e["batch"] == 0 and e["target_id"] not in {d.device_id for d in failing}]
        assert len(touched) == 2
        for e in touched:
            assert e["state"] == "ROLLED_BACK", e
            assert _history(e)[-3:] == ["ACTIVE", "ROLLING_BACK", "ROLLED_BACK"]
        assert all(e["state"] == "CANCELED" for e in rolled["executions"] if e["batch"] > 0)
        assert [_running_version(d) for d in _fleet(fleet)] == ["1.0.0"] * FLEET

        # Execute: halt policy
        halted = _deploy_and_wait(fleet, v2, ids, strategy={"type": "rolling", "batch_size": 5}, max_failure_percent=10, failure_policy="halt")

        # Assert: FAILED, no further batch released, the two that installed keep 1.1.0
        assert halted["state"] == "FAILED", halted["counts"]
        assert all(e["released_at"] is None and e["state"] == "CANCELED" for e in halted["executions"] if e["batch"] > 0)
        assert sorted(_running_version(d) or "" for d in _fleet(fleet)) == ["1.0.0"] * 18 + ["1.1.0"] * 2
    finally:
        for dev in failing:
            _restore_key(fleet, dev)


def test_a_tampered_cache_entry_is_repaired_forged_and_downgraded_artefacts_are_rejected_and_the_old_model_serves(fleet: DevStack, tmp_path: Path) -> None:
    # Prepare
    _ensure_fleet_runs(fleet, "1.1.0")
    victim = _fleet(fleet)[5]
    x = {victim.models.get("mlp").inputs[0].name: np.ones((1, 128), np.float32)}
    before = victim.models.infer(x)
    # a third version whose bytes the edge's cache holds tampered (a corrupted or compromised edge); its
    # bytes share nothing with 1.1.0, so the hub offers no delta and the device fetches it whole
    v3_bytes = np.random.default_rng(3).bytes(200_000)
    v3 = _upload(fleet, V2, "model", "mlp", "1.2.0", "onnx", data=v3_bytes)
    cache = fleet.data / "edge" / "artifacts"
    cache.mkdir(parents=True, exist_ok=True)
    tampered = bytearray(v3_bytes)
    tampered[len(tampered) // 2] ^= 0xFF
    (cache / v3["sha256"]).write_bytes(bytes(tampered))

    # Execute + Assert: tampered byte. The edge checks its entry before serving it and fetches the signed bytes
    # again, so the device never sees the tampered ones; those bytes are no model, so its install fails and the
    # old model serves on (a device refusing tampered bytes itself: tests/device/test_ota_updater.py)
    result = _deploy_and_wait(fleet, v3, [victim.device_id])
    execution = result["executions"][0]
    assert execution["state"] in ("FAILED", "ROLLED_BACK"), (execution["detail"], _history(execution))
    assert "sha-256" not in (execution["detail"] or "").lower() and "signature" not in (execution["detail"] or "")
    assert hashlib.sha256((cache / v3["sha256"]).read_bytes()).hexdigest() == v3["sha256"]  # repaired
    assert _running_version(victim) == "1.1.0"

    # Execute + Assert: wrong signature (a device that pinned another key)
    (cache / v3["sha256"]).unlink()
    forged = _pin_foreign_key(fleet, victim, tmp_path)
    try:
        result = _deploy_and_wait(fleet, v3, [forged.device_id])
        assert result["executions"][0]["state"] == "REJECTED"
        assert "signature" in result["executions"][0]["detail"]
        assert _running_version(forged) == "1.1.0"
    finally:
        victim = _restore_key(fleet, forged)

    # Execute + Assert: downgrade refused without allow_downgrade, and the old model still answers the same
    v1 = _upload(fleet, V1, "model", "mlp", "1.0.0", "onnx")
    result = _deploy_and_wait(fleet, v1, [victim.device_id])
    assert result["executions"][0]["state"] == "REJECTED"
    assert "downgrade" in result["executions"][0]["detail"]
    after = victim.models.infer(x)
    assert after.version == "1.1.0"
    np.testing.assert_array_equal(next(iter(after.outputs.values())), next(iter(before.outputs.values())))

    # ... and allowed with it
    result = _deploy_and_wait(fleet, v1, [victim.device_id], allow_downgrade=True)
    assert result["executions"][0]["state"] == "ACTIVE"
    assert _running_version(victim) == "1.0.0"


def test_a_hub_restart_mid_rollout_completes_it_and_installs_nothing_twice(fleet: DevStack, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: count every model install on the devices
    _ensure_fleet_runs(fleet, "1.0.0")
    v2 = _upload(fleet, V2, "model", "mlp", "1.1.0", "onnx")
    installs: Counter[str] = Counter()
    from device.ota.models import ModelHost

    original = ModelHost.install

    def counting(self: ModelHost, *args: Any, **kwargs: Any) -> Any:
        installs[str(self.root)] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(ModelHost, "install", counting)
    targets = _fleet(fleet)[:8]
    deployment = _deploy(fleet, v2, [d.device_id for d in targets], strategy={"type": "rolling", "batch_size": 2})

    # Execute: kill the hub once the second batch is released, start it again on the same database
    def second_batch_released() -> bool:
        with fleet.hub.client("viewer") as api:
            return any(e["batch"] == 1 and e["released_at"] for e in api.get(f"/deployments/{deployment['id']}").json()["executions"])

    wait_for(second_batch_released, 60, interval=0.05, what="second batch released")
    fleet.hub.proc.send_signal(signal.SIGKILL)
    fleet.hub.proc.wait(10)
    time.sleep(1.0)
    old = fleet.hub
    fleet.hub = start_hub(old.data_dir, old.database_url, fleet.upstream.url, heartbeat_interval=0.5, offline_after_missed=4, port=old.port)
    result = _wait_final(fleet, deployment["id"])

    # Assert
    assert result["state"] == "SUCCEEDED", result["counts"]
    for e in result["executions"]:
        assert _history(e) == FULL_PATH, e["history"]
    assert [_running_version(d) for d in targets] == ["1.1.0"] * len(targets)
    assert sorted(installs.values()) == [1] * len(targets), installs


def test_a_fine_tuned_model_arrives_as_a_delta(fleet: DevStack) -> None:
    # Prepare: a version no device has seen (devices keep their previous model and reuse it unasked)
    from tests.fixtures.make_models import mlp

    _ensure_fleet_runs(fleet, "1.0.0")
    tuned_bytes = mlp("1.3.0", fine_tune_seed=11)
    tuned = _upload(fleet, V2, "model", "mlp", "1.3.0", "onnx", data=tuned_bytes)
    dev = _fleet(fleet)[10]

    # Execute
    result = _deploy_and_wait(fleet, tuned, [dev.device_id])

    # Assert: offered and used as a delta, and the model verifies and runs
    execution = result["executions"][0]
    assert execution["state"] == "ACTIVE" and execution["delta"] is True
    progress = _execution_events(fleet, dev.device_id, execution["id"])
    assert any(p.get("via_delta") for p in progress), progress
    assert _running_version(dev) == "1.3.0"
    with fleet.hub.client("viewer") as api:
        delta = api.get(f"/artifacts/{tuned['id']}/delta", params={"from": hashlib.sha256(V1.read_bytes()).hexdigest()})
    assert delta.status_code == 200
    assert len(delta.content) <= 0.2 * len(tuned_bytes), (len(delta.content), len(tuned_bytes))


def _execution_events(stack: DevStack, device_id: str, execution_id: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    cursor = None
    with stack.hub.client("viewer") as api:
        while True:
            page = api.get(f"/devices/{device_id}/events", params={"limit": 500, **({"cursor": cursor} if cursor else {})}).json()
            out += [e["data"] for e in page["items"] if e["type"] == EXECUTION_EVENT and e["data"].get("execution_id") == execution_id]
            cursor = page.get("next_cursor")
            if not cursor:
                return out
