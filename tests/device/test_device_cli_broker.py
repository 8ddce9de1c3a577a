"""``aisynergy device run`` as a process against a real Mosquitto over mutual TLS: enrolment, state,
heartbeats, commands, desired state across a restart, event sequence across a restart, will."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from interfaces.ids import new_id
from interfaces.messages import CommandBody
from interfaces.topics import DEVICE_STATE
from tests.device.conftest import DeviceBroker, EdgeObserver, EnrolmentServer

pytestmark = pytest.mark.broker
REPO = Path(__file__).resolve().parents[2]
TOKEN = "bootstrap-" + "x" * 24


def _start_device(data_dir: Path, device_id: str, *extra: str) -> subprocess.Popen[bytes]:
    args = ["run", "--device-id", device_id, "--data-dir", str(data_dir), "--emit-every", "0.1", "--emit-type", "tick"]
    return subprocess.Popen([sys.executable, "-m", "device.cli", *args, *extra], cwd=REPO)


def test_device_process_lifecycle(
    tmp_path: Path, device_broker: DeviceBroker, enrolment_server: EnrolmentServer
) -> None:
    device_id, data_dir = new_id("dv"), tmp_path / "device"
    enrolment_server.mqtt_url, enrolment_server.heartbeat_s = device_broker.url, 0.2
    enrolment_server.tokens[device_id] = TOKEN
    edge = EdgeObserver(device_broker, device_id)
    device = _start_device(data_dir, device_id, "--enrol-url", enrolment_server.url, "--bootstrap-token", TOKEN)
    try:
        _, online = edge.expect("state", state="online")
        assert online["src"] == device_id and online["body"]["agent_version"]
        _, beat = edge.expect("heartbeat", seq=1)
        assert beat["body"]["resources"]["memory"]["total_bytes"] > 0

        request_id = edge.command(CommandBody(name="ping"), b"corr-ping")
        reply, answer = edge.expect("cmd/reply", ok=True)
        assert (reply.properties.CorrelationData, answer["reply_to"], answer["body"]["result"]["pong"]) == (
            b"corr-ping",
            request_id,
            True,
        )
        assert answer["body"]["result"].keys() == {"pong", "ts"}
        edge.command(CommandBody(name="format-disk"), b"corr-unknown")
        reply, _ = edge.expect("cmd/reply", ok=False, error_code="unknown_command")
        assert reply.properties.CorrelationData == b"corr-unknown"
        edge.command(b'{"v": 1, "body": {"name": ""}}', b"corr-bad")
        reply, _ = edge.expect("cmd/reply", ok=False, error_code="validation_failed")
        assert reply.properties.CorrelationData == b"corr-bad"
        edge.expect("events", type="message_rejected", severity="error")

        edge.desire(1, {"sample_rate_hz": 10})
        _, report = edge.expect("reported", version=1)
        assert report["body"]["status"] == {"sample_rate_hz": 10}  # no handler: applied as desired

        edge.expect("events", type="tick", data={"count": 2})
        device.send_signal(signal.SIGTERM)
        assert device.wait(10) == 0
        edge.expect("state", state="offline", reason="shutdown")
        before = [e["seq"] for e in edge.bodies("events")]
        assert before == sorted(set(before))  # strictly increasing, in order

        edge.desire(2, {"sample_rate_hz": 50})  # while the device is stopped: only the retained copy has it
        device = _start_device(data_dir, device_id)  # no token: the stored identity is enough
        edge.expect("state", state="online")
        edge.expect("reported", version=2, status={"sample_rate_hz": 50})
        edge.expect("events", type="tick", data={"count": 2})  # the demo counter starts again at 0 ...
        before_bodies = edge.bodies("events")[: len(before)]
        # an event the edge had not acknowledged before the stop is sent again, unchanged; the new ones ...
        after = [e["seq"] for e in edge.bodies("events")[len(before) :] if e not in before_bodies]
        assert min(after) > max(before)  # ... go on with the sequence
        assert after == sorted(set(after))

        device.kill()
        device.wait(5)
        edge.expect("state", state="offline", reason="will")
        late = EdgeObserver(device_broker, device_id)  # a subscriber arriving later still learns it
        message, _ = late.expect("state", state="offline", reason="will")
        assert message.retain and message.topic == DEVICE_STATE.topic(device_id=device_id)
        late.close()
    finally:
        device.kill()
        device.wait(5)
        edge.close()
    assert len(enrolment_server.requests) == 1
