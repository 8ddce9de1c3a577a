"""Diagnostics only (``rollout.py --trace``, ``--what-if``; ``reconnect.py --what-if``): where a device event's time goes
on its way to the hub, and what a change of the edge would save.

Wraps, from the outside, the functions an event passes through, and appends JSON lines to
``$AISYNERGY_BENCH_TRACE/<role>-<pid>.jsonl`` (written by a background thread once a second):

* device (a device-host worker calls :func:`install_device`): ``Outbox.append`` returned (committed),
  ``Outbox.sendable`` handed rows to the sender, ``Outbox.acknowledge`` (the edge's ``events/ack`` arrived);
* edge (``python bench/_trace.py edge run ...``): ``DeviceRelay._on_device_message`` started on an event (its seq
  is the one it admitted), ``DeviceRelay._commit_staged`` (the group commit: when, how long, which seqs),
  ``EdgeStore.outbox_head`` (the pump took a window: which events) and ``EdgeStore.delete_outbox`` (every
  PUBACK of that window is in; how long the delete took), and the event loop's lag (a 50 ms sleep, late by);
* hub (``python bench/_trace.py hub serve ...``): ``StatusIngest.flush`` (when, how long, how many events and
  acknowledgements), and its event loop's lag.

Every line is ``{"k": kind, "t": wall time, ...}``. The product's code is not changed; headline figures come
from runs without this wrapper.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

_lines: list[str] = []
_lock = threading.Lock()
_SEQ = re.compile(rb'"seq":(\d+)')


def record(kind: str, **fields: Any) -> None:
    line = json.dumps({"k": kind, "t": time.time(), **fields})
    with _lock:
        _lines.append(line)


def _writer(role: str) -> None:
    path = Path(os.environ["AISYNERGY_BENCH_TRACE"]) / f"{role}-{os.getpid()}.jsonl"
    with path.open("a") as out:
        while True:
            time.sleep(1.0)
            with _lock:
                lines, _lines[:] = list(_lines), []
            if lines:
                out.write("\n".join(lines) + "\n")
                out.flush()


def _start(role: str) -> None:
    threading.Thread(target=_writer, args=(role,), name="bench-trace", daemon=True).start()


async def _loop_lag(where: str, period: float = 0.05) -> None:
    """Once a second: the worst lateness of a ``period`` sleep on this event loop during that second."""
    loop = asyncio.get_running_loop()
    worst, since = 0.0, loop.time()
    while True:
        t0 = loop.time()
        await asyncio.sleep(period)
        worst = max(worst, loop.time() - t0 - period)
        if loop.time() - since >= 1.0:
            record("lag", where=where, ms=round(worst * 1000, 1))
            worst, since = 0.0, loop.time()


def install_device() -> None:
    from device import outbox as outbox_module

    cls = outbox_module.Outbox
    append, sendable, acknowledge = cls.append, cls.sendable, cls.acknowledge

    def traced_append(self: Any, build: Any) -> int:
        seq = append(self, build)
        record("dev.committed", d=self.path.parent.name, seq=seq)
        return seq

    def traced_sendable(self: Any, connected: bool) -> list[tuple[int, bytes]]:
        rows = sendable(self, connected)
        if rows:
            record("dev.sent", d=self.path.parent.name, first=rows[0][0], last=rows[-1][0])
        return rows

    def traced_acknowledge(self: Any, seq: int | None, resend: bool = False) -> int:
        done = acknowledge(self, seq, resend)
        record("dev.acked", d=self.path.parent.name, seq=seq, resend=resend, n=done)
        return done

    cls.append, cls.sendable, cls.acknowledge = traced_append, traced_sendable, traced_acknowledge  # type: ignore[method-assign]

    import paho.mqtt.client as mqtt

    publish, on_publish = mqtt.Client.publish, mqtt.Client._do_on_publish
    in_flight: dict[tuple[int, int], tuple[str, int]] = {}

    def traced_publish(self: Any, topic: str, payload: Any = None, *args: Any, **kw: Any) -> Any:
        info = publish(self, topic, payload, *args, **kw)
        if topic.endswith("/events") and isinstance(payload, (bytes, bytearray)):
            m = _SEQ.search(payload)
            if m:
                in_flight[(id(self), info.mid)] = (topic.split("/")[-2], int(m.group(1)))
        return info

    def traced_on_publish(self: Any, mid: int, *args: Any) -> Any:
        event = in_flight.pop((id(self), mid), None)
        if event is not None:
            record("dev.puback", d=event[0], seq=event[1])
        return on_publish(self, mid, *args)

    mqtt.Client.publish, mqtt.Client._do_on_publish = traced_publish, traced_on_publish  # type: ignore[method-assign]
    _start("device")


def install_edge() -> None:
    from edge import relay as relay_module
    from edge.store import EdgeStore
    from interfaces.topics import DEVICE_EVENTS, RELAY_EVENTS

    cls = relay_module.DeviceRelay
    on_message, commit_staged = cls._on_device_message, cls._commit_staged
    head, delete = EdgeStore.outbox_head, EdgeStore.delete_outbox
    started: list[bool] = []
    window = [0]

    async def traced_on_message(self: Any, device_topic: Any, relay_topic: Any, client: Any, message: Any, ids: dict[str, str]) -> None:
        if not started:
            started.append(True)
            asyncio.get_running_loop().create_task(_loop_lag("edge"))
            asyncio.get_running_loop().create_task(report_busy())
        t = time.time()
        before = self._accepted_seq.get(ids.get("device_id"))
        await on_message(self, device_topic, relay_topic, client, message, ids)
        if device_topic is DEVICE_EVENTS:
            after = self._accepted_seq.get(ids.get("device_id"))
            if after is not None and after != before:
                record("edge.rx", d=ids["device_id"], seq=after, t_in=t)

    def traced_commit(self: Any) -> dict[str, int]:
        t0 = time.time()
        n = len(self._staged)
        seqs = commit_staged(self)
        record("edge.committed", t0=t0, rows=n, seqs=seqs)
        return seqs

    def traced_head(self: Any, limit: int) -> list[Any]:
        rows = head(self, limit)
        window[0] += 1
        events = []
        for r in rows:
            ids = RELAY_EVENTS.parse(r.topic)
            m = _SEQ.search(r.payload) if ids else None
            if ids and m:
                events.append([ids["device_id"], int(m.group(1))])
        if rows:
            record("edge.head", w=window[0], rows=len(rows), events=events)
        return rows

    def traced_delete(self: Any, ids: Any) -> None:
        ids = list(ids)
        t0 = time.time()
        delete(self, ids)
        record("edge.deleted", w=window[0], t0=t0, rows=len(ids))

    import aiomqtt.client

    arrived = aiomqtt.client.Client._on_message

    def traced_arrived(self: Any, client: Any, userdata: Any, message: Any) -> None:
        ids = DEVICE_EVENTS.parse(message.topic)
        m = _SEQ.search(message.payload) if ids else None
        if ids and m:
            record("edge.arrived", d=ids["device_id"], seq=int(m.group(1)))
        arrived(self, client, userdata, message)

    aiomqtt.client.Client._on_message = traced_arrived  # type: ignore[method-assign]

    from edge import link as link_module

    route = link_module.Link.route
    busy: dict[str, list[float]] = {}  # route -> [messages, seconds in the handler]

    def traced_route(self: Any, topic: Any, handler: Any, **fixed: str) -> None:
        name = topic.pattern

        async def timed(client: Any, message: Any, ids: dict[str, str]) -> None:
            t0 = time.perf_counter()
            try:
                await handler(client, message, ids)
            finally:
                took = time.perf_counter() - t0
                b = busy.setdefault(name, [0, 0.0, 0.0])
                b[0] += 1
                b[1] += took
                b[2] = max(b[2], took)

        route(self, topic, timed, **fixed)

    async def report_busy() -> None:
        while True:
            await asyncio.sleep(1.0)
            if busy:
                record("edge.handlers", busy={k: [v[0], round(v[1], 3), round(v[2], 3)] for k, v in busy.items()})
                busy.clear()

    link_module.Link.route = traced_route  # type: ignore[method-assign]
    cls._on_device_message, cls._commit_staged = traced_on_message, traced_commit  # type: ignore[method-assign]
    EdgeStore.outbox_head, EdgeStore.delete_outbox = traced_head, traced_delete  # type: ignore[method-assign]
    _start("edge")


def _what_if_edge(spec: str) -> None:
    """What-if changes of the edge, to measure a remedy before anyone writes it (``rollout.py --what-if``):

    * ``desired-async``: a desired document from the hub is stored and relayed in a task of its own (one after the
      other per device) instead of inside the link's message loop, which then goes on with the devices' messages;
    * ``link-drain``: the link's message loop takes every message already queued at each wake-up (aiomqtt's iterator
      costs a few event-loop rounds per message, and each round may read a long burst from the socket);
    * ``inflight=N``: the edge's MQTT client keeps up to N QoS 1 messages in flight instead of paho's 20.
    """
    import aiomqtt

    from edge import link as link_module
    from edge import relay as relay_module

    for item in filter(None, (x.strip() for x in spec.split(","))):
        if item == "desired-async":
            cls = relay_module.DeviceRelay
            on_desired = cls._on_relay_desired

            async def detached(self: Any, client: Any, message: Any, ids: dict[str, str]) -> None:
                chains = self.__dict__.setdefault("_what_if_desired", {})
                before = chains.get(ids["device_id"])

                async def relay() -> None:
                    if before is not None:
                        await asyncio.gather(before, return_exceptions=True)
                    await on_desired(self, client, message, ids)

                task = asyncio.get_running_loop().create_task(relay())
                chains[ids["device_id"]] = task
                self._background.add(task)
                task.add_done_callback(self._background.discard)

            cls._on_relay_desired = detached  # type: ignore[method-assign]
        elif item == "link-drain":
            log = link_module.log

            async def drained(self: Any, client: Any) -> None:
                async for first in client.messages:
                    # the messages queued meanwhile too, without a trip through the event loop for each
                    batch = [first, *(client._queue.get_nowait() for _ in range(len(client.messages)))]  # noqa: SLF001
                    for message in batch:
                        topic = message.topic.value
                        for route in self._routes:
                            ids = route.topic.parse(topic)
                            if ids is not None and route.fixed.items() <= ids.items():
                                break
                        else:
                            continue
                        try:
                            await route.handler(client, message, ids)
                        except aiomqtt.MqttError:
                            raise
                        except Exception:
                            log.exception("%s: handling a message on %s failed", self.name, topic)

            link_module.Link._dispatch = drained  # type: ignore[method-assign]
        elif item.startswith("inflight="):
            n, make = int(item.split("=", 1)[1]), link_module.Link._client

            def client(self: Any, make: Any = make, n: int = n) -> Any:
                c = make(self)
                c._client.max_inflight_messages_set(n)  # noqa: SLF001
                return c

            link_module.Link._client = client  # type: ignore[method-assign]
        else:
            raise SystemExit(f"unknown what-if {item!r}")
        print(f"bench what-if: {item}", file=sys.stderr, flush=True)


def install_hub() -> None:
    from cloud import bridge as bridge_module
    from cloud.ingest import StatusIngest

    flush, run = StatusIngest.flush, bridge_module.MqttBridge.run

    def traced_flush(self: Any) -> int:
        with self._lock:
            events, acks = len(self._events), len(self._acks)
        t0 = time.time()
        written = flush(self)
        if events or acks:
            record("hub.flush", t0=t0, events=events, acks=acks, rows=written)
        return written

    async def traced_run(self: Any) -> None:
        asyncio.get_running_loop().create_task(_loop_lag("hub"))
        await run(self)

    StatusIngest.flush = traced_flush  # type: ignore[method-assign]
    bridge_module.MqttBridge.run = traced_run  # type: ignore[method-assign]
    _start("hub")


# ---- reading a run's traces ---------------------------------------------------------------------------
def load(trace_dir: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for path in sorted(Path(trace_dir).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                out.append(json.loads(line))
    return out


def _pct(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"count": 0}
    v = sorted(values)

    def at(p: float) -> float:
        return round(v[min(len(v) - 1, max(0, int(-(-p * len(v) // 100)) - 1))] * 1000, 1)

    return {"count": len(v), "p50_ms": at(50), "p90_ms": at(90), "p99_ms": at(99), "max_ms": round(v[-1] * 1000, 1)}


def analyse(trace_dir: Path, events: list[dict[str, Any]], ts: Any) -> dict[str, Any]:
    """Per event (the hub's ``device_id``, ``seq``, ``ts``, ``received_at``), the time spent in each stage."""
    import bisect
    from collections import defaultdict

    recs = load(trace_dir)
    committed: dict[tuple[str, int], float] = {}
    sent: dict[str, list[tuple[float, int, int]]] = defaultdict(list)
    acked: dict[str, list[tuple[float, int]]] = defaultdict(list)
    rx: dict[tuple[str, int], float] = {}
    puback: dict[tuple[str, int], float] = {}
    arrived: dict[tuple[str, int], float] = {}
    edge_commits: dict[str, list[tuple[float, int]]] = defaultdict(list)
    commit_stats: list[tuple[float, float, int]] = []
    head: dict[tuple[str, int], tuple[float, int]] = {}
    windows: dict[int, dict[str, float]] = {}
    flushes: list[tuple[float, float, int, int]] = []
    lag: dict[str, list[float]] = defaultdict(list)
    handlers: dict[str, list[float]] = {}  # the edge's link: route -> [messages, seconds in handlers, longest]
    for r in recs:
        k = r["k"]
        if k == "dev.committed":
            committed.setdefault((r["d"], r["seq"]), r["t"])
        elif k == "dev.sent":
            sent[r["d"]].append((r["t"], r["first"], r["last"]))
        elif k == "dev.acked" and r["seq"] is not None:
            acked[r["d"]].append((r["t"], r["seq"]))
        elif k == "dev.puback":
            puback.setdefault((r["d"], r["seq"]), r["t"])
        elif k == "edge.arrived":
            arrived.setdefault((r["d"], r["seq"]), r["t"])
        elif k == "edge.rx":
            rx.setdefault((r["d"], r["seq"]), r["t_in"])
        elif k == "edge.committed":
            commit_stats.append((r["t0"], r["t"], r["rows"]))
            for d, seq in r["seqs"].items():
                edge_commits[d].append((r["t"], seq))
        elif k == "edge.head":
            windows.setdefault(r["w"], {})["head"] = r["t"]
            windows[r["w"]]["rows"] = r["rows"]
            for d, seq in r["events"]:
                head.setdefault((d, seq), (r["t"], r["w"]))
        elif k == "edge.deleted":
            windows.setdefault(r["w"], {}).update(acked=r["t0"], deleted=r["t"])
        elif k == "hub.flush":
            flushes.append((r["t0"], r["t"], r["events"], r["acks"]))
        elif k == "edge.handlers":
            for name, (n, secs, worst) in r["busy"].items():
                h = handlers.setdefault(name, [0, 0.0, 0.0])
                h[0] += n
                h[1] += secs
                h[2] = max(h[2], worst)
        elif k == "lag":
            lag[r["where"]].append(r["ms"])
    for lst in (*sent.values(), *acked.values(), *edge_commits.values()):
        lst.sort()
    flushes.sort()
    flush_starts = [f[0] for f in flushes]

    def first_after(lst: list[tuple[float, int]], t: float, seq: int) -> float | None:
        for at, s in lst[bisect.bisect_left(lst, (t, -1)):]:
            if s >= seq:
                return at
        return None

    stages: dict[str, list[float]] = defaultdict(list)
    missing: dict[str, int] = defaultdict(int)
    for e in events:
        d, seq = e["device_id"], e["seq"]
        t_ts, t_hub = ts(e["ts"]), ts(e["received_at"])
        t_commit = committed.get((d, seq))
        t_sent = next((t for t, a, b in sent.get(d, []) if a <= seq <= b and (t_commit is None or t >= t_commit - 0.001)), None)
        t_rx = rx.get((d, seq))
        t_puback_dev, t_arrived = puback.get((d, seq)), arrived.get((d, seq))
        t_ecommit = first_after(edge_commits.get(d, []), t_rx, seq) if t_rx is not None else None
        h = head.get((d, seq))
        t_head, w = h if h else (None, None)
        t_puback = windows.get(w, {}).get("acked") if w is not None else None
        i = bisect.bisect_left(flush_starts, t_hub)
        t_hcommit = flushes[i][1] if i < len(flushes) else None
        t_acked = first_after(acked.get(d, []), t_ecommit, seq) if t_ecommit is not None else None
        chain = [("1 device: outbox commit (emit -> committed)", t_ts, t_commit),
                 ("2 device: wait for the sender / send window", t_commit, t_sent),
                 ("3 device -> broker -> edge handler", t_sent, t_rx),
                 ("3a device: handed to paho -> the broker's PUBACK", t_sent, t_puback_dev),
                 ("3b device: handed to paho -> arrived at the edge's client", t_sent, t_arrived),
                 ("3c edge: arrived -> its handler runs (the link's message queue)", t_arrived, t_rx),
                 ("4 edge: staged -> group commit done", t_rx, t_ecommit),
                 ("5 edge: committed -> the pump takes it", t_ecommit, t_head),
                 ("6 edge: pump publish -> its window's PUBACKs", t_head, t_puback),
                 ("7 edge pump -> broker -> hub's bridge (received_at)", t_head, t_hub),
                 ("8 hub: received -> ingest commit", t_hub, t_hcommit),
                 ("edge commit -> the device has its ack", t_ecommit, t_acked),
                 ("total: event ts -> hub received_at", t_ts, t_hub)]  # fmt: skip
        for name, a, b in chain:
            if a is None or b is None:
                missing[name] += 1
            else:
                stages[name].append(b - a)
    pump = [(w["acked"] - w["head"], w["rows"]) for w in windows.values() if "acked" in w and "head" in w]
    return {
        "events": len(events),
        "stages": {name: _pct(v) for name, v in sorted(stages.items())},
        "unmatched": dict(missing),
        "edge_group_commit": {"commits": len(commit_stats), "duration": _pct([b - a for a, b, _ in commit_stats]),
                              "rows_max": max((n for *_, n in commit_stats), default=0)},
        "edge_pump_windows": {"windows": len(pump), "rows_p50": sorted(n for _, n in pump)[len(pump) // 2] if pump else None,
                              "rows_max": max((n for _, n in pump), default=0), "publish_to_pubacks": _pct([x for x, _ in pump])},
        "hub_flush": {"flushes": len(flushes), "duration": _pct([b - a for a, b, *_ in flushes]),
                      "events_max": max((f[2] for f in flushes), default=0)},
        "edge_link_handlers": {name: {"messages": int(n), "seconds": round(secs, 2), "longest_ms": round(worst * 1000, 1),
                                      "mean_ms": round(secs / n * 1000, 2) if n else None}
                               for name, (n, secs, worst) in sorted(handlers.items(), key=lambda x: -x[1][1])},
        "loop_lag_worst_per_second_ms": {w: {"p50": sorted(v)[len(v) // 2], "p99": sorted(v)[int(len(v) * 0.99)], "max": max(v)}
                                         for w, v in lag.items() if v},
    }  # fmt: skip


if __name__ == "__main__":
    from cloud.cli.root import main

    if os.environ.get("AISYNERGY_BENCH_TRACE"):
        {"edge": install_edge, "hub": install_hub}[sys.argv[1]]()
    if sys.argv[1] == "edge":
        _what_if_edge(os.environ.get("AISYNERGY_BENCH_WHAT_IF", ""))
    main()
