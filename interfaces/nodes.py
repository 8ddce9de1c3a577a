"""REST models of edge node management (DESIGN §4.1, standard §8.1)."""

from __future__ import annotations

from datetime import datetime, timedelta
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from interfaces.lifecycle import AdminState, NodeState
from interfaces.messages import Health
from interfaces.resources import Resources
from interfaces.selectors import LABEL_KEY_PATTERN, LABEL_VALUE_PATTERN, MAX_LABELS, validate_labels
from interfaces.strict import INT64_MAX, JsonObject
from interfaces.text import NoNul

_LABELS_SCHEMA = {
    "maxProperties": MAX_LABELS,
    "propertyNames": {"pattern": LABEL_KEY_PATTERN, "maxLength": 253},
    "additionalProperties": {"type": "string", "pattern": LABEL_VALUE_PATTERN},
}
Labels = Annotated[dict[str, str], AfterValidator(validate_labels), Field(json_schema_extra=_LABELS_SCHEMA)]
"""Kubernetes-style labels; the JSON Schema states the rules ``validate_labels`` holds."""
Name = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9 _.:-]*$")]
Description = Annotated[str, Field(max_length=1024)]

# Documented liveness bounds (README "Liveness settings"; standard 7.2 d 2, 7.2 d 3). A hub announces its
# heartbeat interval and offline timeout at enrolment; the offline timeout is the interval times the
# number of missed heartbeats after which a silent node is OFFLINE.
MIN_HEARTBEAT_INTERVAL_S = 0.2
MAX_HEARTBEAT_INTERVAL_S = 300.0
MAX_OFFLINE_AFTER_MISSED = 10
MAX_OFFLINE_TIMEOUT_S = MAX_HEARTBEAT_INTERVAL_S * MAX_OFFLINE_AFTER_MISSED


class _In(NoNul):
    """Request bodies refuse unknown fields and U+0000 in text."""

    model_config = ConfigDict(extra="forbid")


class NodeKind(StrEnum):
    EDGE = "edge"


class NodeCreate(_In):
    name: Name
    kind: NodeKind = NodeKind.EDGE
    labels: Labels = Field(default_factory=dict)
    description: Description = ""
    bootstrap_ttl_s: int = Field(default=3600, ge=60, le=7 * 24 * 3600, description="lifetime of the bootstrap token")


class NodeUpdate(_In):
    """PATCH body; absent fields are left as they are. ``labels`` replaces the whole label set."""

    name: Name | None = None
    labels: Labels | None = None
    description: Description | None = None


class AdminStateUpdate(_In):
    admin_state: AdminState


class NodePublic(BaseModel):
    id: str
    name: str
    kind: NodeKind
    labels: dict[str, str]
    description: str
    state: NodeState
    admin_state: AdminState
    created_at: datetime
    updated_at: datetime
    certificate_serial: str | None = None
    certificate_not_after: datetime | None = None


class NodeRegistered(BaseModel):
    """The answer to ``POST /nodes``: the node and its one-time bootstrap token (shown once)."""

    node: NodePublic
    bootstrap_token: str
    bootstrap_expires_at: datetime
    ca_sha256: str = Field(description="the hub CA's fingerprint (sha256:<hex>): the node checks it before it sends the token (`aisynergy edge run --ca-sha256`)")


class BootstrapTokenIssued(BaseModel):
    """The answer to ``POST /nodes/{id}/bootstrap-token`` and ``POST /devices/{id}/bootstrap-token`` (shown once)."""

    bootstrap_token: str
    bootstrap_expires_at: datetime
    ca_sha256: str = Field(description="the hub CA's fingerprint (sha256:<hex>): the agent checks it before it sends the token (`--ca-sha256`)")
    tls_server_name: str | None = Field(
        default=None,
        description="a device: the name in its edge's listener certificate (the edge's node id), for `aisynergy device run --tls-server-name`",
    )


class BootstrapTokenReissue(_In):
    ttl_s: int = Field(default=3600, ge=60, le=7 * 24 * 3600)


class CertificateRequest(_In):
    csr_pem: str = Field(min_length=64, max_length=16384, description="PEM PKCS#10 CSR; subject CN = node id")
    bootstrap_token: str = Field(min_length=16, max_length=256)


# Certificate renewal (DESIGN §6): an agent renews from the identity it holds when less than RENEW_BEFORE of its
# certificate is left, and the hub still renews one that expired less than RENEWAL_GRACE ago (an agent that was
# offline for a while); beyond it the identity re-enrols with a new bootstrap token.
RENEW_BEFORE = timedelta(days=60)
RENEWAL_GRACE = timedelta(days=30)


class CertificateRenewal(_In):
    """``POST /nodes/{id}/certificate/renewal`` and ``POST /devices/{id}/certificate/renewal``: proof of possession,
    no token. The CSR must be signed by the key of the certificate it renews."""

    certificate_pem: str = Field(min_length=64, max_length=16384, description="the PEM certificate the hub issued to this id")
    csr_pem: str = Field(min_length=64, max_length=16384, description="PEM PKCS#10 CSR; subject CN = the id, the certificate's public key")


class CertificateIssued(BaseModel):
    node_id: str
    certificate_pem: str
    ca_pem: str
    serial: str
    not_after: datetime
    mqtt_url: str = Field(description="where the agent connects, e.g. mqtts://broker:8883")
    heartbeat_interval_s: float = Field(gt=0)
    offline_timeout_s: float | None = Field(default=None, gt=0, description="silence after which the hub marks the agent OFFLINE (at most MAX_OFFLINE_TIMEOUT_S)")
    signing_key_pem: str | None = Field(
        default=None, max_length=16384,
        description="the hub's Ed25519 artefact-signing public keys to pin, as PEM blocks: its current key first, then those it retired (newest first)",
    )  # fmt: skip


class NodeStatus(BaseModel):
    node_id: str
    state: NodeState
    admin_state: AdminState
    connected: bool
    last_heartbeat_at: datetime | None = None
    last_state_change_at: datetime | None = None
    health: Health | None = None
    health_detail: str | None = None
    agent_version: str | None = None
    uptime_s: float | None = None
    resources: Resources | None = None


class NodeTransition(BaseModel):
    from_state: NodeState | None
    to_state: NodeState
    at: datetime
    reason: str


class DeviceCreate(_In):
    node_id: str = Field(min_length=1, max_length=64)
    name: Name | None = None
    model: str = Field(min_length=1, max_length=128)
    labels: Labels = Field(default_factory=dict)
    description: Description = ""


class DeviceUpdate(_In):
    name: Name | None = None
    model: str | None = Field(default=None, min_length=1, max_length=128)
    labels: Labels | None = None
    description: Description | None = None


class DevicePublic(BaseModel):
    id: str
    node_id: str
    name: str | None
    model: str
    labels: dict[str, str]
    description: str
    state: NodeState
    created_at: datetime
    updated_at: datetime


class TwinUpdate(_In):
    """``PUT /devices/{id}/twin``: replaces the desired document and bumps its version."""

    desired: JsonObject = Field(default_factory=dict, description="becomes the desired document's spec on MQTT (bounded JSON)")
    expected_version: int | None = Field(default=None, ge=0, le=INT64_MAX, description="optimistic concurrency: 409 if the current desired version differs")


class Twin(BaseModel):
    """Desired and reported documents; ``diff`` holds what desired wants changed (key -> desired value,
    ``null`` for a reported key that desired no longer has)."""

    device_id: str | None = None
    node_id: str | None = None
    desired: dict[str, Any]
    desired_version: int
    reported: dict[str, Any]
    reported_version: int
    reported_at: datetime | None = None
    in_sync: bool
    diff: dict[str, Any] = Field(default_factory=dict)


class DeviceCertificateIssued(BaseModel):
    """The answer to ``POST /devices/{id}/certificate`` (at the hub, or at the device's edge, which
    forwards the request to the hub and rewrites ``mqtt_url`` to the broker its devices use)."""

    device_id: str
    node_id: str
    certificate_pem: str
    ca_pem: str
    serial: str
    not_after: datetime
    mqtt_url: str
    heartbeat_interval_s: float = Field(gt=0)
    offline_timeout_s: float | None = Field(default=None, gt=0, description="silence after which the hub marks the agent OFFLINE (at most MAX_OFFLINE_TIMEOUT_S)")
    signing_key_pem: str | None = Field(
        default=None, max_length=16384,
        description="the hub's Ed25519 artefact-signing public keys to pin, as PEM blocks: its current key first, then those it retired (newest first)",
    )  # fmt: skip


class DeviceStatus(BaseModel):
    device_id: str
    node_id: str
    state: NodeState
    connected: bool
    last_heartbeat_at: datetime | None = None
    last_state_change_at: datetime | None = None
    health: Health | None = None
    agent_version: str | None = None
    uptime_s: float | None = None
    resources: Resources | None = None


class CommandRequest(_In):
    """``POST /nodes/{id}/commands`` and ``POST /devices/{id}/commands``."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-z][a-z0-9_.-]*$")
    args: JsonObject = Field(default_factory=dict, description="sent as the command's args on MQTT (bounded JSON)")
    timeout_s: float = Field(default=10, gt=0, le=300)


class CommandResult(BaseModel):
    """The target's answer (a failed command is still an answer: ``ok`` false with its error)."""

    ok: bool
    result: dict[str, Any] | None = None
    error_code: str | None = None
    error: str | None = None
    duration_ms: float


class _StoredEvent(BaseModel):
    seq: int | None
    message_id: str
    type: str
    severity: str
    message: str | None
    data: dict[str, Any]
    ts: datetime
    received_at: datetime


class NodeEvent(_StoredEvent):
    """An edge node's own event (``source`` node), or one the hub recorded about the node (``source`` hub: for
    example ``message_rejected`` when it dropped a malformed message the node sent, DESIGN §6)."""

    node_id: str
    source: Literal["node", "hub"]


class DeviceEvent(_StoredEvent):
    device_id: str
