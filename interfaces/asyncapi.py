"""The AsyncAPI 3.0 document of the MQTT protocol, as committed in ``interfaces/asyncapi.json``.

Built from the topic table (:data:`interfaces.topics.TOPICS`) and the payload models, so it cannot say
anything the code does not: one channel per topic (address = the pattern, parameters ``node_id`` and
``device_id``), one message per payload (the envelope with its typed body, ``kind`` fixed to the body's;
a binary ``infer`` frame as bytes with its MQTT 5 user properties as headers), one operation per topic
from the point of view of the agent on that topic (an edge node on ``nodes/...`` and ``hub/state``, a
device on ``devices/...``), with QoS and retain as MQTT bindings. The MQTT 5 properties the protocol
relies on are bindings too: response topic and correlation data on requests, correlation data on
answers, message expiry on commands an edge relays to a device, the last will and the session expiry of
each broker's clients. ``interfaces/AGENTS.md`` is the prose beside it.

JSON Schemas come from pydantic, with every ``$ref`` pointing into ``components/schemas`` and tuples
written as draft 7 ``items`` arrays (an AsyncAPI Schema Object is a superset of JSON Schema draft 7).
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from interfaces import PROTOCOL_VERSION
from interfaces.infer import MAX_CORRELATION_BYTES
from interfaces.messages import HUB_SRC, MAX_MESSAGE_BYTES
from interfaces.topics import DEVICE_CMD, DEVICE_STATE, NODE_STATE, PREFIX, SHARE_GROUP, TOPICS, Direction, Topic

ASYNCAPI_VERSION = "3.0.0"
MQTT_BINDING = "0.2.0"
HUB_BROKER = "hub-broker"
DEVICES_BROKER = "devices-broker"
EDGE, DEVICE = "edge", "device"
KEEPALIVE_S = 30
EDGE_DOWNSTREAM_SESSION_EXPIRY_S = 3600
_SCHEMAS = "#/components/schemas/"

_AGENT = {
    Direction.EDGE_TO_HUB: EDGE,
    Direction.HUB_TO_EDGE: EDGE,
    Direction.DEVICE_TO_EDGE: DEVICE,
    Direction.EDGE_TO_DEVICE: DEVICE,
}
_SENDS = {Direction.EDGE_TO_HUB, Direction.DEVICE_TO_EDGE}  # the agent of the tier publishes
_PUBLISHER = {
    Direction.EDGE_TO_HUB: "the edge",
    Direction.HUB_TO_EDGE: "the hub",
    Direction.DEVICE_TO_EDGE: "the device",
    Direction.EDGE_TO_DEVICE: "its edge",
}
_SUBSCRIBER = {
    Direction.EDGE_TO_HUB: "the hub",
    Direction.HUB_TO_EDGE: "the edge",
    Direction.DEVICE_TO_EDGE: "its edge",
    Direction.EDGE_TO_DEVICE: "the device",
}

_PARAMETERS = {
    "node_id": {
        "description": "the edge node's id as the hub assigned it (POST /api/v1/nodes); the CN of its certificate "
        "and its MQTT client id. One topic level: no '/', '+' or '#', at most 64 characters.",
        "examples": ["n-01jb2x6v3k9m8q7r5t4w2y1z0a"],
    },
    "device_id": {
        "description": "the device's id as the hub assigned it (POST /api/v1/devices); the CN of its certificate "
        "and its MQTT client id. One topic level: no '/', '+' or '#', at most 64 characters.",
        "examples": ["d-01jb2x7c4n1p2q3r4s5t6v7w8x"],
    },
}

_CORRELATION = {
    "type": "string",
    "format": "binary",
    "minLength": 1,
    "maxLength": MAX_CORRELATION_BYTES,
    "description": "MQTT 5 correlation data: opaque bytes chosen by the requester; the answer carries them back "
    "unchanged",
}
_MESSAGE_EXPIRY = {
    DEVICE_CMD.pattern: {
        "type": "integer",
        "minimum": 1,
        "description": "set by the edge on every command it relays to a device: the seconds left of the command's "
        "timeout_s, so that the broker drops a command that would run after its requester gave up",
    },
}


def _draft7(schema: Any) -> Any:
    """Pydantic's draft 2020-12 ``prefixItems`` (tuples) as draft 7 ``items`` arrays; everything else as it is."""
    if isinstance(schema, dict):
        out = {k: _draft7(v) for k, v in schema.items() if k != "prefixItems"}
        if "prefixItems" in schema:
            out["items"] = _draft7(schema["prefixItems"])
            out["additionalItems"] = False
        return out
    if isinstance(schema, list):
        return [_draft7(item) for item in schema]
    return schema


def _as_text(prop: dict[str, Any]) -> dict[str, Any]:
    """A user property's schema: MQTT 5 user properties are strings, whatever the model field's type."""
    branches = [b for b in prop.get("anyOf", [prop]) if b.get("type") != "null"]
    typed = branches[0] if branches else {}
    out: dict[str, Any] = {"type": "string"}
    if "const" in typed:
        out["enum"] = [str(typed["const"])]
    elif "enum" in typed:
        out["enum"] = [str(v) for v in typed["enum"]]
    elif typed.get("type") in ("number", "integer"):
        out["pattern"] = r"^-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?$"
    for key in ("minLength", "maxLength"):
        if key in typed:
            out[key] = typed[key]
    if prop.get("default") is not None:
        out["default"] = str(prop["default"])
    if prop.get("description"):
        out["description"] = prop["description"]
    if typed.get("type") in ("number", "integer"):
        out["description"] = f"{out.get('description', 'a number')} (a number, written as text)"
    return out


def _summary(model: type[BaseModel], default: str = "") -> str:
    """The first line of the model's docstring, in CommonMark."""
    return ((model.__doc__ or "").strip().splitlines() or [default])[0].replace("``", "`")


def _user_properties(model: type[BaseModel]) -> dict[str, Any]:
    schema = model.model_json_schema()
    return {
        "type": "object",
        "title": f"{model.__name__} (MQTT 5 user properties)",
        "description": f"{_summary(model)} Name/value string pairs; the first of a repeated name counts, names not "
        "listed here are ignored.",
        "properties": {name: _as_text(prop) for name, prop in schema["properties"].items()},
        "required": sorted(schema.get("required", [])),
        "additionalProperties": {"type": "string"},
    }


def _channel_id(topic: Topic[Any]) -> str:
    """``synergy/v1/nodes/{node_id}/cmd/reply`` -> ``nodes-cmd-reply``; relayed: ``nodes-devices-cmd-reply``."""
    levels = topic.pattern[len(PREFIX) + 1 :].split("/")
    return "-".join(level for level in levels if not level.startswith("{"))


def _body(topic: Topic[Any]) -> type[BaseModel]:
    body: type[BaseModel] = topic.payload.model_fields["body"].annotation
    return body


def _channel(topic: Topic[Any]) -> str:
    """The channel below the ids: ``cmd/reply``; ``hub/state`` for the topic without ids."""
    return topic.pattern.rsplit("}/", 1)[1] if topic.placeholders else topic.pattern[len(PREFIX) + 1 :]


def _message_id(topic: Topic[Any]) -> str:
    """An envelope's is its body's ``kind`` (``state``, ``events.ack``), a frame's its channel (``infer.reply``)."""
    if topic.binary:
        return _channel(topic).replace("/", ".")
    kind: str = _body(topic).KIND  # type: ignore[attr-defined]
    return kind


def _reply_topic(topic: Topic[Any]) -> Topic[Any] | None:
    """The answers' topic of a request topic (``cmd`` -> ``cmd/reply``, ``infer`` -> ``infer/reply``)."""
    return next((t for t in TOPICS if t.pattern == f"{topic.pattern}/reply"), None)


def _is_reply(topic: Topic[Any]) -> bool:
    return topic.pattern.endswith("/reply")


def _message(topic: Topic[Any], schema_ref: dict[str, str]) -> dict[str, Any]:
    binding: dict[str, Any] = {}
    reply = _reply_topic(topic)
    if reply is not None:
        binding["responseTopic"] = {
            "type": "string",
            "minLength": 1,
            "description": f"MQTT 5 response topic, always set: where the answer goes (the {_channel(reply)} topic of "
            "the same subtree); answer there, with the request's correlation data",
        }
        binding["correlationData"] = _CORRELATION
    elif _is_reply(topic):
        binding["correlationData"] = {
            **_CORRELATION,
            "description": "MQTT 5 correlation data: the request's, copied unchanged",
        }
    if topic.binary:
        message: dict[str, Any] = {
            "name": _message_id(topic),
            "title": f"safetensors frame, user properties {topic.payload.__name__}",
            "summary": topic.description,
            "contentType": "application/octet-stream",
            "headers": {"$ref": f"{_SCHEMAS}{topic.payload.__name__}UserProperties"},
            "payload": {
                "type": "string",
                "format": "binary",
                "description": "a safetensors file (never pickle); may be empty, see the user properties",
            },
        }
    else:
        body = _body(topic)
        kind: str = body.KIND  # type: ignore[attr-defined]
        message = {
            "name": _message_id(topic),
            "title": f"Envelope[{body.__name__}]",
            "summary": _summary(body, topic.description),
            "contentType": "application/json",
            "payload": {"allOf": [schema_ref, {"properties": {"kind": {"const": kind}}}]},
        }
    if binding:
        message["bindings"] = {"mqtt": {**binding, "bindingVersion": MQTT_BINDING}}
    return message


def _operation(topic: Topic[Any], channel_id: str) -> dict[str, Any]:
    direction = topic.direction
    agent = _AGENT[direction]
    publisher = _PUBLISHER[direction]
    subscribers = "every edge (any identity may read it)" if not topic.placeholders else _SUBSCRIBER[direction]
    via = ""
    # the hub's reports come through shared subscriptions; answers are matched by correlation data in every replica
    if direction is Direction.EDGE_TO_HUB and not _is_reply(topic):
        via = f" through the shared subscription $share/{SHARE_GROUP}/{topic.filter()} (hub replicas split the load)"
    mqtt: dict[str, Any] = {"qos": topic.qos, "retain": topic.retain}
    if topic.pattern in _MESSAGE_EXPIRY:
        mqtt["messageExpiryInterval"] = _MESSAGE_EXPIRY[topic.pattern]
    operation: dict[str, Any] = {
        "action": "send" if direction in _SENDS else "receive",
        "channel": {"$ref": f"#/channels/{channel_id}"},
        "messages": [{"$ref": f"#/channels/{channel_id}/messages/{_message_id(topic)}"}],
        "summary": topic.description,
        "description": f"Published by {publisher} (QoS {topic.qos}{', retained' if topic.retain else ''}); "
        f"received by {subscribers}{via}.",
        "tags": [{"name": agent}],
        "bindings": {"mqtt": {**mqtt, "bindingVersion": MQTT_BINDING}},
    }
    reply = _reply_topic(topic)
    if reply is not None:
        reply_id = _channel_id(reply)
        operation["reply"] = {
            "channel": {"$ref": f"#/channels/{reply_id}"},
            "messages": [{"$ref": f"#/channels/{reply_id}/messages/{_message_id(reply)}"}],
        }
    return operation


def _will(topic: Topic[Any], who: str) -> dict[str, Any]:
    return {
        "topic": topic.pattern,
        "qos": topic.qos,
        "retain": topic.retain,
        "message": f'the state envelope from {who}: {{"v": {PROTOCOL_VERSION}, "src": "<{who}>", "kind": "state", '
        '"body": {"state": "offline", "reason": "will"}, ...}',
    }


def _servers() -> dict[str, Any]:
    tls = [{"$ref": "#/components/securitySchemes/certificate"}]
    variables = {
        "broker": {
            "description": "host:port of mqtt_url in the enrolment answer (mqtts://host:port)",
            "default": "localhost:8883",
        }
    }
    return {
        HUB_BROKER: {
            "host": "{broker}",
            "protocol": "secure-mqtt",
            "protocolVersion": "5",
            "title": "The hub's broker",
            "description": "Where the hub and the edge nodes meet. An edge connects with its own certificate (client "
            "id = CN = node id; a second connection with the same identity takes the first one over), MQTT 5, "
            f"keep-alive {KEEPALIVE_S} s, with its retained offline state as its last will. The hub uses a persistent "
            "session and acknowledges (PUBACK) a report only after its database commit.",
            "variables": variables,
            "security": tls,
            "bindings": {
                "mqtt": {
                    "keepAlive": KEEPALIVE_S,
                    "lastWill": _will(NODE_STATE, "node_id"),
                    "bindingVersion": MQTT_BINDING,
                }
            },
        },
        DEVICES_BROKER: {
            "host": "{broker}",
            "protocol": "secure-mqtt",
            "protocolVersion": "5",
            "title": "The devices' broker of an edge",
            "description": "Where an edge and its devices meet (the hub's broker, or one of the edge's own). A device "
            f"connects with its own certificate (client id = CN = device id), MQTT 5, keep-alive {KEEPALIVE_S} s, with "
            "its retained offline state as its last will; the broker delivers an edge only its own devices' topics.",
            "variables": variables,
            "security": tls,
            "bindings": {
                "mqtt": {
                    "keepAlive": KEEPALIVE_S,
                    "lastWill": _will(DEVICE_STATE, "device_id"),
                    "sessionExpiryInterval": {
                        "type": "integer",
                        "minimum": 0,
                        "default": EDGE_DOWNSTREAM_SESSION_EXPIRY_S,
                        "description": "the edge's link to a devices' broker of its own is a persistent session "
                        "(clean start off) with this expiry, so that the broker keeps its devices' messages while "
                        "the edge restarts",
                    },
                    "bindingVersion": MQTT_BINDING,
                }
            },
        },
    }


def asyncapi_document() -> dict[str, Any]:
    """The AsyncAPI 3.0 document of every topic in :data:`TOPICS` (what ``aisynergy contracts write`` commits)."""
    payloads = list(dict.fromkeys(t.payload for t in TOPICS if not t.binary))
    refs, definitions = models_json_schema([(m, "validation") for m in payloads], ref_template=_SCHEMAS + "{model}")
    schemas: dict[str, Any] = _draft7(definitions["$defs"])
    for model in (t.payload for t in TOPICS if t.binary):
        schemas[f"{model.__name__}UserProperties"] = _user_properties(model)
    messages: dict[str, Any] = {}
    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    for topic in TOPICS:
        channel_id, message_id = _channel_id(topic), _message_id(topic)
        messages.setdefault(message_id, _message(topic, {} if topic.binary else refs[(topic.payload, "validation")]))
        server = DEVICES_BROKER if _AGENT[topic.direction] == DEVICE else HUB_BROKER
        channels[channel_id] = {
            "address": topic.pattern,
            "title": channel_id,
            "description": f"{topic.description} ({topic.direction}).",
            "messages": {message_id: {"$ref": f"#/components/messages/{message_id}"}},
            "servers": [{"$ref": f"#/servers/{server}"}],
        }
        if topic.placeholders:
            channels[channel_id]["parameters"] = {
                p: {"$ref": f"#/components/parameters/{p}"} for p in topic.placeholders
            }
        operations[f"{channel_id}.{'send' if topic.direction in _SENDS else 'receive'}"] = _operation(topic, channel_id)
    document = {
        "asyncapi": ASYNCAPI_VERSION,
        "id": "urn:aisynergy:mqtt",
        "info": {
            "title": "AISynergy agent protocol (MQTT 5)",
            "version": f"{PROTOCOL_VERSION}.0.0",
            "description": "The MQTT side of the cloud-edge-device protocol, for agents written in any language. "
            "Operations are those of the agent on each channel: an edge node on nodes/... (its own subtree, and its "
            "devices' channels relayed under it) and hub/state, a device on devices/...; each says who publishes and "
            "who subscribes. Every JSON message is an envelope {v, id, ts, src, kind, body} with src the sender's own "
            f"id (or '{HUB_SRC}'), at most {MAX_MESSAGE_BYTES} bytes; a receiver drops, counts and reports a malformed "
            "one. Enrolment, commands and the rest of the life of an agent: interfaces/AGENTS.md. Generated from "
            "interfaces/topics.py (`aisynergy contracts write`); do not edit by hand.",
            "tags": [
                {"name": EDGE, "description": "operations of an edge node's agent"},
                {"name": DEVICE, "description": "operations of a device's agent"},
            ],
        },
        "defaultContentType": "application/json",
        "servers": _servers(),
        "channels": channels,
        "operations": operations,
        "components": {
            "schemas": schemas,
            "messages": messages,
            "parameters": _PARAMETERS,
            "securitySchemes": {
                "certificate": {
                    "type": "X509",
                    "description": "Mutual TLS with a certificate issued by the hub's CA from the agent's CSR (POST "
                    "/api/v1/nodes/{id}/certificate, or /devices/{id}/certificate through its edge); CN = the node "
                    "or device id, which the broker takes as username and client id. A revoked certificate is "
                    "refused at the handshake.",
                }
            },
        },
    }
    return copy.deepcopy(document)  # the caller's to change: nothing shared with this module's constants
