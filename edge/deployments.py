"""The edge node as a deployment target (DESIGN §4.2): models and applications for the node itself.

The orders in the node's desired document go to the :class:`~device.ota.updater.Updater` a device runs,
over ``DIR/ota``: the manifest's Ed25519 signature is checked against the hub key pinned at enrolment
before a byte is fetched, the content's size and SHA-256 before anything is installed; a downgrade is
REJECTED unless the order says ``allow_downgrade``; models are swapped atomically in a
:class:`~device.ota.models.ModelHost`. The node downloads from the hub itself (``<hub URL>/api/v1``, with
Range resume). It takes no firmware: a firmware order is REJECTED with the reason.

``Updater.apply`` runs on a worker thread, one document at a time in arrival order; of several documents
that arrive while one is applied, the newest wins (each carries the full list of orders). A finished
order delivered again (the retained document at every connect) only reports its final state again.

Each progress leaves as an ``events`` message of type ``deployment.execution`` with a ``seq`` that only
grows across restarts (``DIR/node-event-seq``), through the relay's outbox: stored first, delivered in
order once the upstream link and the hub are back, so progress survives an outage. After each document
the node reports again (through the outbox too), its status carrying what is installed
(``installed``, by kind). ``infer`` and ``models`` are answered from the installed models.

Task workers (DESIGN §4.3): the document's ``tasks`` go to :attr:`NodeDeployments.tasks`, a
:class:`~device.tasks.host.WorkerHost` over the same models, on the same worker after the deployment
orders (whenever ``tasks_version`` grows, and at each start). Their events take the same path as the
progress; their inputs come from the hub like the node's own artefacts (signed manifest, pinned key). A
``split_inference`` tail worker answers the devices' requests through ``infer`` (:class:`edge.split.TailRouter`); a
``federated_training`` aggregator takes its devices' updates from ``fl`` (:class:`edge.fl.FlRouter`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import ssl
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from device.commands import Commands
from device.errors import OutboxFull, StoredStateError
from device.ota.models import ModelHost, model_commands
from device.ota.updater import Updater
from device.sequence import EventSequence
from device.tasks import InputFetcher, WorkerHost
from device.tasks.site import Site
from interfaces import API_PREFIX
from interfaces.deployments import (
    EXECUTION_EVENT,
    EXECUTION_FAILURES,
    INSTALLED_KEY,
    DeploymentOrder,
    ExecutionProgress,
)
from interfaces.messages import DesiredBody, EventBody, ReportedBody, envelope
from interfaces.tasks import WorkerOrder
from interfaces.topics import NODE_EVENTS, NODE_REPORTED, Topic

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    from device.ota.verify import TrustedKeys

    from edge.fl import FlRouter
    from edge.split import TailRouter

log = logging.getLogger("aisynergy.edge.deployments")

SEQUENCE_FILE = "node-event-seq"
NO_FIRMWARE = "an edge node takes no firmware updates (only models and applications)"
SendUp = Callable[[str, bytes, Topic[Any]], bool]  # the relay's outbox: (topic, payload, topic kind) -> stored
STOP_WAIT_S = 10.0


class NodeDeployments:
    """Carries out the node's own deployment orders; see the module docstring.

    ``send_up`` stores a message for the hub (:meth:`edge.relay.DeviceRelay.enqueue`); it is called from
    the worker thread. ``hub_url`` ``None``: every order FAILS (no artefact source).
    """

    def __init__(
        self,
        node_id: str,
        data_dir: Path,
        signing_key: TrustedKeys | Ed25519PublicKey | None,
        hub_url: str | None,
        send_up: SendUp,
        signing_key_source: Callable[[], TrustedKeys | Ed25519PublicKey | None] | None = None,
        infer: TailRouter | None = None,
        fl: FlRouter | None = None,
        verify: ssl.SSLContext | bool = True,
        pin_signing_keys: Callable[[str], None] | None = None,
        datasets: dict[str, Path] | None = None,
    ) -> None:
        """``verify``: how the hub's HTTPS is checked when the node downloads its artefacts and task inputs;
        ``pin_signing_keys`` stores the hub's keys when a manifest led to a new one (a rotation); ``datasets``: the
        site's datasets by name (files or folders) that ``training`` workers read."""
        self.node_id = node_id
        self.models = ModelHost(Path(data_dir) / "ota" / "models")
        base_url = f"{hub_url.rstrip('/')}{API_PREFIX}" if hub_url else None
        self.updater = Updater(data_dir, signing_key, base_url, self._progress, models=self.models, no_firmware=NO_FIRMWARE, verify=verify)
        self.updater.signing_key_source = signing_key_source
        self.updater.pin_signing_keys = pin_signing_keys
        self.commands = Commands()
        for name, handler in model_commands(self.models).items():
            self.commands.register_builtin(name, handler)
        self._sequence = EventSequence(Path(data_dir) / SEQUENCE_FILE)
        self._send_up = send_up
        self._event_lock = threading.Lock()  # held from taking a seq to storing the event: seqs leave in order
        fetch_inputs = InputFetcher(Path(data_dir) / "tasks" / "inputs", self.updater.signing_key, self.updater.downloader, self.updater.verify_manifest)
        self._datasets = {name: Path(path) for name, path in (datasets or {}).items()}
        site = Site(Path(data_dir) / "tasks" / "training", hub_url, dict(self._datasets), verify, private=Path(data_dir))
        self.tasks = WorkerHost(Path(data_dir) / "tasks", self.models, self.emit, fetch_inputs, infer=infer, fl=fl, site=site)
        self._version = -1  # the newest desired version seen
        self._tasks_version = -1  # the newest task orders seen
        self._pending: list[DeploymentOrder] | None = None
        self._pending_tasks: list[WorkerOrder] | None = None
        self._wake = asyncio.Event()
        self._applying: asyncio.Future[None] | None = None
        self._restored = False

    def status(self) -> dict[str, Any]:
        """What the node reports it runs (``ReportedBody.status``: ``installed``), and the site's datasets that are
        ``.npz`` files of inputs and labels (``datasets``: rows, row shape; what bounds the examples a federated
        update of this site may count). A folder, or another format, is not described."""
        from device.local_data import DatasetError, describe_npz
        from interfaces.privacy import DATASETS_KEY

        installed = self.updater.installed()
        status: dict[str, Any] = {INSTALLED_KEY: {kind: a.model_dump(mode="json") for kind, a in installed.items()}} if installed else {}
        described = {}
        for name, path in sorted(self._datasets.items()):
            if path.is_file() and path.suffix == ".npz":
                try:
                    described[name] = describe_npz(path).model_dump(mode="json")
                except DatasetError as exc:
                    log.warning("dataset %s is not described: %s", name, exc)
        if described:
            status[DATASETS_KEY] = described
        return status

    def offer(self, desired: DesiredBody) -> None:
        """A desired document arrived (on the event loop); its orders wait for the worker."""
        self._version = max(self._version, desired.version)
        if desired.deployments:
            self._pending = list(desired.deployments)
            self._wake.set()
        if desired.tasks_version > self._tasks_version:  # the first document after a start always
            self._tasks_version = desired.tasks_version
            self._pending_tasks = list(desired.tasks)
            self._wake.set()

    async def restore(self) -> None:
        """Load what is installed (the model serves again); once. The agent awaits it before it connects, so a
        command that arrives right after a restart finds the model loaded."""
        if not self._restored:
            self._restored = True
            await asyncio.to_thread(self.updater.restore)

    async def run(self) -> None:
        """The worker: load the installed model again (unless :meth:`restore` did), then apply documents as
        they come, until cancelled."""
        await self.restore()
        while not self.updater.canceled.is_set():
            await self._wake.wait()
            self._wake.clear()
            orders, self._pending = self._pending, None
            tasks, self._pending_tasks = self._pending_tasks, None
            if orders:
                self._applying = asyncio.ensure_future(asyncio.to_thread(self.updater.apply, orders))
                try:
                    await asyncio.shield(self._applying)  # a cancelled worker leaves the thread to close()
                except Exception:  # a bug in our own code must not end the worker; the next document tries again
                    log.exception("applying the deployment orders failed")
                self._applying = None
                if self.updater.canceled.is_set():
                    return  # interrupted: the retained document brings the orders again at the next start
                self._report()
            if tasks is not None:  # after the deployments: a task may need the model just installed
                try:
                    await asyncio.to_thread(self.tasks.apply, tasks)
                except Exception:
                    log.exception("applying the task orders failed")

    async def close(self) -> None:
        """Stop a download in progress (it resumes at the next start), wait for the worker thread and keep
        the event sequence. Call after cancelling :meth:`run`."""
        self.updater.canceled.set()
        if self._applying is not None:
            await asyncio.wait([self._applying], timeout=STOP_WAIT_S)
        await asyncio.to_thread(self.tasks.stop)
        try:
            self._sequence.close()
        except OSError as exc:  # harmless: the reserved ceiling on disk still rules out a repeat
            log.warning("cannot record the event sequence: %s", exc)

    # ---- to the hub ---------------------------------------------------------------------------------
    def emit(self, type: str, data: dict[str, Any], severity: Literal["debug", "info", "warning", "error"] = "info") -> None:
        """Store an event of the node's own for the hub (any thread); :class:`OutboxFull` when it was dropped."""
        with self._event_lock:
            body = EventBody(seq=self._sequence.next(), type=type, severity=severity, data=data)
            if not self._send(NODE_EVENTS, body):
                raise OutboxFull(f"the outbox is full; event {type} (seq {body.seq}) dropped")

    def _progress(self, progress: ExecutionProgress) -> None:
        """The updater's progress sink (on the worker thread)."""
        severity: Literal["info", "error"] = "error" if progress.state in EXECUTION_FAILURES else "info"
        try:
            self.emit(EXECUTION_EVENT, progress.model_dump(mode="json", exclude_none=True), severity)
        except (OSError, StoredStateError, sqlite3.Error, OutboxFull) as exc:  # the order is delivered again; a finished one is reported again
            log.warning("could not report execution %s %s: %s", progress.execution_id, progress.state.value, exc)

    def _report(self) -> None:
        """Report what is installed now, under the newest desired version."""
        if self._version < 0:
            return
        with contextlib.suppress(OSError, sqlite3.Error):
            if self._send(NODE_REPORTED, ReportedBody(version=self._version, status=self.status())):
                return
        log.warning("could not report desired version %s after applying its orders", self._version)

    def _send(self, topic: Topic[Any], body: EventBody | ReportedBody) -> bool:
        message = envelope(self.node_id, body)
        return self._send_up(topic.topic(node_id=self.node_id), message.model_dump_json().encode(), topic)
