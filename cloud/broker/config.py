"""Mosquitto configuration for the hub's broker (DESIGN §4.4, §6).

One MQTT 5 TLS listener that requires a client certificate signed by the hub CA, takes the
certificate's CN as the username (and as the client id, so nobody can take over another's session),
checks the CA's revocation list, and applies an ACL that confines every node to
``synergy/v1/nodes/{its id}/#`` and every device to ``synergy/v1/devices/{its id}/#``. Revoked
identities get an explicit deny-all entry, which a running broker applies on SIGHUP to connections
that are already open; the reloaded CRL refuses new ones.

Mosquitto reads its own copies of the four files it needs (:data:`TLS_FILES`) from a directory of its
own (``tls/``, 0700, each file 0600, owned by the account it runs as); it never sees the CA key or the
artefact signing key. Its limits follow the wire's: a packet holds one message of at most
:data:`~interfaces.messages.MAX_MESSAGE_BYTES` plus its topic and properties, a client's queue is bounded
in messages and bytes, and TLS is 1.2 or later with AEAD ECDHE suites only (1.3 preferred).
"""

from __future__ import annotations

import getpass
from dataclasses import dataclass
from pathlib import Path

from cloud.pki import HUB_IDENTITY
from interfaces.infer import MAX_FRAME_BYTES
from interfaces.messages import MAX_MESSAGE_BYTES
from interfaces.topics import HUB_STATE, PREFIX, Tier, acl_pattern

PACKET_HEADROOM_BYTES = 16 * 1024
"""Room in a packet beside its message: fixed header, topic (a few hundred bytes), MQTT 5 properties (response
topic, correlation data, user properties)."""
DEFAULT_MAX_PACKET_BYTES = max(MAX_MESSAGE_BYTES, MAX_FRAME_BYTES) + PACKET_HEADROOM_BYTES
"""A larger PUBLISH (or any packet) is refused: the broker disconnects its sender. The largest message of any
channel: a split-inference frame (``interfaces.infer.MAX_FRAME_BYTES``); every envelope is bounded far below, by
``MAX_MESSAGE_BYTES``, at each tier."""
MAX_QUEUED_MESSAGES = 200_000
"""Per client, QoS 1 messages queued beyond those in flight (the hub's persistent session during a restart)."""
MAX_QUEUED_BYTES = 256 * 1024 * 1024
"""Per client, the bytes of those queued messages: 200,000 reports of ~1.3 KiB, or 1,000 of the largest."""
TLS12_CIPHERS = ":".join([
    "ECDHE-ECDSA-AES128-GCM-SHA256", "ECDHE-ECDSA-AES256-GCM-SHA384", "ECDHE-ECDSA-CHACHA20-POLY1305",
    "ECDHE-RSA-AES128-GCM-SHA256", "ECDHE-RSA-AES256-GCM-SHA384", "ECDHE-RSA-CHACHA20-POLY1305",
])  # fmt: skip
"""TLS 1.2: forward-secret AEAD suites only (no CBC, no SHA-1, no static RSA key exchange)."""
TLS13_CIPHERS = "TLS_AES_256_GCM_SHA384:TLS_CHACHA20_POLY1305_SHA256:TLS_AES_128_GCM_SHA256"
TLS_FILES = ("ca.crt", "broker.crt", "broker.key", "crl.pem")
"""What Mosquitto reads of the PKI: its copies live in :attr:`BrokerLayout.tls_dir`."""


@dataclass(frozen=True)
class BrokerLayout:
    """Where the broker's files live under a data directory (shared with the hub in the embedded stack)."""

    data_dir: Path
    instance: str = "broker"  # several brokers may share one PKI (an edge's own devices' broker, say)
    pki: Path | None = None
    """Where the broker's TLS files and access lists come from, when not the hub's ``DATA_DIR/pki`` (a directory
    that ``aisynergy broker share`` fills, without the CA key): the broker never creates a CA there."""

    @property
    def pki_dir(self) -> Path:
        return self.pki if self.pki is not None else self.data_dir / "pki"

    @property
    def owns_ca(self) -> bool:
        """Whether the broker may create the CA (and its own certificate) in :attr:`pki_dir`."""
        return self.pki is None

    @property
    def broker_dir(self) -> Path:
        return self.data_dir / self.instance

    @property
    def tls_dir(self) -> Path:
        """The broker's own copies of :data:`TLS_FILES` (0700, files 0600, owned by the account it runs as)."""
        return self.broker_dir / "tls"

    @property
    def config_file(self) -> Path:
        return self.broker_dir / "mosquitto.conf"

    @property
    def acl_file(self) -> Path:
        return self.broker_dir / "acl"

    @property
    def pid_file(self) -> Path:
        return self.broker_dir / "mosquitto.pid"

    @property
    def persistence_dir(self) -> Path:
        return self.broker_dir / "data"

    @property
    def revoked_file(self) -> Path:
        """Identities (one CN a line) the hub has revoked; written by the hub, read by the broker."""
        return self.pki_dir / "revoked.txt"

    @property
    def devices_file(self) -> Path:
        """``<node id> <device id>`` lines: which devices each edge serves; written by the hub."""
        return self.pki_dir / "devices.txt"

    @property
    def crl_file(self) -> Path:
        return self.pki_dir / "crl.pem"


def render_config(layout: BrokerLayout, host: str, port: int, max_packet_bytes: int = DEFAULT_MAX_PACKET_BYTES,
                  user: str | None = None) -> str:  # fmt: skip
    """``user``: the account Mosquitto drops to when started as root (default: the current one, which stays)."""
    tls = layout.tls_dir
    return "\n".join(
        [
            "# Generated by `aisynergy broker`; edits are overwritten.",
            f"user {user or getpass.getuser()}",
            f"pid_file {layout.pid_file}",
            "persistence true",
            f"persistence_location {layout.persistence_dir}/",
            "autosave_interval 60",
            "log_dest stdout",
            "log_type error",
            "log_type warning",
            "log_type notice",
            "connection_messages true",
            f"max_packet_size {max_packet_bytes}",
            f"max_queued_messages {MAX_QUEUED_MESSAGES}",
            f"max_queued_bytes {MAX_QUEUED_BYTES}",
            # QoS 1 messages in flight to one client: the hub acknowledges a report only once its ingest
            # has committed it (up to a flush interval later), so 20, the default, would cap it at ~100/s
            "max_inflight_messages 0",
            "per_listener_settings false",
            "set_tcp_nodelay true",  # no ~40 ms delayed-ACK stall per hop for small request/response packets
            "allow_anonymous false",
            f"acl_file {layout.acl_file}",
            "",
            f"listener {port} {host}",
            "protocol mqtt",
            f"cafile {tls / 'ca.crt'}",
            f"certfile {tls / 'broker.crt'}",
            f"keyfile {tls / 'broker.key'}",
            f"crlfile {tls / 'crl.pem'}",
            "tls_version tlsv1.2",  # the minimum; 1.3 is preferred when the client offers it
            f"ciphers {TLS12_CIPHERS}",
            f"ciphers_tls1.3 {TLS13_CIPHERS}",
            "require_certificate true",
            "use_identity_as_username true",
            "use_username_as_clientid true",
            "",
        ]
    )


def render_acl(revoked: list[str], devices: list[tuple[str, str]] | None = None,
               hub_identities: tuple[str, ...] = (HUB_IDENTITY,)) -> str:  # fmt: skip
    """Hub: everything under the prefix. Revoked: nothing. Edge: its subtree (pattern) plus its devices'.
    Device: its subtree (pattern) and never a node topic."""
    lines = ["# Generated by `aisynergy broker`; edits are overwritten.", ""]
    for hub in hub_identities:
        lines += [f"user {hub}", f"topic readwrite {PREFIX}/#", ""]
    revoked_set = set(revoked)
    for identity in sorted(revoked_set):
        lines += [f"user {identity}", "topic deny #", ""]
    by_node: dict[str, list[str]] = {}
    for node, device in devices or []:
        if node not in revoked_set and device not in revoked_set:
            by_node.setdefault(node, []).append(device)
    for node, node_devices in sorted(by_node.items()):
        lines.append(f"user {node}")
        lines += [f"topic readwrite {PREFIX}/{Tier.DEVICE}/{device}/#" for device in node_devices]
        lines.append("")
    for device in sorted(d for ds in by_node.values() for d in ds):
        lines += [f"user {device}", f"topic deny {PREFIX}/{Tier.NODE}/#", ""]
    lines += [f"pattern readwrite {acl_pattern(Tier.NODE)}", f"pattern readwrite {acl_pattern(Tier.DEVICE)}"]
    lines += [f"pattern read {HUB_STATE.pattern}", ""]  # everyone may see whether the hub is there
    return "\n".join(lines)


def read_devices(layout: BrokerLayout) -> list[tuple[str, str]]:
    if not layout.devices_file.exists():
        return []
    pairs = []
    for line in layout.devices_file.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2:
            pairs.append((parts[0], parts[1]))
    return pairs


def read_revoked(layout: BrokerLayout) -> list[str]:
    if not layout.revoked_file.exists():
        return []
    return [line.strip() for line in layout.revoked_file.read_text().splitlines() if line.strip()]
