"""Devices behind an edge, end to end: twin, commands, isolation, and a cloud outage.

Real processes: the hub, two Mosquitto brokers (the hub's and the edge's devices'), the edge agent;
the devices run in the test process through the SDK's Device class.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.devstack import DevStack, start_devstack
from tests.support import Identity, MqttProbe, enrol, start_broker, start_hub, stop, wait_for


@pytest.fixture
def stack(tmp_path: Path, sqlite_url: str) -> Iterator[DevStack]:
    s = start_devstack(tmp_path, sqlite_url)
    try:
        yield s
    finally:
        s.close()


def _twin(stack: DevStack, device_id: str) -> dict:
    with stack.hub.client("viewer") as api:
        return api.get(f"/devices/{device_id}/twin").json()


def test_twin_change_is_reported_and_an_offline_device_converges(stack: DevStack) -> None:
    # Prepare: an online device that reports what it applied
    dev = stack.add_device("cam-1", on_desired=lambda spec: {"applied": spec})
    wait_for(lambda: stack.device_state(dev.device_id) == "ONLINE", 60, what="device ONLINE")

    # Execute: a desired change through REST
    with stack.hub.client("operator") as api:
        put = api.put(f"/devices/{dev.device_id}/twin", json={"desired": {"fps": 15}})
    assert put.status_code == 200, put.text
    version = put.json()["desired_version"]

    # Assert: reported back to the hub (how fast is bench/'s question, not a test's)
    twin = wait_for(lambda: (t := _twin(stack, dev.device_id))["reported_version"] == version and t, 60, interval=0.02, what="reported")
    assert twin["in_sync"] and twin["reported"] == {"applied": {"fps": 15}}

    # a device offline during the change converges when it returns
    dev.stop()
    wait_for(lambda: stack.device_state(dev.device_id) == "OFFLINE", 60, what="device OFFLINE")
    with stack.hub.client("operator") as api:
        version = api.put(f"/devices/{dev.device_id}/twin", json={"desired": {"fps": 30}}).json()["desired_version"]
    assert _twin(stack, dev.device_id)["in_sync"] is False
    stack.restart_device(dev, on_desired=lambda spec: {"applied": spec})
    twin = wait_for(lambda: (t := _twin(stack, dev.device_id))["reported_version"] == version and t, 60, what="offline device converges")
    assert twin["reported"] == {"applied": {"fps": 30}}


def test_command_round_trip_and_timeouts(stack: DevStack) -> None:
    # Prepare: a device with a fast and a slow command
    release = threading.Event()
    dev = stack.add_device("plc-1", handlers={
        "add": lambda args: {"sum": args["a"] + args["b"]},
        "slow": lambda args: (release.wait(10), {"done": True})[1],
    })  # fmt: skip
    wait_for(lambda: stack.device_state(dev.device_id) == "ONLINE", 60, what="device ONLINE")

    with stack.hub.client("operator") as api:
        # Execute / Assert: REST -> hub -> edge -> device -> back
        r = api.post(f"/devices/{dev.device_id}/commands", json={"name": "add", "args": {"a": 2, "b": 3}, "timeout_s": 30})
        assert r.status_code == 200, r.text
        assert r.json()["ok"] is True and r.json()["result"] == {"sum": 5}
        r = api.post(f"/devices/{dev.device_id}/commands", json={"name": "ping", "timeout_s": 30})
        assert r.json()["ok"] is True

        # an unknown command is an error answer, never silence
        r = api.post(f"/devices/{dev.device_id}/commands", json={"name": "self-destruct", "timeout_s": 30})
        assert r.status_code == 200 and r.json()["ok"] is False and r.json()["error_code"] == "unknown_command"

        # the device does not answer in time: a clear timeout error
        r = api.post(f"/devices/{dev.device_id}/commands", json={"name": "slow", "timeout_s": 1})
        assert r.status_code == 504 and r.json()["code"] == "command_timeout" and r.json()["title"] == "Gateway timeout", r.text
        release.set()

        # the node's own agent answers node commands
        r = api.post(f"/nodes/{stack.node_id}/commands", json={"name": "ping", "timeout_s": 30})
        assert r.status_code == 200 and r.json()["ok"] is True

        # a frozen edge: the hub's own timeout
        import signal

        stack.edge.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
        try:
            r = api.post(f"/devices/{dev.device_id}/commands", json={"name": "ping", "timeout_s": 1})
            assert r.status_code == 504 and r.json()["code"] == "command_timeout"
        finally:
            stack.edge.send_signal(signal.SIGCONT)  # type: ignore[union-attr]


def test_a_device_reaches_only_its_own_topics(stack: DevStack, tmp_path: Path) -> None:
    # Prepare: two devices with certificates (enrolled at the hub directly), and the edge's node topics
    from interfaces.topics import DEVICE_DESIRED, DEVICE_EVENTS, NODE_EVENTS, NODE_HEARTBEAT

    idents: list[Identity] = []
    with stack.hub.client("operator") as api:
        for name in ("dev-a", "dev-b"):
            device_id = api.post("/devices", json={"node_id": stack.node_id, "name": name, "model": "m"}).json()["id"]
            token = api.post(f"/devices/{device_id}/bootstrap-token", json={}).json()["bootstrap_token"]
            idents.append(enrol(stack.hub, device_id, token, tmp_path / name, kind="devices"))
    a, b = idents
    probe_a = MqttProbe(a, stack.downstream.port).connect()
    probe_b = MqttProbe(b, stack.downstream.port).connect()
    wait_for(lambda: probe_a.connected() and probe_b.connected(), 60, what="devices connected")
    # the broker takes up the new devices' access a moment after the device list changes: until each may publish on
    # its own topic, every refusal below would prove nothing
    for probe, ident in ((probe_a, a), (probe_b, b)):
        own = DEVICE_EVENTS.topic(device_id=ident.node_id)
        wait_for(lambda p=probe, t=own: p.publish(t, b"{}") in ("Success", "No matching subscribers"), 60, interval=0.3, what=f"{ident.node_id} may publish on its own topic")
    assert probe_b.subscribe(DEVICE_DESIRED.topic(device_id=b.node_id)) == ["Granted QoS 1"]

    # Execute: A subscribes to B's topics and to node topics, and tries to publish there
    probe_a.subscribe(f"synergy/v1/devices/{b.node_id}/#")
    probe_a.subscribe("synergy/v1/nodes/#")
    assert probe_b.publish(DEVICE_EVENTS.topic(device_id=b.node_id), b"{}") in ("Success", "No matching subscribers")
    refused = [
        probe_a.publish(DEVICE_EVENTS.topic(device_id=b.node_id), b"{}"),
        probe_a.publish(NODE_EVENTS.topic(node_id=stack.node_id), b"{}"),
        probe_a.publish(NODE_HEARTBEAT.topic(node_id=a.node_id), b"{}"),
    ]
    # traffic on B's topics that A would see if it could: B's desired document, sent down by the edge, reaches B
    with stack.hub.client("operator") as api:
        assert api.put(f"/devices/{b.node_id}/twin", json={"desired": {"secret": "b-only"}}).status_code == 200
    wait_for(lambda: any(e[0] == "message" and b"b-only" in e[1][1] for e in probe_b.events), 60, what="B's desired document at B")  # type: ignore[index]

    # Assert
    assert refused == ["Not authorized"] * 3
    assert [e for e in probe_a.events if e[0] == "message"] == []
    assert probe_a.publish(DEVICE_EVENTS.topic(device_id=a.node_id), b"{}") in ("Success", "No matching subscribers")
    probe_a.close()
    probe_b.close()


def test_cloud_outage_loses_and_duplicates_no_event(stack: DevStack) -> None:
    # Prepare: 3 devices emitting 10 events/s each
    devices = [stack.add_device(f"sensor-{i}") for i in range(3)]
    for dev in devices:
        wait_for(lambda d=dev: stack.device_state(d.device_id) == "ONLINE", 60, what="device ONLINE")
    emitted = {dev.device_id: 0 for dev in devices}
    stop_emitting = threading.Event()

    def emit(dev) -> None:  # type: ignore[no-untyped-def]
        n, started = 0, time.monotonic()
        while not stop_emitting.is_set():
            dev.emit("tick", {"n": n})
            n += 1
            emitted[dev.device_id] = n
            stop_emitting.wait(max(0.0, started + 0.1 * n - time.monotonic()))  # 10 a second on the clock, however slow an emit

    emitters = [threading.Thread(target=emit, args=(d,), daemon=True) for d in devices]
    for t in emitters:
        t.start()
    time.sleep(3)

    # Execute: the cloud (hub and its broker) is down for 60 s while the devices keep emitting
    stop(stack.hub.proc)
    stop(stack.upstream.proc)
    time.sleep(60)
    stack.upstream = start_broker(stack.data, stack.upstream.port)
    stack.hub = start_hub(stack.data, stack.database_url, stack.upstream.url, heartbeat_interval=0.5, offline_after_missed=4,
                          port=stack.hub.port)  # fmt: skip
    time.sleep(3)
    stop_emitting.set()
    for t in emitters:
        t.join(5)

    # Assert: every event reached the hub once, in per-device order
    def events(device_id: str) -> list[dict]:
        out, cursor = [], None
        with stack.hub.client("viewer") as api:
            while True:
                page = api.get(f"/devices/{device_id}/events", params={"limit": 500, **({"cursor": cursor} if cursor else {})}).json()
                out += page["items"]
                cursor = page["next_cursor"]
                if not cursor:
                    return out

    for dev in devices:
        wait_for(lambda d=dev: len(events(d.device_id)) >= emitted[d.device_id], 90, interval=1, what=f"all events of {dev.device_id}")
        got = events(dev.device_id)
        ns = [e["data"]["n"] for e in got]
        assert ns == list(range(emitted[dev.device_id])), f"{dev.device_id}: lost, duplicated or reordered events"
        seqs = [e["seq"] for e in got]
        assert seqs == sorted(set(seqs))
    assert sum(emitted.values()) >= 3 * 10 * 60
