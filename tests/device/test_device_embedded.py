"""The Device class embedded in an application (this process) against a real Mosquitto over mutual TLS."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from device.agent import Device
from device.errors import ConfigError, NotRunning
from device.identity import IdentityStore
from interfaces.messages import CommandBody
from interfaces.topics import DEVICE_DESIRED
from tests.device.conftest import DeviceBroker, EdgeObserver, Gate, ThrowawayCA
from tests.support import wait_for

pytestmark = pytest.mark.broker


def test_handlers_answer_commands_and_apply_desired(enrolled: tuple[str, Path], edge: EdgeObserver) -> None:
    device_id, data_dir = enrolled
    dev = Device(device_id, data_dir)
    applied: list[dict] = []

    @dev.command("add")
    def add(args: dict) -> dict:
        return {"sum": args["a"] + args["b"]}

    @dev.command("explode")
    def explode(args: dict) -> None:
        raise RuntimeError("boom")

    @dev.on_desired
    def apply(spec: dict) -> dict:
        applied.append(spec)
        return {"rate": spec["rate"], "applied": True}

    with dev:
        edge.expect("state", state="online")
        edge.expect("heartbeat", seq=1)

        edge.command(CommandBody(name="add", args={"a": 2, "b": 3}), b"c-add")
        reply, answer = edge.expect("cmd/reply", ok=True)
        assert (reply.properties.CorrelationData, answer["body"]["result"]) == (b"c-add", {"sum": 5})

        request_id = edge.command(CommandBody(name="explode"), b"c-explode")
        reply, answer = edge.expect("cmd/reply", ok=False, error_code="failed")
        assert (reply.properties.CorrelationData, answer["reply_to"]) == (b"c-explode", request_id)
        assert "boom" in answer["body"]["error"]

        edge.desire(1, {"rate": 5})
        _, report = edge.expect("reported", version=1)
        assert report["body"]["status"] == {"rate": 5, "applied": True}
        edge.desire(1, {"rate": 5})  # the same version again (as a redelivery would be) is not re-applied
        edge.publish(DEVICE_DESIRED.topic(device_id=device_id), b'{"v": 1, "body": "nonsense"}', retain=True)
        _, rejected = edge.expect("events", type="message_rejected", severity="error")
        assert rejected["body"]["data"]["topic"] == DEVICE_DESIRED.topic(device_id=device_id)

        seq = dev.emit("temperature", {"c": 21.5})
        _, event = edge.expect("events", type="temperature")
        assert (event["body"]["seq"], event["body"]["data"]) == (seq, {"c": 21.5})
        assert seq > rejected["body"]["seq"]  # error events and application events share one sequence

        stats = dev.stats()
        assert stats.connected and stats.dropped == 1 and stats.rss_bytes > 0
        assert stats.messages_in >= 5 and stats.messages_out >= 8
    edge.expect("state", state="offline", reason="shutdown")
    assert applied == [{"rate": 5}]
    with pytest.raises(NotRunning):
        dev.emit("temperature", {"c": 22})


def test_bad_options_are_refused_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="device id"):
        Device("a/b", tmp_path)
    with pytest.raises(ConfigError, match="mqtts"):
        Device("dv-1", tmp_path, mqtt_url="tcp://broker:1883")
    with pytest.raises(ConfigError, match="built-in"):
        Device("dv-1", tmp_path).command("ping")
    with pytest.raises(ConfigError, match="bootstrap_token"):
        Device("dv-1", tmp_path, enrol_url="http://127.0.0.1:9").start()


def test_events_emitted_during_a_broker_outage_arrive_in_order_after_the_reconnect(
    enrolled: tuple[str, Path], device_broker: DeviceBroker
) -> None:
    # the device reaches the broker through a gate: shutting it is an outage for the device alone, so the
    # observer is subscribed before the device can come back (no race with its reconnect)
    device_id, data_dir = enrolled
    gate = Gate(device_broker.port)
    edge = EdgeObserver(device_broker, device_id)
    try:
        with Device(device_id, data_dir, mqtt_url=gate.url, reconnect_cap_s=0.3) as dev:
            edge.expect("state", state="online")
            gate.shut()
            wait_for(lambda: not dev.connected, 60, what="the device to notice the outage")

            queued = [dev.emit("reading", {"n": n}) for n in range(3)]
            time.sleep(0.8)  # a few refused connection attempts
            gate.open()
            edge.expect("state", state="online", timeout=60)
            for n, seq in enumerate(queued):
                _, event = edge.expect("events", type="reading")
                assert (event["body"]["data"], event["body"]["seq"]) == ({"n": n}, seq)
            assert dev.stats().reconnects == 1
    finally:
        edge.close()
        gate.shut()


def test_a_certificate_the_broker_does_not_trust_is_logged_as_a_tls_failure_and_retried(
    tmp_path: Path, device_broker: DeviceBroker, test_ca: ThrowawayCA, caplog: pytest.LogCaptureFixture
) -> None:
    store = IdentityStore(tmp_path / "stranger")
    stranger_ca = ThrowawayCA.create()
    store.save(stranger_ca.issue(store.make_csr("dv-stranger"), "dv-stranger", device_broker.url), "x")
    store.ca_path.write_text(test_ca.pem)  # it trusts the broker, the broker does not trust it
    caplog.set_level(logging.INFO, logger="aisynergy.device")

    with Device("dv-stranger", store.data_dir, reconnect_cap_s=0.2) as dev:
        wait_for(lambda: len(_tls_failures(caplog)) >= 2, 60, what="two TLS failures")
        assert not dev.connected

    failure = _tls_failures(caplog)[0].getMessage()
    assert "alert" in failure and "retrying" in failure  # the cause, from paho's log, and what happens next
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR and r.name != "aisynergy.device"]


def _tls_failures(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "aisynergy.device" and "TLS with" in r.getMessage()]
