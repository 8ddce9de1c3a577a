"""Strict wire models (``interfaces.strict``): every MQTT payload refuses a wrong type instead of coercing it, and the
committed JSON Schemas (``interfaces/schemas/``) refuse the same payloads.

One valid document per channel (and per event type the hub acts on) is mutated leaf by leaf: a number as a string, a
boolean for a number or a number for a boolean, an integer beyond 64 bits, ``NaN`` and ``Infinity``, a number for a
date-time. Each mutation must be refused by the model of the topic table and by the committed schema.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jsonschema_rs
import pytest
from pydantic import BaseModel, RootModel, ValidationError

from cloud.contracts import channel_topics
from interfaces.deployments import (
    ArtifactFormat,
    ArtifactKind,
    ArtifactManifest,
    DeltaOffer,
    DeploymentOrder,
    ExecutionProgress,
    ExecutionState,
    InstalledArtifact,
    SignedManifest,
)
from interfaces.infer import InferReply, InferRequest
from interfaces.messages import (
    EVENT_DATA,
    ActedEvent,
    TaskMetricsEvent,
    CommandBody,
    CommandResultBody,
    ConnectionState,
    DesiredBody,
    EventBody,
    EventsAckBody,
    FlUpdateBody,
    HeartbeatBody,
    HubStateBody,
    ReportedBody,
    StateBody,
    envelope,
)
from interfaces.privacy import LocalDataset
from interfaces.resources import (
    Accelerator,
    AcceleratorType,
    CpuReading,
    DiskReading,
    MemoryReading,
    NetworkReading,
    Resources,
)
from interfaces.strict import INT64_MAX, INT64_MIN, MAX_JSON_DEPTH, MAX_MESSAGE_BYTES
from interfaces.tasks import (
    ORDER_ADAPTER,
    FlKey,
    FlOrder,
    FlReveal,
    FlEvaluation,
    FlScore,
    FlUpdate,
    InputRef,
    LogLine,
    SplitOrder,
    SplitPart,
    TaskType,
    TrainedModel,
    TrainingOrder,
    WorkerLog,
    WorkerMetrics,
    WorkerOutput,
    WorkerReport,
    WorkerState,
    worker_order,
)
from interfaces.topics import (
    DEVICE_EVENTS_ACK,
    DEVICE_FL,
    HUB_STATE,
    NODE_CMD,
    NODE_CMD_REPLY,
    NODE_DESIRED,
    NODE_EVENTS,
    NODE_HEARTBEAT,
    NODE_REPORTED,
    NODE_STATE,
    TOPICS,
)

SCHEMAS = Path(__file__).resolve().parents[1] / "interfaces" / "schemas"
T0 = datetime(2030, 1, 1, 12, 30, tzinfo=UTC)
SHA = "ab" * 32
KEY = "A" * 43 + "="


# ---- one valid document per channel -----------------------------------------------------------------


def _resources() -> Resources:
    return Resources(
        cpu=CpuReading(cores=4, utilisation=0.25, load_1m=0.5),
        memory=MemoryReading(total_bytes=8 << 30, available_bytes=4 << 30),
        disk=DiskReading(path="/", total_bytes=64 << 30, free_bytes=32 << 30),
        network=NetworkReading(bytes_sent=1, bytes_received=2, send_rate_bps=10.5, receive_rate_bps=2.5),
        accelerators=[Accelerator(type=AcceleratorType.GPU, model="g1", count=2, memory_bytes=1 << 30, utilisation=0.5, purpose="both")],
    )


def _signed() -> SignedManifest:
    manifest = ArtifactManifest(
        name="fw", version="1.2.0", kind=ArtifactKind.FIRMWARE, format=ArtifactFormat.FIRMWARE, sha256=SHA, size=10, created_at=T0
    )
    return SignedManifest(manifest=manifest, signature="c2lnbmF0dXJl", key_id="0123456789abcdef")


def _ref() -> InputRef:
    return InputRef(artifact_id="a-1", signed_manifest=_signed(), path="/artifacts/a-1/content", token="t")


def _desired() -> DesiredBody:
    order = DeploymentOrder(
        execution_id="x-1", deployment_id="d-1", artifact_id="a-1", signed_manifest=_signed(), path="/artifacts/a-1/content",
        token="t", delta=DeltaOffer(base_sha256=SHA, sha256=SHA, size=3, path="/deltas/1"), allow_downgrade=True, confirm_timeout_s=30.5,
    )  # fmt: skip
    model = {"name": "m", "version": "1.0.0"}
    batch = worker_order(
        worker_id="w-1", task_id="t-1", type=TaskType.BATCH_INFERENCE, attempt=2, spec={"model": model, "inputs": "a-2", "chunk_size": 10},
        heartbeat_s=2.5, inputs=_ref(), items=100, chunk_size=10, chunks=[(0, 5)],
    )  # fmt: skip
    training = worker_order(
        worker_id="w-2", task_id="t-2", type=TaskType.INCREMENTAL_TRAINING, spec={"model": model, "dataset": "camera", "steps": 10},
        training=TrainingOrder(body=_ref(), base_sha256=SHA, feature="f", head="aGVhZA==", max_steps=10, sample_rate=0.125),
    )  # fmt: skip
    split = worker_order(
        worker_id="w-3", task_id="t-3", type=TaskType.SPLIT_INFERENCE, role="head", spec={"model": model},
        split=SplitOrder(base_sha256=SHA, input="x", parts=[SplitPart(cut="c", head=_ref())]),
    )  # fmt: skip
    federated = worker_order(
        worker_id="w-4", task_id="t-4", type=TaskType.FEDERATED_TRAINING, spec={"model": model, "dataset": "camera", "rounds": 3},
        fl=FlOrder(
            round=2, attempt=1, deadline_at=T0, weights=_ref(), body=_ref(), base_sha256=SHA, feature="f", sample_rate=0.5, via_edge=True,
            participants=["dv-1"], secure=True, peers={"dv-1": KEY}, total_examples=100,
        ),
    )  # fmt: skip
    return DesiredBody(version=3, deployments=[order], deployments_version=1, tasks=[batch, training, split, federated], tasks_version=2)


def _update() -> FlUpdate:
    return FlUpdate(task_id="t-1", worker_id="w-1", round=1, attempt=1, contributors=["dv-1"], num_examples=10, data="ZGF0YQ==",
                    metrics={"loss": 0.5}, masked=False)  # fmt: skip


def _doc(model: BaseModel) -> dict[str, Any]:
    return json.loads(model.model_dump_json())  # type: ignore[no-any-return]


# (name of the committed schema, the model that reads it, a valid document)
CHANNELS: list[tuple[str, type[BaseModel], dict[str, Any]]] = [
    ("hub-state", HUB_STATE.payload, _doc(envelope("hub", HubStateBody(state=ConnectionState.ONLINE, agent_version="1", reason="up", signing_key_id="0123456789abcdef")))),
    ("state", NODE_STATE.payload, _doc(envelope("n-1", StateBody(state=ConnectionState.OFFLINE, agent_version="1", reason="will")))),
    ("heartbeat", NODE_HEARTBEAT.payload, _doc(envelope("n-1", HeartbeatBody(seq=12, agent_version="1.0", uptime_s=3.5, resources=_resources())))),
    ("desired", NODE_DESIRED.payload, _doc(envelope("hub", _desired()))),
    ("reported", NODE_REPORTED.payload, _doc(envelope("n-1", ReportedBody(version=3)))),
    ("cmd", NODE_CMD.payload, _doc(envelope("hub", CommandBody(name="blink", timeout_s=2.5)))),
    ("cmd-reply", NODE_CMD_REPLY.payload, _doc(envelope("n-1", CommandResultBody(ok=False, error_code="failed", error="no"), reply_to="m-1"))),
    ("events", NODE_EVENTS.payload, _doc(envelope("n-1", EventBody(seq=7, prev_seq=6, type="note", severity="warning", message="m")))),
    ("events-ack", DEVICE_EVENTS_ACK.payload, _doc(envelope("n-1", EventsAckBody(seq=7, resend=True)))),
    ("fl", DEVICE_FL.payload, _doc(envelope("dv-1", FlUpdateBody(update=_update())))),
]  # fmt: skip
EVENTS: list[tuple[str, type[BaseModel], dict[str, Any]]] = [
    (f"events/{type_}", EVENT_DATA[type_], _doc(data))
    for type_, data in {
        "deployment.execution": ExecutionProgress(
            execution_id="x-1", state=ExecutionState.ACTIVE, bytes_downloaded=10, via_delta=True,
            installed=InstalledArtifact(name="fw", version="1.2.0", sha256=SHA, artifact_id="a-1", slot="b"),
        ),  # fmt: skip
        "task.worker": WorkerReport(worker_id="w-1", task_id="t-1", state=WorkerState.RUNNING, paused=True, items_done=3),
        "task.log": WorkerLog(worker_id="w-1", task_id="t-1", lines=[LogLine(ts=T0, text="hello")]),
        "task.metrics": WorkerMetrics(worker_id="w-1", task_id="t-1", ts=T0, values={"rate": 2.5}),
        "task.output": WorkerOutput(worker_id="w-1", task_id="t-1", chunk=3, items=10, data="ZGF0YQ=="),
        "fl.update": _update(),
        "fl.key": FlKey(task_id="t-1", worker_id="w-1", public_key=KEY),
        "fl.reveal": FlReveal(task_id="t-1", worker_id="w-1", round=2, attempt=1, seeds={"dv-2": KEY}),
        "fl.evaluation": FlEvaluation(task_id="t-1", worker_id="w-1", scores={"global": FlScore(loss=0.5, num_examples=90, metrics={"accuracy": 0.9})}),
        "task.trained": TrainedModel(task_id="t-1", worker_id="w-1", parameters="a-1", onnx="a-2", steps=4, resumed_from=2, num_examples=300,
                                     loss=0.25, metrics={"accuracy": 0.9}),  # fmt: skip
    }.items()
]
ACTED: list[tuple[str, type[BaseModel], dict[str, Any]]] = [
    # the hub's typed view of the events it acts on: one variant per type, told apart by type
    ("events/acted", RootModel[ActedEvent], _doc(TaskMetricsEvent(seq=8, prev_seq=7, type="task.metrics", data=WorkerMetrics(worker_id="w-1", task_id="t-1", ts=T0, values={"rate": 2.5})))),
]
DOCUMENTS = CHANNELS + EVENTS + ACTED


@functools.cache
def _validator(name: str) -> Any:
    return jsonschema_rs.validator_for(json.loads((SCHEMAS / f"{name}.json").read_text()))


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def is_json(raw: bytes) -> bool:
    """Whether ``raw`` is JSON (RFC 8259: no NaN, no Infinity), which is all a JSON Schema can judge."""
    try:
        json.loads(raw, parse_constant=_refuse_constant)
    except ValueError:
        return False
    return True


# ---- the mutations ----------------------------------------------------------------------------------


def _leaves(node: Any, path: tuple[str | int, ...] = ()) -> Iterator[tuple[tuple[str | int, ...], Any]]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, (*path, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _leaves(value, (*path, index))
    elif node is not None:
        yield path, node


def _wrong(value: Any) -> list[tuple[str, Any]]:
    """What a lax reader would coerce into ``value``'s type, or what its type cannot hold."""
    if isinstance(value, bool):
        return [("string", str(value).lower()), ("integer", int(value))]
    if isinstance(value, int):
        return [("string", str(value)), ("boolean", True), ("float", float(value)), ("beyond 64 bits", INT64_MAX + 1)]
    if isinstance(value, float):
        return [("string", str(value)), ("boolean", True), ("Infinity", math.inf), ("NaN", math.nan)]
    if isinstance(value, str) and value.startswith("2030-01-01T"):
        return [("Unix time", 1_893_456_000), ("date alone", value[:10])]
    return [("number", 7)]


def _with(doc: Any, path: tuple[str | int, ...], value: Any) -> Any:
    if not path:
        return value
    copy = list(doc) if isinstance(doc, list) else dict(doc)
    copy[path[0]] = _with(doc[path[0]], path[1:], value)  # type: ignore[index]
    return copy


MUTATIONS = [
    pytest.param(name, model, json.dumps(_with(doc, path, wrong)).encode(), kind, id=f"{name}:{'.'.join(map(str, path))}:{kind}")
    for name, model, doc in DOCUMENTS
    for path, value in _leaves(doc)
    for kind, wrong in _wrong(value)
]


def test_every_json_payload_of_the_topic_table_and_every_event_type_has_a_document_here() -> None:
    # Prepare: the binary topics carry user properties (text pairs), not JSON
    binary = {name for name, topics in channel_topics().items() if topics[0].binary}

    # Assert
    committed = {f.relative_to(SCHEMAS).with_suffix("").as_posix() for f in SCHEMAS.rglob("*.json")}
    assert {name for name, _model, _doc in DOCUMENTS} == committed - binary
    assert {name for name, _model, _doc in EVENTS} == {f"events/{t}" for t in EVENT_DATA}
    assert {name for name, _model, _doc in ACTED} == {"events/acted"}
    assert {name: model for name, model, _doc in CHANNELS} == {name: topics[0].payload for name, topics in channel_topics().items() if name not in binary}


@pytest.mark.parametrize(("name", "model", "doc"), [pytest.param(n, m, d, id=n) for n, m, d in DOCUMENTS])
def test_the_valid_documents_pass_the_model_and_the_committed_schema(name: str, model: type[BaseModel], doc: dict[str, Any]) -> None:
    # Execute
    parsed = model.model_validate_json(json.dumps(doc))

    # Assert: as JSON and as the dict a stored document gives back, the same message
    assert _validator(name).is_valid(doc), list(_validator(name).iter_errors(doc))[:1]
    assert model.model_validate(doc) == parsed
    assert json.loads(parsed.model_dump_json()) == doc


@pytest.mark.parametrize(("name", "model", "raw", "kind"), MUTATIONS)
def test_a_wrong_type_is_refused_by_the_model_and_the_committed_schema(name: str, model: type[BaseModel], raw: bytes, kind: str) -> None:
    # Execute + Assert: the model of the topic table refuses it
    with pytest.raises(ValidationError):
        model.model_validate_json(raw)

    # Assert: so does the committed schema, or the payload is no JSON at all
    if kind in ("Infinity", "NaN"):
        assert not is_json(raw)
    elif kind != "float":  # JSON Schema cannot tell 12.0 from 12 (one number to it); the models refuse 12.0
        assert not _validator(name).is_valid(json.loads(raw))


def _valid(name: str) -> dict[str, Any]:
    """The valid document of one channel."""
    return next(doc for channel, _model, doc in CHANNELS if channel == name)


@pytest.mark.parametrize(
    ("path", "raw_value"),
    [(("body", "seq"), '"13"'), (("body", "resources", "cpu", "cores"), '"114"'), (("body", "seq"), "true"), (("body", "uptime_s"), "Infinity")],
    ids=["seq-string", "cores-string", "seq-true", "uptime-infinity"],
)
def test_the_reported_heartbeats_are_refused(path: tuple[str, ...], raw_value: str) -> None:
    # Prepare: the valid heartbeat with one value replaced, byte for byte as it came on the wire
    marker = "__VALUE__"
    raw = json.dumps(_with(_valid("heartbeat"), path, marker)).replace(f'"{marker}"', raw_value).encode()

    # Execute + Assert
    with pytest.raises(ValidationError) as refused:
        NODE_HEARTBEAT.payload.model_validate_json(raw)
    assert refused.value.errors()[0]["loc"] == path
    if raw_value == "Infinity":
        assert not is_json(raw)
    else:
        assert not _validator("heartbeat").is_valid(json.loads(raw))


# ---- bounds -----------------------------------------------------------------------------------------

FREE_FORM = {"spec", "status", "data", "args", "result", "config", "config_schema"}
"""free-form objects (still size-bounded by JsonObject): a spec, a status, event data, command arguments and results, an
algorithm's configuration and its JSON Schema"""


def _unbounded(node: Any, path: str = "") -> Iterator[str]:
    if isinstance(node, list):
        for index, item in enumerate(node):
            yield from _unbounded(item, f"{path}/{index}")
        return
    if not isinstance(node, dict):
        return
    kind = node.get("type")
    if kind == "integer" and "const" not in node and not (INT64_MIN <= node.get("minimum", INT64_MIN - 1) and node.get("maximum", INT64_MAX + 1) <= INT64_MAX):
        yield f"{path}: an integer without 64-bit bounds"
    if kind == "string" and not {"maxLength", "enum", "const"} & set(node) and not (node.get("format") == "date-time" and "pattern" in node):
        yield f"{path}: a string without a length limit"
    if kind == "array" and "maxItems" not in node:
        yield f"{path}: an array without a length limit"
    if kind == "object" and isinstance(node.get("additionalProperties"), dict) and "maxProperties" not in node:
        yield f"{path}: a map without a size limit"
    field = re.sub(r"/anyOf/\d+$", "", path).rsplit("/", 1)[-1]  # an optional object is one branch of an anyOf
    if kind == "object" and node.get("additionalProperties") is True and field not in FREE_FORM:
        yield f"{path}: a free-form object that is not one of {sorted(FREE_FORM)} (interfaces.strict.JsonObject)"
    for key, value in node.items():
        yield from _unbounded(value, f"{path}/{key}")


def test_every_integer_string_list_and_map_of_the_committed_schemas_is_bounded() -> None:
    # Prepare
    files = sorted(SCHEMAS.rglob("*.json"))

    # Execute
    found = [f"{f.relative_to(SCHEMAS)}{where}" for f in files for where in _unbounded(json.loads(f.read_text()))]

    # Assert: every channel and event type was looked at, and nothing is unbounded
    assert {f.relative_to(SCHEMAS).with_suffix("").as_posix() for f in files} >= {name for name, _m, _d in DOCUMENTS}
    assert found == []


def test_every_topic_has_a_schema_that_names_each_of_its_topics() -> None:
    # Prepare
    described = {f.stem: json.loads(f.read_text())["description"] for f in SCHEMAS.glob("*.json")}

    # Assert: a topic's pattern, direction, QoS and retain flag are in the description of its channel's schema
    for topic in TOPICS:
        name = next(n for n, text in described.items() if topic.pattern + " " in text)
        line = f"{topic.pattern} ({topic.direction}, QoS {topic.qos}, retain {str(topic.retain).lower()}): {topic.description}"
        assert line in described[name], (topic.pattern, described[name])
    assert "synergy/v1/nodes/{node_id}/heartbeat (edge->hub" in described["heartbeat"]
    assert "synergy/v1/devices/{device_id}/heartbeat (device->edge" in described["heartbeat"]
    assert "synergy/v1/nodes/{node_id}/devices/{device_id}/heartbeat (edge->hub" in described["heartbeat"]


# ---- free-form objects ------------------------------------------------------------------------------


def _nested(depth: int) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    for _ in range(depth):
        doc = {"x": doc}
    return doc


@pytest.mark.parametrize(
    ("data", "why"),
    [
        ({"loss": math.nan}, "nan is not JSON"),
        ({"rates": [1.0, -math.inf]}, "-inf is not JSON"),
        ({"n": INT64_MAX + 1}, "does not fit a signed 64-bit integer"),
        ({"n": INT64_MIN - 1}, "does not fit a signed 64-bit integer"),
        (_nested(MAX_JSON_DEPTH + 1), f"nested more than {MAX_JSON_DEPTH} deep"),
        ({"blob": "x" * MAX_MESSAGE_BYTES}, f"exceed the {MAX_MESSAGE_BYTES} byte limit"),
        ({"when": object()}, "not JSON"),
    ],
    ids=["nan", "infinity", "beyond-int64", "below-int64", "too-deep", "too-large", "not-json"],
)
def test_a_free_form_object_is_bounded_json(data: dict[str, Any], why: str) -> None:
    # Execute + Assert: from Python code and, where JSON can say it, from the wire
    for build in (
        lambda: EventBody(type="note", data=data),
        lambda: ReportedBody(version=1, status=data),
        lambda: DesiredBody(version=1, spec=data),
        lambda: CommandBody(name="x", args=data),
        lambda: CommandResultBody(ok=True, result=data),
    ):
        with pytest.raises(ValidationError, match=why):
            build()
    if why.endswith("is not JSON") or "64-bit" in why:
        raw = json.dumps({"type": "note", "data": data}).encode()
        with pytest.raises(ValidationError, match=why):
            EventBody.model_validate_json(raw)


def test_a_free_form_object_within_its_bounds_is_kept_as_it_is() -> None:
    # Prepare
    data = {"a": [1, 2.5, True, None, "x"], "b": _nested(MAX_JSON_DEPTH - 1), "big": INT64_MAX, "low": INT64_MIN}

    # Execute
    event = EventBody.model_validate_json(json.dumps({"type": "note", "data": data}))

    # Assert
    assert event.data == data


def test_infinity_inside_event_data_on_the_wire_is_refused() -> None:
    # Execute + Assert
    with pytest.raises(ValidationError, match="inf is not JSON"):
        NODE_EVENTS.payload.model_validate_json(json.dumps(_with(_valid("events"), ("body", "data"), {"loss": math.inf})).encode())


# ---- Python code builds the models from what it holds ----------------------------------------------


def test_python_code_may_pass_enum_values_datetime_text_and_lists_for_tuples() -> None:
    # Execute
    state = StateBody(state="online")  # type: ignore[arg-type]
    accelerator = Accelerator(type="gpu", model="g", count=1, memory_bytes=1, utilisation=0.0)  # type: ignore[arg-type]
    line = LogLine(ts="2030-01-01T12:30:00+00:00", text="x")  # type: ignore[arg-type]
    progress = ExecutionProgress(execution_id="x-1", state="ACTIVE")  # type: ignore[arg-type]
    order = ORDER_ADAPTER.validate_python({"worker_id": "w", "task_id": "t", "type": "inference", "spec": {"model": {"name": "m"}}, "chunks": [[0, 2]]})
    dataset = LocalDataset.model_validate({"rows": 10, "shape": [28, 28], "dtype": "float32"})

    # Assert
    assert state.state is ConnectionState.ONLINE
    assert accelerator.type is AcceleratorType.GPU
    assert line.ts == T0
    assert progress.state is ExecutionState.ACTIVE
    assert (order.type, order.chunks) == (TaskType.INFERENCE, [(0, 2)])
    assert dataset.shape == [28, 28]


@pytest.mark.parametrize(
    "build",
    [
        lambda: HeartbeatBody(seq="13", agent_version="1", uptime_s=1, resources=_resources()),  # type: ignore[arg-type]
        lambda: HeartbeatBody(seq=True, agent_version="1", uptime_s=1, resources=_resources()),
        lambda: HeartbeatBody(seq=1, agent_version="1", uptime_s=math.inf, resources=_resources()),
        lambda: CpuReading(cores=4.0, utilisation=0.5),  # type: ignore[arg-type]
        lambda: EventsAckBody(seq="3"),  # type: ignore[arg-type]
        lambda: LogLine(ts=1_893_456_000, text="x"),  # type: ignore[arg-type]
        lambda: StateBody(state="ONLINE"),  # type: ignore[arg-type]
        lambda: LocalDataset(rows="10", shape=[1], dtype="f"),  # type: ignore[arg-type]
    ],
    ids=["seq-string", "seq-bool", "uptime-inf", "cores-float", "ack-string", "ts-number", "state-name", "rows-string"],
)
def test_python_code_gets_no_coercion_either(build: Any) -> None:
    with pytest.raises(ValidationError):
        build()


# ---- user properties of split inference ------------------------------------------------------------


@pytest.mark.parametrize("text", ["inf", "-Infinity", "nan", "NaN", "1e400"])
def test_infer_properties_refuse_nan_and_infinity(text: str) -> None:
    with pytest.raises(ValueError, match="tail_ms"):
        InferReply.from_pairs([("status", "ok"), ("tail_ms", text)])


def test_infer_properties_read_numbers_and_names_from_their_text() -> None:
    # Execute
    reply = InferReply.from_pairs([("status", "ok"), ("tail_ms", "1.5")])
    request = InferRequest.from_pairs([("task_id", "t-1"), ("kind", "probe")])

    # Assert
    assert (reply.tail_ms, request.kind) == (1.5, "probe")
