"""Fixtures for the device tests: a throwaway CA, a small real enrolment server that signs CSRs with
it, a throwaway Mosquitto with mutual TLS and the per-device ACL, and an observer in the edge's place."""

from __future__ import annotations

import contextlib
import datetime as dt
import ipaddress
import json
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from interfaces import API_PREFIX
from interfaces.errors import PROBLEM_MEDIA_TYPE
from interfaces.ids import new_id
from interfaces.messages import CommandBody, DesiredBody, EventsAckBody, envelope
from interfaces.nodes import DeviceCertificateIssued
from interfaces.topics import (
    DEVICE_CMD,
    DEVICE_CMD_REPLY,
    DEVICE_DESIRED,
    DEVICE_EVENTS_ACK,
    Channel,
    Tier,
    acl_pattern,
    own_subtree,
)

MOSQUITTO = shutil.which("mosquitto") or ("/usr/sbin/mosquitto" if os.path.exists("/usr/sbin/mosquitto") else None)
NODE_ID = "nd-edge-1"


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


LEAF_VALIDITY = dt.timedelta(days=365)  # as the hub issues: no agent renews at start (RENEW_BEFORE)


@dataclass
class ThrowawayCA:
    """Stands in for the hub CA: signs the broker's, the edge's and the devices' certificates."""

    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @classmethod
    def create(cls, name: str = "device test CA") -> ThrowawayCA:
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        cert = (
            x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(key, hashes.SHA256())
        )  # fmt: skip
        return cls(key, cert)

    @property
    def pem(self) -> str:
        return self.cert.public_bytes(serialization.Encoding.PEM).decode()

    def leaf(self, cn: str, public_key: object, server: bool = False, validity: dt.timedelta = LEAF_VALIDITY,
             now: dt.datetime | None = None) -> x509.Certificate:  # fmt: skip
        """``now``: when it is issued (in the past, for one that has expired)."""
        now = now or dt.datetime.now(dt.UTC)
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (
            x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(self.cert.subject)
            .public_key(public_key).serial_number(x509.random_serial_number())  # type: ignore[arg-type]
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + validity)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )  # fmt: skip
        if server:
            san = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
            builder = builder.add_extension(san, critical=False)
        return builder.sign(self.key, hashes.SHA256())

    def issue(
        self, csr_pem: str, device_id: str, mqtt_url: str = "mqtts://127.0.0.1:8883", heartbeat_s: float = 5.0
    ) -> DeviceCertificateIssued:
        """What the edge (or hub) answers to a device's CSR."""
        cert = self.leaf(device_id, x509.load_pem_x509_csr(csr_pem.encode()).public_key())
        return DeviceCertificateIssued(
            device_id=device_id,
            node_id=NODE_ID,
            certificate_pem=cert.public_bytes(serialization.Encoding.PEM).decode(),
            ca_pem=self.pem,
            serial=format(cert.serial_number, "x"),
            not_after=cert.not_valid_after_utc,
            mqtt_url=mqtt_url,
            heartbeat_interval_s=heartbeat_s,
        )

    def write_identity(self, directory: Path, cn: str, server: bool = False) -> tuple[Path, Path]:
        """A key and certificate in ``directory`` (a broker's when ``server``); returns (crt, key)."""
        key = ec.generate_private_key(ec.SECP256R1())
        crt_path, key_path = directory / f"{cn}.crt", directory / f"{cn}.key"
        crt_path.write_bytes(self.leaf(cn, key.public_key(), server).public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        return crt_path, key_path


@pytest.fixture(scope="session")
def test_ca() -> ThrowawayCA:
    return ThrowawayCA.create()


@dataclass
class EnrolmentServer:
    """A real HTTP server doing what the edge does for ``POST /devices/{id}/certificate``: one-time
    bootstrap tokens, a CSR whose subject must be the device id, problem+json refusals."""

    ca: ThrowawayCA
    mqtt_url: str = "mqtts://127.0.0.1:8883"
    heartbeat_s: float = 5.0
    tokens: dict[str, str] = field(default_factory=dict)  # device id -> unused bootstrap token
    enrolled: set[str] = field(default_factory=set)
    scripted: list[tuple[int, str]] = field(default_factory=list)  # answers to give first: (status, code)
    requests: list[str] = field(default_factory=list)  # paths seen
    url: str = ""

    def answer(self, path: str, body: bytes) -> tuple[int, str, bytes]:
        self.requests.append(path)
        if self.scripted:
            return self._problem(*self.scripted.pop(0))
        prefix, suffix = f"{API_PREFIX}/devices/", "/certificate"
        if not (path.startswith(prefix) and path.endswith(suffix)):
            return self._problem(404, "not_found")
        device_id = path[len(prefix) : -len(suffix)]
        request = json.loads(body)
        if device_id in self.enrolled:
            return self._problem(409, "bootstrap_token_used")
        if self.tokens.get(device_id) != request.get("bootstrap_token"):
            return self._problem(401, "bootstrap_token_invalid")
        csr = x509.load_pem_x509_csr(request["csr_pem"].encode())
        if [a.value for a in csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)] != [device_id]:
            return self._problem(422, "csr_invalid")
        del self.tokens[device_id]
        self.enrolled.add(device_id)
        issued = self.ca.issue(request["csr_pem"], device_id, self.mqtt_url, self.heartbeat_s)
        return 201, "application/json", issued.model_dump_json().encode()

    @staticmethod
    def _problem(status: int, code: str) -> tuple[int, str, bytes]:
        problem = {
            "type": f"urn:aisynergy:error:{code}",
            "title": code,
            "status": status,
            "code": code,
            "detail": f"because {code}",
        }
        return status, PROBLEM_MEDIA_TYPE, json.dumps(problem).encode()


@pytest.fixture
def enrolment_server(test_ca: ThrowawayCA) -> Iterator[EnrolmentServer]:
    server = EnrolmentServer(test_ca)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            status, content_type, payload = server.answer(self.path, body)
            self.send_response(status)
            self.send_header("content-type", content_type)
            self.send_header("content-length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    httpd.shutdown()
    httpd.server_close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class DeviceBroker:
    port: int
    pki: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"mqtts://127.0.0.1:{self.port}"

    def start(self) -> None:
        assert MOSQUITTO is not None
        self.process = subprocess.Popen(
            [MOSQUITTO, "-c", str(self.pki / "mosquitto.conf")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 5
        while not _listening(self.port):
            assert time.monotonic() < deadline and self.process.poll() is None, "mosquitto did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(5)


@pytest.fixture
def device_broker(tmp_path: Path, test_ca: ThrowawayCA) -> Iterator[DeviceBroker]:
    """Mosquitto on a free port: mutual TLS, CN as user name, devices confined to their own subtree."""
    if MOSQUITTO is None:
        pytest.skip("needs the mosquitto binary")
    port, pki = free_port(), tmp_path / "pki"
    pki.mkdir()
    (pki / "ca.crt").write_text(test_ca.pem)
    crt, key = test_ca.write_identity(pki, "broker", server=True)
    test_ca.write_identity(pki, "edge")
    (pki / "acl").write_text(f"user edge\ntopic readwrite synergy/v1/#\npattern readwrite {acl_pattern(Tier.DEVICE)}\n")
    (pki / "mosquitto.conf").write_text(
        f"allow_anonymous false\npersistence false\nacl_file {pki / 'acl'}\nlistener {port} 127.0.0.1\n"
        f"cafile {pki / 'ca.crt'}\ncertfile {crt}\nkeyfile {key}\n"
        "require_certificate true\nuse_identity_as_username true\n" + ("user root\n" if os.geteuid() == 0 else "")
    )
    broker = DeviceBroker(port, pki)
    broker.start()
    yield broker
    broker.stop()


class EdgeObserver:
    """A paho client with the edge's identity that records everything under one device's subtree and
    talks to the device the way its edge does."""

    def __init__(self, broker: DeviceBroker, device_id: str) -> None:
        self.device_id = device_id
        self._history: dict[str, list[mqtt.MQTTMessage]] = {}  # channel -> every message, in arrival order
        self._returned: set[int] = set()
        self._arrived = threading.Condition()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=new_id("edge"), protocol=mqtt.MQTTv5)
        pki = broker.pki
        self.client.tls_set(ca_certs=str(pki / "ca.crt"), certfile=str(pki / "edge.crt"), keyfile=str(pki / "edge.key"))
        self.client.on_message = self._on_message
        self.client.connect("127.0.0.1", broker.port)
        self.client.subscribe(own_subtree(Tier.DEVICE, device_id), qos=1)
        self.client.loop_start()

    def _on_message(self, client: mqtt.Client, userdata: object, message: mqtt.MQTTMessage) -> None:
        if message.payload:  # an empty payload only clears a retained message
            channel = message.topic.split(f"/{self.device_id}/", 1)[-1]
            with self._arrived:
                self._history.setdefault(channel, []).append(message)
                self._arrived.notify_all()
            if channel == Channel.EVENTS:  # stored: the device may forget it (as an edge says after its commit)
                seq = json.loads(message.payload)["body"].get("seq")
                ack = envelope("edge", EventsAckBody(seq=seq)).model_dump_json().encode()
                client.publish(DEVICE_EVENTS_ACK.topic(device_id=self.device_id), ack, qos=DEVICE_EVENTS_ACK.qos)

    def expect(self, channel: str, timeout: float = 60.0, **body: object) -> tuple[mqtt.MQTTMessage, dict]:
        """The earliest message on ``channel`` not returned before whose body contains ``body``."""
        deadline = time.monotonic() + timeout
        with self._arrived:
            while True:
                for message in self._history.get(channel, []):
                    payload = json.loads(message.payload)
                    if id(message) not in self._returned and body.items() <= payload["body"].items():
                        self._returned.add(id(message))
                        return message, payload
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"nothing on {channel} with {body} within {timeout} s")
                self._arrived.wait(left)

    def bodies(self, channel: str) -> list[dict]:
        """Every body received so far on ``channel``, in arrival order."""
        with self._arrived:
            return [json.loads(m.payload)["body"] for m in self._history.get(channel, [])]

    def publish(
        self, topic: str, payload: bytes, qos: int = 1, retain: bool = False, properties: Properties | None = None
    ) -> None:
        self.client.publish(topic, payload, qos=qos, retain=retain, properties=properties).wait_for_publish(5)

    def command(self, body: CommandBody | bytes, correlation: bytes) -> str | None:
        """Send a command with a response topic and correlation data; returns the request id."""
        props = Properties(PacketTypes.PUBLISH)
        props.ResponseTopic = DEVICE_CMD_REPLY.topic(device_id=self.device_id)
        props.CorrelationData = correlation
        if isinstance(body, bytes):
            self.publish(DEVICE_CMD.topic(device_id=self.device_id), body, DEVICE_CMD.qos, properties=props)
            return None
        request = envelope("edge", body)
        self.publish(
            DEVICE_CMD.topic(device_id=self.device_id),
            request.model_dump_json().encode(),
            DEVICE_CMD.qos,
            properties=props,
        )
        return request.id

    def desire(self, version: int, spec: dict) -> None:
        """Publish the retained desired document, as the edge does."""
        document = envelope("edge", DesiredBody(version=version, spec=spec)).model_dump_json().encode()
        self.publish(
            DEVICE_DESIRED.topic(device_id=self.device_id), document, DEVICE_DESIRED.qos, DEVICE_DESIRED.retain
        )

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


@pytest.fixture
def enrolled(tmp_path: Path, test_ca: ThrowawayCA, device_broker: DeviceBroker) -> tuple[str, Path]:
    """A device id and a data directory already holding its identity (heartbeat every 0.2 s)."""
    from device.identity import IdentityStore

    device_id = new_id("dv")
    store = IdentityStore(tmp_path / "device")
    issued = test_ca.issue(store.make_csr(device_id), device_id, device_broker.url, heartbeat_s=0.2)
    store.save(issued, "http://edge.invalid")
    return device_id, store.data_dir


@pytest.fixture
def edge(device_broker: DeviceBroker, enrolled: tuple[str, Path]) -> Iterator[EdgeObserver]:
    observer = EdgeObserver(device_broker, enrolled[0])
    yield observer
    observer.close()


class Gate:
    """A TCP forwarder in front of the broker that can be shut (existing connections cut, new ones refused)
    and opened again on the same port: a broker outage for the device alone, while a test's observer keeps
    its own connection to the broker."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self._listener: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self.open()

    @property
    def url(self) -> str:
        return f"mqtts://127.0.0.1:{self.port}"

    def open(self) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(16)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def shut(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            conns, self._conns = self._conns, []
        if listener is not None:
            listener.close()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # shut
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)
