"""The edge's side of the devices' store-and-forward (see :mod:`edge.relay`): a device's events are stored once
and in order, acknowledged on ``events/ack`` with the highest seq stored, and a hole asks for a resend; the
stored seq outlives the edge process. A raw MQTT peer plays the device, so every message is the test's own."""

from __future__ import annotations

import contextlib
import sqlite3
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from interfaces.messages import DesiredBody, EventBody, envelope
from interfaces.topics import (
    DEVICE_DESIRED,
    DEVICE_EVENTS,
    DEVICE_EVENTS_ACK,
    RELAY_DESIRED,
    RELAY_EVENTS,
    Tier,
    own_subtree,
)
from tests.edge.support import (
    Mosquitto,
    Peer,
    Pki,
    body,
    edge_acl,
    enrol_node,
    needs_mosquitto,
    start_edge,
    stop_edge,
    wait_until,
)

pytestmark = [pytest.mark.broker, needs_mosquitto]

NODE, DEVICE = "nd-acks", "dev-acks"
PATIENCE_S = 30.0  # generous: the machine may be busy


def device_event(n: int, seq: int | None, prev_seq: int | None = None) -> bytes:
    """The device's event number ``n`` (``data.n``, also without a seq)."""
    event = EventBody(seq=seq, prev_seq=prev_seq, type="progress", data={"n": n})
    return envelope(DEVICE, event).model_dump_json().encode()


@dataclass
class Relay:
    """Hub, edge and device around two real brokers; the device is a paho peer that sends what it is told."""

    node_dir: Path
    options: tuple[str, ...]
    hub: Peer
    device: Peer
    edge: subprocess.Popen[bytes]

    def send(self, payload: bytes) -> None:
        self.device.publish(DEVICE_EVENTS.topic(device_id=DEVICE), payload)

    def ack(self, where: Callable[[dict], bool] = lambda ack: True) -> dict:
        """The oldest acknowledgement not taken yet that satisfies ``where``, waiting for it if need be."""
        topic = DEVICE_EVENTS_ACK.topic(device_id=DEVICE)
        return body(self.device.expect(topic, PATIENCE_S, where=lambda m: where(body(m))))

    def acks(self) -> list[dict]:
        """Every acknowledgement that arrives until none has for a moment."""
        return [body(m) for m in self.device.drain(DEVICE_EVENTS_ACK.topic(device_id=DEVICE), quiet_s=0.3)]

    def relayed_until(self, n: int) -> list[int]:
        """The ``data.n`` of each event the hub receives, in order, up to and including event ``n``."""
        topic = RELAY_EVENTS.topic(node_id=NODE, device_id=DEVICE)
        seen: list[int] = []
        while not seen or seen[-1] != n:
            seen.append(body(self.hub.expect(topic, PATIENCE_S))["data"]["n"])
        return seen

    def stored_seq(self) -> int | None:
        with contextlib.closing(sqlite3.connect(self.node_dir / "edge.db")) as db:
            row = db.execute("SELECT seq FROM device_seq WHERE device_id = ?", (DEVICE,)).fetchone()
        return None if row is None else int(row[0])

    def outbox_rows(self) -> int:
        with contextlib.closing(sqlite3.connect(self.node_dir / "edge.db")) as db:
            return int(db.execute("SELECT COUNT(*) FROM outbox").fetchone()[0])

    def restart_edge(self) -> None:
        # every PUBACK is in first: a row the hub's broker took without acknowledging it would rightly go again
        wait_until(lambda: self.outbox_rows() == 0, PATIENCE_S, what="an empty outbox")
        assert stop_edge(self.edge) == 0
        self.edge = start_edge(self.node_dir, NODE, *self.options)
        # the edge publishes its stored desired documents after each downstream connect: it is back
        self.device.expect(DEVICE_DESIRED.topic(device_id=DEVICE), PATIENCE_S)


@pytest.fixture
def relay(tmp_path: Path, pki: Pki, cleanup: list[Callable[[], object]]) -> Iterator[Relay]:
    up = Mosquitto(tmp_path / "upstream", pki, edge_acl(NODE, [DEVICE]), persistent=True).start()
    down = Mosquitto(tmp_path / "downstream", pki, edge_acl(NODE, [DEVICE])).start()
    cleanup += [up.stop, down.stop]
    hub = Peer(up, pki, "hub", [own_subtree(Tier.NODE, NODE)], session_expiry_s=600)
    topics = [DEVICE_DESIRED.topic(device_id=DEVICE), DEVICE_EVENTS_ACK.topic(device_id=DEVICE)]
    device = Peer(down, pki, DEVICE, topics)
    cleanup += [hub.close, device.close]
    desired = envelope("hub", DesiredBody(version=1, spec={})).model_dump_json().encode()
    hub.publish(RELAY_DESIRED.topic(node_id=NODE, device_id=DEVICE), desired, retain=True)
    node_dir = enrol_node(tmp_path / "node", pki.ca, NODE, up.url).data_dir
    options = ("--downstream-mqtt-url", down.url, "--device-listen", "off")
    state = Relay(node_dir, options, hub, device, start_edge(node_dir, NODE, *options))
    cleanup.append(lambda: stop_edge(state.edge))
    device.expect(DEVICE_DESIRED.topic(device_id=DEVICE), PATIENCE_S)  # the edge is up on both links
    yield state


def test_stored_events_are_acknowledged_with_the_highest_seq_stored(relay: Relay) -> None:
    for seq in range(3):
        relay.send(device_event(seq, seq, seq - 1 if seq else None))

    last = relay.ack(lambda ack: ack["seq"] == 2)
    stored_when_acknowledged = relay.stored_seq()
    relayed = relay.relayed_until(2)

    assert last == {"seq": 2, "resend": False}
    assert stored_when_acknowledged == 2  # acknowledged after the commit, never before
    assert relayed == [0, 1, 2]
    assert all(ack["seq"] == 2 and not ack["resend"] for ack in relay.acks())


def test_a_duplicate_is_not_relayed_again_and_is_acknowledged_again(relay: Relay) -> None:
    # Prepare: events 0 and 1 stored and acknowledged
    relay.send(device_event(0, 0))
    relay.send(device_event(1, 1, 0))
    relay.ack(lambda ack: ack["seq"] == 1)
    relay.acks()

    # Execute: event 1 again (its acknowledgement was lost, say), then the next one
    relay.send(device_event(1, 1, 0))
    again = relay.ack()
    relay.send(device_event(2, 2, 1))

    # Assert: the hub gets event 1 once
    assert again == {"seq": 1, "resend": False}
    assert relay.relayed_until(2) == [0, 1, 2]
    relay.ack(lambda ack: ack["seq"] == 2)


def test_an_event_after_a_hole_is_not_relayed_and_asks_for_a_resend(relay: Relay) -> None:
    # Prepare: event 0 stored
    relay.send(device_event(0, 0))
    relay.ack(lambda ack: ack["seq"] == 0)

    # Execute: event 2 arrives, naming 1 as its predecessor, which the edge never got; then the device resends
    relay.send(device_event(2, 2, 1))
    asked = relay.ack(lambda ack: ack["resend"])
    relay.send(device_event(1, 1, 0))
    relay.send(device_event(2, 2, 1))

    # Assert: the resend request names what is stored; the hub gets 1 and 2 once, in order, and nothing early
    assert asked == {"seq": 0, "resend": True}
    assert relay.relayed_until(2) == [0, 1, 2]
    assert relay.ack(lambda ack: ack["seq"] == 2)["resend"] is False
    assert relay.stored_seq() == 2


def test_events_without_seq_are_relayed_as_before(relay: Relay) -> None:
    relay.send(device_event(0, None))
    relay.send(device_event(1, 0))
    relay.send(device_event(2, None))
    relay.send(device_event(3, 1, 0))

    assert relay.relayed_until(3) == [0, 1, 2, 3]
    assert relay.ack(lambda ack: ack["seq"] == 1)["resend"] is False
    assert relay.stored_seq() == 1


def test_the_stored_seq_survives_an_edge_restart(relay: Relay) -> None:
    # Prepare: events 0 and 1 stored, relayed and acknowledged
    relay.send(device_event(0, 0))
    relay.send(device_event(1, 1, 0))
    relay.ack(lambda ack: ack["seq"] == 1)
    assert relay.relayed_until(1) == [0, 1]

    # Execute: a new edge process; the device sends event 1 again, then the next one, then one after a hole
    relay.restart_edge()
    relay.device.drain(DEVICE_EVENTS_ACK.topic(device_id=DEVICE), quiet_s=0.3)
    relay.send(device_event(1, 1, 0))
    again = relay.ack()
    relay.send(device_event(2, 2, 1))
    relay.ack(lambda ack: ack["seq"] == 2)
    relay.send(device_event(4, 4, 3))
    asked = relay.ack(lambda ack: ack["resend"])

    # Assert: the duplicate is still dropped, the next one goes, the hole is still seen
    assert again == {"seq": 1, "resend": False}
    assert relay.relayed_until(2) == [2]
    assert asked == {"seq": 2, "resend": True}
    relay.send(device_event(3, 3, 2))
    relay.send(device_event(4, 4, 3))
    assert relay.relayed_until(4) == [3, 4]
    relay.ack(lambda ack: ack["seq"] == 4)


def test_the_last_event_of_every_burst_is_acknowledged(relay: Relay) -> None:
    # Prepare: bursts whose commits overlap the acknowledgements of the previous ones
    topic, seq = DEVICE_EVENTS.topic(device_id=DEVICE), 0
    acknowledged = []

    # Execute: each burst in flight at once, as a device's sender publishes it
    for _ in range(10):
        sent = []
        for _ in range(40):
            sent.append(relay.device.client.publish(topic, device_event(seq, seq, seq - 1 if seq else None), qos=1))
            seq += 1
            time.sleep(0.002)  # a stream, not one packet
        for info in sent:
            info.wait_for_publish(PATIENCE_S)
        last = seq - 1
        # Assert: the burst's last event is acknowledged without the device sending anything again
        acknowledged.append(relay.ack(lambda ack, last=last: ack["seq"] == last)["seq"])

    assert acknowledged == [40 * (burst + 1) - 1 for burst in range(10)]
    assert relay.relayed_until(seq - 1) == list(range(seq))
