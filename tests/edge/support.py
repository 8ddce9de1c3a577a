"""Helpers for the edge tests: a throwaway certificate authority (the hub's own CA is not needed here),
real Mosquitto brokers set up like the hub's, paho peers standing in for the hub and devices, the agent."""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from edge.identity import IdentityStore
from interfaces.nodes import CertificateIssued, DeviceCertificateIssued
from interfaces.messages import ConnectionState, StateBody, envelope
from interfaces.topics import HUB_STATE, Tier, acl_pattern


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


LEAF_VALIDITY = dt.timedelta(days=365)  # as the hub issues: no agent renews at start (RENEW_BEFORE)


@dataclass
class ThrowawayCA:
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @classmethod
    def create(cls) -> ThrowawayCA:
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        cert = (
            x509.CertificateBuilder().subject_name(_name("test CA")).issuer_name(_name("test CA"))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(key, hashes.SHA256())
        )  # fmt: skip
        return cls(key, cert)

    @property
    def pem(self) -> str:
        return self.cert.public_bytes(serialization.Encoding.PEM).decode()

    def _leaf(
        self, cn: str, public_key: object, usage: x509.ObjectIdentifier, hosts: tuple[str, ...] = (), server_name: bool = False,
        validity: dt.timedelta = LEAF_VALIDITY, now: dt.datetime | None = None,
    ) -> x509.Certificate:
        """``server_name``: also a TLS server's certificate named ``cn``, as the hub issues a node's; ``now``: when
        it is issued (in the past, for one that has expired)."""
        now = now or dt.datetime.now(dt.UTC)
        usages = [usage, *([ExtendedKeyUsageOID.SERVER_AUTH] if server_name else [])]
        builder = (
            x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(self.cert.subject)
            .public_key(public_key).serial_number(x509.random_serial_number())  # type: ignore[arg-type]
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + validity)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        )  # fmt: skip
        names: list[x509.GeneralName] = [x509.IPAddress(ipaddress.ip_address(h)) for h in hosts]
        names += [x509.DNSName(cn)] if server_name else []
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return builder.sign(self.key, hashes.SHA256())

    def issue(
        self, csr_pem: str, node_id: str, mqtt_url: str = "mqtts://127.0.0.1:8883", heartbeat_s: float = 5.0
    ) -> CertificateIssued:
        """What the hub answers to a CSR."""
        csr = x509.load_pem_x509_csr(csr_pem.encode())
        cert = self._leaf(node_id, csr.public_key(), ExtendedKeyUsageOID.CLIENT_AUTH, server_name=True)
        return CertificateIssued(
            node_id=node_id,
            certificate_pem=cert.public_bytes(serialization.Encoding.PEM).decode(),
            ca_pem=self.pem,
            serial=format(cert.serial_number, "x"),
            not_after=cert.not_valid_after_utc,
            mqtt_url=mqtt_url,
            heartbeat_interval_s=heartbeat_s,
        )

    def issue_device(self, csr_pem: str, device_id: str, node_id: str, mqtt_url: str) -> DeviceCertificateIssued:
        """What the hub answers to a device's CSR."""
        cert = self._leaf(
            device_id, x509.load_pem_x509_csr(csr_pem.encode()).public_key(), ExtendedKeyUsageOID.CLIENT_AUTH
        )
        return DeviceCertificateIssued(
            device_id=device_id,
            node_id=node_id,
            certificate_pem=cert.public_bytes(serialization.Encoding.PEM).decode(),
            ca_pem=self.pem,
            serial=format(cert.serial_number, "x"),
            not_after=cert.not_valid_after_utc,
            mqtt_url=mqtt_url,
            heartbeat_interval_s=5.0,
        )

    def write_identity(self, directory: Path, cn: str, server: bool = False) -> tuple[Path, Path]:
        """A key pair and certificate in ``directory`` (a broker's when ``server``); returns (crt, key)."""
        key = ec.generate_private_key(ec.SECP256R1())
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        cert = self._leaf(cn, key.public_key(), usage, ("127.0.0.1",) if server else ())
        crt_path, key_path = directory / f"{cn}.crt", directory / f"{cn}.key"
        crt_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        return crt_path, key_path


# ---- real processes: Mosquitto brokers, MQTT peers (hub, devices), the edge agent -----------------------

MOSQUITTO = shutil.which("mosquitto") or ("/usr/sbin/mosquitto" if os.path.exists("/usr/sbin/mosquitto") else None)
needs_mosquitto = pytest.mark.skipif(MOSQUITTO is None, reason="needs the mosquitto binary")
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def service_port() -> int:
    """A free port outside the kernel's ephemeral range, so that no client socket takes it while the
    broker on it is stopped for a while."""
    try:
        low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except OSError:
        low, high = 32768, 60999
    candidates = [p for p in range(10000, 65000) if not low <= p <= high]
    for port in random.sample(candidates, 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port outside the ephemeral range")


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def wait_until(predicate: Callable[[], object], timeout: float = 60.0, what: str = "condition") -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := predicate():
            return result
        time.sleep(0.05)
    raise AssertionError(f"no {what} within {timeout} s")


def edge_acl(node_id: str, device_ids: Iterable[str]) -> str:
    """What the hub writes: the hub everywhere, an edge on its devices, everyone on its own subtree."""
    lines = ["user hub", "topic readwrite synergy/v1/#", f"user {node_id}"]
    lines += [f"topic readwrite synergy/v1/devices/{d}/#" for d in device_ids]
    lines += [f"pattern readwrite {acl_pattern(Tier.NODE)}", f"pattern readwrite {acl_pattern(Tier.DEVICE)}"]
    lines += [f"pattern read {HUB_STATE.pattern}", ""]
    return "\n".join(lines)


class Pki:
    """The test CA's files in one directory: its certificate and one key pair per identity."""

    def __init__(self, directory: Path, ca: ThrowawayCA) -> None:
        self.dir, self.ca = directory, ca
        directory.mkdir(parents=True, exist_ok=True)
        self.ca_path = directory / "ca.crt"
        self.ca_path.write_text(ca.pem)

    def identity(self, cn: str, server: bool = False) -> tuple[Path, Path]:
        crt, key = self.dir / f"{cn}.crt", self.dir / f"{cn}.key"
        if not crt.exists():
            self.ca.write_identity(self.dir, cn, server)
        return crt, key


class Mosquitto:
    """A mutual-TLS Mosquitto on 127.0.0.1 set up like the hub's (CN = user name = client id, an ACL)."""

    def __init__(self, directory: Path, pki: Pki, acl: str, persistent: bool = False) -> None:
        self.dir, self.port = directory, service_port()
        directory.mkdir(parents=True)
        crt, key = pki.identity("broker", server=True)
        (directory / "acl").write_text(acl)
        self.log = directory / "mosquitto.log"
        persistence = f"persistence true\npersistence_location {directory}/\n" if persistent else "persistence false\n"
        (directory / "mosquitto.conf").write_text(
            f"allow_anonymous false\n{persistence}acl_file {directory / 'acl'}\nlog_dest file {self.log}\n"
            "log_type error\nlog_type warning\nlog_type notice\nlog_type information\n"
            f"listener {self.port} 127.0.0.1\ncafile {pki.ca_path}\ncertfile {crt}\nkeyfile {key}\n"
            "require_certificate true\nuse_identity_as_username true\nuse_username_as_clientid true\n"
            + ("user root\n" if os.geteuid() == 0 else "")
        )
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"mqtts://127.0.0.1:{self.port}"

    def start(self) -> Mosquitto:
        assert MOSQUITTO is not None
        self.process = subprocess.Popen(
            [MOSQUITTO, "-c", str(self.dir / "mosquitto.conf")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 5
        while not listening(self.port):
            assert time.monotonic() < deadline and self.process.poll() is None, "mosquitto did not start"
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(5)

    def connections_of(self, client_id: str) -> int:
        return self.log.read_text().count(f" as {client_id} ")


class Peer:
    """A paho MQTT 5 client with one certificate (the hub, a device) that records what it receives and
    subscribes again after every reconnect."""

    def __init__(
        self,
        broker: Mosquitto,
        pki: Pki,
        cn: str,
        subscriptions: Iterable[str] = (),
        session_expiry_s: int = 0,
        on_message: Callable[[Peer, mqtt.MQTTMessage], None] | None = None,
    ) -> None:
        self.cn, self.subscriptions = cn, list(subscriptions)
        self._inbox: list[mqtt.MQTTMessage] = []
        self._arrived = threading.Condition()
        self.ready = threading.Event()
        self._on_message = on_message
        crt, key = pki.identity(cn)
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=cn, protocol=mqtt.MQTTv5)
        self.client.tls_set(ca_certs=str(pki.ca_path), certfile=str(crt), keyfile=str(key))
        self.client.reconnect_delay_set(min_delay=0.2, max_delay=0.5)  # type: ignore[arg-type]
        self.client.on_connect = self._connected
        self.client.on_subscribe = lambda *args: self.ready.set()
        self.client.on_message = self._message
        props = None
        if session_expiry_s:
            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = session_expiry_s
        self.client.connect("127.0.0.1", broker.port, clean_start=not session_expiry_s, properties=props)
        self.client.loop_start()
        assert self.ready.wait(5), f"{cn} did not connect and subscribe"

    def _connected(
        self, client: mqtt.Client, userdata: object, flags: mqtt.ConnectFlags, reason: object, props: object
    ) -> None:
        if self.cn == "hub":  # like the real hub: tell the edges it is there, so they deliver what they stored
            online = envelope("hub", StateBody(state=ConnectionState.ONLINE)).model_dump_json()
            client.publish(HUB_STATE.topic(), online, qos=HUB_STATE.qos, retain=True)
        # a restored session keeps its subscriptions
        if self.subscriptions and not flags.session_present:
            client.subscribe([(s, 1) for s in self.subscriptions])
        else:
            self.ready.set()

    def _message(self, client: mqtt.Client, userdata: object, message: mqtt.MQTTMessage) -> None:
        with self._arrived:
            self._inbox.append(message)
            self._arrived.notify_all()
        if self._on_message is not None:
            self._on_message(self, message)

    def expect(
        self, topic: str, timeout: float = 60.0, where: Callable[[mqtt.MQTTMessage], bool] = lambda m: True
    ) -> mqtt.MQTTMessage:
        """Take the oldest message on ``topic`` that satisfies ``where``, waiting for it if need be; the
        others stay for later calls."""
        deadline = time.monotonic() + timeout
        with self._arrived:
            while True:
                for index, message in enumerate(self._inbox):
                    if message.topic == topic and where(message):
                        return self._inbox.pop(index)  # not remove(): paho's messages compare equal by mid
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"{self.cn}: nothing on {topic} within {timeout} s")
                self._arrived.wait(left)

    def drain(self, topic: str, quiet_s: float = 0.5) -> list[mqtt.MQTTMessage]:
        """Take everything on ``topic`` that arrives until nothing has for ``quiet_s``."""
        found: list[mqtt.MQTTMessage] = []
        quiet_until = time.monotonic() + quiet_s
        with self._arrived:
            while (left := quiet_until - time.monotonic()) > 0:
                taken = [m for m in self._inbox if m.topic == topic]
                if taken:
                    found += taken
                    self._inbox = [m for m in self._inbox if m.topic != topic]
                    quiet_until = time.monotonic() + quiet_s
                else:
                    self._arrived.wait(left)
        return found

    def publish(
        self, topic: str, payload: bytes, qos: int = 1, retain: bool = False, properties: Properties | None = None
    ) -> None:
        self.client.publish(topic, payload, qos=qos, retain=retain, properties=properties).wait_for_publish(5)

    def close(self) -> None:
        self.client.disconnect()  # first: it wakes the network loop, which then ends at once
        self.client.loop_stop()


def body(message: mqtt.MQTTMessage) -> dict:
    return json.loads(message.payload)["body"]


def enrol_node(
    data_dir: Path, ca: ThrowawayCA, node_id: str, mqtt_url: str, hub_url: str = "http://hub"
) -> IdentityStore:
    """A node identity as if the hub had issued it, without a hub."""
    store = IdentityStore(data_dir)
    store.save(ca.issue(store.make_csr(node_id), node_id, mqtt_url, heartbeat_s=0.2), hub_url)
    return store


def start_edge(data_dir: Path, node_id: str, *options: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "edge.cli", "run", "--node-id", node_id, "--data-dir", str(data_dir), *options], cwd=REPO
    )


def stop_edge(process: subprocess.Popen[bytes]) -> int:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            return process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
    return process.wait(5)
