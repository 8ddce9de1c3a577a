"""The edge's link (the asyncio face of the session core): a publish waiting for a PUBACK that cannot come."""

from __future__ import annotations

import asyncio
import os
import signal
import ssl
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from device.session import SessionPlan
from edge.link import Link, NotConnected
from tests.edge.support import Mosquitto, Pki, edge_acl

NODE = "nd-link1"


def test_a_publish_whose_session_ends_answers_not_connected_at_once(tmp_path: Path, pki: Pki,
                                                                    cleanup: list[Callable[[], object]]) -> None:  # fmt: skip
    # Prepare: a link to a real broker, with a 1 s keepalive so that a silent broker is noticed fast
    broker = Mosquitto(tmp_path / "broker", pki, edge_acl(NODE, [])).start()
    cleanup.append(broker.stop)
    crt, key = pki.identity(NODE)
    tls = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(pki.ca_path))
    tls.load_cert_chain(str(crt), str(key))
    link = Link("upstream", broker.url, tls, SessionPlan(NODE, keepalive_s=1, connect_timeout_s=5))

    async def scenario() -> tuple[float, BaseException | None]:
        stop = asyncio.Event()
        running = asyncio.create_task(link.run(stop))
        await asyncio.wait_for(link.connected.wait(), 60)
        await link.publish(f"synergy/v1/nodes/{NODE}/events", b"{}", qos=1)  # a PUBACK comes
        assert broker.process is not None
        os.kill(broker.process.pid, signal.SIGSTOP)  # the broker stops answering, the TCP connection stays
        cleanup.append(lambda: os.kill(broker.process.pid, signal.SIGCONT))  # type: ignore[union-attr]
        started, failure = time.monotonic(), None
        try:
            await asyncio.wait_for(link.publish(f"synergy/v1/nodes/{NODE}/events", b"{}", qos=1), 60)
        except (NotConnected, TimeoutError) as exc:
            failure = exc
        took = time.monotonic() - started
        stop.set()
        os.kill(broker.process.pid, signal.SIGCONT)
        await asyncio.wait_for(running, 30)
        return took, failure

    # Execute
    took, failure = asyncio.run(scenario())

    # Assert: the keepalive ends the session and the waiting publish is told so, not left to its 120 s timeout
    assert isinstance(failure, NotConnected), failure
    assert took < 30, took


@pytest.mark.parametrize("qos", [0, 1])
def test_a_publish_without_a_session_is_refused(tmp_path: Path, pki: Pki, qos: int) -> None:
    crt, key = pki.identity(NODE)
    tls = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(pki.ca_path))
    tls.load_cert_chain(str(crt), str(key))
    link = Link("upstream", "mqtts://127.0.0.1:1", tls, SessionPlan(NODE))

    with pytest.raises(NotConnected):
        asyncio.run(link.publish(f"synergy/v1/nodes/{NODE}/events", b"{}", qos=qos))
    assert link.publish_nowait(f"synergy/v1/nodes/{NODE}/events", b"{}") is False
