"""Database tables (SQLModel). The schema is created and upgraded by Alembic (cloud/migrations).

The whole schema stays in one module on purpose: the migrations and ``SQLModel.metadata`` see every table
at once, and each table's foreign keys and indexes read next to the tables they name.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, Column, DateTime, Index, LargeBinary, Text, UniqueConstraint
from sqlalchemy import true as sa_true
from sqlmodel import Field, SQLModel


def _ts(**kw: Any) -> Any:
    return Field(sa_column=Column(DateTime(timezone=True), **kw))


class Node(SQLModel, table=True):
    __tablename__ = "nodes"
    __table_args__ = (Index("ix_nodes_state", "state"),)

    id: str = Field(primary_key=True, max_length=64)
    name: str = Field(max_length=128)
    kind: str = Field(max_length=16)
    description: str = Field(default="", sa_column=Column(Text, nullable=False, default=""))
    labels: dict[str, str] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    state: str = Field(max_length=16)
    admin_state: str = Field(max_length=16)
    created_at: datetime = _ts(nullable=False)
    updated_at: datetime = _ts(nullable=False)
    deleted_at: datetime | None = _ts(nullable=True)
    certificate_serial: str | None = Field(default=None, max_length=64)
    certificate_not_after: datetime | None = _ts(nullable=True)
    last_heartbeat_at: datetime | None = _ts(nullable=True)
    last_state_change_at: datetime | None = _ts(nullable=True)
    health: str | None = Field(default=None, max_length=16)
    health_detail: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    agent_version: str | None = Field(default=None, max_length=64)
    uptime_s: float | None = None
    resources: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    desired: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    desired_version: int = 0
    desired_published: int = Field(default=0, description="the desired version the broker holds retained")
    reported: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    reported_version: int = 0
    reported_at: datetime | None = _ts(nullable=True)
    orders: list[dict[str, Any]] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    orders_version: int = Field(default=0, sa_column_kwargs={"server_default": "0"})
    orders_published: int = Field(default=0, sa_column_kwargs={"server_default": "0"})
    tasks: list[dict[str, Any]] = Field(default_factory=list, sa_column=Column(JSON, nullable=False), description="task worker orders (DESIGN §4.3)")
    tasks_version: int = Field(default=0, sa_column_kwargs={"server_default": "0"})
    tasks_published: int = Field(default=0, sa_column_kwargs={"server_default": "0"})


class NodeTransitionRow(SQLModel, table=True):
    __tablename__ = "node_transitions"
    __table_args__ = (Index("ix_node_transitions_node", "node_id", "id"),)

    id: int | None = Field(default=None, primary_key=True)
    node_id: str = Field(max_length=64)
    from_state: str | None = Field(default=None, max_length=16)
    to_state: str = Field(max_length=16)
    at: datetime = _ts(nullable=False)
    reason: str = Field(max_length=256)


class Label(SQLModel, table=True):
    """One row per (owner, key): lets label selectors run in SQL for nodes and devices alike."""

    __tablename__ = "labels"
    __table_args__ = (Index("ix_labels_key_value", "key", "value"),)

    owner_id: str = Field(primary_key=True, max_length=64)
    key: str = Field(primary_key=True, max_length=317)
    value: str = Field(max_length=63)


class BootstrapToken(SQLModel, table=True):
    __tablename__ = "bootstrap_tokens"

    token_hash: str = Field(primary_key=True, max_length=64)
    owner_id: str = Field(index=True, max_length=64, description="the node or device it enrols")
    created_at: datetime = _ts(nullable=False)
    expires_at: datetime = _ts(nullable=False)
    used_at: datetime | None = _ts(nullable=True)


class Certificate(SQLModel, table=True):
    __tablename__ = "certificates"

    serial: str = Field(primary_key=True, max_length=64)
    identity: str = Field(index=True, max_length=64)
    issued_at: datetime = _ts(nullable=False)
    not_after: datetime = _ts(nullable=False)
    revoked_at: datetime | None = _ts(nullable=True)


class Device(SQLModel, table=True):
    __tablename__ = "devices"

    id: str = Field(primary_key=True, max_length=64)
    node_id: str = Field(index=True, max_length=64)
    name: str | None = Field(default=None, max_length=128)
    model: str = Field(max_length=128)
    description: str = Field(default="", sa_column=Column(Text, nullable=False, default=""))
    labels: dict[str, str] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    state: str = Field(max_length=16)
    created_at: datetime = _ts(nullable=False)
    updated_at: datetime = _ts(nullable=False)
    deleted_at: datetime | None = _ts(nullable=True)
    desired: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    desired_version: int = 0
    desired_published: int = Field(default=-1, description="the desired version the broker holds retained")
    reported: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    reported_version: int = 0
    reported_at: datetime | None = _ts(nullable=True)
    certificate_serial: str | None = Field(default=None, max_length=64)
    certificate_not_after: datetime | None = _ts(nullable=True)
    last_heartbeat_at: datetime | None = _ts(nullable=True)
    last_state_change_at: datetime | None = _ts(nullable=True)
    health: str | None = Field(default=None, max_length=16)
    agent_version: str | None = Field(default=None, max_length=64)
    uptime_s: float | None = None
    resources: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    orders: list[dict[str, Any]] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    orders_version: int = Field(default=0, sa_column_kwargs={"server_default": "0"})
    orders_published: int = Field(default=0, sa_column_kwargs={"server_default": "0"})
    tasks: list[dict[str, Any]] = Field(default_factory=list, sa_column=Column(JSON, nullable=False), description="task worker orders (DESIGN §4.3)")
    tasks_version: int = Field(default=0, sa_column_kwargs={"server_default": "0"})
    tasks_published: int = Field(default=0, sa_column_kwargs={"server_default": "0"})


class DeviceEventRow(SQLModel, table=True):
    """Device events relayed by edges; ``message_id`` (the envelope id) makes delivery idempotent."""

    __tablename__ = "device_events"
    __table_args__ = (Index("ix_device_events_device", "device_id", "id"),)

    id: int | None = Field(default=None, primary_key=True)
    message_id: str = Field(unique=True, max_length=64)
    node_id: str = Field(max_length=64)
    device_id: str = Field(max_length=64)
    seq: int | None = None
    type: str = Field(max_length=64)
    severity: str = Field(max_length=16)
    message: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    data: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    ts: datetime = _ts(nullable=False)
    received_at: datetime = _ts(nullable=False)


class NodeEventRow(SQLModel, table=True):
    """An edge node's own events (``source`` node), and those the hub records about it (``source`` hub, e.g. a
    message it dropped); ``message_id`` (the envelope id) makes delivery idempotent."""

    __tablename__ = "node_events"
    __table_args__ = (Index("ix_node_events_node", "node_id", "id"),)

    id: int | None = Field(default=None, primary_key=True)
    message_id: str = Field(unique=True, max_length=64)
    node_id: str = Field(max_length=64)
    source: str = Field(max_length=8)
    seq: int | None = None
    type: str = Field(max_length=64)
    severity: str = Field(max_length=16)
    message: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    data: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    ts: datetime = _ts(nullable=False)
    received_at: datetime = _ts(nullable=False)


class ApiToken(SQLModel, table=True):
    __tablename__ = "api_tokens"

    id: str = Field(primary_key=True, max_length=64)
    token_hash: str = Field(unique=True, max_length=64)
    role: str = Field(max_length=16)
    name: str = Field(default="", max_length=128)
    created_at: datetime = _ts(nullable=False)
    revoked_at: datetime | None = _ts(nullable=True)


class IdempotencyRecord(SQLModel, table=True):
    __tablename__ = "idempotency_records"
    __table_args__ = (UniqueConstraint("principal", "key", name="uq_idempotency_principal_key"),)

    id: int | None = Field(default=None, primary_key=True)
    principal: str = Field(max_length=64)
    key: str = Field(max_length=255)
    request_hash: str = Field(max_length=64)
    status_code: int | None = None
    response_headers: list[list[str]] | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    response_body: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    response_sha256: str | None = Field(default=None, max_length=64)  # instead of the body when it carried a secret
    created_at: datetime = _ts(nullable=False)


class Lease(SQLModel, table=True):
    """Only the replica holding a controller's lease drives it."""

    __tablename__ = "leases"

    name: str = Field(primary_key=True, max_length=64)
    holder: str = Field(max_length=128)
    expires_at: datetime = _ts(nullable=False)


# --- deployment and update (DESIGN §4.2) ------------------------------------------------------------


class Artifact(SQLModel, table=True):
    """An uploaded artefact; its bytes live in the blob store under ``sha256``; ``signature`` signs the manifest."""

    __tablename__ = "artifacts"
    __table_args__ = (UniqueConstraint("kind", "name", "version", name="uq_artifacts_kind_name_version"),)

    id: str = Field(primary_key=True, max_length=64)
    kind: str = Field(max_length=16)
    name: str = Field(max_length=128)
    version: str = Field(max_length=64)
    format: str = Field(max_length=16)
    sha256: str = Field(index=True, max_length=64)
    size: int = Field(sa_column=Column(BigInteger, nullable=False))
    created_at: datetime = _ts(nullable=False)
    signature: str = Field(max_length=256)
    key_id: str = Field(max_length=64)


class ArtifactUpload(SQLModel, table=True):
    """A chunked upload in progress (``/artifacts/uploads``); its chunks are files under ``<data_dir>/uploads/<id>``."""

    __tablename__ = "artifact_uploads"

    id: str = Field(primary_key=True, max_length=64)
    kind: str = Field(max_length=16)
    name: str = Field(max_length=128)
    version: str = Field(max_length=64)
    format: str = Field(max_length=16)
    size: int = Field(sa_column=Column(BigInteger, nullable=False))
    sha256: str | None = Field(default=None, max_length=64, description="declared at the start, else in the commit")
    chunk_size: int = Field(sa_column=Column(BigInteger, nullable=False))
    created_at: datetime = _ts(nullable=False)
    expires_at: datetime = Field(sa_column=Column(DateTime(timezone=True), nullable=False, index=True))


class ArtifactDelta(SQLModel, table=True):
    """A bsdiff4 patch from one stored artefact's bytes to another's, kept in the blob store."""

    __tablename__ = "artifact_deltas"
    __table_args__ = (UniqueConstraint("base_sha256", "target_sha256", name="uq_artifact_deltas_pair"),)

    id: int | None = Field(default=None, primary_key=True)
    base_sha256: str = Field(max_length=64)
    target_sha256: str = Field(max_length=64)
    sha256: str = Field(max_length=64)
    size: int = Field(sa_column=Column(BigInteger, nullable=False))
    created_at: datetime = _ts(nullable=False)


class Deployment(SQLModel, table=True):
    __tablename__ = "deployments"
    __table_args__ = (Index("ix_deployments_state", "state"),)

    id: str = Field(primary_key=True, max_length=64)
    name: str = Field(default="", max_length=128)
    artifact_id: str = Field(index=True, max_length=64)
    kind: str = Field(max_length=16, description="the artefact's kind: a newer deployment of the same kind supersedes")
    target: dict[str, Any] = Field(sa_column=Column(JSON, nullable=False))
    strategy: dict[str, Any] = Field(sa_column=Column(JSON, nullable=False))
    max_failure_percent: float
    failure_policy: str = Field(max_length=16)
    timeout_s: int
    allow_downgrade: bool = False
    state: str = Field(max_length=16)
    reason: str = Field(default="", sa_column=Column(Text, nullable=False, default=""))
    superseded_by: str | None = Field(default=None, max_length=64)
    batches: int = 1
    current_batch: int = 0
    created_at: datetime = _ts(nullable=False)
    updated_at: datetime = _ts(nullable=False)


class Execution(SQLModel, table=True):
    """One target of a deployment, following the execution state machine of DESIGN §4.2."""

    __tablename__ = "executions"
    __table_args__ = (
        Index("ix_executions_deployment", "deployment_id", "batch"),
        Index("ix_executions_target", "target_id", "state"),
        Index("ix_executions_state", "state"),
    )

    id: str = Field(primary_key=True, max_length=64)
    deployment_id: str = Field(max_length=64)
    target_kind: str = Field(max_length=16)
    target_id: str = Field(max_length=64)
    batch: int = 0
    state: str = Field(max_length=16)
    released_at: datetime | None = _ts(nullable=True)
    deadline_at: datetime | None = _ts(nullable=True)
    rollback_requested: bool = False
    previous: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    delta: bool = False
    detail: str = Field(default="", sa_column=Column(Text, nullable=False, default=""))
    updated_at: datetime = _ts(nullable=False)


class ExecutionTransitionRow(SQLModel, table=True):
    __tablename__ = "execution_transitions"
    __table_args__ = (Index("ix_execution_transitions_execution", "execution_id", "id"),)

    id: int | None = Field(default=None, primary_key=True)
    execution_id: str = Field(max_length=64)
    from_state: str | None = Field(default=None, max_length=16)
    to_state: str = Field(max_length=16)
    at: datetime = _ts(nullable=False)
    reason: str = Field(default="", sa_column=Column(Text, nullable=False, default=""))


# --- task run management (DESIGN §4.3) --------------------------------------------------------------


class Task(SQLModel, table=True):
    __tablename__ = "tasks"
    __table_args__ = (Index("ix_tasks_state", "state"),)

    id: str = Field(primary_key=True, max_length=64)
    name: str = Field(default="", max_length=128)
    type: str = Field(max_length=32)
    spec: dict[str, Any] = Field(sa_column=Column(JSON, nullable=False))
    placement: dict[str, Any] = Field(sa_column=Column(JSON, nullable=False))
    timeout_s: int | None = None
    worker_timeout_s: float
    heartbeat_s: float
    retry: dict[str, Any] = Field(sa_column=Column(JSON, nullable=False))
    state: str = Field(max_length=16)
    reason: str = Field(default="", sa_column=Column(Text, nullable=False, default=""))
    held: bool = False
    attempt: int = 1
    items_total: int | None = Field(default=None, sa_column=Column(BigInteger, nullable=True))
    chunk_size: int | None = None
    chunks_total: int | None = None
    chunks_done: int = 0
    created_at: datetime = _ts(nullable=False)
    updated_at: datetime = _ts(nullable=False)
    scheduled_at: datetime | None = _ts(nullable=True)
    started_at: datetime | None = _ts(nullable=True)
    finished_at: datetime | None = _ts(nullable=True)
    deadline_at: datetime | None = _ts(nullable=True)
    paused_at: datetime | None = _ts(nullable=True)
    not_before: datetime | None = _ts(nullable=True)


class TaskTransitionRow(SQLModel, table=True):
    __tablename__ = "task_transitions"
    __table_args__ = (Index("ix_task_transitions_task", "task_id", "id"),)

    id: int | None = Field(default=None, primary_key=True)
    task_id: str = Field(max_length=64)
    from_state: str | None = Field(default=None, max_length=16)
    to_state: str = Field(max_length=16)
    at: datetime = _ts(nullable=False)
    reason: str = Field(default="", sa_column=Column(Text, nullable=False, default=""))


class TaskWorker(SQLModel, table=True):
    """One worker of a task on one node or device (and role)."""

    __tablename__ = "task_workers"
    __table_args__ = (
        Index("ix_task_workers_task", "task_id", "state"),
        Index("ix_task_workers_target", "target_id", "state"),
        Index("ix_task_workers_state", "state"),
    )

    id: str = Field(primary_key=True, max_length=64)
    task_id: str = Field(max_length=64)
    target_kind: str = Field(max_length=16)
    target_id: str = Field(max_length=64)
    role: str = Field(default="worker", max_length=32)
    state: str = Field(max_length=16)
    attempt: int = 1
    weight: float = 1.0
    accelerators: list[dict[str, Any]] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    items_done: int | None = None
    paused: bool = False
    replaced_by: str | None = Field(default=None, max_length=64, description="the worker that took over after this one ended badly ('-': none will)")
    detail: str = Field(default="", sa_column=Column(Text, nullable=False, default=""))
    created_at: datetime = _ts(nullable=False)
    updated_at: datetime = _ts(nullable=False)
    started_at: datetime | None = _ts(nullable=True)
    finished_at: datetime | None = _ts(nullable=True)
    last_report_at: datetime | None = _ts(nullable=True)


class WorkerTransitionRow(SQLModel, table=True):
    __tablename__ = "worker_transitions"
    __table_args__ = (Index("ix_worker_transitions_worker", "worker_id", "id"),)

    id: int | None = Field(default=None, primary_key=True)
    worker_id: str = Field(max_length=64)
    from_state: str | None = Field(default=None, max_length=16)
    to_state: str = Field(max_length=16)
    at: datetime = _ts(nullable=False)
    reason: str = Field(default="", sa_column=Column(Text, nullable=False, default=""))


class TaskChunk(SQLModel, table=True):
    """A slice of a sharded task's inputs: owned by one worker at a time, its outputs kept once."""

    __tablename__ = "task_chunks"
    __table_args__ = (Index("ix_task_chunks_state", "task_id", "state"), Index("ix_task_chunks_worker", "worker_id"))

    task_id: str = Field(primary_key=True, max_length=64)
    index: int = Field(primary_key=True)
    state: str = Field(max_length=16, description="PENDING | ASSIGNED | DONE")
    worker_id: str | None = Field(default=None, max_length=64)
    attempts: int = 0
    not_before: datetime | None = _ts(nullable=True)
    last_error: str = Field(default="", sa_column=Column(Text, nullable=False, default=""))
    data: bytes | None = Field(default=None, sa_column=Column(LargeBinary, nullable=True))
    done_at: datetime | None = _ts(nullable=True)


class TaskLog(SQLModel, table=True):
    """A log line of a task: from a worker (``message_id``, ``line`` keep each once) or from the hub."""

    __tablename__ = "task_logs"
    __table_args__ = (Index("ix_task_logs_task", "task_id", "id"), UniqueConstraint("message_id", "line", name="uq_task_logs_message_line"))

    id: int | None = Field(default=None, primary_key=True)
    task_id: str = Field(max_length=64)
    worker_id: str | None = Field(default=None, max_length=64)
    target_id: str | None = Field(default=None, max_length=64)
    message_id: str | None = Field(default=None, max_length=64)
    line: int = 0
    ts: datetime = _ts(nullable=False)
    level: str = Field(max_length=16)
    text: str = Field(sa_column=Column(Text, nullable=False))


class TaskMetric(SQLModel, table=True):
    __tablename__ = "task_metrics"
    __table_args__ = (Index("ix_task_metrics_task", "task_id", "id"), Index("ix_task_metrics_worker", "worker_id", "id"))

    id: int | None = Field(default=None, primary_key=True)
    task_id: str = Field(max_length=64)
    worker_id: str = Field(max_length=64)
    target_id: str = Field(max_length=64)
    message_id: str = Field(unique=True, max_length=64)
    ts: datetime = _ts(nullable=False)
    values: dict[str, float] = Field(sa_column=Column(JSON, nullable=False))


# --- DP incremental training (DESIGN §5) -------------------------------------------------------------


class PrivacyBudget(SQLModel, table=True):
    """What all tasks together may spend of one device's dataset: (ε, δ)-DP under RDP composition."""

    __tablename__ = "privacy_budgets"

    device_id: str = Field(primary_key=True, max_length=64)
    dataset: str = Field(primary_key=True, max_length=128)
    epsilon: float
    delta: float
    revision: int = Field(default=0, description="goes up with every reservation: the write that serialises admissions")
    created_at: datetime = _ts(nullable=False)
    updated_at: datetime = _ts(nullable=False)


class PrivacySpendRow(SQLModel, table=True):
    """One worker run's use of a device's dataset: reserved at admission, settled when the worker ends."""

    __tablename__ = "privacy_spends"
    __table_args__ = (Index("ix_privacy_spends_budget", "device_id", "dataset", "id"), Index("ix_privacy_spends_task", "task_id", "state"))

    id: int | None = Field(default=None, primary_key=True)
    device_id: str = Field(max_length=64)
    dataset: str = Field(max_length=128)
    task_id: str = Field(max_length=64)
    worker_id: str | None = Field(default=None, max_length=64)
    state: str = Field(max_length=16, description="reserved | spent | released")
    sample_rate: float
    noise_multiplier: float
    steps: int = Field(description="reserved: the most steps allowed; settled: the steps taken")
    max_steps: int
    delta: float
    epsilon: float
    created_at: datetime = _ts(nullable=False)
    settled_at: datetime | None = _ts(nullable=True)


class TrainingPlan(SQLModel, table=True):
    """How an incremental_training task cut its model: the body artefact and the trainable last layer."""

    __tablename__ = "training_plans"

    task_id: str = Field(primary_key=True, max_length=64)
    model_artifact_id: str = Field(max_length=64)
    body_artifact_id: str = Field(max_length=64)
    layer: dict[str, Any] = Field(sa_column=Column(JSON, nullable=False), description="cloud.incremental.surgery.DenseLayer as JSON")
    head: bytes = Field(sa_column=Column(LargeBinary, nullable=False), description="safetensors: weight [features, classes], bias [classes]")


class FlPlan(SQLModel, table=True):
    """A federated_training task's model cut and the round in progress (everything a restarted hub resumes from)."""

    __tablename__ = "fl_plans"

    task_id: str = Field(primary_key=True, max_length=64)
    model_artifact_id: str = Field(max_length=64)
    body_artifact_id: str = Field(max_length=64)
    layer: dict[str, Any] = Field(sa_column=Column(JSON, nullable=False), description="cloud.incremental.surgery.DenseLayer as JSON")
    round: int = Field(default=1, description="the round in progress (1-based); rounds + 1 once the last one closed")
    attempt: int = Field(default=0, description="the attempt of the round in progress; 0: not opened yet")
    opened_at: datetime | None = Field(default=None, sa_column=Column(DateTime(timezone=True), nullable=True))
    deadline_at: datetime | None = Field(default=None, sa_column=Column(DateTime(timezone=True), nullable=True))
    participants: list[str] = Field(default_factory=list, sa_column=Column(JSON, nullable=False), description="devices of the open round attempt")
    weights: bytes = Field(sa_column=Column(LargeBinary, nullable=False), description="the global layer (safetensors weight, bias) the open round starts from")
    weights_artifact_id: str | None = Field(default=None, max_length=64, description="the signed artefact the orders point at for those weights")
    strategy_state: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    strategy_arrays: bytes | None = Field(default=None, sa_column=Column(LargeBinary, nullable=True), description="safetensors: a server optimiser's moments")
    published_artifact_id: str | None = Field(default=None, max_length=64)
    keys: dict[str, dict[str, str]] = Field(
        default_factory=dict, sa_column=Column(JSON, nullable=False), description="secure aggregation: device -> {worker_id, key}: its worker's X25519 public key",
    )  # fmt: skip
    total_examples: int | None = Field(default=None, description="secure aggregation: the open attempt's participants' examples in all")
    unmasking: list[str] = Field(default_factory=list, sa_column=Column(JSON, nullable=False), description="secure: participants that dropped after masking")
    reveals: dict[str, dict[str, str]] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False), description="secure: survivor -> dropped -> seed")
    trained: dict[str, int] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False), description="device -> round attempts it was a participant of")


class FlUpdateRow(SQLModel, table=True):
    """One update received for a federated round attempt (a device's, or an edge's combined one)."""

    __tablename__ = "fl_updates"
    __table_args__ = (Index("ix_fl_updates_round", "task_id", "round", "attempt"),)

    id: int | None = Field(default=None, primary_key=True)
    task_id: str = Field(max_length=64)
    round: int
    attempt: int
    worker_id: str = Field(max_length=64)
    contributors: list[str] = Field(sa_column=Column(JSON, nullable=False))
    num_examples: int
    data: bytes = Field(sa_column=Column(LargeBinary, nullable=False), description="a last layer (safetensors); empty for a whole model's update")
    artifact_id: str | None = Field(default=None, max_length=64, description="a whole model's update: the model artefact the participant uploaded")
    vetted: bool = Field(default=True, sa_column_kwargs={"server_default": sa_true()}, description="a whole model's update: its tensors were read through and fit the model")
    metrics: dict[str, float] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    stale: bool = Field(default=False, description="arrived after its round closed; fused into a later round (late_updates=stale)")
    used_in: int | None = Field(default=None, description="the round whose fusion used it")
    received_at: datetime = Field(sa_column=Column(DateTime(timezone=True), nullable=False))


class FlRoundRow(SQLModel, table=True):
    """A closed federated round: who took part, what it measured."""

    __tablename__ = "fl_rounds"

    task_id: str = Field(primary_key=True, max_length=64)
    round: int = Field(primary_key=True)
    attempts: int
    participants: int
    contributors: int
    stale: int = 0
    opened_at: datetime = Field(sa_column=Column(DateTime(timezone=True), nullable=False))
    closed_at: datetime = Field(sa_column=Column(DateTime(timezone=True), nullable=False))
    reason: str = Field(default="", max_length=512)
    metrics: dict[str, float] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    participant_ids: list[str] | None = Field(
        default=None, sa_column=Column(JSON, nullable=True), description="the closing attempt's participants: the only ones whose late update may count as stale",
    )  # fmt: skip


class SplitPlan(SQLModel, table=True):
    """How a split_inference task cut its model (the parts are ``split_parts`` rows)."""

    __tablename__ = "split_plans"

    task_id: str = Field(primary_key=True, max_length=64)
    model_artifact_id: str = Field(max_length=64)
    input: str = Field(max_length=256, description="the model's one input")


class SplitPartRow(SQLModel, table=True):
    """One cut of a split_inference task's model: its head and tail, each a model artefact."""

    __tablename__ = "split_parts"

    task_id: str = Field(primary_key=True, max_length=64)
    position: int = Field(primary_key=True, description="1, 2, ... in the model's order (the head's cut_index metric)")
    cut: str = Field(max_length=256)
    head_artifact_id: str = Field(max_length=64)
    tail_artifact_id: str = Field(max_length=64)


class TrainingResult(SQLModel, table=True):
    """A device's trained last layer, kept until the hub has published the new model version."""

    __tablename__ = "training_results"
    __table_args__ = (Index("ix_training_results_task", "task_id"), Index("ix_training_results_artifact", "artifact_id"))

    worker_id: str = Field(primary_key=True, max_length=64)
    task_id: str = Field(max_length=64)
    device_id: str = Field(max_length=64)
    steps: int
    data: bytes = Field(sa_column=Column(LargeBinary, nullable=False))
    artifact_id: str | None = Field(default=None, max_length=64)
    attempts: int = 0
    error: str = Field(default="", sa_column=Column(Text, nullable=False, default=""))
    created_at: datetime = _ts(nullable=False)
    published_at: datetime | None = _ts(nullable=True)


class TrainedModelRow(SQLModel, table=True):
    """What a ``training`` worker published and reported (its evaluation): kept once, the task's outputs."""

    __tablename__ = "trained_models"
    __table_args__ = (Index("ix_trained_models_task", "task_id"),)

    worker_id: str = Field(primary_key=True, max_length=64)
    task_id: str = Field(max_length=64)
    node_id: str = Field(max_length=64)
    parameters_id: str = Field(max_length=64)
    onnx_id: str | None = Field(default=None, max_length=64)
    steps: int
    resumed_from: int
    num_examples: int = Field(sa_column=Column(BigInteger, nullable=False))
    loss: float
    metrics: dict[str, float] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    created_at: datetime = _ts(nullable=False)


class TrainingManifest(SQLModel, table=True):
    """A ``training`` task's algorithm as admitted: the package's id and its manifest (placement reads its frameworks),
    and the output identity pinned for it (no other task pins the same)."""

    __tablename__ = "training_manifests"
    __table_args__ = (UniqueConstraint("output_name", "output_version", name="uq_training_manifests_output"),)

    task_id: str = Field(primary_key=True, max_length=64)
    algorithm_id: str = Field(max_length=64)
    output_name: str = Field(max_length=128)
    output_version: str = Field(max_length=64)
    manifest: dict[str, Any] = Field(sa_column=Column(JSON, nullable=False))
