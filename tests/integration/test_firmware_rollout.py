"""Firmware A/B over the air, end to end: the hub's rollout, the edge's cache and ``aisynergy device run``.

The device is its own process started from the CLI with a factory image (``firmware_images/samples``);
its "reboot" re-executes that process, which boots the new slot and confirms it (or does not).
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import psutil

from tests.integration.devstack import DevStack, create_deployment, upload_artifact, wait_deployment_final
from tests.support import AISYNERGY, start, stop, wait_for

SAMPLES = Path(__file__).parent.parent.parent / "firmware_images" / "samples"


class FirmwareDevice:
    """``aisynergy device run`` with the sample factory firmware, restartable after a kill."""

    def __init__(self, stack: DevStack, name: str) -> None:
        with stack.hub.client("operator") as api:
            self.device_id = api.post("/devices", json={"node_id": stack.node_id, "name": name, "model": "sensor-board"}).json()["id"]
            issued = api.post(f"/devices/{self.device_id}/bootstrap-token", json={}).json()
        self.stack, self.data_dir, self.log = stack, stack.data / name, stack.data / f"{name}.log"
        # as on a real site, the device starts once the brokers' access files name it; one that connects before
        # the reload that follows is first heard of by its heartbeats after it (edge/relay.py sends its desired
        # document again then)
        acl = stack.data / "devices-broker" / "acl"
        wait_for(lambda: acl.exists() and self.device_id in acl.read_text(), 60, what="the devices' broker knows the device")
        self.args = [*AISYNERGY, "device", "run", "--device-id", self.device_id, "--data-dir", str(self.data_dir),
                     *stack.enrolment_args(issued),
                     "--firmware", str(SAMPLES / "sensor-fw-1.0.0.fw"), "--firmware-manifest", str(SAMPLES / "sensor-fw-1.0.0.manifest.json"),
                     "--firmware-public-key", str(SAMPLES / "sample-signing.pub")]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = start(self.args, self.log)
        wait_for(lambda: self.stack.device_state(self.device_id) == "ONLINE" or self.proc.poll() is not None, 30, what="device ONLINE")  # type: ignore[union-attr]
        assert self.proc.poll() is None, self.log.read_text()[-3000:]

    def kill_9(self) -> None:
        assert self.proc is not None
        process = psutil.Process(self.proc.pid)
        children = process.children(recursive=True)  # the health check runs in a process group of its own
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        for child in children:
            child.kill()

    def installed_firmware(self) -> dict[str, Any] | None:
        with self.stack.hub.client("viewer") as api:
            reported = api.get(f"/devices/{self.device_id}/twin").json()["reported"]
        return (reported.get("installed") or {}).get("firmware")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            stop(self.proc)


def _upload(stack: DevStack, image: Path, version: str) -> dict[str, Any]:
    return upload_artifact(stack, image.read_bytes(), "firmware", "sensor-fw", version, "firmware")


def _deploy(stack: DevStack, artifact: dict[str, Any], device_id: str) -> str:
    return str(create_deployment(stack, artifact["id"], {"ids": [device_id]}, timeout_s=120)["id"])


def _wait_deployment(stack: DevStack, deployment_id: str, timeout: float = 90) -> dict[str, Any]:
    return wait_deployment_final(stack, deployment_id, timeout)


def _slow_image(tmp: Path) -> Path:
    """Firmware 1.3.0 whose health check never finishes in time (it marks that it started, then sleeps)."""
    src = tmp / "sensor-fw-1.3.0"
    shutil.copytree(SAMPLES / "sensor-fw-1.1.0", src)
    for name in ("firmware.json", "app/config.json"):
        doc = json.loads((src / name).read_text())
        doc["version" if name == "firmware.json" else "firmware_version"] = "1.3.0"
        (src / name).write_text(json.dumps(doc))
    (src / "health.py").write_text(
        "import time\nfrom pathlib import Path\n"
        "Path('../../health-started').write_text('1')  # <data dir>/firmware/health-started\n"
        "time.sleep(120)\n"
    )
    image = tmp / "sensor-fw-1.3.0.fw"
    subprocess.run([*AISYNERGY, "firmware", "build", str(src), "-o", str(image), "--compress-level", "0"], check=True, capture_output=True)
    return image


def _damaged_image(tmp: Path) -> Path:
    """Firmware 1.2.1, built by the tool, then its gzip stream cut short (the hub signs the bytes as uploaded)."""
    src = tmp / "sensor-fw-1.2.1"
    shutil.copytree(SAMPLES / "sensor-fw-1.1.0", src)
    doc = json.loads((src / "firmware.json").read_text())
    (src / "firmware.json").write_text(json.dumps({**doc, "version": "1.2.1"}))
    image = tmp / "sensor-fw-1.2.1.fw"
    subprocess.run([*AISYNERGY, "firmware", "build", str(src), "-o", str(image), "--compress-level", "0"], check=True, capture_output=True)
    image.write_bytes(image.read_bytes()[:-64])  # the gzip trailer (CRC, length) and the tar's zero padding
    return image


def test_firmware_delta_boots_the_new_slot_a_damaged_image_is_rejected_a_kill_during_confirmation_rolls_back(stack: DevStack, tmp_path: Path) -> None:
    # Prepare: a device on factory firmware 1.0.0 (slot a); the hub holds 1.0.0 too, so it can offer a delta
    device = FirmwareDevice(stack, "sensor-1")
    device.start()
    try:
        _upload(stack, SAMPLES / "sensor-fw-1.0.0.fw", "1.0.0")
        v110 = _upload(stack, SAMPLES / "sensor-fw-1.1.0.fw", "1.1.0")
        wait_for(lambda: (device.installed_firmware() or {}).get("version") == "1.0.0", 60, what="factory firmware reported")

        # Execute: 1.1.0 -> a delta, installed into slot b, the agent re-executes and confirms
        first = _wait_deployment(stack, _deploy(stack, v110, device.device_id))

        # Assert
        execution = first["executions"][0]
        assert first["state"] == "SUCCEEDED", execution
        assert execution["delta"] is True
        assert [t["to_state"] for t in execution["history"]][-2:] == ["INSTALLING", "ACTIVE"]
        installed = wait_for(lambda: (f := device.installed_firmware() or {}).get("version") == "1.1.0" and f, 60, what="1.1.0 reported")
        assert installed["slot"] == "b"  # type: ignore[index]
        delta_used = _progress(stack, device.device_id, execution["id"])
        assert any(p.get("via_delta") for p in delta_used), delta_used

        # Execute: a signed 1.2.1 whose gzip stream is damaged
        damaged = _wait_deployment(stack, _deploy(stack, _upload(stack, _damaged_image(tmp_path), "1.2.1"), device.device_id))

        # Assert: REJECTED before its slot was written; 1.1.0 runs on from slot b
        execution = damaged["executions"][0]
        assert execution["state"] == "REJECTED", execution
        assert "damaged" in execution["detail"], execution["detail"]
        assert "ACTIVE" not in [t["to_state"] for t in execution["history"]]
        assert device.installed_firmware()["version"] == "1.1.0"  # type: ignore[index]
        assert device.installed_firmware()["slot"] == "b"  # type: ignore[index]

        # Execute: 1.3.0 whose health check hangs; kill -9 the device while it confirms, start it again
        v130 = _upload(stack, _slow_image(tmp_path), "1.3.0")
        second_id = _deploy(stack, v130, device.device_id)
        marker = device.data_dir / "firmware" / "health-started"
        wait_for(marker.exists, 60, what="the new slot's health check running")
        device.kill_9()
        device.start()
        second = _wait_deployment(stack, second_id)

        # Assert: back on the old slot; the execution ended in a defined state, through the documented path
        execution = second["executions"][0]
        assert execution["state"] == "ROLLED_BACK", execution
        assert second["state"] in {"FAILED", "ROLLED_BACK"}
        assert [t["to_state"] for t in execution["history"]][-3:] == ["FAILED", "ROLLING_BACK", "ROLLED_BACK"]
        installed = wait_for(lambda: (f := device.installed_firmware() or {}).get("version") == "1.1.0" and f, 60, what="1.1.0 reported again")
        assert installed["slot"] == "b"  # type: ignore[index]
    finally:
        device.stop()


def _progress(stack: DevStack, device_id: str, execution_id: str) -> list[dict[str, Any]]:
    with stack.hub.client("viewer") as api:
        items = api.get(f"/devices/{device_id}/events", params={"limit": 500}).json()["items"]
    return [e["data"] for e in items if e["type"] == "deployment.execution" and e["data"].get("execution_id") == execution_id]
