"""The generated contract artefacts committed under ``interfaces/``, and the check that they match the code.

- ``interfaces/openapi.json``: the hub's OpenAPI document;
- ``interfaces/schemas/<channel>.json``: the JSON Schema of every MQTT payload in the topic table, one per channel, naming
  its topics at every tier;
- ``interfaces/schemas/events/<type>.json``: the JSON Schema of ``EventBody.data`` of each event type the hub acts on;
- ``interfaces/TOPICS.md``: the topic table;
- ``interfaces/asyncapi.json``: the AsyncAPI 3.0 document of the MQTT protocol (``interfaces.asyncapi``).
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import TypeAdapter

import interfaces
from interfaces.asyncapi import asyncapi_document
from interfaces.messages import EVENT_DATA, ActedEvent
from interfaces.topics import TOPICS, Topic, topic_table_markdown

ROOT = Path(interfaces.__file__).parent


def _dump(data: object) -> str:
    return json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def channel_topics() -> dict[str, list[Topic]]:
    """The topics of each schema file, by its name: one channel at every tier it exists at (node, device, relayed)."""
    channels: dict[str, list[Topic]] = {}
    for topic in TOPICS:
        # the channel ("cmd-reply"), or the topic below the prefix for topics without ids ("hub-state")
        name = (topic.pattern.rsplit("}/", 1)[1] if "}/" in topic.pattern else topic.pattern.split("/", 2)[2]).replace("/", "-")
        channels.setdefault(name, []).append(topic)
    for name, topics in channels.items():
        if len({t.payload for t in topics}) != 1:
            raise ValueError(f"the topics of channel {name!r} carry different payloads: one schema cannot describe them")
    return channels


def describe_channel(topics: list[Topic]) -> str:
    """The schema's description: each topic that carries the payload, its direction, QoS, retain flag and purpose."""
    return "; ".join(f"{t.pattern} ({t.direction}, QoS {t.qos}, retain {str(t.retain).lower()}): {t.description}" for t in topics)


def render() -> dict[Path, str]:
    from cloud.api.app import create_app
    from cloud.config import Settings

    app = create_app(Settings(enable_mqtt=False, data_dir=Path("/nonexistent")))
    files: dict[Path, str] = {ROOT / "openapi.json": _dump(app.openapi()), ROOT / "TOPICS.md": topic_table_markdown()}
    files[ROOT / "asyncapi.json"] = _dump(asyncapi_document())
    for name, topics in channel_topics().items():
        schema = topics[0].payload.model_json_schema()
        schema["$id"] = f"urn:aisynergy:schema:{name}"
        schema["description"] = describe_channel(topics)
        files[ROOT / "schemas" / f"{name}.json"] = _dump(schema)
    acted = TypeAdapter(ActedEvent).json_schema()
    acted["$id"] = "urn:aisynergy:schema:events:acted"
    acted["title"] = "ActedEvent"
    acted["description"] = (
        "EventBody of the event types the hub acts on, one variant per type (told apart by type); an event of any other "
        "type is an EventBody as events.json has it, stored as it came"
    )
    files[ROOT / "schemas" / "events" / "acted.json"] = _dump(acted)
    for event_type, model in EVENT_DATA.items():
        schema = model.model_json_schema()
        schema["$id"] = f"urn:aisynergy:schema:events:{event_type}"
        schema["description"] = f"EventBody.data of an event of type {event_type!r}: {(model.__doc__ or model.__name__).strip().splitlines()[0]}"
        files[ROOT / "schemas" / "events" / f"{event_type}.json"] = _dump(schema)
    return files


def write() -> list[Path]:
    written = []
    for path, content in render().items():
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text() != content:
            path.write_text(content)
            written.append(path)
    return written


def drift() -> list[Path]:
    """Paths whose committed content differs from what the code generates now."""
    return [p for p, content in render().items() if not p.exists() or p.read_text() != content]
