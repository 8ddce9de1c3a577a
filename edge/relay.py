"""The relay between the hub and this edge's devices: an edge is to the hub what a device is to its edge.

The hub never touches device topics; it talks to the edge under the edge's own subtree::

    hub -> device  RELAY_DESIRED  stored, then republished retained on DEVICE_DESIRED (the hub's bytes); its
                                  deployment orders go to ``prefetch`` (the artefact cache fetches them ahead)
                   RELAY_CMD      forwarded on DEVICE_CMD with our response topic and a fresh correlation
                                  id; the device's answer goes to the hub's response topic with the hub's
                                  correlation data; unknown device or no answer in time: a failed result
    device -> hub  reported, events  through the outbox: SQLite first, then published in order
                                  with QoS 1, each row deleted after its PUBACK (the envelope id is the
                                  hub's idempotency key, so a resend after a lost PUBACK is harmless)
                   state          the latest of each device, coalesced and published retained with QoS 1
                                  ahead of the outbox (see :meth:`DeviceRelay._pump_states`): a fleet back
                                  after an outage is ONLINE at the hub without waiting for the events queued
                                  meanwhile. Kept in memory only: the device's own state is retained on the
                                  downstream broker, which hands it again to an edge that restarts
                   events         also acknowledged to the device on DEVICE_EVENTS_ACK once committed (the
                                  device keeps each event until then, see :mod:`device.outbox`); stored only
                                  in order: a seq at or below the device's last stored one is a duplicate
                                  (dropped, acknowledged again), one whose ``prev_seq`` is above it comes after
                                  a hole (dropped, and the device is asked to resend what follows)
                   heartbeat      forwarded while the upstream is connected, dropped otherwise

Device envelopes travel upstream unchanged. The downstream broker's ACL delivers only our devices.

The commands are relayed by :class:`edge.relay_commands.CommandRelay`. The rest stays one module: documents and
reports in both directions share the edge's store, its outbox and the two clients (hub and devices), and the
ordering rules above hold only across all of them.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import aiomqtt
from pydantic import ValidationError

from device.rejections import Rejections
from edge.link import Link
from edge.relay_commands import CommandRelay, payload_bytes
from edge.store import EdgeStore, LearnedFrom, OutboxRow, Scope
from interfaces.deployments import DeploymentOrder
from interfaces.tasks import WorkerOrder
from interfaces.messages import (
    MAX_MESSAGE_BYTES,
    ConnectionState,
    Envelope,
    EventBody,
    EventsAckBody,
    HubStateBody,
    envelope,
)
from interfaces.topics import (
    DEVICE_CMD_REPLY,
    DEVICE_DESIRED,
    DEVICE_EVENTS,
    DEVICE_EVENTS_ACK,
    DEVICE_HEARTBEAT,
    DEVICE_REPORTED,
    DEVICE_STATE,
    HUB_STATE,
    NODE_EVENTS,
    RELAY_CMD,
    RELAY_DESIRED,
    RELAY_EVENTS,
    RELAY_HEARTBEAT,
    RELAY_REPORTED,
    RELAY_STATE,
    Topic,
)

log = logging.getLogger("aisynergy.edge.relay")

# ``error_code`` values of the edge's own failed results, next to those of CommandError

QUEUED: dict[Topic[Any], Topic[Any]] = {  # device topic -> relay topic; all but state through the outbox
    DEVICE_STATE: RELAY_STATE,
    DEVICE_REPORTED: RELAY_REPORTED,
    DEVICE_EVENTS: RELAY_EVENTS,
}


GROUP_COMMIT_S = 0.005  # messages arriving within this share one outbox transaction
REDELIVER_DESIRED_AFTER_S = (0.0, 1.0, 3.0, 10.0, 30.0)  # after a device comes online (see _on_device_online)
ACK_DELAY_S = 0.02  # acknowledgements due within this go out together, one per device
RESEND_EVERY_S = 1.0  # at most one resend request per device this often (events in flight follow the first)
RESEND_DELIVERED_S = 10.0  # what the broker acknowledged this long before a session ended goes again (see _pump_outbox)
DESIRED_RETRY_S = 1.0  # a desired document the store could not take is tried again after this
RESEND_DELIVERED_MAX = 20_000  # ... at most this many messages (the newest), so a burst does not fill the memory


class DeviceRelay:
    """Relays between the upstream and the downstream link; see the module docstring."""

    def __init__(
        self,
        node_id: str,
        store: EdgeStore,
        up: Link,
        down: Link,
        *,
        outbox_window: int = 256,
        outbox_limit: int = 100_000,
        prefetch: Callable[[DeploymentOrder], object] | None = None,
        on_task_orders: Callable[[str, list[WorkerOrder]], None] | None = None,
    ) -> None:
        """Plug into the links (the same one twice when devices use the hub's broker); ``prefetch`` gets the
        deployment orders of each desired document (it must not block); ``on_task_orders`` the task orders of
        each device, as stored now and then of each document the hub sends (none: the hub cleared it)."""
        self.node_id = node_id
        self.up, self.down = up, down
        self.rejections = Rejections(log)
        self.commands = CommandRelay(node_id, up, down, self._knows, self.rejections)
        self.dropped = 0  # messages for the hub refused because the outbox was full
        self._store = store
        self._window = outbox_window
        self._limit = outbox_limit
        self._prefetch = prefetch
        self._on_task_orders = on_task_orders
        if on_task_orders is not None:
            for stored in store.all_desired(Scope.DEVICE):
                try:
                    on_task_orders(stored.target_id, RELAY_DESIRED.payload.model_validate_json(stored.payload).body.tasks)
                except ValidationError as exc:
                    log.warning("the stored desired document of %s does not parse: %s", stored.target_id, exc)
        self._prefetched: dict[str, int] = {}  # device id -> the deployments_version whose orders were prefetched
        # device id -> (version, document) received and not yet stored; version None: cleared by the hub
        self._desired_waiting: dict[str, tuple[int | None, bytes]] = {}
        self._desired_writing: dict[str, tuple[int | None, bytes]] = {}  # ... the batch being stored now
        self._desired_writer: asyncio.Task[None] | None = None
        self._outbox_ready = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None  # the pump's, once a session has started
        self._hub_online = asyncio.Event()
        self.on_hub_signing_key: Callable[[str], None] | None = None
        """Told the key id the hub announces in its retained state (the artefact cache catches up after a
        rotation); called on the relay's loop, so it must not block."""
        self._background: set[asyncio.Task[None]] = set()
        self._alive: set[str] = set()  # devices heard from (state online or a heartbeat) since they were last offline
        self._staged: list[tuple[str, bytes, int, bool]] = []  # accepted, not yet committed to the outbox
        self._staged_seq: dict[str, int] = {}  # device id -> highest event seq among the staged messages
        self._stored_seq = store.device_seqs()  # device id -> highest event seq committed (what we acknowledge)
        self._accepted_seq = dict(self._stored_seq)  # ... committed or staged
        self._resend_asked: dict[str, float] = {}  # device id -> loop time of the last resend request
        self._acks_due: dict[str, bool] = {}  # device id -> resend flag, sent within ACK_DELAY_S
        self._acker: asyncio.Task[None] | None = None
        # (monotonic time, row) acknowledged by the broker, the newest RESEND_DELIVERED_MAX of them
        self._delivered: deque[tuple[float, OutboxRow]] = deque(maxlen=RESEND_DELIVERED_MAX)
        self._session_ended: float | None = None
        self._states: dict[str, bytes] = {}  # device id -> its newest state, not yet acknowledged by the broker
        self._states_ready = asyncio.Event()
        # (monotonic time, device id, state) acknowledged by the broker, for the next session (see _pump_states)
        self._states_delivered: deque[tuple[float, str, bytes]] = deque(maxlen=RESEND_DELIVERED_MAX)
        self._states_ended: float | None = None
        self.duplicates = 0  # device events received again (dropped)
        self.out_of_order = 0  # device events received after a hole (dropped; the device resends)
        self._staged_lock = threading.Lock()
        self._committer: asyncio.Task[None] | None = None
        self._commit_scheduled = False
        up.route(RELAY_DESIRED, self._on_relay_desired, node_id=node_id)
        up.route(RELAY_CMD, self.commands.on_relay_command, node_id=node_id)
        up.route(HUB_STATE, self._on_hub_state)
        up.during_session(self._pump_outbox)
        up.during_session(self._pump_states)
        for device_topic, relay_topic in QUEUED.items():
            down.route(device_topic, functools.partial(self._on_device_message, device_topic, relay_topic))
        down.route(DEVICE_HEARTBEAT, self._on_device_heartbeat)
        down.route(DEVICE_CMD_REPLY, self.commands.on_device_reply)
        down.during_session(self._republish_desired)

    async def close(self) -> None:
        """Cancel the commands still waiting for a device, and the pending re-deliveries."""
        tasks = [*self.commands.tasks, *self._background, *([self._acker] if self._acker is not None else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._desired_writer is not None:  # what the hub sent is stored before the store closes
            await asyncio.gather(self._desired_writer, return_exceptions=True)
        await self.flush_staged()

    # ---- hub -> device: desired documents -----------------------------------------------------------
    async def _on_relay_desired(self, client: aiomqtt.Client, message: aiomqtt.Message, ids: dict[str, str]) -> None:
        """Validate a device's document and hand it to the desired writer; the link's message loop goes on at once.

        Storing a document is a committed write: done here, one after the other, a rollout's release of 1,000
        documents would hold every device event behind it for seconds. The writer stores what arrived together
        in one transaction and relays it; a device's newer document replaces its older one still waiting (the
        document is the whole desired state; the retained message downstream is the newest one either way).
        """
        device_id, payload = ids["device_id"], payload_bytes(message.payload)
        if payload:
            try:
                request = RELAY_DESIRED.payload.model_validate_json(payload)
            except ValidationError as exc:
                self._reject(message.topic.value, exc, device_id=device_id)
                return
            if self._on_task_orders is not None:
                self._on_task_orders(device_id, request.body.tasks)
            if self._prefetch is not None and request.body.deployments_version > self._prefetched.get(device_id, -1):
                # only when the orders changed: a document re-sent for a task order still holds the finished ones
                self._prefetched[device_id] = request.body.deployments_version
                for order in request.body.deployments:
                    try:
                        self._prefetch(order)
                    except Exception:  # best effort: the device can still download through us later
                        log.exception("cannot prefetch %s for %s", order.artifact_id, device_id)
            version: int | None = request.body.version
        else:
            version = None  # the hub cleared it: the device is no longer ours
            if self._on_task_orders is not None:
                self._on_task_orders(device_id, [])
        self._desired_waiting.pop(device_id, None)  # re-inserted last: the writer takes documents in arrival order
        self._desired_waiting[device_id] = (version, payload)
        if self._desired_writer is None or self._desired_writer.done():
            self._desired_writer = asyncio.create_task(self._write_desired(), name="desired-writer")

    def _knows(self, device_id: str) -> bool:
        """Whether the device is ours, by the newest word of the hub (a document not yet stored counts)."""
        for pending in (self._desired_waiting, self._desired_writing):
            if device_id in pending:
                return pending[device_id][0] is not None
        return self._store.has_device(device_id)

    async def _write_desired(self) -> None:
        """Store the waiting documents in one transaction, relay them downstream together; until none waits."""
        while self._desired_waiting:
            batch, self._desired_waiting = self._desired_waiting, {}
            self._desired_writing = batch
            cleared = [device_id for device_id, (version, _payload) in batch.items() if version is None]
            for device_id in cleared:
                self._stored_seq.pop(device_id, None)
                self._accepted_seq.pop(device_id, None)
            documents = [(device_id, version, payload) for device_id, (version, payload) in batch.items() if version is not None]
            try:
                changed = await asyncio.to_thread(self._store.store_device_desired, documents, cleared, LearnedFrom.DESIRED)
            except sqlite3.Error as exc:  # kept to be tried again (behind any newer document of the same device)
                log.error("cannot store %s desired documents (trying again in %s s): %s", len(batch), DESIRED_RETRY_S, exc)
                self._desired_waiting = {**batch, **self._desired_waiting}
                await asyncio.sleep(DESIRED_RETRY_S)
                continue
            finally:
                self._desired_writing = {}
            for device_id in cleared:
                log.info("the hub cleared the desired document of %s; device forgotten", device_id)
            for device_id, version, _payload in documents:
                if device_id in changed:
                    log.info("desired version %s of device %s stored; relaying it", version, device_id)
                else:
                    log.debug("desired version %s of %s already stored", version, device_id)
            relay = [(device_id, b"") for device_id in cleared]
            relay += [(device_id, payload) for device_id, _version, payload in documents if device_id in changed]
            await asyncio.gather(*(self._publish_down(DEVICE_DESIRED.topic(device_id=d), p) for d, p in relay))

    async def _publish_down(self, topic: str, payload: bytes) -> None:
        try:
            await self.down.publish(topic, payload, qos=DEVICE_DESIRED.qos, retain=DEVICE_DESIRED.retain)
        except aiomqtt.MqttError as exc:
            log.warning("cannot publish %s downstream (%s); it goes out when the downstream link is back", topic, exc)

    async def _republish_desired(self, client: aiomqtt.Client) -> None:
        """After each downstream connect: the devices' broker may have lost its retained documents."""
        documents = await asyncio.to_thread(self._store.all_desired, Scope.DEVICE)
        for doc in documents:
            await client.publish(
                DEVICE_DESIRED.topic(device_id=doc.target_id),
                doc.payload,
                qos=DEVICE_DESIRED.qos,
                retain=DEVICE_DESIRED.retain,
            )
        if documents:
            log.info("republished %s stored desired documents downstream", len(documents))


    # ---- device -> hub ------------------------------------------------------------------------------
    async def _on_device_message(
        self,
        device_topic: Topic[Any],
        relay_topic: Topic[Any],
        client: aiomqtt.Client,
        message: aiomqtt.Message,
        ids: dict[str, str],
    ) -> None:
        device_id, payload = ids["device_id"], payload_bytes(message.payload)
        if not payload:
            log.debug("ignoring an empty message on %s", message.topic.value)
            return
        parsed = self._valid(device_topic, message.topic.value, payload, device_id)
        if parsed is None:
            return
        if device_topic is DEVICE_STATE:
            self._states.pop(device_id, None)  # coalesced: the newest replaces the one not yet sent, and queues last
            self._states[device_id] = payload
            self._states_ready.set()
            await self._on_device_online(device_id, payload)
            return
        seq: int | None = None
        if device_topic is DEVICE_EVENTS:
            body: EventBody = parsed.body
            seq = body.seq
            if seq is not None and not self._admit_event(device_id, seq, body.prev_seq):
                return
        topic = relay_topic.topic(node_id=self.node_id, device_id=device_id)
        if not self.enqueue(topic, payload, relay_topic, device_seq=(device_id, seq) if seq is not None else None):
            return  # outbox full: not acknowledged, so the device keeps the event and sends it again

    def _admit_event(self, device_id: str, seq: int, prev_seq: int | None) -> bool:
        """Whether a device's event is the next one to store (see the module docstring)."""
        last = self._accepted_seq.get(device_id)
        if last is not None and seq <= last:
            self.duplicates += 1
            log.debug("event %s of %s is stored already (last %s)", seq, device_id, last)
            self._request_ack(device_id)
            return False
        if last is not None and prev_seq is not None and prev_seq > last:
            self.out_of_order += 1
            now = asyncio.get_running_loop().time()
            if now - self._resend_asked.get(device_id, -RESEND_EVERY_S) >= RESEND_EVERY_S:
                self._resend_asked[device_id] = now
                log.info("event %s of %s follows %s, but %s is the last stored: asking for a resend", seq, device_id, prev_seq, last)
                self._request_ack(device_id, resend=True)
            return False
        self._resend_asked.pop(device_id, None)
        return True

    def _request_ack(self, device_id: str, resend: bool = False) -> None:
        """Acknowledge ``device_id``'s events soon (with those of other devices due meanwhile)."""
        self._acks_due[device_id] = self._acks_due.get(device_id, False) or resend
        if self._acker is None or self._acker.done():
            self._acker = asyncio.get_running_loop().create_task(self._send_acks())

    async def _send_acks(self) -> None:
        await asyncio.sleep(ACK_DELAY_S)
        due, self._acks_due = self._acks_due, {}
        failed = 0
        for device_id, resend in due.items():
            ack = EventsAckBody(seq=self._stored_seq.get(device_id), resend=resend)
            payload = envelope(self.node_id, ack).model_dump_json().encode()
            topic = DEVICE_EVENTS_ACK.topic(device_id=device_id)
            # handed to the session without waiting for each PUBACK: the next acknowledgements need not wait
            # for these, and a lost one is covered by the next (or by the device's probe)
            if not self.down.publish_nowait(topic, payload, qos=DEVICE_EVENTS_ACK.qos, retain=DEVICE_EVENTS_ACK.retain):
                failed += 1
        if failed:  # the devices send again, unacknowledged; the next acknowledgement covers these
            log.debug("%s of %s event acknowledgements not sent", failed, len(due))
        if self._acks_due:  # fell due meanwhile, when _request_ack saw this task running
            self._acker = asyncio.get_running_loop().create_task(self._send_acks())

    async def _on_device_online(self, device_id: str, payload: bytes) -> None:
        """A device came online: publish its stored desired document again, now and a few times more.

        The broker's access list learns of a device a moment after the hub registers it (the broker
        reloads it); a document relayed before that was refused without a word, and MQTT gives the
        publisher no refusal to act on. The device ignores a version it already has. A device whose own
        ``online`` was refused (it connected before the reload) is first heard of by its next heartbeat, which
        does the same (:meth:`_on_device_heartbeat`).
        """
        try:
            online = DEVICE_STATE.payload.model_validate_json(payload).body.state is ConnectionState.ONLINE
        except ValidationError:
            return
        if online:
            self._alive.add(device_id)
            self._start_redelivery(device_id)
        else:
            self._alive.discard(device_id)

    def _start_redelivery(self, device_id: str) -> None:
        task = asyncio.create_task(self._redeliver_desired(device_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _redeliver_desired(self, device_id: str) -> None:
        for delay in REDELIVER_DESIRED_AFTER_S:
            await asyncio.sleep(delay)
            stored = await asyncio.to_thread(self._store.desired, Scope.DEVICE, device_id)
            if stored is None:
                return
            await self._publish_down(DEVICE_DESIRED.topic(device_id=device_id), stored.payload)

    async def _on_device_heartbeat(self, client: aiomqtt.Client, message: aiomqtt.Message, ids: dict[str, str]) -> None:
        device_id, payload = ids["device_id"], payload_bytes(message.payload)
        if self._valid(DEVICE_HEARTBEAT, message.topic.value, payload, device_id) is None:
            return
        if device_id not in self._alive:  # the first sign of life since it was offline: its online may have been refused
            self._alive.add(device_id)
            self._start_redelivery(device_id)
        if not self.up.connected.is_set():
            log.debug("upstream down: heartbeat of %s dropped", device_id)
            return
        topic = RELAY_HEARTBEAT.topic(node_id=self.node_id, device_id=device_id)
        assert RELAY_HEARTBEAT.qos == 0  # best effort, like the heartbeat itself: nothing to wait for
        if not self.up.publish_nowait(topic, payload, retain=RELAY_HEARTBEAT.retain):
            log.debug("heartbeat of %s dropped: the upstream link is down", device_id)

    def _valid(self, topic: Topic[Any], where: str, payload: bytes, device_id: str) -> Any:
        """The message validated into the topic's model, or ``None`` (rejected: counted and reported)."""
        if len(payload) > MAX_MESSAGE_BYTES:
            self._reject(where, f"{len(payload)} bytes is more than {MAX_MESSAGE_BYTES}", device_id=device_id)
            return None
        try:
            return topic.payload.model_validate_json(payload)
        except ValidationError as exc:
            self._reject(where, exc, device_id=device_id)
            return None

    def _reject(self, where: str, exc: ValidationError | str, **data: Any) -> None:
        """Drop a malformed message, count it and tell the hub on the node's ``events`` (DESIGN §6)."""
        event = envelope(self.node_id, self.rejections.reject(where, exc, **data))
        self.enqueue(NODE_EVENTS.topic(node_id=self.node_id), event.model_dump_json().encode(), NODE_EVENTS)

    def enqueue(self, topic: str, payload: bytes, kind: Topic[Any], device_seq: tuple[str, int] | None = None) -> bool:
        """Store ``payload`` for the hub (store-and-forward, delivered in order with the devices' messages);
        ``False`` when the outbox is full and it was dropped. Safe from any thread (the node's own events).
        ``device_seq``: a device's event and its seq, acknowledged to the device once committed.

        Messages arriving together are committed together (group commit: one transaction, one fsync, in a
        worker thread) a few milliseconds after the first of them; the pump sends only committed rows.
        """
        with self._staged_lock:
            if self._store.outbox_size() + len(self._staged) >= self._limit:
                self.dropped += 1
                if self.dropped == 1 or self.dropped % 1000 == 0:
                    log.error("the outbox holds %s messages; %s dropped so far", self._limit, self.dropped)
                return False
            self._staged.append((topic, payload, kind.qos, kind.retain))
            if device_seq is not None:
                device_id, seq = device_seq
                self._staged_seq[device_id] = seq
                self._accepted_seq[device_id] = seq
            schedule, self._commit_scheduled = not self._commit_scheduled, True
        if schedule:
            try:
                here: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
            except RuntimeError:
                here = None
            loop = here or self._loop
            if loop is None:  # no loop yet: commit now; the pump reads the outbox when it starts
                self._commit_staged()
                while not self._commit_done():  # another thread staged meanwhile
                    self._commit_staged()
            elif loop is here:
                self._start_committer()
            else:
                loop.call_soon_threadsafe(self._start_committer)
        return True

    def _start_committer(self) -> None:
        self._committer = asyncio.get_running_loop().create_task(self._commit_loop())

    async def _commit_loop(self) -> None:
        """The only committer while it runs, so that bursts reach the outbox in arrival order."""
        while True:
            await asyncio.sleep(GROUP_COMMIT_S)
            committed = await asyncio.to_thread(self._commit_staged)
            self._outbox_ready.set()
            for device_id, seq in committed.items():  # stored: the devices may forget these events
                self._stored_seq[device_id] = max(seq, self._stored_seq.get(device_id, seq))
                self._request_ack(device_id)
            if self._commit_done():
                return

    def _commit_done(self) -> bool:
        """Nothing staged any more: the next enqueue schedules a committer (atomic with enqueue's check)."""
        with self._staged_lock:
            if self._staged:
                return False
            self._commit_scheduled = False
            return True

    def _commit_staged(self) -> dict[str, int]:
        """Commit what is staged; the devices' highest event seqs in it (now stored)."""
        with self._staged_lock:
            rows, self._staged = self._staged, []
            seqs, self._staged_seq = self._staged_seq, {}
        try:
            self._store.enqueue_many(rows, seqs)
        except BaseException:
            with self._staged_lock:  # not stored: forget the seqs too, so the devices' resends are taken
                for device_id in seqs:
                    self._accepted_seq[device_id] = self._stored_seq.get(device_id, -1)
                    if device_id not in self._stored_seq:
                        del self._accepted_seq[device_id]
            raise
        return seqs

    async def flush_staged(self) -> None:
        """Commit what is staged now (a clean stop)."""
        if self._committer is not None and not self._committer.done():
            await asyncio.wait([self._committer], timeout=5)
        await asyncio.to_thread(self._commit_staged)

    async def _on_hub_state(self, client: aiomqtt.Client, message: aiomqtt.Message, ids: dict[str, str]) -> None:
        """The hub says whether it is subscribed; a broker acknowledgement only means delivered to the hub
        while it is (a broker that restarted keeps no promise for the hub's session before it is back)."""
        try:
            body = Envelope[HubStateBody].model_validate_json(payload_bytes(message.payload)).body
        except ValidationError:
            body = None
        online = body is not None and body.state is ConnectionState.ONLINE
        if online and body is not None and body.signing_key_id is not None and self.on_hub_signing_key is not None:
            self.on_hub_signing_key(body.signing_key_id)
        if online and not self._hub_online.is_set():
            log.info("the hub is online: delivering the %s stored messages", self._store.outbox_size())
            self._hub_online.set()
        elif not online and self._hub_online.is_set():
            log.info("the hub is offline: keeping messages for it in the outbox")
            self._hub_online.clear()

    async def _pump_outbox(self, client: aiomqtt.Client) -> None:
        """Deliver the outbox in order while the upstream session lasts and the hub is online; a row goes
        after its PUBACK.

        A broker acknowledges what it holds, not what the hub has stored: a broker killed with messages still
        on their way to the hub loses them (its persistence is not written per message). So the rows delivered
        in the last :data:`RESEND_DELIVERED_S` before a session ended (at most :data:`RESEND_DELIVERED_MAX`) go again,
        first, at the next one: what was lost was the newest, so order holds, and the hub keeps each envelope once.
        """
        self._loop = asyncio.get_running_loop()
        ended = self._session_ended
        again = [row for at, row in self._delivered if ended is not None and at >= ended - RESEND_DELIVERED_S]
        self._delivered.clear()
        try:
            await self._pump(client, again)
        finally:
            self._session_ended = time.monotonic()
            # learnt afresh from the next session's retained HUB_STATE (cleared here, not when the next session
            # starts: that state may be handled before this pump runs again)
            self._hub_online.clear()

    async def _pump_states(self, client: aiomqtt.Client) -> None:
        """Publish the devices' newest states, retained with QoS 1, while the session lasts and the hub is
        online: beside the outbox, not behind it, so that 1,000 devices back after an outage are ONLINE at the
        hub at once, whatever number of events waits in the outbox. A state replaced before it was sent is
        never sent. Like the outbox, what the broker acknowledged in the last :data:`RESEND_DELIVERED_S` before
        a session ended goes again at the next one (unless a newer state of that device waits).
        """
        ended = self._states_ended
        for at, device_id, payload in self._states_delivered:
            if ended is not None and at >= ended - RESEND_DELIVERED_S:
                self._states.setdefault(device_id, payload)
        self._states_delivered.clear()
        try:
            while True:
                await self._hub_online.wait()
                if not self._states:
                    self._states_ready.clear()
                    await self._states_ready.wait()
                    continue
                batch = list(self._states.items())[: self._window]
                results = await asyncio.gather(
                    *(
                        client.publish(
                            RELAY_STATE.topic(node_id=self.node_id, device_id=device_id),
                            payload,
                            qos=RELAY_STATE.qos,
                            retain=RELAY_STATE.retain,
                        )
                        for device_id, payload in batch
                    ),
                    return_exceptions=True,
                )
                now = time.monotonic()
                for (device_id, payload), result in zip(batch, results, strict=True):
                    if isinstance(result, BaseException):
                        continue
                    if self._states.get(device_id) is payload:
                        del self._states[device_id]
                    self._states_delivered.append((now, device_id, payload))
                while self._states_delivered and self._states_delivered[0][0] < now - RESEND_DELIVERED_S:
                    self._states_delivered.popleft()
                failure = next((r for r in results if isinstance(r, BaseException)), None)
                if failure is not None:
                    raise failure
        finally:
            self._states_ended = time.monotonic()
            self._hub_online.clear()

    async def _pump(self, client: aiomqtt.Client, again: list[OutboxRow]) -> None:
        if again:
            await self._hub_online.wait()
            log.info("sending the %s messages delivered just before the last session ended again", len(again))
            for start in range(0, len(again), self._window):
                rows = again[start : start + self._window]
                results = await asyncio.gather(
                    *(client.publish(r.topic, r.payload, qos=r.qos, retain=r.retain) for r in rows), return_exceptions=True
                )
                failure = next((r for r in results if isinstance(r, BaseException)), None)
                if failure is not None:
                    now = time.monotonic()  # still owed at the next session
                    self._delivered.extend((now, row) for row in again[start:])
                    raise failure
        while True:
            await self._hub_online.wait()
            # the store's lock may be held by a commit (an fsync): wait for it in a thread, not on the event loop;
            # cleared first, so that a commit while the rows are read wakes the wait below
            self._outbox_ready.clear()
            rows = await asyncio.to_thread(self._store.outbox_head, self._window)
            if not rows:
                await self._outbox_ready.wait()
                continue
            # publish() hands each message to paho as its task starts, in order; then waits for its PUBACK
            results = await asyncio.gather(
                *(client.publish(row.topic, row.payload, qos=row.qos, retain=row.retain) for row in rows),
                return_exceptions=True,
            )
            delivered = []
            now = time.monotonic()
            for row, result in zip(rows, results, strict=True):
                if isinstance(result, BaseException):
                    break
                delivered.append(row.id)
                self._delivered.append((now, row))
            while self._delivered and self._delivered[0][0] < now - RESEND_DELIVERED_S:
                self._delivered.popleft()
            await asyncio.to_thread(self._store.delete_outbox, delivered)  # a committed write: off the loop
            failure = next((r for r in results if isinstance(r, BaseException)), None)
            if failure is not None:
                raise failure
