"""The hub's incoming MQTT queue is bounded in bytes; what it cannot hold is never lost (QoS 1 comes again)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import aiomqtt
import pytest

from cloud import bridge as bridge_module
from cloud.bridge import INCOMING_QUEUE_BYTES, MESSAGE_COST_BYTES, IncomingOverflow, IncomingQueue, MqttBridge


def _message(n: int, qos: int, size: int = 3000) -> aiomqtt.Message:
    return aiomqtt.Message(f"synergy/v1/nodes/n{n}/events", bytes(size), qos=qos, retain=False, mid=n + 1, properties=None)


def test_the_incoming_queue_is_bounded_by_bytes_and_counts_what_it_drops() -> None:
    # Prepare: room for three messages of 3,000 bytes (each costs 3,000 + MESSAGE_COST_BYTES)
    queue = IncomingQueue(max_bytes=3 * (3000 + MESSAGE_COST_BYTES))

    # Execute: five arrive, the last two of QoS 0 and QoS 1
    for n, qos in enumerate([1, 1, 1, 0, 1]):
        queue.put_nowait(_message(n, qos))

    # Assert: three held, the QoS 0 one dropped, the QoS 1 one left for the broker to send again
    assert queue.qsize() == 3
    assert queue.bytes == 3 * (3000 + MESSAGE_COST_BYTES)
    assert (queue.dropped, queue.left_unacknowledged) == (1, 1)
    assert [queue.get_nowait().mid for _ in range(3)] == [1, 2, 3]
    assert queue.bytes == 0
    assert 64 * 1024 * 1024 <= INCOMING_QUEUE_BYTES <= 256 * 1024 * 1024


def test_the_bridges_client_uses_the_bounded_queue(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: a client that records how it was made and fails to connect
    made: list[dict[str, object]] = []

    class Recorder:
        def __init__(self, *args: object, **kwargs: object) -> None:
            made.append(kwargs)
            raise aiomqtt.MqttError("no broker here")

    monkeypatch.setattr(bridge_module.aiomqtt, "Client", Recorder)
    monkeypatch.setattr(bridge_module, "reconnect_delay", lambda attempt, cap: 0.01)
    bridge = MqttBridge("mqtt://127.0.0.1:1", tmp_path, "hub-test", SimpleNamespace())  # type: ignore[arg-type]

    async def scenario() -> None:
        task = asyncio.create_task(bridge.run())
        deadline = asyncio.get_running_loop().time() + 60
        while not made and not task.done() and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    # Execute
    asyncio.run(scenario())

    # Assert: the queue is the byte-bounded one, with no count bound of its own
    assert made and made[0]["queue_type"] is IncomingQueue
    assert not made[0].get("max_queued_incoming_messages")


def test_a_full_queue_ends_the_connection_once_what_it_holds_is_dispatched(tmp_path: Path) -> None:
    # Prepare: a connection whose queue held two messages and had to leave a QoS 1 one unacknowledged
    queue = IncomingQueue(max_bytes=2 * (3000 + MESSAGE_COST_BYTES))
    for n in range(3):
        queue.put_nowait(_message(n, 1))
    assert queue.left_unacknowledged == 1

    class Messages:
        def __aiter__(self) -> Messages:
            return self

        async def __anext__(self) -> aiomqtt.Message:
            return await queue.get()

    client = SimpleNamespace(_queue=queue, messages=Messages())
    bridge = MqttBridge("mqtt://127.0.0.1:1", tmp_path, "hub-test", SimpleNamespace())  # type: ignore[arg-type]
    dispatched: list[int] = []
    bridge.dispatch = lambda topic, payload, properties, ack: dispatched.append(ack[1])  # type: ignore[method-assign]

    # Execute / Assert: what was held is dispatched, then the connection ends so that the broker sends the rest again
    with pytest.raises(IncomingOverflow, match="1 QoS 1 messages left unacknowledged"):
        asyncio.run(bridge._consume(client))  # type: ignore[arg-type]  # noqa: SLF001
    assert dispatched == [1, 2]
    assert bridge.counters["incoming_left_unacknowledged"] == 1
