"""The device agent: one mutual-TLS MQTT 5 session to the device's broker (normally its edge's), kept up.

Synchronous on purpose, so that a Raspberry Pi application embeds it without an event loop::

    dev = Device("dv-01", "/var/lib/mydevice", enrol_url="https://edge:8090", bootstrap_token=token,
                 ca_sha256=pin, tls_server_name=edge_node_id)   # both printed by the hub with the token

    @dev.command("reboot")
    def reboot(args: dict) -> dict | None: ...

    @dev.on_desired
    def apply(spec: dict) -> dict | None: ...     # the status to report; None: applied as desired

    dev.run_forever()                              # or start() ... emit(...) ... stop()
    dev.models.infer({"x": batch})                 # the installed model, swapped atomically on update

On connect the device subscribes to its own ``desired`` and ``cmd`` topics and publishes a retained
``online`` state, then a heartbeat every ``heartbeat_interval_s``. If it vanishes, the broker publishes
its retained ``offline`` last will; :meth:`Device.stop` publishes ``offline`` (reason shutdown) itself.
Every topic comes from :mod:`interfaces.topics` (DESIGN §4.4).

Over-the-air updates (DESIGN §4.2): the desired document's ``deployments`` go to the
:class:`~device.ota.updater.Updater` on the ``desired`` worker; its progress leaves as ``events`` of type
``deployment.execution``, and the reported status carries what is installed (``installed``, by kind). The
built-in commands ``infer`` (``{"inputs": {name: nested list}}``) and ``models`` use :attr:`Device.models`.

Task workers (DESIGN §4.3): the document's ``tasks`` go to :attr:`Device.tasks` (a
:class:`~device.tasks.host.WorkerHost`) after its deployments; the workers report on ``events``
(``task.worker``, ``task.log``, ``task.metrics``, ``task.output``) and fetch their inputs the way the
updater fetches artefacts. The stored orders run again at the next start.

Local datasets (DESIGN §5): :attr:`Device.datasets` (a :class:`~device.local_data.LocalDatasets` in
``<data dir>/datasets``) keeps data that never leaves the device; training workers read it, and the reported
status describes it under ``datasets`` (rows, row shape), reported again whenever a dataset is added or removed.

Events are stored before they leave (:mod:`device.outbox`): each one waits in ``<data dir>/outbox.db`` until
the edge acknowledges on ``events/ack`` that it has stored it, and is sent again after any reconnect until then,
in order and with the same envelope (the edge and the hub keep it once). ``durable_events=True`` (the default):
when :meth:`Device.emit` returns, the event survives a power cut; ``False``: it survives one within
``commit_window_s`` (50 ms), and emit costs no fsync.

Memory: :attr:`Device.models`, the updater and :attr:`Device.tasks` are made at their first use (at start only when
there is something to restore: an installed model, finished executions, running firmware, stored task orders), so an
idle agent loads neither them nor numpy, ONNX Runtime, cryptography or httpx (``bench/device_rss.py``).

Threads: paho's network thread runs the callbacks and answers ``ping`` and unknown commands itself (so
they are answered while a handler is busy); the application's command handlers run one at a time on the
``commands`` worker, the desired handler on the ``desired`` worker (the newest document wins); the ``events``
sender publishes the stored events. Other QoS 1 messages (state, reported, command answers) published while
disconnected wait in memory (``max_queued``) and leave in order after the reconnect; the reported status is
published again on every connect.

It stays one module: the agent's parts (commands, outbox, heartbeats, desired store, session plan, updater, task
host, channels) live in modules of their own; what is here is their wiring and paho's callbacks, which share one
client, its lock and its connection state.
"""

from __future__ import annotations

import logging
import queue
import signal
import socket
import ssl
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Literal, Self, TypeVar

import paho.mqtt.client as mqtt
import psutil
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode
from pydantic import BaseModel

from device.commands import MODEL_COMMANDS, CommandHandler, Commands, failure
from device.connection import PahoLog, encode, log_retry, parse_mqtt_url, tls_context
from device.desired import DesiredStore
from device.errors import ConfigError, IdentityError, NotRunning, OutboxFull, StoredStateError
from device.fl import FlChannel
from device.heartbeat import AGENT_VERSION, Heartbeats
from device import renewal
from device.identity import Enrolment, IdentityStore
from device.local_data import LocalDatasets
from device.outbox import DEFAULT_MAX_EVENTS, DEFAULT_WINDOW, OUTBOX_FILE, Outbox
from device.rejections import Rejections
from device.session import Presence, SessionPlan
from device.resources import ResourceSampler
from device.split.channel import InferChannel
from interfaces import API_PREFIX
from interfaces.deployments import EXECUTION_EVENT, EXECUTION_FAILURES, INSTALLED_KEY, ExecutionProgress
from interfaces.messages import (
    MAX_MESSAGE_BYTES,
    CommandBody,
    CommandError,
    CommandResultBody,
    Envelope,
    EventBody,
    EventsAckBody,
    HeartbeatBody,
    ReportedBody,
)
from interfaces.privacy import DATASETS_KEY
from interfaces.reconnect import RECONNECT_CAP_S
from interfaces.topics import (
    DEVICE_CMD,
    DEVICE_CMD_REPLY,
    DEVICE_DESIRED,
    DEVICE_EVENTS,
    DEVICE_EVENTS_ACK,
    DEVICE_FL,
    DEVICE_HEARTBEAT,
    DEVICE_INFER_REPLY,
    DEVICE_REPORTED,
    DEVICE_STATE,
    Topic,
)

if TYPE_CHECKING:
    from device.ota.firmware import BootResult
    from device.ota.models import ModelHost
    from device.ota.updater import Updater
    from device.tasks import WorkerHost
    from device.tasks.site import Site

log = logging.getLogger("aisynergy.device")

MIN_HEARTBEAT_S = 0.1
Severity = Literal["debug", "info", "warning", "error"]
DesiredHandler = Callable[[dict[str, Any]], dict[str, Any] | None]
H = TypeVar("H", bound=Callable[..., Any])
M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


@dataclass(frozen=True)
class DeviceStats:
    connected: bool
    messages_in: int
    messages_out: int
    dropped: int  # inbound messages rejected as malformed
    reconnects: int
    next_event_seq: int | None
    rss_bytes: int
    events_waiting: int = 0  # events the edge has not acknowledged yet


class _Worker:
    """One daemon thread running submitted calls in order (a hung handler never blocks process exit)."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, call: Callable[[], None]) -> None:
        self._calls.put(call)

    def close(self) -> None:
        self._calls.put(None)

    def _run(self) -> None:
        while (call := self._calls.get()) is not None:
            try:
                call()
            except Exception:  # a bug in our own code must not end the worker
                log.exception("internal error in %s", threading.current_thread().name)


class _Lazy(Generic[T]):
    """A part of the agent made at its first use, so that its modules load only when it is used (an idle agent
    has no model, no update, no task). :meth:`close` closes it if it was made; one made later is closed at once."""

    def __init__(self, make: Callable[[], T]) -> None:
        self._make = make
        self._lock = threading.Lock()
        self._value: T | None = None
        self._close: Callable[[T], None] | None = None

    def get(self) -> T:
        with self._lock:
            value = self._value
            if value is None:
                value = self._value = self._make()
                if self._close is not None:
                    self._close(value)
            return value

    def made(self) -> T | None:
        """The part if it was made, without making it."""
        with self._lock:
            return self._value

    def close(self, close: Callable[[T], None]) -> None:
        with self._lock:
            self._close = close
            value = self._value
        if value is not None:
            close(value)


class Device:
    """A device's MQTT session and its handlers; see the module docstring.

    ``enrol_url`` and ``bootstrap_token`` are needed only on the first start, and so are ``ca_sha256`` (the hub
    CA's fingerprint, checked before the token is sent: see :mod:`device.enrol`) and ``tls_server_name`` (the
    name in the enrolment server's certificate when it is not the URL's host: the node id of an edge); the
    hub's bootstrap-token answer gives all three. ``mqtt_url`` and ``heartbeat_interval_s`` override what
    enrolment returned. Raises :class:`~device.errors.ConfigError` for a bad device id, URL, pin or interval.

    The certificate is renewed from the stored identity at start and every ``renewal_check_s`` (12 hours) once less
    than 60 days of it are left (:mod:`device.renewal`); a start with a certificate expired beyond the renewal
    grace window raises :class:`~device.errors.IdentityError` (re-enrol with a new bootstrap token).
    """

    def __init__(
        self,
        device_id: str,
        data_dir: str | Path,
        enrol_url: str | None = None,
        bootstrap_token: str | None = None,
        mqtt_url: str | None = None,
        heartbeat_interval_s: float | None = None,
        *,
        keepalive_s: int = 30,
        reconnect_cap_s: float = RECONNECT_CAP_S,
        max_queued: int = 1000,
        durable_events: bool = True,
        max_events_waiting: int = DEFAULT_MAX_EVENTS,
        sampler: ResourceSampler | None = None,
        reboot: Callable[[], None] | None = None,
        firmware_boot: BootResult | None = None,
        ca_sha256: str | None = None,
        tls_server_name: str | None = None,
        renewal_check_s: float = renewal.RENEWAL_CHECK_S,
    ) -> None:
        try:
            DEVICE_STATE.topic(device_id=device_id)
        except ValueError as exc:
            raise ConfigError(f"invalid device id: {exc}") from None
        if heartbeat_interval_s is not None and heartbeat_interval_s < MIN_HEARTBEAT_S:
            raise ConfigError(f"heartbeat interval {heartbeat_interval_s} s is below {MIN_HEARTBEAT_S} s")
        if mqtt_url is not None:
            parse_mqtt_url(mqtt_url)
        self.device_id = device_id
        self.node_id: str | None = None  # the edge serving this device, known from enrolment
        self.data_dir = Path(data_dir)
        self.identity = IdentityStore(self.data_dir)
        self._enrol_url, self._bootstrap_token = enrol_url, bootstrap_token
        self._ca_sha256, self._tls_server_name = ca_sha256, tls_server_name
        if ca_sha256 is not None:
            from device.enrol import parse_ca_pin  # a bad pin is a ConfigError now, not at the first start

            parse_ca_pin(ca_sha256)
        self._mqtt_url, self._heartbeat_interval_s = mqtt_url, heartbeat_interval_s
        self._renewal_check_s = renewal_check_s
        self._renewal_tried = False  # at this start (enrol() and start() renew once between them)
        self._tls: ssl.SSLContext | None = None
        try:  # the session core (device.session): the same plan as the edge's links, run on paho's own thread
            self._plan = SessionPlan(
                device_id,
                keepalive_s,
                reconnect_cap_s=reconnect_cap_s,
                presence=Presence(DEVICE_STATE, device_id, {"device_id": device_id}),
            )
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self._max_queued = max_queued
        self._durable_events, self._max_events_waiting = durable_events, max_events_waiting
        self._sampler = sampler
        self._reboot = reboot
        self.firmware_boot = firmware_boot  # what FirmwareSlots.boot() decided at this start; None without firmware slots
        self._commands = Commands()
        self._desired_handler: DesiredHandler | None = None
        # the model host, the OTA updater and the task host are made when first used (see _Lazy)
        self._models = _Lazy(self._make_models)
        self._enrolled: Enrolment | None = None  # set by start(); the updater needs its URL
        self._updater = _Lazy(self._make_updater)
        self._tasks = _Lazy(self._make_tasks)
        self.datasets = LocalDatasets(self.data_dir / "datasets", on_change=self._report_local_state)
        self.infer = InferChannel(device_id, self._publish_raw)
        """split inference: requests to the edge's tail workers (a ``split_inference`` head worker uses it)"""
        self.fl = FlChannel(device_id, self._publish_fl)
        """federated training: updates to the edge's aggregator (a hierarchical ``federated_training`` worker uses it)"""
        for name in MODEL_COMMANDS:
            self._commands.register_builtin(name, self._model_command(name))

        self._lifecycle = threading.Lock()
        self._client: mqtt.Client | None = None
        self._connected = threading.Event()
        self._stopping = threading.Event()
        self._event_lock = threading.Lock()  # guards _accepting_events against stop()
        self._accepting_events = False
        self._outbox: Outbox | None = None
        self._stats_lock = threading.Lock()
        self._messages_in = self._messages_out = self._reconnects = 0
        self._rejections = Rejections(log)
        self._backoff = self._plan.backoff()
        self._paho_log = logging.getLogger("aisynergy.device.mqtt")
        self._paho_filter = PahoLog()

    @property
    def models(self) -> ModelHost:
        """The served models (:class:`~device.ota.models.ModelHost`), swapped atomically on update."""
        return self._models.get()

    @property
    def tasks(self) -> WorkerHost:
        """The task workers (:class:`~device.tasks.host.WorkerHost`) of the desired document's orders."""
        return self._tasks.get()

    def _make_models(self) -> ModelHost:
        from device.ota.models import ModelHost

        return ModelHost(self.data_dir / "ota" / "models")

    def _make_tasks(self) -> WorkerHost:
        from device.tasks import InputFetcher, WorkerHost

        fetch_inputs = InputFetcher.through(self.data_dir / "tasks" / "inputs", self._ota)
        return WorkerHost(
            self.data_dir / "tasks", self.models, self._task_event, fetch_inputs, self.datasets, infer=self.infer, fl=self.fl, site=self._training_site()
        )

    def _training_site(self) -> Site | None:
        """What a ``training`` worker gets here: the local datasets, a directory under the data dir, and the edge the
        device enrolled through, which relays the upload of its results to the hub (``edge.upload_relay``)."""
        from device.tasks.site import Site

        enrolment = self._enrolled
        if enrolment is None:
            return None
        return Site(self.data_dir / "tasks" / "training", enrolment.enrol_url, self.datasets.paths(), verify=self._server_context(),
                    server_name=enrolment.tls_server_name, private=self.data_dir)  # fmt: skip

    def _model_command(self, name: str) -> CommandHandler:
        """The built-in command ``name`` over :attr:`models` (``device.ota.models`` loads at its first call)."""

        def run(args: dict[str, Any]) -> dict[str, Any] | None:
            from device.ota.models import model_commands

            return model_commands(self.models)[name](args)

        return run

    # ---- registration -------------------------------------------------------------------------------
    def command(self, name: str) -> Callable[[H], H]:
        """Decorator: ``handler(args) -> dict | None`` answers the command ``name``; raising answers
        ``ok=false`` with ``error_code`` ``failed``."""

        Commands.check_name(name)  # refuse a bad name at the decorator line, not at registration

        def register(handler: H) -> H:
            self._commands.register(name, handler)
            return handler

        return register

    def on_desired(self, handler: H) -> H:
        """Decorator: ``handler(spec) -> dict | None`` applies a new desired document and returns the
        status to report (``None``: applied exactly as desired, so the spec itself is reported)."""
        self._desired_handler = handler
        return handler

    # ---- lifecycle ----------------------------------------------------------------------------------
    def enrol(self) -> bool:
        """Enrol now if no identity is stored, or renew a certificate that is due (:meth:`start` does both
        otherwise); ``True`` when it enrolled or renewed.

        ``aisynergy device run`` enrols this way and then starts itself again, so that the running agent does not
        keep the enrolment's libraries (the HTTP client, the CSR code) in its memory. Raises what :meth:`start` does.
        """
        with self._lifecycle:
            self.identity.secure()
            self.identity.check_owner(self.device_id)
            if self.identity.is_enrolled():
                held = self.identity.load_enrolment().serial
                return self._enrolment().serial != held
            self._enrolment()
            return True

    def start(self) -> None:
        """Enrol if needed, then connect in the background and return. A second call does nothing.

        Raises :class:`~device.errors.DeviceError` subclasses: ``ConfigError``, ``StoredStateError``
        (``IdentityError``, ``IdentityMismatch``), ``EnrolmentError`` (``EnrolmentUnreachable``).
        """
        with self._lifecycle:
            if self._client is not None:
                return
            if self._stopping.is_set():
                raise NotRunning("a stopped Device cannot be started again; make a new one")
            self.identity.secure()
            enrolment = self._enrolment()
            self.node_id = enrolment.node_id
            self._host, self._port = parse_mqtt_url(self._mqtt_url or enrolment.mqtt_url)
            interval = self._heartbeat_interval_s or enrolment.heartbeat_interval_s
            if interval < MIN_HEARTBEAT_S:
                raise ConfigError(f"heartbeat interval {interval} s is below {MIN_HEARTBEAT_S} s")
            try:
                tls = self._tls = tls_context(self.identity.ca_path, self.identity.cert_path, self.identity.key_path)
            except OSError as exc:  # ssl.SSLError included: the key does not match the certificate
                raise IdentityError(f"cannot load the device certificate and key: {exc}") from exc
            self._desired = DesiredStore(self.data_dir / "desired.json")
            self._outbox = Outbox(
                self.data_dir / OUTBOX_FILE,
                durable=self._durable_events,
                max_events=self._max_events_waiting,
                window=max(1, min(DEFAULT_WINDOW, self._max_queued // 2)),  # room in paho's queue for the rest
                legacy_sequence=self.data_dir / "event-seq",
            )
            sampler = self._sampler or ResourceSampler(self.data_dir)
            self._heartbeats = Heartbeats(interval, sampler, AGENT_VERSION, self._send_heartbeat, self._connected)
            self._command_worker, self._desired_worker = _Worker("aisynergy-commands"), _Worker("aisynergy-desired")
            self._accepting_events = True
            self._paho_log.addFilter(self._paho_filter)
            self._client = self._make_client(tls)
            self._enrolled = enrolment
            # made now only when there is something to restore or report (the installed model, finished executions,
            # the firmware this boot runs or ended; the stored task orders), else at the first order that needs it
            firmware_runs = self.firmware_boot is not None and self.firmware_boot.outcome != "none"
            if firmware_runs or (self.data_dir / "ota").exists():
                self._updater.get()
            if self._desired.record.tasks or (self.data_dir / "tasks").exists():
                self._desired_worker.submit(lambda: self.tasks.apply(self._desired.record.tasks))  # what ran before
            self._sender = threading.Thread(target=self._send_events, name="aisynergy-events", daemon=True)
            self._sender.start()
            threading.Thread(target=self._renew_periodically, name="aisynergy-renewal", daemon=True).start()
            log.info("connecting to mqtts://%s:%s as %s", self._host, self._port, self.device_id)
            plan = self._plan
            self._client.connect_async(
                self._host, self._port, keepalive=plan.keepalive_s, clean_start=plan.clean_start, properties=plan.connect_properties()
            )
            self._client.loop_start()
            self._heartbeats.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Publish the retained ``offline`` state (reason shutdown) if connected, then disconnect."""
        with self._lifecycle:
            first = not self._stopping.is_set()
            self._stopping.set()
            client = self._client
            if client is None or not first:
                return
        # a download in progress stops (it resumes on the next start); the workers stop before events close, so
        # that their last log lines still leave
        self._updater.close(lambda updater: updater.canceled.set())
        self._tasks.close(lambda tasks: tasks.stop(timeout_s / 2))
        with self._event_lock:
            self._accepting_events = False
        assert self._outbox is not None
        self._outbox.close(timeout_s)  # what the edge has not acknowledged leaves at the next start
        self._sender.join(timeout_s)
        self._heartbeats.stop(timeout_s)
        self._command_worker.close()
        self._desired_worker.close()
        if self._connected.is_set():
            info = self._publish_presence(self._plan_presence.farewell())
            try:
                info.wait_for_publish(timeout_s)
            except (RuntimeError, ValueError) as exc:
                log.warning("could not publish offline: %s", exc)
            if info.is_published():
                log.info("published offline (shutdown); disconnecting")
        client.disconnect()
        client.loop_stop()
        self._connected.clear()
        self._paho_log.removeFilter(self._paho_filter)

    def reboot(self) -> bool:
        """:meth:`stop` (``offline`` published), then the ``reboot`` hook, which restarts the agent so that a
        firmware slot just installed boots (``aisynergy device run``: the process re-executes itself).
        False, and nothing stopped, without a hook: the embedding application restarts on its own terms."""
        if self._reboot is None:
            return False
        log.info("rebooting")
        self.stop()
        self._reboot()
        return True

    def run_forever(self) -> None:
        """:meth:`start`, block until SIGTERM or SIGINT, then :meth:`stop`. Call it from the main thread."""
        self.start()
        received = threading.Event()

        def on_signal(signum: int, frame: object) -> None:
            log.info("received %s; stopping", signal.Signals(signum).name)
            received.set()

        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            while not received.wait(1.0):
                pass
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.stop()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def stats(self) -> DeviceStats:
        with self._stats_lock:
            counts = (self._messages_in, self._messages_out, self._rejections.total, self._reconnects)
        outbox = self._outbox
        next_seq = outbox.next_seq if outbox is not None else None
        waiting = outbox.waiting if outbox is not None else 0
        return DeviceStats(self.connected, *counts, next_seq, psutil.Process().memory_info().rss, waiting)

    # ---- events -------------------------------------------------------------------------------------
    def emit(
        self, type: str, data: dict[str, Any] | None = None, *, severity: Severity = "info", message: str | None = None
    ) -> int:
        """Store an event for the edge and return its ``seq``; it leaves in order, now or after a reconnect.

        Durability: with ``durable_events`` (the default), when this returns the event is committed to the
        device's outbox with an fsync and survives a power cut; without it, it is committed within 50 ms. It is
        kept until the edge has stored it (see :mod:`device.outbox`).

        Raises ``ValueError`` for an invalid event, :class:`~device.errors.NotRunning` before
        :meth:`start` or after :meth:`stop`, :class:`~device.errors.OutboxFull` when ``max_events_waiting``
        events already wait for the edge (nothing is stored: the application decides what to do),
        :class:`~device.errors.StoredStateError` when the outbox cannot be written.
        """
        return self._send_event(EventBody(type=type, severity=severity, message=message, data=data or {}))

    def _send_event(self, body: EventBody) -> int:
        with self._event_lock:
            if not self._accepting_events or self._outbox is None:
                raise NotRunning("the device is not running; call start() first")
            outbox = self._outbox

        def payload(seq: int, prev: int | None) -> bytes:
            event = body.model_copy(update={"seq": seq, "prev_seq": prev})
            return encode(DEVICE_EVENTS, self.device_id, event)

        seq = outbox.append(payload)
        log.debug("event %s seq %s stored", body.type, seq)
        return seq

    def _send_events(self) -> None:
        """The ``events`` sender: publish the stored events in order while connected (see :mod:`device.outbox`)."""
        outbox, topic = self._outbox, DEVICE_EVENTS.topic(device_id=self.device_id)
        assert outbox is not None
        while not self._stopping.is_set():
            client = self._client
            rows = outbox.sendable(client is not None and self._connected.is_set())
            if not rows:
                outbox.wait(0.5)
                continue
            for seq, payload in rows:
                assert client is not None
                info = client.publish(topic, payload, qos=DEVICE_EVENTS.qos, retain=DEVICE_EVENTS.retain)
                if info.rc not in (MQTTErrorCode.MQTT_ERR_SUCCESS, MQTTErrorCode.MQTT_ERR_NO_CONN):
                    log.warning("event %s not handed to the broker (%s); it is sent again", seq, info.rc)
                    outbox.rewind()
                    self._stopping.wait(0.2)  # paho's queue is full: let its network thread drain it first
                    break
                with self._stats_lock:
                    self._messages_out += 1

    def _on_events_ack(self, message: mqtt.MQTTMessage) -> None:
        try:
            ack: Envelope[EventsAckBody] = self._parse(DEVICE_EVENTS_ACK, message)
        except ValueError as exc:
            self._reject(message, exc)
            return
        assert self._outbox is not None
        done = self._outbox.acknowledge(ack.body.seq, ack.body.resend)
        log.debug("the edge has stored events up to %s (%s newly; resend=%s)", ack.body.seq, done, ack.body.resend)

    def _report_error(self, type: str, message: str, **data: Any) -> None:
        """An error event from the agent itself; never raises (it runs in callbacks and workers)."""
        try:
            self._send_event(EventBody(type=type, severity="error", message=message[:8192], data=data))
        except (NotRunning, OutboxFull, StoredStateError, ValueError, OSError) as exc:
            log.warning("could not report %s: %s", type, exc)

    # ---- enrolment and connection -------------------------------------------------------------------
    def _enrolment(self) -> Enrolment:
        self.identity.check_owner(self.device_id)
        if self.identity.is_enrolled():
            enrolment = self.identity.load_enrolment()
            if self._enrol_url and self._enrol_url.rstrip("/") != enrolment.enrol_url.rstrip("/"):
                log.warning(
                    "enrolled with %s, not %s; keeping the stored identity", enrolment.enrol_url, self._enrol_url
                )
            log.info("using the stored identity of %s (serial %s)", self.device_id, enrolment.serial)
            self.identity.check_complete()
            renewal.check_renewable(self.identity, enrolment)
            if not self._renewal_tried and renewal.due(enrolment):
                self._renewal_tried = True
                enrolment = self._renew(enrolment, renewal.START_ATTEMPTS) or enrolment
        else:
            if not self._enrol_url or not self._bootstrap_token:
                raise ConfigError("a first start needs enrol_url and bootstrap_token")
            from device.enrol import request_certificate  # httpx is loaded only when enrolling

            csr = self.identity.make_csr(self.device_id)
            issued = request_certificate(
                self._enrol_url, self.device_id, csr, self._bootstrap_token, ca_sha256=self._ca_sha256, server_name=self._tls_server_name
            )
            enrolment = self.identity.save(issued, self._enrol_url, tls_server_name=self._tls_server_name)
        self.identity.check_complete()
        return enrolment

    def _renew(self, enrolment: Enrolment, attempts: int) -> Enrolment | None:
        """Renew the certificate (:mod:`device.renewal`); the MQTT session presents it from its next connection."""
        from device.enrol import DEVICE  # httpx and cryptography: loaded only when a renewal is due

        renewed = renewal.renew(self.identity, DEVICE, enrolment, attempts=attempts)
        if renewed is not None and self._tls is not None:
            try:
                self._tls.load_cert_chain(str(self.identity.cert_path), str(self.identity.key_path))
            except OSError as exc:
                log.error("cannot load the renewed certificate: %s", exc)
            self._enrolled = renewed
        return renewed

    def _renew_periodically(self) -> None:
        """Every ``renewal_check_s``: renew when less than RENEW_BEFORE is left; after a failure, again sooner."""
        wait = self._renewal_check_s
        while not self._stopping.wait(wait):
            enrolment, wait = self._enrolled, self._renewal_check_s
            if enrolment is not None and renewal.due(enrolment) and self._renew(enrolment, attempts=3) is None:
                wait = min(renewal.RENEWAL_RETRY_S, self._renewal_check_s)

    def _server_context(self) -> ssl.SSLContext:
        """How downloads from the enrolment server are checked: the stored hub CA (and the system's CAs)."""
        from device.tls import agent_context  # httpx's module: loaded with the first download, not by an idle agent

        return agent_context(self.identity.ca_path)

    def _ota(self) -> Updater | None:
        """The OTA updater, made at the first order when start() did not need it; ``None`` before start()."""
        return self._updater.get() if self._enrolled is not None else None

    def _make_updater(self) -> Updater:
        """The OTA updater; when made it ends the firmware execution this boot decided and loads the installed model."""
        from device.ota.updater import Updater

        enrolment = self._enrolled
        assert enrolment is not None, "the updater is made after enrolment"

        firmware = None
        if self.firmware_boot is not None or self._reboot is not None:  # otherwise device.ota.firmware stays unloaded
            from device.ota.firmware import FirmwareSlots

            firmware = FirmwareSlots(self.data_dir / "firmware")
        updater = Updater(
            self.data_dir,
            self.identity.signing_key_pem(),
            f"{enrolment.enrol_url.rstrip('/')}{API_PREFIX}",
            self._send_progress,
            firmware,
            self.reboot if self._reboot is not None else None,
            models=self.models,
            verify=self._server_context(),
            server_name=enrolment.tls_server_name,
        )
        updater.pin_signing_keys = self.identity.pin_signing_key  # the hub rotated its key: keep the one it leads to
        if self.firmware_boot is not None:
            updater.report_boot(self.firmware_boot)
        updater.restore()
        return updater

    def _task_event(self, type: str, data: dict[str, Any], severity: Severity) -> None:
        self.emit(type, data, severity=severity)

    def _send_progress(self, progress: ExecutionProgress) -> None:
        severity: Severity = "error" if progress.state in EXECUTION_FAILURES else "info"
        try:
            self.emit(EXECUTION_EVENT, progress.model_dump(mode="json", exclude_none=True), severity=severity)
        except (NotRunning, OutboxFull, StoredStateError) as exc:  # the order is delivered again; a finished one is reported again
            log.warning("could not report execution %s %s: %s", progress.execution_id, progress.state, exc)

    def _with_installed(self, status: dict[str, Any]) -> dict[str, Any]:
        """``status`` with what the device runs (``installed``) and the datasets it keeps (``datasets``)."""
        updater = self._updater.made()  # not made: nothing was ever installed
        installed = updater.installed() if updater is not None else {}
        if installed:
            status = {**status, INSTALLED_KEY: {kind: a.model_dump(mode="json") for kind, a in installed.items()}}
        datasets = self.datasets.describe()
        if datasets:
            status = {**status, DATASETS_KEY: datasets}
        elif DATASETS_KEY in status:
            status = {k: v for k, v in status.items() if k != DATASETS_KEY}
        return status

    def _report_local_state(self) -> None:
        """A dataset was added or removed: report the status again now (else at the next connect)."""
        if self._client is None or not self._connected.is_set() or self._stopping.is_set():
            return
        record = self._desired.record
        status = record.status if record.applied_version >= 0 else {}
        self._publish(DEVICE_REPORTED, ReportedBody(version=max(record.applied_version, 0), status=self._with_installed(status)))

    def _make_client(self, tls: Any) -> mqtt.Client:
        client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=self.device_id, protocol=mqtt.MQTTv5)
        client.tls_set_context(tls)
        client.enable_logger(self._paho_log)
        client.max_queued_messages_set(self._max_queued)
        client.connect_timeout = self._plan.connect_timeout_s
        client.on_connect = self._on_connect
        client.on_connect_fail = self._on_connect_fail
        client.on_disconnect = self._on_disconnect
        client.on_subscribe = self._on_subscribe
        client.on_message = self._on_message
        self._set_will(client)
        return client

    def _set_will(self, client: mqtt.Client) -> None:
        presence = self._plan_presence
        client.will_set(presence.state_topic, presence.will(), qos=presence.qos, retain=presence.retain)

    def _retry_later(self, client: mqtt.Client, reason: str) -> None:
        """Runs in the callback paho makes just before it waits to reconnect: set that wait, jittered."""
        if self._stopping.is_set():
            return
        delay = self._backoff.failed()
        client.reconnect_delay_set(delay, delay)  # type: ignore[arg-type]  # seconds; paho takes a float
        self._set_will(client)  # a fresh envelope for the next session's will
        log_retry(log, f"{self._host}:{self._port}", reason, delay, detail=self._paho_filter.take())

    def _on_connect(
        self, client: mqtt.Client, userdata: object, flags: object, reason: ReasonCode, props: Properties | None
    ) -> None:
        if reason.is_failure:
            log.error("broker %s:%s refused %s: %s", self._host, self._port, self.device_id, reason)
            return
        if self._stopping.is_set():  # stop() came while this connection was being made
            client.disconnect()
            return
        sock = client.socket()
        if sock is not None:  # small request/response packets must not wait for delayed ACKs (~40 ms a hop)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        log.info("connected to %s:%s as %s", self._host, self._port, self.device_id)
        self._backoff.connected()
        self._connected.set()
        wanted = (DEVICE_DESIRED, DEVICE_CMD, DEVICE_INFER_REPLY, DEVICE_EVENTS_ACK)
        client.subscribe([(t.topic(device_id=self.device_id), t.qos) for t in wanted])
        assert self._outbox is not None
        self._outbox.rewind()  # what the edge has not acknowledged leaves again, in order
        self._publish_presence(self._plan_presence.online())
        record = self._desired.record
        if record.applied_version >= 0:  # say it again: a report queued when the process last ended never left
            self._publish(DEVICE_REPORTED, ReportedBody(version=record.applied_version, status=self._with_installed(record.status)))
        elif ((updater := self._updater.made()) is not None and updater.installed()) or self.datasets.names():
            # no desired document applied yet, but something runs (factory firmware) or data is kept: the hub
            # needs to know what, to offer deltas, to know what a rollback returns to, to account privacy
            self._publish(DEVICE_REPORTED, ReportedBody(version=0, status=self._with_installed({})))
        if record.pending:  # stored but not applied: a crash in between, or the handler failed
            self._desired_worker.submit(self._apply_desired)
        self._heartbeats.beat_now()

    def _on_connect_fail(self, client: mqtt.Client, userdata: object) -> None:
        exc = sys.exc_info()[1]  # paho calls this inside its ``except OSError`` without passing it on
        self._retry_later(client, f"{type(exc).__name__}: {exc}" if exc else "connection failed")

    def _on_disconnect(
        self, client: mqtt.Client, userdata: object, flags: object, reason: ReasonCode, props: Properties | None
    ) -> None:
        self._connected.clear()
        if self._stopping.is_set():
            log.info("disconnected from %s:%s", self._host, self._port)
            return
        with self._stats_lock:
            self._reconnects += 1
        self._retry_later(client, f"disconnected: {reason}")

    def _on_subscribe(
        self, client: mqtt.Client, userdata: object, mid: int, reasons: list[ReasonCode], props: Properties | None
    ) -> None:
        refused = [str(r) for r in reasons if r.is_failure]
        if refused:
            log.error("broker refused a subscription of %s: %s", self.device_id, ", ".join(refused))

    # ---- publishing ---------------------------------------------------------------------------------
    @property
    def _plan_presence(self) -> Presence:
        assert self._plan.presence is not None
        return self._plan.presence

    def _publish_presence(self, payload: bytes) -> mqtt.MQTTMessageInfo:
        """The retained ``state`` the session core made (online, or offline at a clean stop)."""
        assert self._client is not None
        presence = self._plan_presence
        info = self._client.publish(presence.state_topic, payload, qos=presence.qos, retain=presence.retain)
        self._count_out(info, presence.qos)
        return info

    def _count_out(self, info: mqtt.MQTTMessageInfo, qos: int) -> None:
        """A message sent, or queued by paho to leave on the next connection (QoS 1)."""
        if info.rc == MQTTErrorCode.MQTT_ERR_SUCCESS or (info.rc == MQTTErrorCode.MQTT_ERR_NO_CONN and qos):
            with self._stats_lock:
                self._messages_out += 1

    def _publish(
        self,
        topic: Topic[Any],
        body: BaseModel,
        *,
        to: str | None = None,
        reply_to: str | None = None,
        properties: Properties | None = None,
    ) -> mqtt.MQTTMessageInfo:
        """Publish ``body`` in an envelope with the topic's QoS and retain flag (``to``: a response topic)."""
        assert self._client is not None
        info = self._client.publish(
            to or topic.topic(device_id=self.device_id),
            encode(topic, self.device_id, body, reply_to),
            qos=topic.qos,
            retain=topic.retain,
            properties=properties,
        )
        self._count_out(info, topic.qos)
        return info

    def _publish_fl(self, body: BaseModel) -> None:
        if self._client is None:
            raise NotRunning("the device has not started")
        self._publish(DEVICE_FL, body)

    def _publish_raw(self, topic: str, payload: bytes, qos: int, properties: Properties) -> bool:
        """Publish bytes as they are (a binary channel: ``infer``); False when not connected."""
        client = self._client
        if client is None or not self._connected.is_set():
            return False
        info = client.publish(topic, payload, qos=qos, properties=properties)
        if info.rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
            return False
        with self._stats_lock:
            self._messages_out += 1
        return True

    def _send_heartbeat(self, body: HeartbeatBody) -> None:
        self._publish(DEVICE_HEARTBEAT, body)

    # ---- incoming -----------------------------------------------------------------------------------
    def _on_message(self, client: mqtt.Client, userdata: object, message: mqtt.MQTTMessage) -> None:
        with self._stats_lock:
            self._messages_in += 1
        try:
            if message.topic == DEVICE_DESIRED.topic(device_id=self.device_id):
                self._on_desired(message)
            elif message.topic == DEVICE_CMD.topic(device_id=self.device_id):
                self._on_command(message)
            elif message.topic == DEVICE_EVENTS_ACK.topic(device_id=self.device_id):
                self._on_events_ack(message)
            elif message.topic == self.infer.reply_topic:
                self.infer.on_reply(message.payload, message.properties)
            else:
                log.debug("ignoring a message on %s", message.topic)
        except Exception:  # an exception here would end paho's network thread
            log.exception("internal error handling a message on %s", message.topic)

    def _parse(self, topic: Topic[M], message: mqtt.MQTTMessage) -> M:
        if len(message.payload) > MAX_MESSAGE_BYTES:
            raise ValueError(f"{len(message.payload)} bytes exceed the {MAX_MESSAGE_BYTES} byte limit")
        return topic.payload.model_validate_json(message.payload)

    def _reject(self, message: mqtt.MQTTMessage, exc: ValueError) -> None:
        """Drop a malformed message, count it and say so on ``events`` (DESIGN §6)."""
        event = self._rejections.reject(message.topic, exc, message.payload)
        self._report_error(event.type, event.message or "", **event.data)

    def _on_desired(self, message: mqtt.MQTTMessage) -> None:
        if not message.payload:
            log.info("the desired document was cleared")
            return
        try:
            request: Envelope[Any] = self._parse(DEVICE_DESIRED, message)
        except ValueError as exc:
            self._reject(message, exc)
            return
        desired = request.body
        try:
            fresh = self._desired.offer(desired, request.id)
        except OSError as exc:
            log.error("cannot store desired version %s: %s", desired.version, exc)
            self._report_error("desired_not_stored", str(exc), version=desired.version)
            return
        if not fresh:
            log.debug("desired version %s is not newer than what the device has; ignored", desired.version)
            return
        log.info("desired version %s received", desired.version)
        self._desired_worker.submit(self._apply_desired)

    def _apply_desired(self) -> None:
        record = self._desired.record
        if not record.pending or self._stopping.is_set():
            return  # an earlier call already applied the newest document
        if record.orders_pending and (updater := self._ota()) is not None:
            updater.apply(record.deployments)  # reports each execution's progress itself
            if self._stopping.is_set():
                return  # interrupted: the orders are applied again on the next start
        if record.tasks_pending:
            self.tasks.apply(record.tasks)
        try:
            if record.version > record.applied_version:
                status = self._desired_handler(dict(record.spec)) if self._desired_handler else None
                status = record.spec if status is None else status
            else:  # only the orders changed
                status = {k: v for k, v in record.status.items() if k not in (INSTALLED_KEY, DATASETS_KEY)}
            report = ReportedBody(version=record.version, status=self._with_installed(status))
        except Exception as exc:  # the application's handler; retried on the next connect or start
            log.exception("applying desired version %s failed", record.version)
            self._report_error("desired_failed", f"{type(exc).__name__}: {exc}", version=record.version)
            return
        try:
            self._desired.applied(record.version, report.status, record.deployments_version, record.tasks_version)
        except OSError as exc:
            log.error("cannot record desired version %s as applied: %s", record.version, exc)
            self._report_error("desired_not_stored", str(exc), version=record.version)
            return
        self._publish(DEVICE_REPORTED, report, reply_to=record.message_id)
        log.info("desired version %s applied and reported", record.version)

    def _on_command(self, message: mqtt.MQTTMessage) -> None:
        props = message.properties
        reply_topic = getattr(props, "ResponseTopic", None) or DEVICE_CMD_REPLY.topic(device_id=self.device_id)
        correlation = getattr(props, "CorrelationData", None)
        try:
            request: Envelope[CommandBody] = self._parse(DEVICE_CMD, message)
        except ValueError as exc:
            self._reject(message, exc)
            self._answer(reply_topic, correlation, None, "?", failure(CommandError.VALIDATION_FAILED, str(exc)))
            return

        def answer() -> None:
            result = self._commands.execute(request.body)
            self._answer(reply_topic, correlation, request.id, request.body.name, result)

        if self._commands.runs_a_handler(request.body):
            self._command_worker.submit(answer)
        else:
            answer()

    def _answer(
        self, topic: str, correlation: bytes | None, request_id: str | None, name: str, result: CommandResultBody
    ) -> None:
        """Publish ``result`` on the command's response topic, echoing its correlation data."""
        props = Properties(PacketTypes.PUBLISH)
        if correlation is not None:
            props.CorrelationData = correlation
        try:
            try:
                self._publish(DEVICE_CMD_REPLY, result, to=topic, reply_to=request_id, properties=props)
            except ValueError as exc:  # a handler result JSON cannot carry
                result = failure(CommandError.FAILED, f"the result cannot be serialised: {exc}")
                self._publish(DEVICE_CMD_REPLY, result, to=topic, reply_to=request_id, properties=props)
        except ValueError as exc:  # the requester's response topic is not one a client may publish to
            log.warning("cannot answer command %s (%s) on %r: %s", name, request_id, topic, exc)
            return
        log.info("command %s (%s) answered ok=%s", name, request_id, result.ok)
