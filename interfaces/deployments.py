"""Deployment and update (DESIGN §4.2, standard §8.2): artefacts, signed manifests, deployments, executions.

The wire contract between the hub, edges and devices for over-the-air updates:

* REST models: ``ArtifactPublic``, ``DeploymentCreate``, ``DeploymentPublic``, ``ExecutionPublic`` ...
* The signed manifest (``ArtifactManifest`` + Ed25519 signature over ``manifest_signing_bytes``) that
  every target verifies against the hub key it pinned at enrolment before it installs anything.
* Orders (``DeploymentOrder``) travel to a target inside its retained ``desired`` document
  (``DesiredBody.deployments``), so a target that was offline converges when it returns; progress
  comes back as ``events`` of type ``EXECUTION_EVENT`` whose ``data`` is an ``ExecutionProgress``.
* Download tokens (``DOWNLOAD_TOKEN_HEADER``) are signed by the same hub key, so an edge can check a
  device's token offline before it serves a cached artefact.

State machines (the transitions below are the only legal moves)::

    QUEUED -> DOWNLOADING -> DOWNLOADED -> VERIFYING -> INSTALLING -> ACTIVE
    any non-terminal -> FAILED | REJECTED | CANCELED | TIMED_OUT
    ACTIVE | FAILED | TIMED_OUT -> ROLLING_BACK -> ROLLED_BACK | ROLLBACK_FAILED
"""

from __future__ import annotations

import base64
import json
import re
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, model_validator

from interfaces.selectors import SELECTOR_PATTERN
from interfaces.strict import BY_VALUE, INT64_MAX, Timestamp, WireModel
from interfaces.text import NoNul

SHA256_RE = r"^[0-9a-f]{64}$"
Sha256 = Annotated[str, Field(min_length=64, max_length=64, pattern=SHA256_RE, description="lower-case hex SHA-256")]
VERSION_RE = r"^[0-9]+(\.[0-9]+){0,3}(-[0-9A-Za-z.]+)?$"
Version = Annotated[str, Field(min_length=1, max_length=64, pattern=VERSION_RE, description="1.2.3, 1.2.3-rc1 (numeric parts compared as numbers)")]
ArtifactName = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")]

EXECUTION_EVENT = "deployment.execution"
"""``EventBody.type`` of an execution's progress report; its ``data`` is an ``ExecutionProgress``."""
INSTALLED_KEY = "installed"
"""Key in ``ReportedBody.status``: what the target runs, ``{kind: InstalledArtifact}`` (used for deltas)."""
DOWNLOAD_TOKEN_HEADER = "X-Download-Token"
DOWNLOAD_TOKEN_DOMAIN = b"aisynergy-download-token-v1\n"
MANIFEST_DOMAIN = b"aisynergy-manifest-v1\n"
KEY_TRANSITION_DOMAIN = b"aisynergy-key-transition-v1\n"
MAX_KEY_TRANSITIONS = 8
"""How many signing-key rotations the hub keeps (and a manifest carries): a target that pins a key older than
the oldest kept re-enrols."""
DELTA_MEDIA_TYPE = "application/vnd.aisynergy.bsdiff4"


class _In(NoNul):
    model_config = ConfigDict(extra="forbid")


# --- artefacts -------------------------------------------------------------------------------------


class ArtifactKind(StrEnum):
    MODEL = "model"
    APPLICATION = "application"
    FIRMWARE = "firmware"
    DATASET = "dataset"  # inputs of a batch task; not deployable
    ALGORITHM = "algorithm"  # a user's training code (zip with algorithm.json); run by training tasks, not deployable


class ArtifactFormat(StrEnum):
    ONNX = "onnx"
    TFLITE = "tflite"
    FIRMWARE = "firmware"  # an ``aisynergy firmware build`` image (tar.gz with firmware.json)
    TAR_GZ = "tar.gz"
    ZIP = "zip"
    WHEEL = "whl"
    BINARY = "bin"
    NPY = "npy"  # a dataset: one numpy array (no pickled objects)
    SAFETENSORS = "safetensors"  # a dataset: named tensors


class ArtifactCreate(_In):
    """The form fields of ``POST /artifacts`` (multipart; the bytes are the ``file`` part)."""

    kind: ArtifactKind
    name: ArtifactName
    version: Version
    format: ArtifactFormat


class ArtifactManifest(WireModel):
    """What the hub signs. Targets verify the content's SHA-256 and size against it, and the signature."""

    model_config = ConfigDict(extra="forbid")

    name: ArtifactName
    version: Version
    kind: Annotated[ArtifactKind, BY_VALUE]
    format: Annotated[ArtifactFormat, BY_VALUE]
    sha256: Sha256
    size: int = Field(ge=0, le=INT64_MAX)
    created_at: Timestamp


KeyId = Annotated[str, Field(min_length=16, max_length=16, pattern=r"^[0-9a-f]{16}$", description="first 16 hex chars of the SHA-256 of the raw Ed25519 public key")]


class KeyTransition(WireModel):
    """The hub's statement that its signing key ``old_key_id`` hands over to ``new_public_key_pem``, signed by
    the old key (``key_transition_signing_bytes``): a target that pins the old key trusts the new one after
    checking this signature, with no other channel (``aisynergy hub rotate signing-key``)."""

    old_key_id: KeyId
    new_key_id: KeyId
    new_public_key_pem: str = Field(min_length=1, max_length=512, pattern=r"^-----BEGIN PUBLIC KEY-----\n[A-Za-z0-9+/=\n]+-----END PUBLIC KEY-----\n$")
    issued_at: Timestamp


class SignedKeyTransition(WireModel):
    transition: KeyTransition
    signature: str = Field(min_length=1, max_length=256, description="base64 Ed25519 signature of key_transition_signing_bytes(transition) by the old key")


class KeyTransitions(WireModel):
    """``GET /signing-key/transitions``: every hand-over the hub keeps, oldest first (the last names its current
    key): how a target whose pinned key signed none of what it is shown catches up."""

    current_key_id: KeyId
    transitions: list[SignedKeyTransition] = Field(default_factory=list, max_length=MAX_KEY_TRANSITIONS)


def key_transition_signing_bytes(transition: KeyTransition) -> bytes:
    doc = transition.model_dump(mode="json")
    return KEY_TRANSITION_DOMAIN + json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


class SignedManifest(WireModel):
    manifest: ArtifactManifest
    signature: str = Field(min_length=1, max_length=256, description="base64 Ed25519 signature of manifest_signing_bytes(manifest)")
    key_id: str = Field(min_length=1, max_length=64, description="first 16 hex chars of the SHA-256 of the raw public key")
    key_transitions: list[SignedKeyTransition] = Field(
        default_factory=list, max_length=MAX_KEY_TRANSITIONS,
        description="the hub's key rotations up to key_id, oldest first: how a target that pins an older key comes to trust key_id",
    )  # fmt: skip


def manifest_signing_bytes(manifest: ArtifactManifest) -> bytes:
    """The exact bytes signed: a domain tag and canonical JSON (sorted keys, no spaces, UTC 'Z' time)."""
    doc = manifest.model_dump(mode="json")
    return MANIFEST_DOMAIN + json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


class ArtifactPublic(BaseModel):
    id: str
    name: str
    version: str
    kind: ArtifactKind
    format: ArtifactFormat
    sha256: str
    size: int
    created_at: datetime
    signed_manifest: SignedManifest
    content_url: str = Field(description="path of GET /artifacts/{id}/content (HTTP Range supported)")


class InstalledArtifact(WireModel):
    """One entry of ``ReportedBody.status["installed"]`` (keyed by kind)."""

    name: ArtifactName
    version: Version
    sha256: Sha256
    artifact_id: str | None = Field(default=None, max_length=64)
    slot: Literal["a", "b"] | None = Field(default=None, description="firmware: the slot it runs from")


def parse_version(version: str) -> tuple[tuple[int, ...], int, str]:
    """A sort key: numeric parts, then release (1) after pre-release (0), then the pre-release tag."""
    if not re.match(VERSION_RE, version):
        raise ValueError(f"not a version: {version!r}")
    core, _, pre = version.partition("-")
    parts = tuple(int(p) for p in core.split("."))
    parts = parts + (0,) * (4 - len(parts))
    return parts, 0 if pre else 1, pre


def compare_versions(a: str, b: str) -> int:
    """-1, 0 or 1 as ``a`` is older than, the same as, or newer than ``b``."""
    ka, kb = parse_version(a), parse_version(b)
    return (ka > kb) - (ka < kb)


# --- download tokens -------------------------------------------------------------------------------


class DownloadGrant(NoNul):
    """What a download token allows: this target may fetch this artefact until ``exp``, and the delta to it from
    ``base_sha256`` (the version the target runs, named in its order) and from no other base: a patch from other
    bytes would reveal those bytes to the holder."""

    model_config = ConfigDict(extra="forbid")

    artifact_id: str = Field(min_length=1, max_length=64)
    sha256: Sha256
    target_id: str = Field(min_length=1, max_length=64)
    exp: int = Field(ge=0, description="expiry, Unix seconds")
    base_sha256: Sha256 | None = Field(default=None, description="the only base a delta may start from; none: no delta")


def _grant_json(grant: DownloadGrant) -> bytes:
    # a grant without a base is signed as before the field existed
    return json.dumps(grant.model_dump(mode="json", exclude_none=True), sort_keys=True, separators=(",", ":")).encode()


def download_token_signing_bytes(grant: DownloadGrant) -> bytes:
    return DOWNLOAD_TOKEN_DOMAIN + _grant_json(grant)


def encode_download_token(grant: DownloadGrant, signature: bytes) -> str:
    """``<base64url(grant JSON)>.<base64url(signature)>``."""
    payload = _grant_json(grant)
    return b64url(payload) + "." + b64url(signature)


def decode_download_token(token: str) -> tuple[DownloadGrant, bytes]:
    """Split and parse a token (the caller verifies the signature); ValueError when malformed."""
    if len(token) > 2048 or token.count(".") != 1:
        raise ValueError("malformed download token")
    payload, signature = token.split(".")
    try:
        grant = DownloadGrant.model_validate_json(unb64url(payload))
        return grant, unb64url(signature)
    except Exception as exc:  # noqa: BLE001 - any decoding problem is one answer: malformed
        raise ValueError("malformed download token") from exc


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def unb64url(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


# --- deployments -----------------------------------------------------------------------------------


class TargetKind(StrEnum):
    DEVICE = "device"
    NODE = "node"


_EXACTLY_ONE_TARGET: list[JsonValue] = [
    {"required": ["ids"], "properties": {"ids": {"type": "array", "maxItems": 10_000}, "selector": {"type": "null"}}},
    {"required": ["selector"], "properties": {"selector": {"type": "string", "maxLength": 4096}, "ids": {"type": "null"}}},
]
"""The JSON Schema of the validator's rule: exactly one of ``ids`` and ``selector`` (the other absent or null)."""


class DeploymentTarget(_In):
    """Which targets: explicit ``ids`` or a label ``selector`` (resolved once, when the deployment is created)."""

    model_config = ConfigDict(json_schema_extra={"oneOf": _EXACTLY_ONE_TARGET})

    kind: TargetKind = TargetKind.DEVICE
    ids: list[Annotated[str, Field(min_length=1, max_length=64)]] | None = Field(
        default=None, min_length=1, max_length=10_000, json_schema_extra={"uniqueItems": True}
    )
    selector: str | None = Field(default=None, min_length=1, max_length=4096, json_schema_extra={"pattern": SELECTOR_PATTERN})  # checked by the parser: 400 invalid_selector

    @model_validator(mode="after")
    def _one_of(self) -> DeploymentTarget:
        if (self.ids is None) == (self.selector is None):
            raise ValueError("give exactly one of ids or selector")
        if self.ids is not None and len(set(self.ids)) != len(self.ids):
            raise ValueError("ids must not repeat")
        return self


def _type_required(schema: dict[str, Any]) -> None:
    # Python code may leave out ``type`` (it has a default), JSON may not: the union is told apart by it
    schema["required"] = ["type", *(name for name in schema.get("required", ()) if name != "type")]


_TAGGED = ConfigDict(json_schema_extra=_type_required)


class AllAtOnce(_In):
    model_config = _TAGGED

    type: Literal["all_at_once"] = "all_at_once"


class Rolling(_In):
    model_config = _TAGGED

    type: Literal["rolling"] = "rolling"
    batch_size: int = Field(ge=1, le=10_000)


class Canary(_In):
    """``percent`` of the targets first (at least one); when they are all ACTIVE, the rest by ``then``."""

    model_config = _TAGGED

    type: Literal["canary"] = "canary"
    percent: float = Field(gt=0, le=100)
    then: Annotated[AllAtOnce | Rolling, Field(discriminator="type")] = Field(default_factory=AllAtOnce)


Strategy = Annotated[AllAtOnce | Rolling | Canary, Field(discriminator="type")]


class FailurePolicy(StrEnum):
    HALT = "halt"
    ROLLBACK = "rollback"


class DeploymentCreate(_In):
    artifact_id: str = Field(min_length=1, max_length=64)
    target: DeploymentTarget
    strategy: Strategy = Field(default_factory=AllAtOnce)
    max_failure_percent: float = Field(default=0, ge=0, le=100, description="more failed targets than this share stops the rollout")
    failure_policy: FailurePolicy = FailurePolicy.HALT
    timeout_s: int = Field(default=600, ge=1, le=7 * 24 * 3600, description="per target, from its release to ACTIVE")
    allow_downgrade: bool = False
    name: str = Field(default="", max_length=128)


class DeploymentState(StrEnum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    PAUSED = "PAUSED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELED = "CANCELED"
    ROLLED_BACK = "ROLLED_BACK"


DEPLOYMENT_TRANSITIONS: dict[DeploymentState, frozenset[DeploymentState]] = {
    DeploymentState.PENDING: frozenset({DeploymentState.RUNNING, DeploymentState.PAUSED, DeploymentState.CANCELED}),
    DeploymentState.RUNNING: frozenset({DeploymentState.PAUSED, DeploymentState.SUCCEEDED, DeploymentState.FAILED, DeploymentState.CANCELED, DeploymentState.ROLLED_BACK}),
    DeploymentState.PAUSED: frozenset({DeploymentState.RUNNING, DeploymentState.CANCELED, DeploymentState.ROLLED_BACK, DeploymentState.FAILED}),
    DeploymentState.SUCCEEDED: frozenset({DeploymentState.ROLLED_BACK}),
    DeploymentState.FAILED: frozenset({DeploymentState.ROLLED_BACK}),
    DeploymentState.CANCELED: frozenset({DeploymentState.ROLLED_BACK}),
    DeploymentState.ROLLED_BACK: frozenset(),
}  # fmt: skip
DEPLOYMENT_FINAL = frozenset({DeploymentState.SUCCEEDED, DeploymentState.FAILED, DeploymentState.CANCELED, DeploymentState.ROLLED_BACK})


class DeploymentAction(StrEnum):
    PAUSE = "pause"
    RESUME = "resume"
    CANCEL = "cancel"
    ROLLBACK = "rollback"


class ExecutionState(StrEnum):
    QUEUED = "QUEUED"
    DOWNLOADING = "DOWNLOADING"
    DOWNLOADED = "DOWNLOADED"
    VERIFYING = "VERIFYING"
    INSTALLING = "INSTALLING"
    ACTIVE = "ACTIVE"
    FAILED = "FAILED"
    ROLLING_BACK = "ROLLING_BACK"
    ROLLED_BACK = "ROLLED_BACK"
    ROLLBACK_FAILED = "ROLLBACK_FAILED"
    CANCELED = "CANCELED"
    REJECTED = "REJECTED"
    TIMED_OUT = "TIMED_OUT"


_E = ExecutionState
IN_FLIGHT = frozenset({_E.QUEUED, _E.DOWNLOADING, _E.DOWNLOADED, _E.VERIFYING, _E.INSTALLING})
_SIDE_EXITS = frozenset({_E.FAILED, _E.REJECTED, _E.CANCELED, _E.TIMED_OUT})
EXECUTION_TRANSITIONS: dict[ExecutionState, frozenset[ExecutionState]] = {
    _E.QUEUED: frozenset({_E.DOWNLOADING}) | _SIDE_EXITS,
    _E.DOWNLOADING: frozenset({_E.DOWNLOADED}) | _SIDE_EXITS,
    _E.DOWNLOADED: frozenset({_E.VERIFYING}) | _SIDE_EXITS,
    _E.VERIFYING: frozenset({_E.INSTALLING}) | _SIDE_EXITS,
    _E.INSTALLING: frozenset({_E.ACTIVE}) | _SIDE_EXITS,
    _E.ACTIVE: frozenset({_E.ROLLING_BACK}),
    _E.FAILED: frozenset({_E.ROLLING_BACK}),
    _E.TIMED_OUT: frozenset({_E.ROLLING_BACK}),
    _E.ROLLING_BACK: frozenset({_E.ROLLED_BACK, _E.ROLLBACK_FAILED}),
    _E.ROLLED_BACK: frozenset(),
    _E.ROLLBACK_FAILED: frozenset(),
    _E.CANCELED: frozenset(),
    _E.REJECTED: frozenset(),
}
EXECUTION_FINAL = frozenset({_E.ACTIVE, _E.FAILED, _E.ROLLED_BACK, _E.ROLLBACK_FAILED, _E.CANCELED, _E.REJECTED, _E.TIMED_OUT})
"""States a rollout treats as done with (ACTIVE, FAILED and TIMED_OUT may still be rolled back)."""
EXECUTION_FAILURES = frozenset({_E.FAILED, _E.REJECTED, _E.TIMED_OUT, _E.ROLLBACK_FAILED})


class IllegalExecutionTransition(ValueError):
    def __init__(self, current: ExecutionState, target: ExecutionState) -> None:
        super().__init__(f"execution cannot go from {current} to {target}")
        self.current = current
        self.target = target


def execution_path(current: ExecutionState, target: ExecutionState) -> list[ExecutionState]:
    """The legal steps from ``current`` to ``target`` along the install path (a target may report only its
    latest state: INSTALLING after QUEUED fills in DOWNLOADING, DOWNLOADED, VERIFYING), or raise."""
    if current == target:
        return []
    if target in EXECUTION_TRANSITIONS[current]:
        return [target]
    order = [_E.QUEUED, _E.DOWNLOADING, _E.DOWNLOADED, _E.VERIFYING, _E.INSTALLING, _E.ACTIVE]
    if current in order and target in order and order.index(target) > order.index(current):
        return order[order.index(current) + 1 : order.index(target) + 1]
    if target in (_E.ROLLED_BACK, _E.ROLLBACK_FAILED) and _E.ROLLING_BACK in EXECUTION_TRANSITIONS[current]:
        return [_E.ROLLING_BACK, target]
    if current in IN_FLIGHT and target in (_E.ROLLING_BACK, _E.ROLLED_BACK, _E.ROLLBACK_FAILED):
        # failed on the way and went back on its own (firmware: the old slot booted)
        return [_E.FAILED, _E.ROLLING_BACK] + ([] if target is _E.ROLLING_BACK else [target])
    raise IllegalExecutionTransition(current, target)


class ExecutionTransition(BaseModel):
    from_state: ExecutionState | None
    to_state: ExecutionState
    at: datetime
    reason: str = ""


class ExecutionPublic(BaseModel):
    id: str
    deployment_id: str
    target_kind: TargetKind
    target_id: str
    state: ExecutionState
    batch: int = Field(description="0 = canary (or the only batch), then 1, 2, ...")
    released_at: datetime | None
    previous: InstalledArtifact | None = Field(description="what the target ran before (the rollback target)")
    delta: bool = Field(description="the target was offered a binary delta")
    detail: str
    updated_at: datetime
    history: list[ExecutionTransition] = Field(default_factory=list)


class DeploymentPublic(BaseModel):
    id: str
    name: str
    artifact_id: str
    artifact: ArtifactManifest | None = Field(description="the artefact deployed; null once it was deleted (only a final deployment lets it go)")
    target: DeploymentTarget
    strategy: Strategy
    max_failure_percent: float
    failure_policy: FailurePolicy
    timeout_s: int
    allow_downgrade: bool
    state: DeploymentState
    reason: str = ""
    superseded_by: str | None = None
    counts: dict[ExecutionState, int] = Field(description="executions per state")
    total: int
    batches: int
    current_batch: int
    created_at: datetime
    updated_at: datetime


class DeploymentDetail(DeploymentPublic):
    executions: list[ExecutionPublic]


# --- orders and progress over MQTT -----------------------------------------------------------------


class OrderAction(StrEnum):
    INSTALL = "install"
    ROLLBACK = "rollback"  # reinstall ``artifact`` (the previous version); downgrade allowed


class DeltaOffer(WireModel):
    """A bsdiff4 patch from the artefact the target runs (``base_sha256``) to the ordered one."""

    base_sha256: Sha256
    sha256: Sha256 = Field(description="of the patch itself")
    size: int = Field(ge=0, le=INT64_MAX)
    path: str = Field(min_length=1, max_length=512, description="GET path of the patch, relative to the API base")


class DeploymentOrder(WireModel):
    """One entry of ``DesiredBody.deployments``: install this signed artefact (one order per kind)."""

    execution_id: str = Field(min_length=1, max_length=64)
    deployment_id: str = Field(min_length=1, max_length=64)
    action: Annotated[OrderAction, BY_VALUE] = OrderAction.INSTALL
    artifact_id: str = Field(min_length=1, max_length=64)
    signed_manifest: SignedManifest
    path: str = Field(min_length=1, max_length=512, description="GET path of the content, relative to the API base; HTTP Range supported")
    token: str = Field(min_length=1, max_length=2048, description=f"send as {DOWNLOAD_TOKEN_HEADER}")
    delta: DeltaOffer | None = None
    allow_downgrade: bool = False
    confirm_timeout_s: float = Field(default=60, gt=0, le=3600, description="firmware: the new slot must confirm its health within this")


class ExecutionProgress(WireModel):
    """``EventBody.data`` of an ``EXECUTION_EVENT``: the target's latest state for one execution."""

    execution_id: str = Field(min_length=1, max_length=64)
    state: Annotated[ExecutionState, BY_VALUE]
    detail: str = Field(default="", max_length=2048)
    bytes_downloaded: int | None = Field(default=None, ge=0, le=INT64_MAX)
    via_delta: bool | None = None
    installed: InstalledArtifact | None = Field(default=None, description="what runs now (on ACTIVE and ROLLED_BACK)")


def dump_order_list(orders: list[DeploymentOrder]) -> list[dict[str, Any]]:
    return [o.model_dump(mode="json") for o in orders]
