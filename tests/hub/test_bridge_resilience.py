"""The hub's broker link outlives any error of one connection attempt: it logs it and connects again."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from cloud import bridge as bridge_module
from cloud.bridge import MqttBridge
from tests.hub.conftest import HubUnderTest


def test_an_unexpected_error_on_a_connection_attempt_does_not_end_the_bridge(hub: HubUnderTest, tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    # Prepare: building the TLS context fails with an error no connection error handler expects, twice
    calls: list[int] = []

    def failing(pki_dir: Path, identity: str) -> object:
        calls.append(1)
        raise RuntimeError("not a connection error")

    monkeypatch.setattr(bridge_module, "tls_context", failing)
    monkeypatch.setattr(bridge_module, "reconnect_delay", lambda attempt, cap: 0.01)
    bridge = MqttBridge("mqtts://127.0.0.1:1", tmp_path, "hub-test", hub.state.ingest)

    async def scenario() -> bool:
        task = asyncio.create_task(bridge.run())
        deadline = asyncio.get_running_loop().time() + 60
        def counted() -> bool:
            return len(calls) >= 3 and bridge.counters["unexpected_errors"] >= 3 and bridge.counters["connection_errors"] >= 3

        while not counted() and not task.done() and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        alive = not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return alive

    # Execute
    alive = asyncio.run(scenario())

    # Assert: it kept trying, counted the errors and never reported itself connected
    assert alive
    assert len(calls) >= 3
    assert bridge.counters["unexpected_errors"] >= 3
    assert bridge.counters["connection_errors"] >= 3
    assert not bridge.connected.is_set()
