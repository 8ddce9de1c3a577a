"""An edge agent written from ``interfaces/AGENTS.md`` alone works with the real hub and broker.

:class:`GuideAgent` is what a third party writes in any language, here in Python with paho-mqtt, httpx and
cryptography only: nothing of ``edge``, ``device`` or ``interfaces``, raw topics and raw JSON as the guide spells
them. The integrator registers it over REST, it enrols with its own key and CSR, connects with mutual TLS,
publishes its retained online state and heartbeats; the hub shows it ONLINE with its readings, takes its
event, gets its answers to REST commands through response topic and correlation data, gets its report of the
desired document, records the malformed message it sent, and shows it OFFLINE after its clean shutdown.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import paho.mqtt.client as mqtt
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from tests.support import Broker, Hub, start_hub, stop, wait_for

HEARTBEAT_S = 0.5
MISSED = 8  # a loaded machine may delay a heartbeat; the test's offline is the clean shutdown, not silence
AGENT_VERSION = "guide-agent/1.0"
CROCKFORD = "0123456789abcdefghjkmnpqrstvwxyz"
NPU = {"type": "npu", "model": "guide-npu", "count": 2, "memory_bytes": 1 << 30, "utilisation": 0.5}
RESOURCES = {
    "cpu": {"cores": 4, "utilisation": 0.25},
    "memory": {"total_bytes": 4 << 30, "available_bytes": 1234567890},
    "disk": {"path": "/", "total_bytes": 32 << 30, "free_bytes": 16 << 30},
    "network": {"bytes_sent": 1, "bytes_received": 2},
    "accelerators": [NPU],
}


@pytest.fixture
def hub(broker: Broker, sqlite_url: str) -> Iterator[Hub]:
    h = start_hub(broker.data_dir, sqlite_url, broker.url, heartbeat_interval=HEARTBEAT_S, offline_after_missed=MISSED)
    try:
        yield h
    finally:
        stop(h.proc)


# ---- the agent, as the guide describes it ---------------------------------------------------------------


def message_id() -> str:
    """``m-`` + 26 Crockford base32 characters: 48-bit milliseconds, 80 random bits (guide §3)."""
    value = (int(time.time() * 1000) << 80) | int.from_bytes(os.urandom(10), "big")
    return "m-" + "".join(CROCKFORD[(value >> (5 * i)) & 31] for i in reversed(range(26)))


class GuideAgent:
    def __init__(self, hub_url: str, node_id: str, directory: Path) -> None:
        self.hub_url, self.node_id, self.directory = hub_url, node_id, directory
        self.base = f"synergy/v1/nodes/{node_id}"
        self.enrolment: dict[str, Any] = {}
        self.client: mqtt.Client | None = None
        self.suback: dict[int, list[int]] = {}
        self.puback: dict[int, int] = {}
        self.desired_seen: list[dict[str, Any]] = []
        self.hub_state: str | None = None
        self.connected = threading.Event()
        self.running = threading.Event()
        self.heartbeat_seq = 0
        self.started = time.monotonic()

    # §1 enrolment
    def enrol(self, bootstrap_token: str) -> None:
        ca_pem = httpx.get(f"{self.hub_url}/api/v1/ca.crt", timeout=10).text
        key = ec.generate_private_key(ec.SECP256R1())
        csr = (
            x509.CertificateSigningRequestBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, self.node_id)]))
            .sign(key, hashes.SHA256())
        )
        csr_pem = csr.public_bytes(serialization.Encoding.PEM).decode()
        r = httpx.post(
            f"{self.hub_url}/api/v1/nodes/{self.node_id}/certificate",
            json={"csr_pem": csr_pem, "bootstrap_token": bootstrap_token},
            timeout=10,
        )
        assert r.status_code == 201, r.text
        self.enrolment = r.json()
        assert self.enrolment["ca_pem"].strip() == ca_pem.strip()
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "key.pem").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        (self.directory / "cert.pem").write_text(self.enrolment["certificate_pem"])
        (self.directory / "ca.pem").write_text(ca_pem)

    def envelope(self, kind: str, body: dict[str, Any], reply_to: str | None = None) -> bytes:
        ts = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        return json.dumps(
            {
                "v": 1,
                "id": message_id(),
                "ts": ts,
                "src": self.node_id,
                "kind": kind,
                "reply_to": reply_to,
                "body": body,
            }
        ).encode()

    # §2 connecting, §5 online and heartbeats
    def connect(self) -> None:
        url = urlsplit(self.enrolment["mqtt_url"])
        assert url.scheme == "mqtts"
        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=self.node_id, protocol=mqtt.MQTTv5)
        client.tls_set(
            ca_certs=str(self.directory / "ca.pem"),
            certfile=str(self.directory / "cert.pem"),
            keyfile=str(self.directory / "key.pem"),
        )
        client.will_set(
            f"{self.base}/state", self.envelope("state", {"state": "offline", "reason": "will"}), qos=1, retain=True
        )
        client.on_connect = self._on_connect
        client.on_subscribe = lambda _c, _u, mid, reasons, _p: self.suback.__setitem__(mid, [r.value for r in reasons])
        client.on_publish = lambda _c, _u, mid, reason, _p: self.puback.__setitem__(mid, reason.value)
        client.on_message = self._on_message
        self.client = client
        client.connect(url.hostname or "127.0.0.1", url.port or 8883, keepalive=30)
        client.loop_start()
        assert self.connected.wait(15), "the broker did not accept the connection"
        _, mid = client.subscribe([(f"{self.base}/desired", 1), (f"{self.base}/cmd", 1), ("synergy/v1/hub/state", 1)])
        wait_for(lambda: mid in self.suback, 60, what="SUBACK")
        assert all(code < 0x80 for code in self.suback[mid]), self.suback[mid]
        self.publish("state", {"state": "online", "agent_version": AGENT_VERSION}, retain=True)
        self.running.set()
        threading.Thread(target=self._heartbeats, daemon=True).start()

    def _on_connect(self, _client: mqtt.Client, _userdata: Any, _flags: Any, reason: Any, _properties: Any) -> None:
        if not reason.is_failure:
            self.connected.set()

    def publish(
        self,
        channel: str,
        body: dict[str, Any],
        kind: str | None = None,
        retain: bool = False,
        qos: int = 1,
        reply_to: str | None = None,
        topic: str | None = None,
        properties: Properties | None = None,
    ) -> int:
        """Publish an envelope on ``channel`` of this node's subtree (or on ``topic``, a response topic)."""
        assert self.client is not None
        payload = self.envelope(kind or channel, body, reply_to)
        return self.client.publish(
            topic or f"{self.base}/{channel}", payload, qos=qos, retain=retain, properties=properties
        ).mid

    def _heartbeats(self) -> None:
        while self.running.is_set():
            self.heartbeat_seq += 1
            uptime_s = round(time.monotonic() - self.started, 3)
            body = {
                "seq": self.heartbeat_seq,
                "health": "ok",
                "agent_version": AGENT_VERSION,
                "uptime_s": uptime_s,
                "resources": RESOURCES,
            }
            self.publish("heartbeat", body, qos=0)
            time.sleep(self.enrolment["heartbeat_interval_s"])

    # §6 desired and reported, §7 commands
    def _on_message(self, _client: mqtt.Client, _userdata: Any, message: mqtt.MQTTMessage) -> None:
        if message.topic == "synergy/v1/hub/state" and message.payload:
            self.hub_state = json.loads(message.payload)["body"]["state"]
        elif message.topic == f"{self.base}/desired" and message.payload:
            desired = json.loads(message.payload)
            if self.desired_seen and desired["body"]["version"] <= self.desired_seen[-1]["body"]["version"]:
                return
            self.desired_seen.append(desired)
            self.publish(
                "reported",
                {"version": desired["body"]["version"], "status": desired["body"]["spec"]},
                reply_to=desired["id"],
            )
        elif message.topic == f"{self.base}/cmd":
            self._on_command(message)

    def _on_command(self, message: mqtt.MQTTMessage) -> None:
        response_topic = message.properties.ResponseTopic  # type: ignore[union-attr]
        answer = Properties(PacketTypes.PUBLISH)
        answer.CorrelationData = message.properties.CorrelationData  # type: ignore[union-attr]
        try:
            request = json.loads(message.payload)
            name, args = request["body"]["name"], request["body"].get("args", {})
        except (ValueError, KeyError, TypeError) as exc:
            result, request = {"ok": False, "error_code": "validation_failed", "error": str(exc)}, {"id": None}
        else:
            if name == "echo":
                result = {"ok": True, "result": {"echo": args, "agent": AGENT_VERSION}}
            else:
                result = {"ok": False, "error_code": "unknown_command", "error": f"no command {name!r}"}
        self.publish(
            "cmd/reply", result, kind="command_result", reply_to=request["id"], topic=response_topic, properties=answer
        )

    # §5 clean shutdown
    def shutdown(self) -> None:
        assert self.client is not None
        self.running.clear()
        mid = self.publish("state", {"state": "offline", "reason": "shutdown"}, retain=True)
        wait_for(lambda: mid in self.puback, 60, what="PUBACK of the offline state")
        self.client.disconnect()
        self.client.loop_stop()


# ---- the test ---------------------------------------------------------------------------------------------


def _get(hub: Hub, path: str) -> Any:
    with hub.client("viewer") as api:
        r = api.get(path)
        assert r.status_code == 200, r.text
        return r.json()


def test_an_agent_written_from_the_guide_alone_works_with_the_hub(hub: Hub, tmp_path: Path) -> None:
    # Prepare: the integrator registers the node (REST)
    with hub.client("operator") as api:
        reg = api.post("/nodes", json={"name": "guide-gw", "labels": {"written": "from-the-guide"}})
        assert reg.status_code == 201, reg.text
    node_id = reg.json()["node"]["id"]
    agent = GuideAgent(hub.url, node_id, tmp_path / "guide-agent")

    # Execute + Assert: it enrols, connects and is ONLINE with its readings
    agent.enrol(reg.json()["bootstrap_token"])
    assert agent.enrolment["node_id"] == node_id
    agent.connect()
    try:
        status: Any = wait_for(
            lambda: (s := _get(hub, f"/nodes/{node_id}/status"))["state"] == "ONLINE" and s.get("resources") and s,
            60,
            what="ONLINE with resources",
        )
        assert status["connected"] is True and status["agent_version"] == AGENT_VERSION
        assert status["resources"]["memory"]["available_bytes"] == 1234567890
        assert status["resources"]["accelerators"] == [{**NPU, "purpose": None}]
        wait_for(lambda: agent.hub_state == "online", 60, what="the hub's retained state")

        # ... its event is stored, once
        agent.publish(
            "events",
            {"seq": 1, "type": "guide.hello", "severity": "info", "message": "hello", "data": {"n": 1}},
            kind="event",
        )
        events: Any = wait_for(
            lambda: [e for e in _get(hub, f"/nodes/{node_id}/events")["items"] if e["type"] == "guide.hello"],
            60,
            what="its event",
        )
        assert [(e["source"], e["seq"], e["data"]) for e in events] == [("node", 1, {"n": 1})]

        # ... it answers REST commands through response topic + correlation data, the unknown one too
        with hub.client("operator") as api:
            echo = api.post(f"/nodes/{node_id}/commands", json={"name": "echo", "args": {"x": 1}, "timeout_s": 10})
            unknown = api.post(f"/nodes/{node_id}/commands", json={"name": "reboot", "timeout_s": 10})
        assert echo.status_code == 200, echo.text
        assert (echo.json()["ok"], echo.json()["result"]) == (True, {"echo": {"x": 1}, "agent": AGENT_VERSION})
        assert unknown.status_code == 200, unknown.text
        assert (unknown.json()["ok"], unknown.json()["error_code"]) == (False, "unknown_command")

        # ... it gets its desired document and reports it
        with hub.client("operator") as api:
            put = api.put(f"/nodes/{node_id}/twin", json={"desired": {"sampling_hz": 5, "mode": "eco"}})
            assert put.status_code == 200, put.text
        twin: Any = wait_for(
            lambda: (t := _get(hub, f"/nodes/{node_id}/twin"))["in_sync"] and t, 60, what="the twin in sync"
        )
        assert twin["reported"] == {"sampling_hz": 5, "mode": "eco"}
        assert twin["reported_version"] == twin["desired_version"] == agent.desired_seen[-1]["body"]["version"]

        # ... a malformed message it sends is dropped and answered with a message_rejected event (§9)
        agent.publish("heartbeat", {"seq": "3", "agent_version": AGENT_VERSION}, qos=1)
        rejected: Any = wait_for(
            lambda: [e for e in _get(hub, f"/nodes/{node_id}/events")["items"] if e["type"] == "message_rejected"],
            60,
            what="message_rejected",
        )
        assert rejected[0]["source"] == "hub"
        assert rejected[0]["data"]["topic"] == f"synergy/v1/nodes/{node_id}/heartbeat"
        assert _get(hub, f"/nodes/{node_id}/status")["state"] == "ONLINE"
    finally:
        # Execute: a clean shutdown
        agent.shutdown()

    # Assert: OFFLINE, for the reason it gave
    wait_for(lambda: _get(hub, f"/nodes/{node_id}/status")["state"] == "OFFLINE", 60, what="OFFLINE")
    history = _get(hub, f"/nodes/{node_id}/history")
    assert [(h["from_state"], h["to_state"]) for h in history][-2:] == [("REGISTERED", "ONLINE"), ("ONLINE", "OFFLINE")]
    assert history[-1]["reason"] == "agent shutdown"
