"""The task workers a target runs, reconciled with the orders of its desired document (DESIGN §4.3).

:meth:`WorkerHost.apply` takes the full list of ``WorkerOrder`` each time: a new worker id starts a thread
(:class:`~device.tasks.worker.Worker`) running its type's program; an order already running is handed
to it (RUN or PAUSE, more chunks, another heartbeat); a withdrawn one is stopped (it finishes the item in
hand and ends without a final report). An order that changes its task, type, attempt, role or spec under
the same worker id replaces the worker.

A worker that ended (SUCCEEDED, FAILED, REJECTED) is recorded in ``<dir>/finished.json`` before its
final report leaves. While its order stands it is not run again: after a restart its final report is
sent once more instead (it may have been lost), unless the order carries a higher ``attempt``. Records
of withdrawn orders are dropped.

One ticker thread sends every worker's heartbeats, metrics samples and late log lines.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from device.files import write_atomic
from device.tasks.programs import program_for
from device.tasks.worker import Emit, FetchInputs, Program, Worker, WorkerInfo
from interfaces.tasks import TASK_WORKER_EVENT, TaskType, WorkerOrder, WorkerReport, WorkerState

if TYPE_CHECKING:
    from device.local_data import LocalDatasets
    from device.ota.models import ModelHost
    from device.tasks.site import Site

log = logging.getLogger("aisynergy.device.tasks")

FINISHED_FILE = "finished.json"


class _Finished(BaseModel):
    attempt: int
    report: WorkerReport


class _FinishedFile(BaseModel):
    workers: dict[str, _Finished] = {}


class WorkerHost:
    """Runs the target's task workers; see the module docstring.

    ``data_dir``: this host's directory (``finished.json``). ``models``: the target's
    :class:`~device.ota.models.ModelHost`. ``emit(type, data, severity)`` sends an event upstream (it may
    raise; the event is then dropped and logged). ``fetch_inputs(ref)`` returns a verified local file
    (:class:`~device.tasks.inputs.InputFetcher`; with a ``prune`` method, it is told which inputs the
    orders still name: datasets, training bodies, split parts). ``datasets``: the device's local datasets, which
    training workers read. ``infer``: the split-inference channel (a device's
    :class:`~device.split.channel.InferChannel`, an edge's :class:`~edge.split.TailRouter`). ``fl``: the federated
    channel (a device's :class:`~device.fl.FlChannel`, an edge's :class:`~edge.fl.FlRouter`). ``site``: what a
    training site gives ``training`` workers (:class:`~device.tasks.site.Site`; None: this target is no site).
    """

    def __init__(
        self, data_dir: str | Path, models: ModelHost, emit: Emit, fetch_inputs: FetchInputs, datasets: LocalDatasets | None = None, infer: Any = None,
        fl: Any = None, site: Site | None = None,
    ) -> None:  # fmt: skip
        self.root = Path(data_dir)
        self.site = site
        self.models = models
        self.datasets = datasets
        self.infer = infer
        self.fl = fl
        self._emit, self._fetch_inputs = emit, fetch_inputs
        self._lock = threading.Lock()  # workers, finished records
        self._workers: dict[str, Worker] = {}
        self._finished: dict[str, _Finished] | None = None  # read at the first apply
        self._repeated: set[str] = set()  # finished workers whose report was sent again in this run
        self._tick = threading.Condition()
        self._poked = self._closed = False
        self._ticker: threading.Thread | None = None

    # ---- orders -------------------------------------------------------------------------------------
    def apply(self, orders: list[WorkerOrder]) -> None:
        """Reconcile the running workers with ``orders`` (all of this target's, in full)."""
        wanted = {order.worker_id: order for order in orders}
        with self._lock:
            if self._closed:
                return
            finished = self._load_finished()
            for worker_id in [w for w in self._workers if w not in wanted]:
                self._workers.pop(worker_id).stop()
                log.info("worker %s withdrawn; stopping it", worker_id)
            withdrawn = [w for w in finished if w not in wanted]
            for worker_id in withdrawn:
                del finished[worker_id]
                self._repeated.discard(worker_id)
            if withdrawn:
                self._save_finished()
            for order in wanted.values():
                self._apply_one(order, finished)
        prune = getattr(self._fetch_inputs, "prune", None)
        if prune is not None:
            try:
                prune({ref.signed_manifest.manifest.sha256 for o in orders for ref in o.input_refs()})
            except OSError as exc:
                log.warning("cannot remove old task inputs: %s", exc)

    def _apply_one(self, order: WorkerOrder, finished: dict[str, _Finished]) -> None:
        current = self._workers.get(order.worker_id)
        if current is not None and _same_run(current.order, order):
            current.update(order)
            return
        if current is not None:
            log.info("worker %s: a new run under the same id; replacing it", order.worker_id)
            current.stop()
            del self._workers[order.worker_id]
        record = finished.get(order.worker_id)
        if current is None and record is not None and record.attempt >= order.attempt:
            if order.worker_id not in self._repeated:  # after a restart: it may never have left
                self._repeated.add(order.worker_id)
                self._send_again(record.report)
            return
        worker = Worker(order, _program(order.type), self.models, self._fetch_inputs, self._emit, self._ended, self._poke, self.datasets, self.infer, self.fl, self.site)
        self._workers[order.worker_id] = worker
        self._start_ticker()
        worker.start()
        log.info("worker %s (%s of task %s) started", order.worker_id, order.type.value, order.task_id)

    def stop(self, timeout_s: float = 5.0) -> None:
        """At agent shutdown: stop every worker (no final reports) and wait up to ``timeout_s`` for them."""
        with self._lock:
            self._closed = True
            workers = list(self._workers.values())
        for worker in workers:
            worker.stop()
        with self._tick:
            self._tick.notify_all()
        deadline = time.monotonic() + timeout_s
        for worker in workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        if self._ticker is not None:
            self._ticker.join(max(0.0, deadline - time.monotonic()))

    def workers(self) -> list[WorkerInfo]:
        """The workers of the current orders (running or ended), in the order they started."""
        with self._lock:
            return [w.info() for w in self._workers.values()]

    # ---- finished workers ---------------------------------------------------------------------------
    def _ended(self, worker: Worker, report: WorkerReport) -> None:
        """A worker's final report is about to leave (on its thread)."""
        with self._lock:
            if self._workers.get(worker.worker_id) is not worker:
                return  # withdrawn or replaced meanwhile
            self._load_finished()[worker.worker_id] = _Finished(attempt=worker.order.attempt, report=report)
            self._save_finished()

    def _send_again(self, report: WorkerReport) -> None:
        log.info("worker %s already ended %s; reporting it again", report.worker_id, report.state)
        severity = "info" if report.state == WorkerState.SUCCEEDED else "error"
        try:
            self._emit(TASK_WORKER_EVENT, report.model_dump(mode="json", exclude_none=True), severity)
        except Exception as exc:
            log.warning("could not report worker %s again: %s", report.worker_id, exc)

    def _load_finished(self) -> dict[str, _Finished]:
        """Hold ``_lock``."""
        if self._finished is None:
            try:
                self._finished = _FinishedFile.model_validate_json((self.root / FINISHED_FILE).read_bytes()).workers
            except FileNotFoundError:
                self._finished = {}
            except (OSError, ValidationError) as exc:  # only a repeat of final reports is lost
                log.warning("cannot read %s (%s); starting without it", self.root / FINISHED_FILE, exc)
                self._finished = {}
        return self._finished

    def _save_finished(self) -> None:
        """Hold ``_lock``."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            write_atomic(self.root / FINISHED_FILE, _FinishedFile(workers=self._load_finished()).model_dump_json().encode(), mode=0o600)
        except OSError as exc:
            log.warning("cannot record finished workers in %s: %s", self.root, exc)

    # ---- the ticker ---------------------------------------------------------------------------------
    def _poke(self) -> None:
        with self._tick:
            self._poked = True
            self._tick.notify_all()

    def _start_ticker(self) -> None:
        """Hold ``_lock``."""
        if self._ticker is None:
            self._ticker = threading.Thread(target=self._run_ticker, name="aisynergy-task-ticker", daemon=True)
            self._ticker.start()

    def _run_ticker(self) -> None:
        while True:
            with self._lock:
                workers = list(self._workers.values())
            now = time.monotonic()
            due = []
            for worker in workers:
                try:
                    if (at := worker.tick(now)) is not None:
                        due.append(at)
                except Exception:  # our own bug must not end the ticker
                    log.exception("reporting of worker %s failed", worker.worker_id)
            with self._tick:
                if self._closed:
                    return
                if not self._poked:  # nothing due: sleep until a worker pokes
                    self._tick.wait(max(0.0, min(due) - time.monotonic()) if due else None)
                self._poked = False


def _same_run(running: WorkerOrder, order: WorkerOrder) -> bool:
    keys = ("task_id", "type", "attempt", "role", "spec")
    return all(getattr(running, k) == getattr(order, k) for k in keys)


def _program(type: TaskType) -> Program:
    """Resolved on the worker's thread: a program that does not import FAILS its worker, not the host."""

    def run(worker: Worker) -> None:
        program_for(type)(worker)

    return run
