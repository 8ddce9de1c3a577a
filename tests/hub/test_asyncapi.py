"""The AsyncAPI document (``interfaces/asyncapi.json``): committed as the code generates it, one channel and one
operation per topic of the table with its QoS and retain, the MQTT 5 properties of the protocol as bindings, and
payload schemas that take the messages the models build and refuse the ones the models refuse."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from cloud.contracts import ROOT, render
from interfaces.asyncapi import DEVICES_BROKER, HUB_BROKER, asyncapi_document
from interfaces.infer import InferReply, InferRequest
from interfaces.messages import (
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
)  # fmt: skip
from interfaces.resources import (
    Accelerator,
    AcceleratorType,
    CpuReading,
    DiskReading,
    MemoryReading,
    NetworkReading,
    Resources,
)
from interfaces.tasks import FlUpdate, TaskType, worker_order
from interfaces.topics import DEVICE_CMD, DEVICE_STATE, NODE_STATE, TOPICS, Direction, Topic

DOC = asyncapi_document()
RESOURCES = Resources(
    cpu=CpuReading(cores=4, utilisation=0.5), memory=MemoryReading(total_bytes=8 << 30, available_bytes=3 << 30),
    disk=DiskReading(path="/", total_bytes=64 << 30, free_bytes=20 << 30), network=NetworkReading(bytes_sent=10, bytes_received=20),
    accelerators=[Accelerator(type=AcceleratorType.NPU, model="edge-npu", count=1, memory_bytes=1 << 30, utilisation=0.1)],
)  # fmt: skip
ORDER = worker_order(
    worker_id="w-1", task_id="task-1", type=TaskType.BATCH_INFERENCE, spec={"model": {"name": "m"}, "inputs": "art-1"}, chunks=[(0, 2), (5, 6)]
)
SAMPLES: dict[type[BaseModel], BaseModel] = {
    StateBody: StateBody(state=ConnectionState.OFFLINE, agent_version="probe/1", reason="shutdown"),
    HubStateBody: HubStateBody(state=ConnectionState.ONLINE, signing_key_id="0123456789abcdef"),
    HeartbeatBody: HeartbeatBody(seq=3, agent_version="probe/1", uptime_s=12.5, resources=RESOURCES),
    DesiredBody: DesiredBody(version=4, spec={"sampling_hz": 10}, tasks=[ORDER], tasks_version=2),
    ReportedBody: ReportedBody(version=4, status={"sampling_hz": 10}),
    CommandBody: CommandBody(name="ping", args={"n": 1}, timeout_s=5),
    CommandResultBody: CommandResultBody(ok=False, error_code="unknown_command", error="no command 'reboot'"),
    EventBody: EventBody(seq=7, prev_seq=6, type="log", severity="warning", message="hello", data={"a": [1, 2]}),
    EventsAckBody: EventsAckBody(seq=7, resend=True),
    FlUpdateBody: FlUpdateBody(
        update=FlUpdate(
            task_id="task-1", worker_id="w-1", round=1, attempt=1, contributors=["d-1"], num_examples=10, data="AAAA"
        )
    ),
    InferRequest: InferRequest(task_id="task-1", cut="conv1", encoding="int8", shape="1,8,8"),
    InferReply: InferReply(status="ok", tail_ms=1.5),
}
"""A real message for every payload of the topic table (a new payload needs one here)."""


def _resolve(ref: str) -> Any:
    node: Any = DOC
    for part in ref.removeprefix("#/").split("/"):
        node = node[part.replace("~1", "/").replace("~0", "~")]
    return node


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        return ([node["$ref"]] if isinstance(node.get("$ref"), str) else []) + [
            r for v in node.values() for r in _refs(v)
        ]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


def _channel(topic: Topic[Any]) -> tuple[str, dict[str, Any]]:
    [(channel_id, channel)] = [(k, c) for k, c in DOC["channels"].items() if c["address"] == topic.pattern]
    return channel_id, channel


def _operation(channel_id: str) -> dict[str, Any]:
    [operation] = [o for o in DOC["operations"].values() if o["channel"]["$ref"] == f"#/channels/{channel_id}"]
    return operation


def _message(topic: Topic[Any]) -> dict[str, Any]:
    [ref] = _channel(topic)[1]["messages"].values()
    return _resolve(ref["$ref"])  # type: ignore[no-any-return]


def _sample(topic: Topic[Any]) -> dict[str, Any]:
    """The JSON a sender puts on ``topic`` (the user properties of a binary frame), built with the models."""
    if topic.binary:
        return dict(SAMPLES[topic.payload].pairs())  # type: ignore[attr-defined]
    body = SAMPLES[topic.payload.model_fields["body"].annotation]  # type: ignore[index]
    src = "d-1" if "device_id" in topic.placeholders else "hub" if topic.direction is Direction.HUB_TO_EDGE else "n-1"
    reply_to = "m-1" if topic.pattern.endswith("/reply") else None
    text = envelope(src, body, reply_to=reply_to).model_dump_json()  # type: ignore[type-var]
    topic.payload.model_validate_json(text)  # what the receivers accept
    return json.loads(text)  # type: ignore[no-any-return]


# ---- committed as generated -------------------------------------------------------------------------


def test_the_committed_document_is_what_the_generator_makes_now_and_contracts_write_it() -> None:
    # Execute
    files = render()

    # Assert: `aisynergy contracts write` writes it, `contracts check` compares it
    assert files[ROOT / "asyncapi.json"] == (ROOT / "asyncapi.json").read_text(), (
        "regenerate with `aisynergy contracts write`"
    )
    assert json.loads(files[ROOT / "asyncapi.json"]) == DOC


def test_the_generator_is_pure() -> None:
    assert asyncapi_document() == DOC
    assert asyncapi_document() is not asyncapi_document()


# ---- structure --------------------------------------------------------------------------------------


def test_asyncapi_3_required_fields_and_every_reference_resolves() -> None:
    assert DOC["asyncapi"] == "3.0.0"
    assert DOC["info"]["title"] and DOC["info"]["version"]
    for server in DOC["servers"].values():
        assert server["host"] and server["protocol"] == "secure-mqtt" and server["protocolVersion"] == "5"
    for operation in DOC["operations"].values():
        assert operation["action"] in ("send", "receive") and "$ref" in operation["channel"]
    for message in DOC["components"]["messages"].values():
        assert message["payload"] and message["contentType"] in ("application/json", "application/octet-stream")
    refs = _refs(DOC)
    assert len(refs) > 100
    for ref in refs:
        assert ref.startswith("#/"), ref
        _resolve(ref)  # a KeyError names the dangling one


@pytest.mark.parametrize("topic", TOPICS, ids=[t.pattern for t in TOPICS])
def test_every_topic_is_a_channel_with_its_operation_qos_and_retain(topic: Topic[Any]) -> None:
    # Execute
    channel_id, channel = _channel(topic)
    operation = _operation(channel_id)

    # Assert: the channel's parameters are the pattern's ids, its server the tier's broker
    assert sorted(channel.get("parameters", {})) == sorted(topic.placeholders)
    device_tier = topic.direction in (Direction.DEVICE_TO_EDGE, Direction.EDGE_TO_DEVICE)
    assert channel["servers"] == [{"$ref": f"#/servers/{DEVICES_BROKER if device_tier else HUB_BROKER}"}]
    # ... the operation is the agent's on that tier: it sends what goes up and receives what comes down
    assert operation["action"] == (
        "send" if topic.direction in (Direction.EDGE_TO_HUB, Direction.DEVICE_TO_EDGE) else "receive"
    )
    assert operation["tags"] == [{"name": "device" if device_tier else "edge"}]
    assert operation["messages"] == [
        {"$ref": f"#/channels/{channel_id}/{ref}"} for ref in [f"messages/{k}" for k in channel["messages"]]
    ]
    mqtt = operation["bindings"]["mqtt"]
    assert (mqtt["qos"], mqtt["retain"]) == (topic.qos, topic.retain)
    assert ("messageExpiryInterval" in mqtt) == (topic is DEVICE_CMD)


@pytest.mark.parametrize(
    "topic", [t for t in TOPICS if any(r.pattern == f"{t.pattern}/reply" for r in TOPICS)], ids=lambda t: t.pattern
)
def test_requests_carry_a_response_topic_and_correlation_data_and_name_their_reply(topic: Topic[Any]) -> None:
    # Prepare
    [reply] = [t for t in TOPICS if t.pattern == f"{topic.pattern}/reply"]

    # Execute
    operation = _operation(_channel(topic)[0])
    request_binding = _message(topic)["bindings"]["mqtt"]
    reply_binding = _message(reply)["bindings"]["mqtt"]

    # Assert
    assert _resolve(operation["reply"]["channel"]["$ref"])["address"] == reply.pattern
    assert {"responseTopic", "correlationData"} <= set(request_binding)
    assert set(reply_binding) == {"correlationData", "bindingVersion"}


def test_the_brokers_name_each_tiers_last_will_and_the_edges_persistent_session() -> None:
    hub, devices = (DOC["servers"][s]["bindings"]["mqtt"] for s in (HUB_BROKER, DEVICES_BROKER))
    assert (hub["lastWill"]["topic"], hub["lastWill"]["retain"]) == (NODE_STATE.pattern, True)
    assert (devices["lastWill"]["topic"], devices["lastWill"]["retain"]) == (DEVICE_STATE.pattern, True)
    assert devices["sessionExpiryInterval"]["default"] == 3600
    assert DOC["components"]["securitySchemes"]["certificate"]["type"] == "X509"


def test_binary_frames_are_bytes_with_their_user_properties_as_headers() -> None:
    for topic in (t for t in TOPICS if t.binary):
        message = _message(topic)
        assert message["payload"]["format"] == "binary"
        headers = _resolve(message["headers"]["$ref"])
        assert set(headers["properties"]) == set(topic.payload.model_fields)
        assert all(p["type"] == "string" for p in headers["properties"].values())


# ---- the payload schemas against real messages --------------------------------------------------------


def _validator(topic: Topic[Any]) -> Any:
    """A draft 7 validator (AsyncAPI's Schema Object) of the topic's payload, or its headers for a binary frame."""
    jsonschema_rs = pytest.importorskip("jsonschema_rs", reason="no JSON Schema validator in this environment")
    message = _message(topic)
    root = {
        **(message["headers"] if topic.binary else message["payload"]),
        "components": {"schemas": DOC["components"]["schemas"]},
    }
    return jsonschema_rs.Draft7Validator(root)


def test_every_payload_of_the_table_has_a_sample() -> None:
    payloads = {t.payload if t.binary else t.payload.model_fields["body"].annotation for t in TOPICS}
    assert payloads == set(SAMPLES)


@pytest.mark.parametrize("topic", TOPICS, ids=[t.pattern for t in TOPICS])
def test_the_channels_schema_takes_a_real_message(topic: Topic[Any]) -> None:
    # Prepare
    sample = _sample(topic)

    # Execute
    errors = [str(e) for e in _validator(topic).iter_errors(sample)]

    # Assert
    assert errors == []


def _bad(topic: Topic[Any], change: Any) -> dict[str, Any]:
    sample = _sample(topic)
    change(sample)
    return sample


BAD: list[tuple[Topic[Any], str, Any]] = [
    (NODE_STATE, "an unknown envelope field", lambda m: m.update(extra=1)),
    (NODE_STATE, "no src", lambda m: m.pop("src")),
    (NODE_STATE, "protocol version 2", lambda m: m.update(v=2)),
    (NODE_STATE, "a state that is not one", lambda m: m["body"].update(state="sleeping")),
    (
        next(t for t in TOPICS if t.payload.__name__ == "Envelope[HeartbeatBody]"),
        "a negative seq",
        lambda m: m["body"].update(seq=-1),
    ),
    (
        next(t for t in TOPICS if t.payload.__name__ == "Envelope[HeartbeatBody]"),
        "an unknown reading",
        lambda m: m["body"]["resources"]["cpu"].update(temp=80),
    ),
    (
        next(t for t in TOPICS if t.payload.__name__ == "Envelope[DesiredBody]"),
        "a chunk range that is not two integers",
        lambda m: m["body"]["tasks"][0].update(chunks=[[0, "x"]]),
    ),
    (
        next(t for t in TOPICS if t.payload.__name__ == "Envelope[EventsAckBody]"),
        "an ack without seq",
        lambda m: m["body"].pop("seq"),
    ),
]


@pytest.mark.parametrize(("topic", "what", "change"), BAD, ids=[what for _, what, _ in BAD])
def test_the_schema_refuses_what_the_models_refuse(topic: Topic[Any], what: str, change: Any) -> None:
    # Prepare
    bad = _bad(topic, change)

    # Execute + Assert: the receivers' models and the document agree
    with pytest.raises(ValidationError):
        topic.payload.model_validate_json(json.dumps(bad))
    assert not _validator(topic).is_valid(bad), what


def test_the_schema_fixes_kind_to_the_body_and_requires_the_user_properties() -> None:
    # Prepare
    state = _sample(NODE_STATE)
    request = next(t for t in TOPICS if t.payload is InferRequest)
    properties = _sample(request)

    # Execute + Assert: a state envelope of another kind, a request without its task, an unknown kind of request
    assert not _validator(NODE_STATE).is_valid({**state, "kind": "heartbeat"})
    assert not _validator(request).is_valid({k: v for k, v in properties.items() if k != "task_id"})
    assert not _validator(request).is_valid({**properties, "kind": "train"})
    assert _validator(request).is_valid({**properties, "traceparent": "00-ab-cd-01"})  # someone else's property


# ---- the guide beside it ------------------------------------------------------------------------------


def test_the_guides_topic_tables_are_the_topic_table() -> None:
    # Prepare: the rows of interfaces/AGENTS.md that name a topic
    rows = [
        [c.strip() for c in line.strip("|").split("|")]
        for line in (ROOT / "AGENTS.md").read_text().splitlines()
        if line.startswith("| `synergy/")
    ]
    guide = {topic.strip("`"): (you, int(qos), retain) for topic, you, qos, retain, *_ in rows}

    # Execute
    table = {
        t.pattern: (
            "publish" if t.direction in (Direction.EDGE_TO_HUB, Direction.DEVICE_TO_EDGE) else "subscribe",
            t.qos,
            "yes" if t.retain else "no",
        )
        for t in TOPICS
    }

    # Assert: every topic once, who publishes, QoS and retain as the code has them
    assert len(rows) == len(guide)
    assert guide == table
