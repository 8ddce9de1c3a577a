"""The task scheduler: places and drives every active task from the database (DESIGN §4.3).

``TaskController.tick()`` runs every ``scheduler_interval_s`` (and at once when an API call or a worker
report asks for it) on the one hub replica that holds the ``scheduler`` lease. Like the rollout
controller it decides from the rows alone, so a restarted hub resumes every task where it was. A few
bulk queries first find the tasks that have something due (``due``); a task in a steady state costs
nothing more.

One tick, per active task (each in its own transaction, the task row locked):

1. **Deadline.** A task not held gets ``deadline_at = now + timeout_s`` the first time it is looked at
   (it moves on resume by the time spent paused); past it, the task is TIMED_OUT, its workers CANCELED.
2. **Placement** (PENDING). ``cloud.placement.find`` lists the qualifying targets; fewer than
   ``min_nodes`` keeps the task PENDING with the reason. Otherwise, by descending weight, up to
   ``max_nodes``: type ``each`` puts one worker on every chosen target; type ``shards`` splits the
   pending chunks over them in proportion to their weights. Workers start QUEUED with their order in
   the target's desired document; the task is SCHEDULED.
3. **Worker health.** An active worker whose target is OFFLINE or deleted is LOST; one that has not
   reported within ``worker_timeout_s`` (since it was queued, or since its last report) is TIMED_OUT.
   Either way its order is withdrawn and its unfinished chunks go back with one more attempt.
4. **Sharded work.** All chunks done: SUCCEEDED. A chunk pending after ``max_attempts`` attempts: FAILED.
   Pending chunks past their back-off go to fresh qualifying targets as new workers, or, when there are
   none, to the task's active workers (their orders grow); none at all: they wait (the reason says so).
5. **Services and per-target work** (type ``each``). A worker that ended badly is replaced on another
   qualifying target after its back-off while its attempt is below ``max_attempts`` (a type whose
   ``on_lost`` is ``continue`` goes on with the workers it still has instead); when no worker is
   active and none will be replaced the task ends: SUCCEEDED if a worker succeeded, else FAILED.

What a kind adds is its own (``cloud.tasks.kind``; nothing here branches on the type): its candidates
(``incremental_training``: only devices holding its privacy reservation; ``federated_training``: devices that
report its dataset), its workers' role, companion workers on the edge nodes of its device workers
(``split_inference``'s tails, a hierarchical federated task's aggregators: placed, replaced and withdrawn by
:meth:`TaskController._companions`; they do not count for the task's end), its work before the tasks are
driven (publishing trained layers, storing a round's global layer), what makes it due, its own step per drive
(a federated round) and what holds its success back (a trained model not published yet).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import func, or_, select
from sqlalchemy.engine import Engine
from sqlmodel import Session

from cloud import placement
from cloud.convert import utc
from cloud.lease import drive_each
from cloud.tables import Task, TaskChunk, TaskWorker, WorkerTransitionRow
from cloud.tasks.lifecycle import PENDING, active_workers, assign, build_order, finish, hub_log, move_task, move_worker, pending_chunks, placement_of, put_worker_order, release_chunks, retry_of, spec_of, target_table, type_info, withdraw_worker_order
from cloud.tasks.kind import Ticked, all_kinds, kind_of, node_roles
from interfaces.deployments import TargetKind
from interfaces.ids import new_id
from interfaces.lifecycle import NodeState
from interfaces.tasks import TASK_ACTIVE, WORKER_ACTIVE, WORKER_FAILURES, ModelRef, TaskState, WorkerState

log = logging.getLogger("aisynergy.hub.scheduler")
_T, _W = TaskState, WorkerState
GAVE_UP = "-"


class TaskController:
    def __init__(self, engine: Engine, signing: Any, on_change: Callable[[], None] | None = None, blobs: Any = None) -> None:
        self.engine = engine
        self.signing = signing
        self.blobs = blobs
        self.on_change = on_change
        self.counters: dict[str, int] = {
            "ticks": 0, "tasks_driven": 0, "workers_placed": 0, "workers_lost": 0, "workers_timed_out": 0, "tasks_timed_out": 0, "chunks_reassigned": 0,
            "models_published": 0, "fl_rounds_closed": 0, "fl_models_stored": 0,
        }  # fmt: skip
        self.rounds_closed: set[str] = set()

    def tick(self, at: datetime | None = None) -> int:
        """Drive every active task that needs it one step; returns how many changed."""
        at = at or datetime.now(UTC)
        self._prepare()
        ids = self.due(at)
        self.rounds_closed: set[str] = set()
        changed = drive_each(self.engine, ids, self._drive, at, self.on_change, "scheduling task", log)
        if self.rounds_closed:  # the next round opens now, not a tick later: store its global layer, then drive again
            again = sorted(self.rounds_closed)
            self._prepare()
            changed += drive_each(self.engine, again, self._drive, at, self.on_change, "scheduling task", log)
        self.counters["ticks"] += 1
        self.counters["tasks_driven"] += len(ids)
        return changed

    def _prepare(self) -> None:
        """Each kind's work of the tick outside the tasks' transactions (storing, publishing models)."""
        if self.blobs is None:
            return
        for kind in all_kinds():
            try:
                for name, n in kind.prepare(self.engine, self.signing, self.blobs).items():
                    self.counters[name] = self.counters.get(name, 0) + n
            except Exception:  # noqa: BLE001 - the tasks are driven all the same; tried again next tick
                log.exception("%s: preparing failed this tick", kind.type.value)

    def due(self, at: datetime) -> list[str]:
        """The active tasks a tick has something to do for, found with a handful of queries however many
        tasks run: PENDING ones; a deadline to set or passed; an active worker whose target is OFFLINE,
        deleted or silent past ``worker_timeout_s``; sharded: every chunk done, or chunks waiting past
        their back-off; per target: a worker to replace, or none left. A steady task costs nothing."""
        with Session(self.engine) as session:
            tasks = session.execute(
                select(Task.id, Task.state, Task.type, Task.deadline_at, Task.timeout_s, Task.worker_timeout_s, Task.chunks_done, Task.chunks_total)
                .where(Task.state.in_([s.value for s in TASK_ACTIVE]), Task.held.is_(False)).order_by(Task.id)  # type: ignore[attr-defined]
            ).all()  # fmt: skip
            if not tasks:
                return []
            workers: dict[str, list[Any]] = defaultdict(list)
            for w in session.execute(
                select(TaskWorker.task_id, TaskWorker.target_kind, TaskWorker.target_id, TaskWorker.created_at, TaskWorker.last_report_at, TaskWorker.role)
                .where(TaskWorker.state.in_([s.value for s in WORKER_ACTIVE]))  # type: ignore[attr-defined]
            ).all():  # fmt: skip
                workers[w.task_id].append(w)
            states: dict[tuple[str, str], str] = {}
            node_of: dict[str, str] = {}  # target -> its edge node (a node: itself)
            for kind in ("device", "node"):
                ids = list({w.target_id for ws in workers.values() for w in ws if w.target_kind == kind})
                table = target_table(kind)
                edge = table.node_id if kind == "device" else table.id
                for start in range(0, len(ids), 10_000):
                    for target_id, state, node_id in session.execute(select(table.id, table.state, edge).where(table.id.in_(ids[start : start + 10_000]))).all():
                        states[(kind, target_id)] = state
                        node_of[target_id] = node_id
            waiting_chunks = set(session.execute(
                select(TaskChunk.task_id).where(TaskChunk.state == PENDING, or_(TaskChunk.not_before.is_(None), TaskChunk.not_before <= at)).distinct()  # type: ignore[union-attr,operator]
            ).scalars())  # fmt: skip
            kinds_due = set().union(*(kind.due_ids(session, at) for kind in all_kinds()))
            to_replace = set(session.execute(
                select(TaskWorker.task_id).where(TaskWorker.state.in_([s.value for s in WORKER_FAILURES]), TaskWorker.replaced_by.is_(None)).distinct()  # type: ignore[attr-defined,union-attr]
            ).scalars())  # fmt: skip
        gone = (NodeState.OFFLINE.value, NodeState.DELETED.value, None)
        companions = node_roles()
        due = []
        for t in tasks:
            deadline = utc(t.deadline_at)
            active = workers.get(t.id, [])
            silent = timedelta(seconds=t.worker_timeout_s)
            if (
                t.state == _T.PENDING.value
                or (deadline is None and t.timeout_s)
                or (deadline is not None and at >= deadline and t.state != _T.PAUSED.value)
                or any(states.get((w.target_kind, w.target_id)) in gone or at - (utc(w.last_report_at) or utc(w.created_at)) > silent for w in active)
                or (t.chunks_total is not None and (t.chunks_done == t.chunks_total or t.id in waiting_chunks))
                or (t.chunks_total is None and (t.id in to_replace or not any(w.role not in companions for w in active)))
                or kind_of(t.type).is_due(active, node_of)
                or t.id in kinds_due
            ):  # fmt: skip
                due.append(t.id)
        return due

    # --- one task ----------------------------------------------------------------------------------

    def _drive(self, session: Session, task_id: str, at: datetime) -> tuple[bool, bool]:
        task = session.get(Task, task_id, with_for_update=True)
        if task is None or TaskState(task.state) not in TASK_ACTIVE or task.held:
            return False, False
        before = (task.state, task.reason, task.chunks_done)
        self._orders = False
        self._changed = False
        state = TaskState(task.state)
        if task.deadline_at is None and task.timeout_s:
            task.deadline_at = at + timedelta(seconds=task.timeout_s)
            self._changed = True
        deadline = utc(task.deadline_at)
        if deadline is not None and state is not _T.PAUSED and at >= deadline:
            self._orders |= finish(session, task, _T.TIMED_OUT, f"not finished within timeout_s={task.timeout_s}", at)
            self.counters["tasks_timed_out"] += 1
        elif state is _T.PENDING:
            self._place(session, task, at)
        else:
            self._check_workers(session, task, at)
            if type_info(task).placement == "shards":
                self._drive_shards(session, task, at)
            else:
                self._drive_each(session, task, at)
        kind = kind_of(task.type)
        if TaskState(task.state) in TASK_ACTIVE and (roles := kind.companion_roles(task)) is not None:
            self._companions(session, task, at, *roles)
        if TaskState(task.state) in TASK_ACTIVE - {_T.PAUSED, _T.PENDING}:
            self._tick_kind(session, task, at)
        session.add(task)
        return self._changed or before != (task.state, task.reason, task.chunks_done), self._orders

    def _model(self, task: Task) -> ModelRef | None:
        model = getattr(spec_of(task), "model", None)
        return model if isinstance(model, ModelRef) else None

    def _candidates(self, session: Session, task: Task, exclude: set[str]) -> placement.Candidates:
        rejected = set(session.execute(
            select(TaskWorker.target_id).where(TaskWorker.task_id == task.id, TaskWorker.state == _W.REJECTED.value)
        ).scalars())  # fmt: skip
        found = kind_of(task.type).candidates(session, task, placement.find(session, placement_of(task), self._model(task), rejected, exclude))
        found.eligible.sort(key=lambda c: (-c.weight, c.id))
        return found

    def _wait(self, session: Session, task: Task, reason: str, at: datetime) -> None:
        if task.reason != reason:
            task.reason = reason
            task.updated_at = at
            hub_log(session, task.id, f"waiting: {reason}", "warning", at)

    def _place(self, session: Session, task: Task, at: datetime) -> None:
        rules = placement_of(task)
        found = self._candidates(session, task, set())
        if len(found.eligible) < rules.min_nodes:
            why = found.why_not or f"{len(found.eligible)} of the {rules.min_nodes} targets needed qualify"
            self._wait(session, task, why, at)
            return
        chosen = found.eligible[: rules.max_nodes] if rules.max_nodes else found.eligible
        if type_info(task).placement == "shards":
            pending = pending_chunks(session, task, at)
            if not pending:
                if task.chunks_done == task.chunks_total:
                    self._orders |= finish(session, task, _T.SUCCEEDED, "every input already has its output", at)
                else:
                    self._wait(session, task, "the unfinished chunks wait for their back-off", at)
                return
            chosen = chosen[: len(pending)]
            shares = placement.split(pending, [c.weight if rules.capability_weighted else 1.0 for c in chosen])
            for candidate, share in zip(chosen, shares, strict=True):
                self._new_worker(session, task, candidate, share, 1, at)
        else:
            for candidate in chosen:
                self._new_worker(session, task, candidate, [], 1, at)
        task.scheduled_at = at
        move_task(session, task, _T.SCHEDULED, f"{len(chosen)} workers placed", at)

    def _new_worker(
        self, session: Session, task: Task, candidate: placement.Candidate, chunks: list[int], attempt: int, at: datetime, role: str | None = None,
    ) -> TaskWorker:  # fmt: skip
        rules = placement_of(task)
        worker = TaskWorker(
            id=new_id("w"), task_id=task.id, target_kind=candidate.kind.value, target_id=candidate.id, state=_W.QUEUED.value, attempt=attempt,
            weight=candidate.weight, accelerators=[r.model_dump(mode="json", exclude_none=True) for r in rules.accelerators] if role is None else [],
            role=role or kind_of(task.type).worker_role(task), created_at=at, updated_at=at,
        )  # fmt: skip
        session.add(worker)
        session.add(WorkerTransitionRow(worker_id=worker.id, from_state=None, to_state=_W.QUEUED.value, at=at, reason=f"placed on {candidate.id}"))
        assign(session, task, worker, chunks)
        session.flush()
        put_worker_order(session, worker.target_kind, worker.target_id, build_order(session, task, worker, self.signing))
        what = f" with {len(chunks)} chunks" if chunks else ""
        what += f" as {worker.role}" if worker.role != "worker" else ""
        hub_log(session, task.id, f"worker {worker.id} placed on {candidate.id} (weight {candidate.weight:g}){what}", at=at, worker_id=worker.id, target_id=candidate.id)
        self.counters["workers_placed"] += 1
        self._orders = True
        return worker

    # --- workers -----------------------------------------------------------------------------------

    def _check_workers(self, session: Session, task: Task, at: datetime) -> None:
        for worker in active_workers(session, task.id):
            target = session.get(target_table(worker.target_kind), worker.target_id)
            silent_since = utc(worker.last_report_at) or utc(worker.created_at)
            if target is None or target.state in (NodeState.OFFLINE.value, NodeState.DELETED.value):
                why = f"its {worker.target_kind} {worker.target_id} is {target.state if target else 'gone'}"
                self._end_worker(session, task, worker, _W.LOST, why, at)
                self.counters["workers_lost"] += 1
            elif silent_since is not None and at - silent_since > timedelta(seconds=task.worker_timeout_s):
                what = "never reported" if worker.state == _W.QUEUED.value else "stopped reporting"
                self._end_worker(session, task, worker, _W.TIMED_OUT, f"{what} within worker_timeout_s={task.worker_timeout_s:g}", at)
                self.counters["workers_timed_out"] += 1

    def _end_worker(self, session: Session, task: Task, worker: TaskWorker, state: WorkerState, why: str, at: datetime) -> None:
        move_worker(session, worker, state, why, at)
        self._orders |= withdraw_worker_order(session, worker.target_kind, worker.target_id, worker.id)
        released = release_chunks(session, task, worker, f"{state.value}: {why}", at)
        extra = f"; {released} chunks to reschedule" if released else ""
        hub_log(session, task.id, f"worker {worker.id} {state.value}: {why}{extra}", "warning", at, worker.id, worker.target_id)
        self._changed = True

    def _drive_shards(self, session: Session, task: Task, at: datetime) -> None:
        if task.chunks_done == task.chunks_total:
            n = len(active_workers(session, task.id))
            self._orders |= finish(session, task, _T.SUCCEEDED, f"all {task.items_total} inputs processed ({n} workers at the end)", at)
            return
        policy = retry_of(task)
        exhausted = session.execute(
            select(TaskChunk).where(TaskChunk.task_id == task.id, TaskChunk.state == PENDING, TaskChunk.attempts >= policy.max_attempts).limit(1)
        ).scalar()  # fmt: skip
        if exhausted is not None:
            why = f"chunk {exhausted.index} failed {exhausted.attempts} times (max_attempts={policy.max_attempts}); last: {exhausted.last_error}"
            self._orders |= finish(session, task, _T.FAILED, why, at)
            return
        if TaskState(task.state) is _T.PAUSED:
            return
        pending = pending_chunks(session, task, at)
        if not pending:
            return
        rules = placement_of(task)
        active = active_workers(session, task.id)
        room = (rules.max_nodes - len(active)) if rules.max_nodes else None
        fresh = self._candidates(session, task, {w.target_id for w in active}).eligible if room is None or room > 0 else []
        fresh = fresh[:room] if room is not None else fresh
        fresh = fresh[: len(pending)]

        def weights(items: list[Any]) -> list[float]:
            return [x.weight if rules.capability_weighted else 1.0 for x in items]

        if fresh:
            attempt = 1 + int(session.execute(
                select(func.max(TaskChunk.attempts)).where(TaskChunk.task_id == task.id, TaskChunk.index.in_(pending))  # type: ignore[attr-defined]
            ).scalar() or 0)  # fmt: skip
            for candidate, share in zip(fresh, placement.split(pending, weights(fresh)), strict=True):
                self._new_worker(session, task, candidate, share, attempt, at)
        elif active:
            for worker, share in zip(active, placement.split(pending, weights(active)), strict=True):
                if share:
                    assign(session, task, worker, share)
                    session.flush()
                    self._orders |= put_worker_order(session, worker.target_kind, worker.target_id, build_order(session, task, worker, self.signing))
                    hub_log(session, task.id, f"{len(share)} chunks given to worker {worker.id} on {worker.target_id}", at=at, worker_id=worker.id, target_id=worker.target_id)
        else:
            self._wait(session, task, f"{len(pending)} chunks wait for a qualifying target", at)
            return
        self.counters["chunks_reassigned"] += len(pending)
        self._changed = True

    @staticmethod
    def _counting(session: Session, task: Task) -> list[TaskWorker]:
        """The active workers the task's end waits for (a split task's tails serve its heads; they do not count)."""
        companions = node_roles()
        return [w for w in active_workers(session, task.id) if w.role not in companions]

    def _tick_kind(self, session: Session, task: Task, at: datetime) -> None:
        """The kind's own step for an active, placed, unpaused task (a federated round: ``cloud.fl.rounds``)."""
        done: Ticked = kind_of(task.type).tick(session, task, at, _Driving(self, session, task, at))
        self._orders |= done.orders
        self._changed |= done.changed
        if done.closed:
            self.rounds_closed.add(task.id)
            self.counters["fl_rounds_closed"] += 1

    def _companions(self, session: Session, task: Task, at: datetime, device_role: str, node_role: str) -> None:
        """A companion (split tail, federated aggregator) on every edge node under the task's device workers, none
        elsewhere; a failed one is replaced after the back-off, at most ``max_attempts`` times per node."""
        session.flush()
        changes = placement.companion_changes(session, active_workers(session, task.id), device_role, node_role)
        for worker in changes.withdraw:
            move_worker(session, worker, _W.CANCELED, f"no {device_role} worker runs under its node any more", at)
            self._orders |= withdraw_worker_order(session, worker.target_kind, worker.target_id, worker.id)
            hub_log(session, task.id, f"{node_role} {worker.id} on {worker.target_id} withdrawn: no {device_role} runs under it", at=at, worker_id=worker.id, target_id=worker.target_id)
            worker.replaced_by = GAVE_UP
            self._changed = True
        ended = list(session.execute(
            select(TaskWorker).where(
                TaskWorker.task_id == task.id, TaskWorker.role == node_role, TaskWorker.state.in_([s.value for s in WORKER_FAILURES]),  # type: ignore[attr-defined]
                TaskWorker.replaced_by.is_(None),  # type: ignore[union-attr]
            ).order_by(TaskWorker.id)
        ).scalars())  # fmt: skip
        policy = retry_of(task)
        failed = (_W.FAILED.value, _W.TIMED_OUT.value, _W.REJECTED.value)  # a node going OFFLINE (LOST) is not the tail's fault
        failures: dict[str, list[TaskWorker]] = defaultdict(list)
        if changes.place:
            for old in session.execute(
                select(TaskWorker).where(TaskWorker.task_id == task.id, TaskWorker.role == node_role, TaskWorker.state.in_(failed))  # type: ignore[attr-defined]
            ).scalars():  # fmt: skip
                failures[old.target_id].append(old)
        for node_id in changes.place:
            before = [old for old in ended if old.target_id == node_id]
            attempt = 1 + len(failures[node_id])
            if attempt > policy.max_attempts:  # its heads fall back to the whole model on their devices
                if before:
                    hub_log(session, task.id, f"no new {node_role} on {node_id}: {attempt - 1} failed (max_attempts={policy.max_attempts})", "warning", at)
                for old in before:
                    old.replaced_by = GAVE_UP
                continue
            last = max((utc(old.finished_at) or at for old in failures[node_id]), default=None)
            if last is not None and at < last + timedelta(seconds=policy.delay(attempt)):
                continue  # the back-off after the tail that failed there
            new = self._new_worker(session, task, placement.Candidate(TargetKind.NODE, node_id, node_id, 1.0), [], attempt, at, role=node_role)
            for old in before:
                old.replaced_by = new.id
        for old in ended:  # an ended tail whose node needs no new one (no head under it, or a tail runs there): done with
            if old.replaced_by is None and (old.target_id not in changes.wanted or old.target_id in changes.covered):
                old.replaced_by = GAVE_UP
        for old in ended:
            session.add(old)

    def _drive_each(self, session: Session, task: Task, at: datetime) -> None:
        policy = retry_of(task)
        ended = list(session.execute(
            select(TaskWorker).where(
                TaskWorker.task_id == task.id, TaskWorker.state.in_([s.value for s in WORKER_FAILURES]), TaskWorker.replaced_by.is_(None),  # type: ignore[attr-defined,union-attr]
                TaskWorker.role.not_in(node_roles()),  # type: ignore[attr-defined]
            ).order_by(TaskWorker.id)
        ).scalars())  # fmt: skip
        paused = TaskState(task.state) is _T.PAUSED
        goes_on = type_info(task).on_lost == "continue"
        for worker in ended:
            if goes_on and self._counting(session, task):
                worker.replaced_by = GAVE_UP  # this type carries on with the workers it has (federated rounds close with k of n)
                session.add(worker)
                hub_log(session, task.id, f"worker {worker.id} is not replaced: the task goes on with the others", "warning", at, worker.id)
                continue
            if worker.attempt >= policy.max_attempts and worker.state != _W.REJECTED.value:
                worker.replaced_by = GAVE_UP
                session.add(worker)
                hub_log(session, task.id, f"worker {worker.id} is not replaced: attempt {worker.attempt} of max_attempts={policy.max_attempts}", "warning", at, worker.id)
                continue
            finished = utc(worker.finished_at) or at
            if paused or at < finished + timedelta(seconds=policy.delay(worker.attempt + 1)):
                continue
            active = active_workers(session, task.id)
            found = self._candidates(session, task, {w.target_id for w in active})
            if not found.eligible:
                self._wait(session, task, f"no target to replace worker {worker.id}: {found.why_not}", at)
                continue
            attempt = worker.attempt if worker.state == _W.REJECTED.value else worker.attempt + 1
            new = self._new_worker(session, task, found.eligible[0], [], attempt, at)
            worker.replaced_by = new.id
            session.add(worker)
        session.flush()
        if self._counting(session, task):
            return
        waiting = session.execute(
            select(TaskWorker.id).where(
                TaskWorker.task_id == task.id, TaskWorker.state.in_([s.value for s in WORKER_FAILURES]), TaskWorker.replaced_by.is_(None),  # type: ignore[attr-defined,union-attr]
                TaskWorker.role.not_in(node_roles()),  # type: ignore[attr-defined]
            )
        ).first()  # fmt: skip
        if waiting is not None:
            return
        succeeded = session.execute(select(TaskWorker.id).where(TaskWorker.task_id == task.id, TaskWorker.state == _W.SUCCEEDED.value)).first()
        if (held := kind_of(task.type).success_held(session, task)) is not None:
            self._wait(session, task, held, at)
            return
        if succeeded is not None:
            self._orders |= finish(session, task, _T.SUCCEEDED, "every worker finished", at)
        else:
            self._orders |= finish(session, task, _T.FAILED, "no worker finished and none is left to try", at)



class _Driving:
    """The scheduler as a kind's ``tick`` sees it (:class:`cloud.tasks.kind.Driver`), for one task."""

    def __init__(self, controller: TaskController, session: Session, task: Task, at: datetime) -> None:
        self._controller, self._session, self._task, self._at = controller, session, task, at

    @property
    def blobs(self) -> Any:
        return self._controller.blobs

    def put_orders(self) -> bool:
        c, session, task = self._controller, self._session, self._task
        changed = False
        for worker in active_workers(session, task.id):
            changed |= put_worker_order(session, worker.target_kind, worker.target_id, build_order(session, task, worker, c.signing))
        return changed

    def finish(self, state: TaskState, reason: str) -> None:
        self._controller._orders |= finish(self._session, self._task, state, reason, self._at)  # noqa: SLF001 - the controller's own helper

    def wait(self, reason: str) -> None:
        self._controller._wait(self._session, self._task, reason, self._at)  # noqa: SLF001 - the controller's own helper
