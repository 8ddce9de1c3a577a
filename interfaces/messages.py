"""MQTT payloads: the envelope ``{v, id, ts, src, kind, body}`` and the typed bodies.

A reply carries, in ``reply_to``, the ``id`` of the request it answers. Validate into these models at
the edge of a process; untyped dicts never travel inward. They read JSON strictly (``interfaces.strict``):
a wrong type is refused, not coerced.
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Generic, Literal, TypeVar, cast

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from interfaces import PROTOCOL_VERSION
from interfaces.deployments import EXECUTION_EVENT, DeploymentOrder, ExecutionProgress
from interfaces.ids import new_id
from interfaces.resources import Resources
from interfaces.tasks import (
    MAX_WORKERS_PER_TARGET, TASK_EVENTS, FlEvaluation, FlKey, FlReveal, FlUpdate, TrainedModel, WorkerLog, WorkerMetrics, WorkerOrder, WorkerOutput, WorkerReport,
)  # fmt: skip
from interfaces.strict import BY_VALUE, INT64_MAX, STRICT_JSON, JsonObject, ProtocolVersion, Timestamp, WireModel
from interfaces.strict import MAX_MESSAGE_BYTES as MAX_MESSAGE_BYTES  # every tier's limit, with the wire's other bounds

MAX_SEQ = INT64_MAX  # sequence numbers fit a signed 64-bit integer (SQLite's and PostgreSQL's BIGINT)


class _Body(WireModel):
    model_config = ConfigDict(extra="forbid")
    KIND: ClassVar[str]


class ConnectionState(StrEnum):
    ONLINE = "online"
    OFFLINE = "offline"


class StateBody(_Body):
    """Retained on ``state``; the agent's last will publishes ``offline``."""

    KIND: ClassVar[str] = "state"
    state: Annotated[ConnectionState, BY_VALUE]
    agent_version: str | None = Field(default=None, max_length=64)
    reason: str | None = Field(default=None, max_length=256, description="why offline: will, shutdown, ...")


class HubStateBody(StateBody):
    """Retained on the hub's ``state``: a :class:`StateBody` and the key the hub signs with."""

    signing_key_id: str | None = Field(
        default=None, min_length=16, max_length=16, pattern=r"^[0-9a-f]{16}$",
        description="the key the hub signs artefacts and download tokens with now (after a rotation, edges fetch the hand-over)",
    )  # fmt: skip


class Health(StrEnum):
    OK = "ok"
    DEGRADED = "degraded"


class HeartbeatBody(_Body):
    KIND: ClassVar[str] = "heartbeat"
    seq: int = Field(ge=0, le=INT64_MAX, description="monotonic per agent run")
    health: Annotated[Health, BY_VALUE] = Health.OK
    health_detail: str | None = Field(default=None, max_length=512)
    agent_version: str = Field(max_length=64)
    uptime_s: float = Field(ge=0)
    resources: Resources


class DesiredBody(_Body):
    """Retained desired-state document on ``desired``."""

    KIND: ClassVar[str] = "desired"
    version: int = Field(ge=0, le=INT64_MAX)
    spec: JsonObject = Field(default_factory=dict)
    deployments: list[DeploymentOrder] = Field(default_factory=list, max_length=8, description="the rollout controller's orders, at most one per artefact kind (DESIGN §4.2)")
    deployments_version: int = Field(default=0, ge=0, le=INT64_MAX, description="goes up whenever the orders change")
    tasks: list[WorkerOrder] = Field(default_factory=list, max_length=MAX_WORKERS_PER_TARGET, description="the task workers this target runs (DESIGN §4.3); a withdrawn one stops")
    tasks_version: int = Field(default=0, ge=0, le=INT64_MAX, description="goes up whenever the task orders change")


class ReportedBody(_Body):
    KIND: ClassVar[str] = "reported"
    version: int = Field(ge=0, le=INT64_MAX, description="the desired version this report converged to")
    status: JsonObject = Field(default_factory=dict)


class FlUpdateBody(_Body):
    """A device's federated update on ``fl``, for its edge's aggregator (hierarchical ``federated_training``)."""

    KIND: ClassVar[str] = "fl.update"
    update: FlUpdate


class CommandBody(_Body):
    """A request on ``cmd``; the answer goes to the MQTT 5 response topic with the correlation data."""

    KIND: ClassVar[str] = "command"
    name: str = Field(min_length=1, max_length=64)
    args: JsonObject = Field(default_factory=dict)
    timeout_s: float = Field(default=10, gt=0, le=3600)


class CommandError(StrEnum):
    """``error_code`` of a failed command result."""

    UNKNOWN_COMMAND = "unknown_command"  # the agent has no handler for this name
    VALIDATION_FAILED = "validation_failed"  # the request did not validate into CommandBody
    FAILED = "failed"  # the handler ran and failed
    TIMEOUT = "timeout"  # no answer within timeout_s
    UNKNOWN_DEVICE = "unknown_device"  # an edge asked for a device that is not one of its own
    DOWNSTREAM_UNAVAILABLE = "downstream_unavailable"  # the edge cannot reach its devices' broker
    INVALID_REPLY = "invalid_reply"  # the device answered something that is not a command result


class CommandResultBody(_Body):
    KIND: ClassVar[str] = "command_result"
    ok: bool
    result: JsonObject | None = None
    error_code: str | None = Field(default=None, max_length=64, description="a CommandError value, or an agent-specific code")
    error: str | None = Field(default=None, max_length=2048)


class EventBody(_Body):
    """Progress, logs, metrics and error reports on ``events``."""

    KIND: ClassVar[str] = "event"
    seq: int | None = Field(default=None, ge=0, le=MAX_SEQ, description="per-sender sequence number, monotonic across restarts; the hub keeps each (sender, seq) once")
    prev_seq: int | None = Field(
        default=None,
        ge=0,
        le=MAX_SEQ,
        description="the seq of the sender's previous event (None: the sender keeps none before this one); with it, the "
        "receiving edge stores a device's events only in order and asks for a resend when one is missing",
    )
    type: str = Field(min_length=1, max_length=64)
    severity: Literal["debug", "info", "warning", "error"] = "info"
    message: str | None = Field(default=None, max_length=8192)
    data: JsonObject = Field(default_factory=dict)


class EventsAckBody(_Body):
    """The edge's acknowledgement of a device's events on ``events/ack``, sent after the edge has *stored* them.

    Cumulative: every event of the device up to ``seq`` is stored at the edge (and so on its way to the hub), and
    the device may forget it. ``resend``: the edge refused a later event because one before it is missing; the
    device sends again, in order, everything after ``seq``.
    """

    KIND: ClassVar[str] = "events.ack"
    seq: int | None = Field(ge=0, le=MAX_SEQ, description="the highest seq stored; None: none of this device's events yet")
    resend: bool = False


MESSAGE_REJECTED_EVENT = "message_rejected"
"""The error event that answers a dropped malformed message (DESIGN §6), from whichever end dropped it."""


def rejection_event(topic: str, reason: object, rejected_total: int, **data: Any) -> EventBody:
    """The ``message_rejected`` event for a message dropped on ``topic`` (``reason``: the validation error or why)."""
    return EventBody(
        type=MESSAGE_REJECTED_EVENT,
        severity="error",
        message=str(reason)[:8192],
        data={"topic": topic, "rejected_total": rejected_total, **data},
    )


B = TypeVar("B", bound=_Body)


class Envelope(BaseModel, Generic[B]):
    """Every control message. ``src`` is the sender's identity (node or device id, or ``hub``)."""

    model_config = ConfigDict(**STRICT_JSON, extra="forbid")

    v: ProtocolVersion = PROTOCOL_VERSION
    id: str = Field(min_length=1, max_length=64)
    ts: Timestamp
    src: str = Field(min_length=1, max_length=64)
    kind: str = Field(min_length=1, max_length=32)
    reply_to: str | None = Field(default=None, max_length=64)
    body: B


HUB_SRC = "hub"
"""The ``src`` of every envelope the hub sends or records (a node or device id never equals it)."""


def envelope(src: str, body: B, reply_to: str | None = None) -> Envelope[B]:
    """Wrap ``body`` in a fresh envelope from ``src``."""
    model: type[Envelope[B]] = cast(Any, Envelope)[type(body)]
    return model(id=new_id("m"), ts=datetime.now(UTC), src=src, kind=body.KIND, reply_to=reply_to, body=body)


class _ActedEvent(EventBody):
    """An event the hub acts on: its ``data`` is its type's model, read as strictly as the rest of the message."""


class ExecutionEvent(_ActedEvent):
    type: Literal["deployment.execution"]
    data: ExecutionProgress  # type: ignore[assignment]


class TaskWorkerEvent(_ActedEvent):
    type: Literal["task.worker"]
    data: WorkerReport  # type: ignore[assignment]


class TaskLogEvent(_ActedEvent):
    type: Literal["task.log"]
    data: WorkerLog  # type: ignore[assignment]


class TaskMetricsEvent(_ActedEvent):
    type: Literal["task.metrics"]
    data: WorkerMetrics  # type: ignore[assignment]


class TaskOutputEvent(_ActedEvent):
    type: Literal["task.output"]
    data: WorkerOutput  # type: ignore[assignment]


class FlUpdateEvent(_ActedEvent):
    type: Literal["fl.update"]
    data: FlUpdate  # type: ignore[assignment]


class FlKeyEvent(_ActedEvent):
    type: Literal["fl.key"]
    data: FlKey  # type: ignore[assignment]


class FlRevealEvent(_ActedEvent):
    type: Literal["fl.reveal"]
    data: FlReveal  # type: ignore[assignment]


class FlEvaluationEvent(_ActedEvent):
    type: Literal["fl.evaluation"]
    data: FlEvaluation  # type: ignore[assignment]


class TaskTrainedEvent(_ActedEvent):
    type: Literal["task.trained"]
    data: TrainedModel  # type: ignore[assignment]


TaskEvent = TaskWorkerEvent | TaskLogEvent | TaskMetricsEvent | TaskOutputEvent | FlUpdateEvent | FlKeyEvent | FlRevealEvent | FlEvaluationEvent | TaskTrainedEvent
"""The events of task workers (``interfaces.tasks.TASK_EVENTS``)."""
ActedEvent = Annotated[ExecutionEvent | TaskEvent, Field(discriminator="type")]
"""An ``EventBody`` of a type the hub acts on, as its type's variant (told apart by ``type``; every other type is
stored as it came). :func:`acted_event` reads one."""
ACTED_EVENTS: tuple[type[_ActedEvent], ...] = (
    ExecutionEvent, TaskWorkerEvent, TaskLogEvent, TaskMetricsEvent, TaskOutputEvent, FlUpdateEvent, FlKeyEvent, FlRevealEvent, FlEvaluationEvent, TaskTrainedEvent,
)  # fmt: skip
EVENT_DATA: dict[str, type[BaseModel]] = {v.model_fields["type"].annotation.__args__[0]: v.model_fields["data"].annotation for v in ACTED_EVENTS}  # type: ignore[union-attr,misc]
"""``EventBody.data`` of the event types the hub acts on, by ``EventBody.type`` (the variants of :data:`ActedEvent`)."""
assert set(EVENT_DATA) == {EXECUTION_EVENT} | TASK_EVENTS, "every acted event type has its variant"
ACTED_EVENT_ADAPTER: TypeAdapter[ExecutionEvent | TaskEvent] = TypeAdapter(ActedEvent)
_VARIANT_OF: dict[str, type[_ActedEvent]] = {v.model_fields["type"].annotation.__args__[0]: v for v in ACTED_EVENTS}  # type: ignore[union-attr]


def acted_event(body: EventBody) -> ExecutionEvent | TaskEvent | None:
    """``body`` as its type's variant of :data:`ActedEvent`; None for a type the hub does not act on. A ``data``
    that is not its type's raises ``pydantic.ValidationError``. Only ``data`` is read again (the rest of ``body``
    was validated when the message was): the hub's ingest reads every task event through here."""
    variant = _VARIANT_OF.get(body.type)
    if variant is None:
        return None
    data = EVENT_DATA[body.type].model_validate(body.data)
    event = variant.model_construct(_fields_set=body.model_fields_set, **{**dict(body), "data": data})
    return event  # type: ignore[return-value]
