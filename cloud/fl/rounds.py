"""Federated rounds on the hub (DESIGN §5, seeds/000): updates in, rounds opened and closed, the model published.

Every decision is taken from ``fl_plans`` / ``fl_updates`` on the scheduler's tick, so a restarted hub resumes a
task at the round it was in (its open round keeps its deadline; updates stored before the restart count).

**A round attempt opens** (:func:`drive`) when no round is open, the round's global layer is stored as a signed
artefact (:func:`prepare`) and at least ``min_participants`` device workers run: its participants are those
devices, its deadline ``now + round_timeout_s`` (``sync: adaptive``: 3x the slowest recent complete round, the
seed's "dynamic adjustment of the sync period", :func:`_timeout`); every worker's order is updated (the devices
train, the aggregators wait for their devices).

**Updates** (:func:`accept`, in the ingest's transaction): an ``fl.update`` counts when it comes from the worker it
names, on its own target: a device's worker reports itself; an edge's aggregator reports devices under its node.
The layer must be float32 ``weight`` / ``bias`` of the plan's shapes with finite values; its contributors must be
participants of the open attempt that have not contributed yet (a repeat is refused: nobody is counted twice).
An update for an earlier round or attempt is *late*: dropped (``late_updates: drop``), or kept as *stale* for the
next fusion (``stale``, at most ``max_staleness`` rounds old, weighted ``n / (1 + staleness)``), and only when it was
computed for the attempt that closed its round by participants of that attempt (``fl_rounds.participant_ids``).
``num_examples`` is bounded by what its contributors reported of the task's dataset (the sum of their
``datasets[dataset].rows``, at least 1 each, so a contributor that reports none counts 1): a claim above that is
clamped to it and a warning goes to the task's log; FedAvg's weights and the round's metrics use the clamped count.

**One vote per participant per round**: a fusion takes at most one update from each device. The fresh updates of
the closing attempt come first (each contributes once by construction), then the stale ones, newest round first;
a stale update whose contributors already voted is left out (it is marked used in that round, kept, and counted in
the round's ``outvoted`` metric). So a device that sends 1 + ``max_staleness`` updates casts one vote, its newest.

**A round attempt closes** when every participant's update is in, or at its deadline with at least
``min_participants`` (k of n); the strategy (``interfaces.aggregation``, its state kept in the plan) fuses the
updates into the next global layer; the round's metrics (sample-weighted loss and accuracy the participants
measured on their own data, ``eval_accuracy`` / ``eval_loss`` on the held-out set at the cloud when the task has
one (:mod:`cloud.fl.evaluate`), counts, duration) go to ``fl_rounds`` and the task's metrics (worker ``hub``). A
participant that did not answer is not waited for: the next round's order resets it to the new global layer
(seeds/000: "reset timed-out local training"). At the deadline with fewer than k the round runs again as the
next attempt (same global layer), at most ``max_round_attempts`` times, then the task FAILS.

**Asynchronous rounds** (``sync: async``, whole models; FedBuff, Nguyen et al. 2022): every update for a round not
older than ``max_staleness`` is kept; once the buffer holds ``buffer_size`` (default k) of them, one per participant
(this round's and stale ones), the round closes at the next look, and at its deadline with whatever arrived (at least
one). A stale update counts ``n / sqrt(1 + staleness)`` (staleness: the rounds since the one it was trained from),
logged as it is folded; participants are never reset, so a slow one trains to the end and still counts.

**The end**: after ``rounds`` rounds :func:`prepare` publishes the model with the fused layer as a new version
(``output``, as incremental training does) and the task SUCCEEDS.
"""

from __future__ import annotations

import base64
import logging
import math
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
from sqlalchemy import select, update
from sqlalchemy.engine import Engine
from sqlmodel import Session

from cloud.convert import utc
from cloud.fl import whole
from cloud.fl.task import spec_of
from cloud.incremental import budgets, surgery
from cloud.tables import Artifact, Device, FlPlan, FlRoundRow, FlUpdateRow, Node, Task, TaskMetric, TaskWorker
from cloud.tasks.kind import Driver, Ticked
from cloud.tasks.lifecycle import active_workers, hub_log
from interfaces.aggregation import ClientUpdate, Strategy, strategy_from_spec, strategy_from_state, weighted_metrics
from interfaces.deployments import ArtifactCreate, ArtifactFormat, ArtifactKind
from interfaces.tasks import FL_AGGREGATOR, TASK_ACTIVE, WORKER_ACTIVE, FederatedTrainingSpec, FlKey, FlReveal, FlUpdate, TaskState

log = logging.getLogger("aisynergy.hub.fl")
EVERYONE = "every participant answered"
HUB_WORKER = "hub"
"""``worker_id`` of the per-round metrics the hub records for a federated task"""


# --- updates ---------------------------------------------------------------------------------------


def accept(session: Session, task: Task, kind: str, target_id: str, data: FlUpdate, at: datetime) -> str:
    """Keep or refuse one update (see the module docstring); the outcome: accepted, stale, late, duplicate, refused."""
    plan = session.get(FlPlan, task.id, with_for_update=True)
    worker = session.get(TaskWorker, data.worker_id)
    if plan is None or worker is None or worker.task_id != task.id or (worker.target_kind, worker.target_id) != (kind, target_id):
        return "refused"
    if worker.role == FL_AGGREGATOR:
        under = set(session.execute(select(Device.id).where(Device.node_id == target_id, Device.id.in_(data.contributors))).scalars())  # type: ignore[attr-defined]
        if under != set(data.contributors):
            return "refused"
    elif data.contributors != [target_id]:
        return "refused"
    spec = spec_of(task)
    if data.masked != spec.secure_aggregation:
        return "refused"
    frame, artifact_id = b"", None
    if spec.whole:  # the update is an uploaded artefact: its identity now, its tensors before the round closes
        why = whole.identity_wrong(session, task.id, target_id, data.parameters, data.round, data.attempt) if data.parameters else "it carries no parameters"
        if why is not None:
            hub_log(session, task.id, f"refused an update from worker {data.worker_id}: {why}", "warning", at, data.worker_id, target_id)
            return "refused"
        artifact_id = data.parameters
    else:
        layer = surgery.DenseLayer.from_json(plan.layer)
        try:
            if data.data is None:
                raise ValueError("it carries no layer")
            frame = base64.b64decode(data.data, validate=True)
            _layer(frame, layer, data.masked)
        except ValueError as exc:
            log.warning("task %s: refused an update from %s: %s", task.id, data.worker_id, exc)
            return "refused"
    named = [spec.dataset] if spec.dataset else sorted(set(spec.datasets.values()))
    dataset = " or ".join(named)
    bound = _examples_bound(session, data.contributors, named, lenient=spec.whole) if named else data.num_examples
    num_examples = min(data.num_examples, bound)
    if num_examples < data.num_examples:
        hub_log(session, task.id, f"an update from worker {data.worker_id} claimed {data.num_examples} examples; its contributors "
                f"reported {bound} rows of {dataset}: counted as {bound}", "warning", at, data.worker_id, target_id)  # fmt: skip
    row = FlUpdateRow(
        task_id=task.id, round=data.round, attempt=data.attempt, worker_id=data.worker_id, contributors=list(data.contributors),
        num_examples=num_examples, data=frame, artifact_id=artifact_id, vetted=not spec.whole,
        metrics={k: float(v) for k, v in data.metrics.items() if math.isfinite(v)}, received_at=at,
    )  # fmt: skip
    if plan.attempt > 0 and (data.round, data.attempt) == (plan.round, plan.attempt):
        if not set(data.contributors) <= set(plan.participants):
            return "refused"
        seen = _contributors(session, task.id, plan.round, plan.attempt)
        if seen & set(data.contributors):
            return "duplicate"
        if plan.unmasking:  # the survivors are revealing their seeds with the dropped: too late to count
            return "late"
        session.add(row)
        if spec.whole and spec.secure_aggregation:
            whole.counted(plan, target_id, num_examples)
            session.add(plan)
        if spec.whole:
            if worker.role == FL_AGGREGATOR:
                hub_log(session, task.id, f"round {data.round}: the weighted mean of {len(data.contributors)} devices under {target_id} is in ({num_examples} examples)",
                        at=at, worker_id=data.worker_id, target_id=target_id)  # fmt: skip
            else:
                ran = whole.algorithm_for(whole.WholePlan.of(plan), whole.labels_of(session, kind, target_id)).manifest
                hub_log(session, task.id, f"round {data.round}: the update of {target_id} is in ({ran['name']} {ran['version']}, {num_examples} examples)",
                        at=at, worker_id=data.worker_id, target_id=target_id)  # fmt: skip
        if seen | set(data.contributors) >= set(plan.participants):
            plan.deadline_at = min(utc(plan.deadline_at) or at, at)  # everyone answered: close at the next look
            session.add(plan)
        elif spec.sync == "async":
            session.flush()
            _fold_when_full(session, task, plan, spec, at)
        return "accepted"
    if (data.round, data.attempt) < (plan.round, plan.attempt) or data.round < plan.round:
        if _keeps_stale(spec) and data.round < plan.round and plan.round - data.round <= spec.max_staleness:
            if not _closing_participants(session, task.id, data.round, data.attempt) >= set(data.contributors):
                return "late"  # not computed by participants of the attempt that closed that round
            if _contributors(session, task.id, data.round, data.attempt) & set(data.contributors) or _stale_seen(session, task.id, data.round, data.contributors):
                return "duplicate"  # already fused (a redelivery), or already kept as stale
            row.stale = True
            session.add(row)
            if spec.sync == "async":
                session.flush()
                _fold_when_full(session, task, plan, spec, at)
            return "stale"
        return "late"
    return "refused"  # a round that has not opened


def _keeps_stale(spec: FederatedTrainingSpec) -> bool:
    """Whether an update for an earlier round may still be fused (``late_updates: stale``, or every async task)."""
    return spec.late_updates == "stale" or spec.sync == "async"


def _stale_rows(session: Session, task_id: str, plan: FlPlan, spec: FederatedTrainingSpec) -> list[FlUpdateRow]:
    """The stale updates not fused yet that are still young enough to be."""
    if not _keeps_stale(spec):
        return []
    return list(session.execute(
        select(FlUpdateRow).where(FlUpdateRow.task_id == task_id, FlUpdateRow.stale.is_(True), FlUpdateRow.used_in.is_(None),  # type: ignore[attr-defined,union-attr]
                                  FlUpdateRow.round >= plan.round - spec.max_staleness).order_by(FlUpdateRow.id)
    ).scalars())  # fmt: skip


def _fold_when_full(session: Session, task: Task, plan: FlPlan, spec: FederatedTrainingSpec, at: datetime) -> None:
    """Async: once the buffer holds ``buffer_size`` updates (this round's and stale ones, one per participant), fold at
    the next look."""
    fresh = _contributors(session, task.id, plan.round, plan.attempt)
    voters = fresh | {c for r in _stale_rows(session, task.id, plan, spec) for c in r.contributors}
    if len(voters) >= (spec.buffer_size or spec.min_participants):
        plan.deadline_at = min(utc(plan.deadline_at) or at, at)
        session.add(plan)


def accept_key(session: Session, task: Task, kind: str, target_id: str, data: FlKey) -> str:
    """A device worker's X25519 public key for secure aggregation (its own, for this task); replaces an older one."""
    plan = session.get(FlPlan, task.id, with_for_update=True)
    worker = session.get(TaskWorker, data.worker_id)
    if plan is None or worker is None or worker.task_id != task.id or (worker.target_kind, worker.target_id, worker.role) != (kind, target_id, "worker"):
        return "refused"
    if not spec_of(task).secure_aggregation:
        return "refused"
    try:
        if len(base64.b64decode(data.public_key, validate=True)) != 32:
            raise ValueError("not 32 bytes")
    except ValueError:
        return "refused"
    plan.keys = {**plan.keys, target_id: {"worker_id": worker.id, "key": data.public_key}}
    session.add(plan)
    return "accepted"


def accept_reveal(session: Session, task: Task, kind: str, target_id: str, data: FlReveal, at: datetime) -> str:
    """A survivor's pair seeds with the participants that dropped after masking, for the attempt being unmasked."""
    plan = session.get(FlPlan, task.id, with_for_update=True)
    worker = session.get(TaskWorker, data.worker_id)
    if plan is None or worker is None or worker.task_id != task.id or (worker.target_kind, worker.target_id) != (kind, target_id):
        return "refused"
    if not plan.unmasking or (data.round, data.attempt) != (plan.round, plan.attempt):
        return "late"
    if target_id not in _contributors(session, task.id, plan.round, plan.attempt) or not set(data.seeds) <= set(plan.unmasking):
        return "refused"
    try:
        if any(len(base64.b64decode(seed, validate=True)) != 32 for seed in data.seeds.values()):
            raise ValueError("a seed is not 32 bytes")
    except ValueError:
        return "refused"
    plan.reveals = {**plan.reveals, target_id: {**plan.reveals.get(target_id, {}), **data.seeds}}
    if _revealed(session, task.id, plan):
        plan.deadline_at = min(utc(plan.deadline_at) or at, at)  # unmask at the next look
    session.add(plan)
    return "accepted"


def _revealed(session: Session, task_id: str, plan: FlPlan) -> bool:
    """Every survivor revealed its seed with every participant that dropped."""
    return all(set(plan.reveals.get(s, {})) >= set(plan.unmasking) for s in _contributors(session, task_id, plan.round, plan.attempt))


def _contributors(session: Session, task_id: str, round: int, attempt: int) -> set[str]:
    rows = session.execute(
        select(FlUpdateRow.contributors).where(FlUpdateRow.task_id == task_id, FlUpdateRow.round == round, FlUpdateRow.attempt == attempt,
                                               FlUpdateRow.stale.is_(False), _not_refused())  # type: ignore[attr-defined]
    ).scalars()  # fmt: skip
    return {c for row in rows for c in row}


def _closing_participants(session: Session, task_id: str, round: int, attempt: int) -> set[str]:
    """The participants of ``round`` if ``attempt`` is the one that closed it (nobody otherwise)."""
    row = session.get(FlRoundRow, (task_id, round))
    return set(row.participant_ids or []) if row is not None and row.attempts == attempt else set()


def _not_refused() -> Any:
    from sqlalchemy import func

    return func.coalesce(FlUpdateRow.used_in, 0) != whole.REFUSED


def _examples_bound(session: Session, contributors: list[str], datasets: list[str], lenient: bool = False) -> int:
    """The most examples ``contributors`` can have trained on: the rows they reported of ``datasets`` (the largest of
    them), at least 1 each. ``lenient`` (a whole model's update): a contributor that reports none of them (an edge
    node's dataset that is a folder or no ``.npz`` of x and y is not described) is not bounded."""
    rows: dict[str, Any] = {d.id: d for d in session.execute(select(Device).where(Device.id.in_(contributors))).scalars()}  # type: ignore[attr-defined]
    if lenient:  # a whole model's participants may be sites: edge nodes describe their .npz datasets as devices do
        rows |= {n.id: n for n in session.execute(select(Node).where(Node.id.in_(contributors))).scalars()}  # type: ignore[attr-defined]
    reported = {c: [info.rows for d in datasets if c in rows and (info := budgets.reported_dataset(rows[c], d)) is not None] for c in set(contributors)}
    if lenient and any(not r for r in reported.values()):
        return 2**62
    return sum(max(1, max(r, default=1)) for r in reported.values())


def _one_vote_each(fresh: list[FlUpdateRow], stale: list[FlUpdateRow]) -> tuple[list[FlUpdateRow], list[FlUpdateRow]]:
    """The stale updates that may vote beside ``fresh`` (newest round first, none from a contributor that already
    voted), and those left out."""
    voted = {c for r in fresh for c in r.contributors}
    kept, outvoted = [], []
    for row in sorted(stale, key=lambda r: (-r.round, -r.attempt, r.id or 0)):
        if voted & set(row.contributors):
            outvoted.append(row)
            continue
        voted |= set(row.contributors)
        kept.append(row)
    return sorted(kept, key=lambda r: r.id or 0), outvoted


def _stale_seen(session: Session, task_id: str, round: int, contributors: list[str]) -> bool:
    rows = session.execute(
        select(FlUpdateRow.contributors).where(FlUpdateRow.task_id == task_id, FlUpdateRow.round == round, FlUpdateRow.stale.is_(True))  # type: ignore[attr-defined]
    ).scalars()  # fmt: skip
    return bool({c for row in rows for c in row} & set(contributors))


def _layer(frame: bytes, layer: surgery.DenseLayer, masked: bool = False) -> dict[str, np.ndarray]:
    from safetensors.numpy import load

    try:
        tensors = load(frame)
    except Exception as exc:  # noqa: BLE001 - safetensors' own error types
        raise ValueError(f"not a safetensors frame: {exc}") from None
    if set(tensors) != {"weight", "bias"}:
        raise ValueError(f"the frame holds {sorted(tensors)}, not weight and bias")
    weight, bias = tensors["weight"], tensors["bias"]
    dtype = np.uint32 if masked else np.float32
    if weight.dtype != dtype or bias.dtype != dtype:
        raise ValueError(f"weight and bias must be {np.dtype(dtype).name}{' (masked)' if masked else ''}, not {weight.dtype} and {bias.dtype}")
    if weight.shape != (layer.features, layer.classes) or bias.shape != (layer.classes,):
        raise ValueError(f"weight {list(weight.shape)} and bias {list(bias.shape)} do not fit the layer ({layer.features} x {layer.classes})")
    if not masked and not (np.isfinite(weight).all() and np.isfinite(bias).all()):
        raise ValueError("the layer holds NaN or infinite values")
    return {"weight": weight, "bias": bias}


# --- rounds ----------------------------------------------------------------------------------------


def drive(session: Session, task: Task, at: datetime, driver: Driver, blobs: Any = None) -> Ticked:
    """Open, close or retry the task's round (see the module docstring), through the scheduler's ``driver``:
    ``put_orders()`` rewrites every active worker's order, ``finish(state, reason)`` ends the task, ``wait(reason)``
    records why it waits; ``blobs``: the artefact store (for the held-out set)."""
    done = Ticked()
    plan = session.get(FlPlan, task.id, with_for_update=True)
    if plan is None:
        driver.finish(TaskState.FAILED, "the task's federated plan is gone")
        return done
    spec = spec_of(task)
    checking = whole.check_due(plan, spec)  # evaluate_every: a round's global model is scored before anything else
    if checking is not None:
        phase = whole.checked(session, task, plan, spec, checking, _running(session, task.id), at, driver)
        done.orders |= phase in ("opened", "done")
        done.changed |= phase in ("opened", "done")
        if phase != "done" or plan.round > spec.rounds:
            return done
    if plan.round > spec.rounds:
        if plan.published_artifact_id:
            running = _running(session, task.id)
            for wanted, step in ((spec.whole and spec.then_deploy is not None, whole.exported), (spec.whole and spec.cross_evaluation, whole.evaluated)):
                phase = step(session, task, plan, spec, running, at, driver) if wanted else "done"
                if phase != "done":
                    done.orders |= phase == "opened"
                    done.changed |= phase == "opened"
                    return done
            onnx, deployment = whole.deployment_of(plan)
            if spec.whole and spec.then_deploy is not None and onnx is not None and deployment is None and whole.WholePlan.of(plan).export.why_not is None:  # type: ignore[union-attr]
                driver.wait(f"starting the deployment of {onnx}")
                return done
            driver.finish(TaskState.SUCCEEDED, f"{spec.rounds} rounds done; published {plan.published_artifact_id}" + (f"; deployment {deployment} started" if deployment else ""))
        elif spec.whole and spec.evaluate_every is not None and plan.weights_artifact_id is None and not whole.WholePlan.of(plan).publish_from:
            driver.wait("storing the last round's global model to score it")
        else:
            driver.wait("publishing the trained model")
        return done
    devices = [w for w in active_workers(session, task.id) if w.role != FL_AGGREGATOR]
    if plan.attempt == 0:
        if plan.weights_artifact_id is None:
            driver.wait(f"storing round {plan.round}'s global layer")
            return done
        _open(session, task, plan, spec, devices, 1, at, done, driver, blobs)
        return done
    deadline = utc(plan.deadline_at) or at
    if at < deadline:
        return done
    if spec.whole and blobs is not None:
        whole.vet(session, blobs, task, plan, at)
    contributed = _contributors(session, task.id, plan.round, plan.attempt)
    k = spec.min_participants
    dropped = set(plan.participants) - contributed
    if spec.secure_aggregation and dropped and len(contributed) >= k:
        if not plan.unmasking:  # the survivors' masks with the dropped ones do not cancel: ask them for the seeds
            plan.unmasking, plan.reveals = sorted(dropped), {}
            plan.deadline_at = at + timedelta(seconds=spec.round_timeout_s)
            session.add(plan)
            session.flush()
            done.orders |= bool(driver.put_orders())
            done.changed = True
            hub_log(session, task.id, f"round {plan.round}: {', '.join(sorted(dropped))} dropped after masking; the {len(contributed)} others reveal their seeds with {'it' if len(dropped) == 1 else 'them'}", at=at)
            return done
        if not _revealed(session, task.id, plan):
            contributed = set()  # the sum cannot be unmasked: the attempt runs again below
    folds = spec.sync == "async" and bool(contributed or _stale_rows(session, task.id, plan, spec))  # async: whatever arrived by the deadline
    if folds or (contributed and (contributed >= set(plan.participants) or len(contributed) >= k)):
        closing, participants = plan.round, len(plan.participants)  # the plan moves on to the next round in _close
        _close(session, task, plan, spec, at, done, blobs)
        hub_log(session, task.id, f"round {closing} closed with {len(contributed)} of {participants} participants", at=at)
        return done
    if plan.attempt >= spec.max_round_attempts:
        driver.finish(TaskState.FAILED, f"round {plan.round} got {len(contributed)} of the k={k} updates needed in each of {plan.attempt} attempts")
        return done
    hub_log(session, task.id, f"round {plan.round} attempt {plan.attempt}: {len(contributed)} of the k={k} updates needed by its deadline; running it again", "warning", at)
    _open(session, task, plan, spec, devices, plan.attempt + 1, at, done, driver, blobs)
    return done


def _running(session: Session, task_id: str) -> list[str]:
    """The participants whose worker runs now."""
    return sorted({w.target_id for w in active_workers(session, task_id) if w.role != FL_AGGREGATOR and w.state in {s.value for s in WORKER_ACTIVE}})


def _open(session: Session, task: Task, plan: FlPlan, spec: FederatedTrainingSpec, devices: list[TaskWorker], attempt: int, at: datetime,
          done: Ticked, driver: Driver, blobs: Any = None) -> None:  # fmt: skip
    running = sorted({w.target_id for w in devices if w.state in {s.value for s in WORKER_ACTIVE}})
    if spec.secure_aggregation:  # a participant masks with every other one: it needs the key of their worker as it runs now
        current = {w.target_id: w.id for w in devices}
        running = [d for d in running if plan.keys.get(d, {}).get("worker_id") == current.get(d)]
    if len(running) < spec.min_participants:
        plan.attempt = 0 if attempt == 1 else plan.attempt
        session.add(plan)
        driver.wait(f"{len(running)} of the {spec.min_participants} participants needed run a worker" + (" and sent their key" if spec.secure_aggregation else ""))
        return
    if attempt > 1:
        whole.sweep_due(session)  # the updates of the attempt run again never count
    plan.attempt, plan.participants = attempt, running
    plan.unmasking, plan.reveals = [], {}
    plan.trained = {**plan.trained, **{d: plan.trained.get(d, 0) + 1 for d in running}}  # what a DP task charges each device
    if spec.secure_aggregation and spec.whole:
        plan.total_examples = whole.secure_weights(plan, running)
    elif spec.secure_aggregation:
        rows = {d.id: d for d in session.execute(select(Device).where(Device.id.in_(running))).scalars()}  # type: ignore[attr-defined]
        plan.total_examples = sum(max(1, (info.rows if (info := budgets.reported_dataset(rows[d], spec.dataset or "")) else 1)) for d in running if d in rows)
    plan.opened_at, plan.deadline_at = at, at + timedelta(seconds=_timeout(session, task.id, spec))
    session.add(plan)
    session.flush()
    done.orders |= bool(driver.put_orders())
    done.changed = True
    what = f"round {plan.round}/{spec.rounds}" + (f" attempt {attempt}" if attempt > 1 else "")
    hub_log(session, task.id, f"{what} open: {len(running)} participants, {spec.strategy}, deadline in {spec.round_timeout_s:g} s", at=at)
    if plan.round == 1 and attempt == 1 and spec.eval_inputs is not None and not spec.whole and blobs is not None:
        _score_start(session, blobs, task, plan, spec, at)


def _score_start(session: Session, blobs: Any, task: Task, plan: FlPlan, spec: FederatedTrainingSpec, at: datetime) -> None:
    """Round 0: the starting model's score on the held-out set, the first point of the accuracy curve (a hub metric
    sample with ``round`` 0, as each round's close records one)."""
    from safetensors.numpy import load

    layer = surgery.DenseLayer.from_json(plan.layer)
    start = load(plan.weights) if plan.weights else None
    if not start:
        return
    values = {"round": 0.0, **_evaluate(session, blobs, task, plan, spec, layer, start)}
    if len(values) > 1:
        session.add(TaskMetric(task_id=task.id, worker_id=HUB_WORKER, target_id=HUB_WORKER, message_id=f"fl-{task.id}-r0", ts=at, values=values))
        hub_log(session, task.id, f"round 0 (the starting model): held-out accuracy {values.get('eval_accuracy', float('nan')):.4f}", at=at)


ADAPTIVE_WINDOW, ADAPTIVE_FACTOR, ADAPTIVE_FLOOR_S = 5, 3.0, 1.0


def _timeout(session: Session, task_id: str, spec: FederatedTrainingSpec) -> float:
    """The round's timeout: ``round_timeout_s``, or (``sync: adaptive``) 3x the slowest of the last 5 rounds that every
    participant finished, within [1 s, round_timeout_s] (the seed's "dynamic adjustment of the sync period")."""
    if spec.sync != "adaptive":
        return spec.round_timeout_s
    rows = session.execute(
        select(FlRoundRow.metrics).where(FlRoundRow.task_id == task_id, FlRoundRow.reason == EVERYONE).order_by(FlRoundRow.round.desc()).limit(ADAPTIVE_WINDOW)  # type: ignore[attr-defined]
    ).scalars().all()  # fmt: skip
    paces = [float(m["round_s"]) for m in rows if "round_s" in m]
    if not paces:
        return spec.round_timeout_s
    return min(spec.round_timeout_s, max(ADAPTIVE_FLOOR_S, ADAPTIVE_FACTOR * max(paces)))


def _strategy(plan: FlPlan, spec: FederatedTrainingSpec) -> Strategy:
    from safetensors.numpy import load

    from interfaces.aggregation import strategy_from_meta

    if plan.strategy_state and spec.whole:  # its arrays are a tensor file of the plan (cloud.fl.whole)
        return strategy_from_meta(plan.strategy_state)
    if plan.strategy_state:
        return strategy_from_state(plan.strategy_state, load(plan.strategy_arrays) if plan.strategy_arrays else {})
    return strategy_from_spec(spec.strategy, **spec.strategy_params)


def _close(session: Session, task: Task, plan: FlPlan, spec: FederatedTrainingSpec, at: datetime, done: Ticked, blobs: Any = None) -> None:
    from safetensors.numpy import load, save

    fresh = list(session.execute(
        select(FlUpdateRow).where(FlUpdateRow.task_id == task.id, FlUpdateRow.round == plan.round, FlUpdateRow.attempt == plan.attempt,
                                  FlUpdateRow.stale.is_(False), _not_refused()).order_by(FlUpdateRow.id)  # type: ignore[attr-defined]
    ).scalars())  # fmt: skip
    stale = _stale_rows(session, task.id, plan, spec)
    stale, outvoted = _one_vote_each(fresh, stale)
    strategy = _strategy(plan, spec)
    new: dict[str, np.ndarray] | None = None
    if spec.whole:  # tensor by tensor over the uploaded files (cloud.fl.whole)
        weighted = [(r, r.num_examples) for r in fresh] + [(r, _stale_weight(r.num_examples, plan.round - r.round, spec.sync == "async")) for r in stale]
        for row, weight in weighted[len(fresh):]:
            hub_log(session, task.id, f"round {plan.round}: folded the update of {', '.join(row.contributors)} from round {row.round} (staleness "
                    f"{plan.round - row.round}) at weight {weight} of its {row.num_examples} examples", at=at, worker_id=row.worker_id)  # fmt: skip
        moved = whole.fuse(session, blobs, plan, strategy, weighted, task.id, spec.compression, _seeds_with_dropped(plan) if spec.secure_aggregation else None, spec.dp)
        if spec.dp is not None:
            moved["dp_noise_std"] = spec.dp.noise_multiplier * spec.dp.clip_norm / max(1, len(weighted))
        meta, arrays = strategy.state_meta(), dict[str, np.ndarray]()
    else:
        layer = surgery.DenseLayer.from_json(plan.layer)
        if spec.secure_aggregation:
            updates = [_unmasked(plan, layer, fresh)]
        else:
            updates = [ClientUpdate(_layer(r.data, layer), r.num_examples, r.metrics, r.worker_id) for r in fresh]
        updates += [ClientUpdate(_layer(r.data, layer), _stale_weight(r.num_examples, plan.round - r.round), r.metrics, r.worker_id) for r in stale]
        new = strategy.aggregate(load(plan.weights), updates)
        meta, arrays = strategy.state()
        moved = {}
    metrics = weighted_metrics([ClientUpdate({}, r.num_examples, r.metrics) for r in fresh])
    contributors = {c for r in fresh for c in r.contributors}
    opened = utc(plan.opened_at) or at
    metrics |= {"round": float(plan.round), "participants": float(len(plan.participants)), "contributors": float(len(contributors)),
                "stale": float(len(stale)), "outvoted": float(len(outvoted)), "round_s": (at - opened).total_seconds(), "examples": float(sum(r.num_examples for r in fresh))} | moved  # fmt: skip
    if spec.eval_inputs and blobs is not None and new is not None:
        metrics |= _evaluate(session, blobs, task, plan, spec, layer, new)
    session.add(FlRoundRow(
        task_id=task.id, round=plan.round, attempts=plan.attempt, participants=len(plan.participants), contributors=len(contributors), stale=len(stale),
        opened_at=opened, closed_at=at, reason=EVERYONE if contributors >= set(plan.participants) else "deadline with k of n",
        metrics=metrics, participant_ids=list(plan.participants),
    ))  # fmt: skip
    session.add(TaskMetric(task_id=task.id, worker_id=HUB_WORKER, target_id=HUB_WORKER, message_id=f"fl-{task.id}-r{plan.round}", ts=at, values=metrics))
    if "eval_accuracy" in metrics:  # what `task create --watch` and `task logs` show round after round
        hub_log(session, task.id, f"round {plan.round}: held-out accuracy {metrics['eval_accuracy']:.4f}, loss {metrics.get('eval_loss', float('nan')):.4f}", at=at)
    ids = [r.id for r in fresh + stale + outvoted]
    if ids:
        session.execute(update(FlUpdateRow).where(FlUpdateRow.id.in_(ids)).values(used_in=plan.round))  # type: ignore[union-attr]
    if new is not None:
        plan.weights = save({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in new.items()})
    plan.strategy_state, plan.strategy_arrays = meta, (save(arrays) if arrays else None)
    plan.round, plan.attempt, plan.participants = plan.round + 1, 0, []
    plan.unmasking, plan.reveals, plan.total_examples = [], {}, None
    plan.weights_artifact_id, plan.opened_at, plan.deadline_at = None, None, None
    session.add(plan)
    whole.sweep_due(session)  # the fused updates (and the round of two rounds ago) can go
    done.closed = done.changed = True


def _stale_weight(num_examples: int, staleness: int, buffered: bool = False) -> int:
    """What a stale update counts for: ``n / (1 + staleness)``; in an async task (FedBuff, Nguyen et al. 2022: the
    polynomial staleness weight with exponent 1/2) ``n / sqrt(1 + staleness)``; rounded, at least 1."""
    return max(1, round(num_examples / (math.sqrt(1 + staleness) if buffered else 1 + staleness)))


def _unmasked(plan: FlPlan, layer: surgery.DenseLayer, rows: list[FlUpdateRow]) -> ClientUpdate:
    """Secure aggregation: the sum of the masked layers, the dropped participants' masks removed with the survivors'
    seeds, decoded, and rescaled from ``n_k / total`` to the contributors' weighted mean."""
    from interfaces import secagg

    total: dict[str, np.ndarray] = {}
    for row in rows:
        for name, array in _layer(row.data, layer, masked=True).items():
            total[name] = total[name] + array if name in total else array.copy()  # uint32: wraps mod 2^32
    if plan.unmasking:
        total = secagg.unmask_sum(total, _seeds_with_dropped(plan))
    examples = sum(r.num_examples for r in rows)
    scale = (plan.total_examples or examples) / examples
    weights = {name: (secagg.decode(array) * scale).astype(np.float32) for name, array in total.items()}
    return ClientUpdate(weights, examples, {}, "secure sum")


def _evaluate(session: Session, blobs: Any, task: Task, plan: FlPlan, spec: FederatedTrainingSpec, layer: surgery.DenseLayer, new: dict[str, np.ndarray]) -> dict[str, float]:
    """The new global model's score on the held-out set (nothing when it cannot be computed: logged, the round goes on)."""
    from cloud.artifacts import read_blob
    from cloud.fl import evaluate

    body = session.get(Artifact, plan.body_artifact_id)
    try:
        if body is None or spec.eval_inputs is None:
            raise LookupError("the body or the held-out set is gone")
        feats, y = evaluate.held_out(session, blobs, spec.eval_inputs, (task.id, body.sha256), lambda: read_blob(blobs, body.sha256), layer.feature)
        return evaluate.score(feats, y, new["weight"], new["bias"])
    except Exception:  # noqa: BLE001 - a missing score must not stop the rounds
        log.exception("task %s: scoring round %s on the held-out set failed", task.id, plan.round)
        return {}


# --- artefacts (own transactions, on the tick before the tasks are driven) ---------------------------


def prepare(engine: Engine, signing: Any, blobs: Any) -> int:
    """Store each active task's next round's global layer as a signed artefact, and publish the final model of
    each task past its last round; how many were stored."""
    with Session(engine) as session:
        rows = session.execute(
            select(FlPlan.task_id).join(Task, Task.id == FlPlan.task_id).where(  # type: ignore[arg-type]
                Task.state.in_([s.value for s in TASK_ACTIVE]), FlPlan.weights_artifact_id.is_(None), FlPlan.published_artifact_id.is_(None)  # type: ignore[attr-defined,union-attr]
            )
        ).scalars().all()  # fmt: skip
    stored = 0
    for task_id in rows:
        try:
            stored += _prepare_one(engine, signing, blobs, task_id)
        except Exception:  # noqa: BLE001 - tried again on the next tick
            log.exception("task %s: storing the federated model failed", task_id)
    try:  # read the updates through here, not under the plan's lock in drive: a whole model's files may be large
        with Session(engine) as session:
            whole.vet_waiting(session, blobs, datetime.now(UTC))
    except Exception:  # noqa: BLE001 - tried again on the next tick (and by drive before a round closes)
        log.exception("reading federated updates through failed")
    try:
        with Session(engine) as session:
            whole.deploy_waiting(session, datetime.now(UTC))
    except Exception:  # noqa: BLE001 - tried again on the next tick
        log.exception("starting the deployment of a federated model failed")
    try:
        with Session(engine) as session:
            whole.sweep_if_due(session, blobs)
    except Exception:  # noqa: BLE001 - tried again on the next tick
        log.exception("deleting fused federated updates failed")
    return stored


def _prepare_one(engine: Engine, signing: Any, blobs: Any, task_id: str) -> int:
    with Session(engine, expire_on_commit=False) as session:
        plan, task = session.get(FlPlan, task_id), session.get(Task, task_id)
        if plan is None or task is None:
            return 0
        spec = spec_of(task)
        model = session.get(Artifact, plan.model_artifact_id)
        if model is None:
            raise LookupError(f"the model of task {task_id} is gone")
        if spec.whole:  # the fused parameters are a blob already: record them as the next round's, or the published model
            stored = whole.store(session, signing, blobs, task, plan, spec)
            if stored is not None and plan.round > spec.rounds:
                hub_log(session, task_id, f"published model {stored.name} {stored.version} ({stored.id}) after {spec.rounds} federated rounds")
                session.commit()
            return int(stored is not None)
        if plan.round > spec.rounds:
            if plan.published_artifact_id:
                return 0
            artifact = _publish(session, signing, blobs, task, plan, spec, model)
            session.execute(update(FlPlan).where(FlPlan.task_id == task_id).values(published_artifact_id=artifact.id))  # type: ignore[arg-type]
        elif plan.weights_artifact_id is None:
            artifact = _store_weights(session, signing, blobs, task, plan, model)
            session.execute(update(FlPlan).where(FlPlan.task_id == task_id, FlPlan.round == plan.round).values(weights_artifact_id=artifact.id))  # type: ignore[arg-type]
        else:
            return 0
        session.commit()
        return 1


def _store_weights(session: Session, signing: Any, blobs: Any, task: Task, plan: FlPlan, model: Artifact) -> Artifact:
    import hashlib

    from cloud.artifacts import create_artifact, find_by_identity
    from cloud.errors import Conflict

    name = f"{model.name[:100]}.fl"
    version = f"{model.version.partition('-')[0]}-{task.id.rpartition('-')[2]}.r{plan.round}"
    existing = find_by_identity(session, ArtifactKind.MODEL.value, name, version)
    if existing is not None and existing.sha256 == hashlib.sha256(plan.weights).hexdigest():
        return existing  # stored before a restart
    if existing is not None:
        version = f"{version}.{hashlib.sha256(plan.weights).hexdigest()[:8]}"
    with blobs.writer() as writer:
        writer.write(plan.weights)
        try:
            return create_artifact(session, signing, blobs, ArtifactCreate(kind=ArtifactKind.MODEL, name=name, version=version, format=ArtifactFormat.SAFETENSORS), writer)
        except Conflict:
            stored = find_by_identity(session, ArtifactKind.MODEL.value, name, version)
            if stored is None:
                raise
            return stored


def _publish(session: Session, signing: Any, blobs: Any, task: Task, plan: FlPlan, spec: FederatedTrainingSpec, model: Artifact) -> Artifact:
    from safetensors.numpy import load

    from cloud.incremental.results import publish_layer
    layer = surgery.DenseLayer.from_json(plan.layer)
    fused = load(plan.weights)
    metadata = {"aisynergy.trained_from": f"{model.name} {model.version}", "aisynergy.task": task.id, "aisynergy.dataset": spec.dataset or "",
                "aisynergy.fl_rounds": str(spec.rounds), "aisynergy.fl_strategy": spec.strategy}  # fmt: skip
    artifact = publish_layer(session, signing, blobs, model, layer, fused["weight"], fused["bias"], metadata, spec.output)
    hub_log(session, task.id, f"published model {artifact.name} {artifact.version} ({artifact.id}) after {spec.rounds} federated rounds")
    return artifact


def round_due(session: Session, at: datetime) -> set[str]:
    """Active federated tasks with something for the scheduler: a round to open, a deadline passed (or moved to now
    because every participant answered), a model published."""
    rows = session.execute(
        select(FlPlan.task_id, FlPlan.attempt, FlPlan.deadline_at, FlPlan.weights_artifact_id, FlPlan.published_artifact_id)
        .join(Task, Task.id == FlPlan.task_id).where(Task.state.in_([s.value for s in TASK_ACTIVE]), Task.held.is_(False))  # type: ignore[arg-type,attr-defined]
    ).all()  # fmt: skip
    return {
        r.task_id for r in rows
        if (r.attempt == 0 and (r.weights_artifact_id is not None or r.published_artifact_id is not None))
        or (r.attempt > 0 and r.deadline_at is not None and utc(r.deadline_at) <= at)
    }  # fmt: skip


def _seeds_with_dropped(plan: FlPlan) -> dict[str, dict[str, bytes]]:
    """Secure aggregation: each participant that dropped after masking -> the survivors' revealed seeds with it."""
    return {d: {s: base64.b64decode(seeds[d]) for s, seeds in plan.reveals.items() if d in seeds} for d in plan.unmasking}
