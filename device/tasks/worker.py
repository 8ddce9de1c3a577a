"""One task worker: a thread running a worker program, and what the program sees of the world (DESIGN §4.3).

A program is a function ``run(worker)`` (see :mod:`device.tasks.programs`). It reads its order
(:attr:`Worker.order`, replaced live when the hub changes it), calls :meth:`Worker.running` once its
quick checks pass (the first RUNNING report; a heartbeat follows every ``order.heartbeat_s``), and
between items calls :meth:`Worker.checkpoint`, which holds it while the order says PAUSE and answers
``False`` once it must stop (order withdrawn, agent stopping). It ends by returning (SUCCEEDED), by
raising :class:`Rejected` or :class:`Failed` (that state, with the message as detail), or by any other
exception (FAILED, ``type: message``). A worker that was stopped ends without a final report.

Reporting goes on beside the program: log lines are sent in batches (after at most :data:`LOG_FLUSH_S`,
or at :data:`LOG_BATCH` lines), and the host's ticker calls :meth:`Worker.tick` for heartbeats, metrics
samples and late log lines, so a long item does not silence the worker. Every event is built from its
:mod:`interfaces.tasks` model; one that cannot be sent (the agent is stopping, its outbox is full) is
logged here and dropped.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from pydantic import BaseModel

from device.errors import OutboxFull
from interfaces.messages import MAX_MESSAGE_BYTES
from interfaces.tasks import (
    MAX_CHUNK_OUTPUT_BYTES,
    TASK_LOG_EVENT,
    TASK_METRICS_EVENT,
    TASK_OUTPUT_EVENT,
    TASK_WORKER_EVENT,
    BatchInferenceOrder,
    FederatedTrainingOrder,
    IncrementalTrainingOrder,
    InferenceOrder,
    InputRef,
    LogLine,
    SplitInferenceOrder,
    TrainingTaskOrder,
    WorkerAction,
    WorkerLog,
    WorkerMetrics,
    WorkerOrder,
    WorkerOutput,
    WorkerReport,
    WorkerState,
)  # fmt: skip

if TYPE_CHECKING:
    from pathlib import Path

    from device.local_data import LocalDatasets
    from device.ota.models import ModelHost

log = logging.getLogger("aisynergy.device.tasks")

Severity = Literal["debug", "info", "warning", "error"]
Emit = Callable[[str, dict[str, Any], Severity], object]
"""``emit(event type, data, severity)``: send one event upstream (the device's or the node's ``events``)."""
FetchInputs = Callable[[InputRef], "Path"]
"""``fetch_inputs(ref)``: the verified local file of a dataset artefact."""
MetricsSource = Callable[[], dict[str, float]]
Program = Callable[["Worker"], None]
M = TypeVar("M", bound=BaseModel)
O = TypeVar("O", InferenceOrder, BatchInferenceOrder, SplitInferenceOrder, IncrementalTrainingOrder, FederatedTrainingOrder, TrainingTaskOrder)

LOG_FLUSH_S = 0.3
LOG_BATCH = 50
FRAME_LIMIT = min(MAX_CHUNK_OUTPUT_BYTES, (MAX_MESSAGE_BYTES - 4096) * 3 // 4)
"""Largest output frame sent: the contract's limit, and small enough that its base64 in an envelope
still fits in one MQTT message (which the relay and the hub check)."""
_LEVELS: dict[str, int] = {"debug": 0, "info": 1, "warning": 2, "error": 3}


class Rejected(Exception):
    """The worker cannot take this order (no such model, a bad input name, a dataset not signed by the hub)."""


class Failed(Exception):
    """The work went wrong; the message is the report's detail."""


@dataclass(frozen=True)
class WorkerInfo:
    """What :meth:`~device.tasks.host.WorkerHost.workers` shows of one worker."""

    worker_id: str
    task_id: str
    type: str
    state: WorkerState
    paused: bool
    items_done: int
    detail: str
    alive: bool


class Worker:
    """One order's thread and the program's view of it; see the module docstring."""

    def __init__(
        self, order: WorkerOrder, program: Program, models: ModelHost, fetch_inputs: FetchInputs, emit: Emit,
        on_end: Callable[[Worker, WorkerReport], None], poke: Callable[[], None], datasets: LocalDatasets | None = None, infer: Any = None,
        fl: Any = None, site: Any = None,
    ) -> None:  # fmt: skip
        self.models, self.fetch_inputs = models, fetch_inputs
        self.site = site
        """a training site's datasets, directory and publishing link (``device.tasks.site.Site``; None: no site)"""
        self.datasets = datasets
        """the target's local datasets (a device's; None on an edge node)"""
        self.infer = infer
        """the split-inference channel: a device's ``InferChannel`` (requests), an edge's ``TailRouter`` (answers)"""
        self.fl = fl
        """the federated channel: a device's ``FlChannel`` (updates to its edge), an edge's ``FlRouter`` (its devices' updates)"""
        self.items_done = 0
        """inputs finished (this run): the program counts them; reports carry them"""
        self.state, self.detail = WorkerState.QUEUED, ""
        self._order, self._program = order, program
        self._emit, self._on_end, self._poke = emit, on_end, poke
        self._control = threading.Condition()  # order, stop, changed
        self._stop = self._changed = self._held = False
        self._reporting = threading.RLock()  # one sender at a time; nothing after the final report
        self._running = self._ended = False
        self._lines: list[LogLine] = []
        self._lines_since = self._next_beat = self._next_sample = 0.0
        self._metrics: MetricsSource | None = None
        self._metrics_interval_s: float | None = None
        self._thread = threading.Thread(target=self._main, name=f"aisynergy-task-{order.worker_id}", daemon=True)

    @property
    def worker_id(self) -> str:
        return self._order.worker_id

    @property
    def task_id(self) -> str:
        return self._order.task_id

    def info(self) -> WorkerInfo:
        o = self._order
        return WorkerInfo(o.worker_id, o.task_id, o.type.value, self.state, self._held, self.items_done, self.detail, self._thread.is_alive())

    # ---- the host's side ----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def update(self, order: WorkerOrder) -> None:
        """The hub changed the order (action, chunks, heartbeat); the program sees it at its next look."""
        with self._control:
            self._order, self._changed = order, True
            self._control.notify_all()

    def stop(self) -> None:
        """Finish the item in hand, then end without a final report."""
        with self._control:
            self._stop = True
            self._control.notify_all()

    def join(self, timeout_s: float) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def tick(self, now: float) -> float | None:
        """Send what is due (late log lines, heartbeat, metrics); the next time something is due."""
        with self._reporting:
            if self._ended:
                return None
            due: list[float] = []
            if self._lines:
                if now >= self._lines_since + LOG_FLUSH_S:
                    self._flush()
                else:
                    due.append(self._lines_since + LOG_FLUSH_S)
            if self._running and not self._stop:  # a stopped worker says nothing more but its last lines
                if now >= self._next_beat:
                    self._beat(now)
                due.append(self._next_beat)
                if self._metrics is not None:
                    if now >= self._next_sample:
                        self._sample(now)
                    due.append(self._next_sample)
            return min(due, default=None)

    def report_now(self) -> None:
        """Send the waiting log lines, a heartbeat and a metrics sample now (a batch worker that ran out of
        chunks: the hub may end the task on its last output, before the next heartbeat is due)."""
        with self._reporting:
            if self._ended or self._stop:
                return
            now = time.monotonic()
            self._flush()
            if self._running:
                self._beat(now)
                if self._metrics is not None:
                    self._sample(now)

    # ---- the program's side -------------------------------------------------------------------------
    @property
    def order(self) -> WorkerOrder:
        """The order as it stands now."""
        return self._order

    @property
    def stopping(self) -> bool:
        return self._stop

    def spec(self, model: type[M]) -> M:
        """The order's spec as ``model`` (its type's variant validated it on arrival); :class:`Rejected` when the
        order is another type's."""
        spec = self._order.spec
        if not isinstance(spec, model):
            raise Rejected(f"a {self._order.type.value} order carries no {model.__name__}")
        return spec

    def order_as(self, variant: type[O]) -> O:
        """The order as it stands now, as ``variant`` (the program's own type's order, with that type's part);
        :class:`Rejected` when it is another type's."""
        order = self._order
        if not isinstance(order, variant):
            raise Rejected(f"a {order.type.value} order is not a {variant.__name__}")
        return order

    def running(self) -> None:
        """The checks passed: report RUNNING now and then every ``order.heartbeat_s``."""
        self.state = WorkerState.RUNNING
        with self._reporting:
            self._running = True
            now = time.monotonic()
            self._beat(now)
            if self._metrics is not None:
                self._next_sample = now + (self._metrics_interval_s or self._order.heartbeat_s)
        self._poke()

    def checkpoint(self) -> bool:
        """Between items: hold while the order says PAUSE (heartbeats say paused); ``False``: stop now."""
        while True:
            with self._control:
                if self._stop or self._order.action is not WorkerAction.PAUSE:
                    break
                if self._held:
                    self._control.wait()
                    continue
            self._hold(True)
        if self._held:
            self._hold(False)
        return not self._stop

    def pause_requested(self) -> bool:
        """Whether the order says PAUSE now (and the worker is not stopping), for a worker that cannot hold between
        items itself (a training run in a process of its own, which its host freezes meanwhile); the heartbeats say
        paused from the first call that sees it until the first that does not."""
        with self._control:
            wanted = not self._stop and self._order.action is WorkerAction.PAUSE
        if wanted != self._held:
            self._hold(wanted)
        return wanted

    def wait(self, timeout_s: float | None = None) -> bool:
        """Sleep until the order changes, the worker must stop or ``timeout_s`` pass; ``False``: stop now."""
        with self._control:
            if not (self._stop or self._changed):
                self._control.wait(timeout_s)
            self._changed = False
            return not self._stop

    def wake(self) -> None:
        """Cut the program's :meth:`wait` short (from another thread: something it must look at happened)."""
        with self._control:
            self._changed = True
            self._control.notify_all()

    def log(self, text: str, level: Severity = "info") -> None:
        """A line for the task's log (sent in order, in batches)."""
        log.log(logging.WARNING if level in ("warning", "error") else logging.DEBUG, "worker %s: %s", self.worker_id, text)
        line = LogLine(ts=datetime.now(UTC), level=level, text=text[:4096])
        with self._reporting:
            if self._ended:
                return
            first = not self._lines
            self._lines.append(line)
            if first:
                self._lines_since = time.monotonic()
            if len(self._lines) >= LOG_BATCH:
                self._flush()
                return
        if first:
            self._poke()

    def metrics_source(self, source: MetricsSource, interval_s: float | None = None) -> None:
        """Sample ``source`` every ``interval_s`` (default: every heartbeat) while running, and at a success."""
        with self._reporting:
            self._metrics, self._metrics_interval_s = source, interval_s
            self._next_sample = time.monotonic() + (interval_s or self._order.heartbeat_s)

    def output(self, chunk: int, items: int, frame: bytes) -> None:
        """Send one finished chunk's outputs (a safetensors frame); :class:`Failed` when it is too big."""
        if len(frame) > FRAME_LIMIT:
            fit = max(1, items * FRAME_LIMIT // len(frame))
            raise Failed(
                f"chunk {chunk}'s outputs take {len(frame)} bytes, more than the {FRAME_LIMIT} bytes one message "
                f"carries; lower chunk_size (about {fit} inputs per chunk fit)"
            )
        data = base64.b64encode(frame).decode("ascii")
        self.event(TASK_OUTPUT_EVENT, WorkerOutput(worker_id=self.worker_id, task_id=self.task_id, chunk=chunk, items=items, data=data))

    def event(self, type: str, body: BaseModel) -> None:
        """Send one result event (an output, a federated update): never dropped, a full outbox holds the worker
        back until the broker catches up (a stopping worker gives up)."""
        doc = body.model_dump(mode="json")
        delay = 0.01
        while True:
            try:
                self._emit(type, doc, "info")
                return
            except OutboxFull:
                if self.stopping:
                    return
                time.sleep(delay)
                delay = min(1.0, delay * 2)

    # ---- inside -------------------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self._program(self)
        except Rejected as exc:
            self._end(WorkerState.REJECTED, str(exc))
        except Failed as exc:
            self._end(WorkerState.FAILED, str(exc))
        except Exception as exc:  # a program's bug or a runtime's error ends this worker, never the host
            if not self._stop:
                log.exception("worker %s failed", self.worker_id)
            self._end(WorkerState.FAILED, f"{type(exc).__name__}: {exc}")
        else:
            self._end(WorkerState.SUCCEEDED, "")

    def _end(self, state: WorkerState, detail: str) -> None:
        if self._stop:  # withdrawn, or the agent stops: no final report (the lines so far still go)
            with self._reporting:
                self._flush()
                self._ended = True
            log.info("worker %s stopped", self.worker_id)
            return
        self.state, self.detail = state, detail[:2048]
        self.log(f"{state.value}: {detail}" if detail else state.value, "info" if state is WorkerState.SUCCEEDED else "error")
        report = self._report(state)
        self._on_end(self, report)  # recorded before it is sent: a report lost in a crash is sent again
        with self._reporting:
            if state is WorkerState.SUCCEEDED and self._metrics is not None:
                self._sample(time.monotonic())
            self._flush()
            self._send(TASK_WORKER_EVENT, report, "info" if state is WorkerState.SUCCEEDED else "error")
            self._ended = True
        log.info("worker %s %s %s", self.worker_id, state.value, detail)

    def _hold(self, held: bool) -> None:
        self._held = held
        if self._stop:
            return
        self.log("paused" if held else "resumed")
        with self._reporting:
            if self._running:
                self._beat(time.monotonic())

    def _report(self, state: WorkerState) -> WorkerReport:
        return WorkerReport(
            worker_id=self.worker_id, task_id=self.task_id, state=state, detail=self.detail,  # type: ignore[arg-type]
            paused=self._held, items_done=self.items_done,
        )  # fmt: skip

    def _beat(self, now: float) -> None:
        """A RUNNING report (the heartbeat). Hold ``_reporting``."""
        if not self._ended:
            self._send(TASK_WORKER_EVENT, self._report(WorkerState.RUNNING))
        self._next_beat = now + self._order.heartbeat_s

    def _sample(self, now: float) -> None:
        """A metrics sample. Hold ``_reporting``."""
        assert self._metrics is not None
        self._next_sample = now + (self._metrics_interval_s or self._order.heartbeat_s)
        try:
            values = {k: float(v) for k, v in self._metrics().items()}
            sample = WorkerMetrics(worker_id=self.worker_id, task_id=self.task_id, ts=datetime.now(UTC), values=values)
        except Exception:  # a bad sample is skipped; the work goes on
            log.exception("worker %s: the metrics sample failed", self.worker_id)
            return
        self._send(TASK_METRICS_EVENT, sample)

    def _flush(self) -> None:
        """Send the waiting log lines. Hold ``_reporting``."""
        if not self._lines or self._ended:
            return
        lines, self._lines = self._lines, []
        worst = max(lines, key=lambda line: _LEVELS[line.level]).level
        for start in range(0, len(lines), 200):
            self._send(TASK_LOG_EVENT, WorkerLog(worker_id=self.worker_id, task_id=self.task_id, lines=lines[start : start + 200]), worst)

    def _send(self, type: str, body: BaseModel, severity: Severity = "info") -> None:
        try:
            self._emit(type, body.model_dump(mode="json", exclude_none=True), severity)
        except Exception as exc:  # NotRunning, OutboxFull, an upstream store error: dropped
            log.warning("worker %s: could not send %s: %s", self.worker_id, type, exc)
