"""The ``incremental_training`` task type on the hub (DESIGN §5): admission, orders, the ends of workers and tasks.

**Admission** (:func:`admit`, from ``POST /tasks``; :func:`readmit` on ``retry``):

1. *Targets*: the devices the placement names (ids or selector; not deleted) that report ``spec.dataset``
   (``datasets`` in their reported document) and run the model (name, version, and the bytes of the stored
   artefact). Named ids that do not are a 422; so is a placement that leaves none. A missing
   ``spec.model.version`` is resolved from the targets (one version among them, else 422) and pinned in the
   stored spec, so that placement sticks to it.
2. *Surgery*: the model artefact (ONNX) is split at the input of its last dense layer (``spec.layer``, else
   found; 422 when there is none); the layer's weight and bias go inline in the orders (at most
   ``MAX_HEAD_BYTES``). An explicit ``output.version`` needs exactly one target and must be free.
3. *Accounting*, per target: q = min(1, batch_size / rows); the task asks for ``steps`` (or
   ceil(epochs / q)), cut to what ``spec.epsilon`` allows at its δ when given; the device's budget for the
   dataset must afford that on top of everything spent and reserved there (RDP composition at the budget's
   δ). A target without a budget, or whose budget cannot afford it: 409 ``privacy_budget_exceeded`` with
   ``targets`` (each: remaining ε, the steps and ε asked, the steps affordable), and nothing is stored.
   This first look writes nothing; then the body artefact is stored (kind model, signed, content-addressed,
   reused when it exists), then the budgets are taken (:func:`cloud.incremental.budgets.lock`), checked
   again and one reservation per target written with the task: max_steps = the steps asked.

**Placement**: a device qualifies only while it holds an unbound reservation of the task
(:func:`reserved_targets`); the worker's order (:func:`training_order`) binds it and carries ``max_steps``.

**A worker ends** (:func:`worker_ended`, from every worker transition to a final state): its reservation is
settled with the steps it took: SUCCEEDED or with a trained layer received, the layer's steps; REJECTED,
none; FAILED or CANCELED, the steps it last reported; LOST or TIMED_OUT, all it reserved (nobody knows).
A failure other than REJECTED, below ``max_attempts`` while the task is active and before its trained layer
arrived, reserves again on the same device (the data is there) the steps still affordable, at most as many
as before (and within the task's own epsilon over all its runs there); otherwise the worker is given up
(``replaced_by = '-'``). **A task ends** (:func:`task_ended`): every
reservation still open is released.
"""

from __future__ import annotations

import base64
import logging
import math
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, select
from sqlmodel import Session

from cloud.errors import BadRequest, Conflict
from cloud.incremental import accounting, budgets, surgery
from cloud.placement import installed_model, installed_version, matching_devices
from cloud.tables import Artifact, PrivacySpendRow, Task, TaskWorker, TrainingPlan, TrainingResult
from cloud.tasks.lifecycle import hub_log, retry_of
from interfaces.deployments import ArtifactKind
from interfaces.errors import ErrorCode
from interfaces.privacy import SpendState
from interfaces.tasks import (
    MAX_HEAD_BYTES, MAX_TRAINING_STEPS, TASK_ACTIVE, WORKER_FAILURES, IncrementalTrainingSpec, Placement, TaskState, TrainingOrder, WorkerState,
)  # fmt: skip

log = logging.getLogger("aisynergy.hub.training")
GAVE_UP = "-"  # TaskWorker.replaced_by: no worker will take over (the scheduler's mark)


@dataclass
class Target:
    device_id: str
    rows: int
    sample_rate: float
    planned: int | None
    """the steps the spec asks for (None: as many as the task's epsilon allows)"""


@dataclass
class Prepared:
    spec: IncrementalTrainingSpec
    model: Artifact
    layer: surgery.DenseLayer
    head: bytes
    body: bytes
    targets: list[Target]


# --- admission -------------------------------------------------------------------------------------


def admit(session: Session, task: Task, spec: IncrementalTrainingSpec, placement: Placement, blobs: Any, signing: Any) -> IncrementalTrainingSpec:
    """Check and reserve (see the module docstring); adds the plan and the reservations to ``session`` (the
    caller commits them with the task) and returns the spec with its model version pinned."""
    if blobs is None or signing is None:
        raise RuntimeError("admitting an incremental_training task needs the blob store and the signing key")
    prepared = prepare(session, spec, placement, blobs)
    plan_steps(session, prepared.spec, prepared.targets, lock=False)
    body = store_body(session, signing, blobs, prepared)
    at = task.created_at
    cut = []
    for target, run, delta in plan_steps(session, prepared.spec, prepared.targets, lock=True):
        budgets.reserve(session, (target.device_id, prepared.spec.dataset), task.id, run, delta, at)
        if target.planned is not None and run.steps < target.planned:
            cut.append(f"{target.device_id} trains {run.steps} of the {target.planned} steps")
    if cut:  # the task's own epsilon affords fewer steps than its epochs ask for: said in its state, not found out later
        asked = f"{spec.epochs:g} epochs" if spec.epochs is not None else f"{spec.steps} steps"
        from cloud.tasks.lifecycle import hub_log

        task.reason = f"its epsilon {spec.epsilon:g} cuts the {asked} it asks for: " + "; ".join(cut[:20])
        hub_log(session, task.id, task.reason, "warning", at)
    session.add(TrainingPlan(task_id=task.id, model_artifact_id=prepared.model.id, body_artifact_id=body.id, layer=prepared.layer.to_json(), head=prepared.head))
    return prepared.spec


def readmit(session: Session, task: Task, at: datetime) -> None:
    """A retried task reserves again for its targets as they are now (409 when a budget cannot afford it)."""
    spec = IncrementalTrainingSpec.model_validate(task.spec)
    plan = session.get(TrainingPlan, task.id)
    model = session.get(Artifact, plan.model_artifact_id) if plan is not None else None
    if plan is None or model is None:
        raise Conflict(f"task {task.id} has lost its training plan or model artefact; create a new task", code=ErrorCode.ILLEGAL_TRANSITION, current_state=task.state)
    targets = _targets(session, spec, Placement.model_validate(task.placement), model)
    for target, run, delta in plan_steps(session, spec, targets, lock=True):
        budgets.reserve(session, (target.device_id, spec.dataset), task.id, run, delta, at)


def prepare(session: Session, spec: IncrementalTrainingSpec, placement: Placement, blobs: Any) -> Prepared:
    from cloud.artifacts import find_by_identity, onnx_model_artifact, read_blob

    version = spec.model.version or _resolve_version(session, spec, placement)
    spec = spec.model_copy(update={"model": spec.model.model_copy(update={"version": version})})
    model = onnx_model_artifact(session, spec.model.name, version, "incremental training")
    targets = _targets(session, spec, placement, model)
    if spec.output.version is not None:
        if len(targets) != 1:
            raise BadRequest(f"output.version names one version but the task trains on {len(targets)} devices (each publishes its own); leave it out", status=422)
        name = spec.output.name or model.name
        taken = find_by_identity(session, ArtifactKind.MODEL.value, name, spec.output.version)
        if taken is not None:
            raise Conflict(f"model {name} {spec.output.version} exists already as {taken.id}", code=ErrorCode.ARTIFACT_EXISTS, artifact_id=taken.id)
    try:
        found = surgery.cut(read_blob(blobs, model.sha256), spec.layer, MAX_HEAD_BYTES, "an order")
    except surgery.SurgeryError as exc:
        raise BadRequest(f"model {model.name} {model.version}: {exc}", status=422) from None
    return Prepared(spec, model, found.layer, found.head, found.body, targets)


def _resolve_version(session: Session, spec: IncrementalTrainingSpec, placement: Placement) -> str:
    return installed_version(session, placement, spec.model.name, keep=lambda d: budgets.reported_dataset(d, spec.dataset) is not None)


def _targets(session: Session, spec: IncrementalTrainingSpec, placement: Placement, model: Artifact) -> list[Target]:
    """The devices of the placement that keep the dataset and run exactly ``model`` (422 when none, or a named one does not)."""
    found, why_not = [], {}
    for device in matching_devices(session, placement):
        data = budgets.reported_dataset(device, spec.dataset)
        installed = installed_model(device)
        if data is None:
            why_not[device.id] = f"reports no dataset {spec.dataset}"
        elif data.rows < 1:
            why_not[device.id] = f"reports dataset {spec.dataset} with no rows"
        elif installed is None or installed.name != model.name or installed.version != model.version or installed.sha256 != model.sha256:
            why_not[device.id] = f"does not run {model.name} {model.version}"
        else:
            q = min(1.0, spec.batch_size / data.rows)
            planned = spec.steps if spec.steps is not None else min(MAX_TRAINING_STEPS, math.ceil(spec.epochs / q)) if spec.epochs is not None else None
            found.append(Target(device.id, data.rows, q, planned))
    named = [i for i in placement.ids or [] if i in why_not]
    if named:
        raise BadRequest("cannot train on " + "; ".join(f"{d}: it {why_not[d]}" for d in named[:20]), status=422, unusable_ids=named)
    if not found:
        reasons = "; ".join(f"{d} {w}" for d, w in list(why_not.items())[:20]) or "no device matches the placement"
        raise BadRequest(f"no device to train {model.name} {model.version} on dataset {spec.dataset}: {reasons}", status=422)
    return found


def plan_steps(session: Session, spec: IncrementalTrainingSpec, targets: list[Target], lock: bool) -> list[tuple[Target, accounting.Run, float]]:
    """Per target: the run this task may make and the δ of its own ε; 409 ``privacy_budget_exceeded`` when a
    budget cannot afford one (``lock``: take the budgets first, for the check that is followed by writes)."""
    keys = [(t.device_id, spec.dataset) for t in targets]
    rows = budgets.lock(session, keys) if lock else budgets.read(session, keys)
    planned, refused = [], []
    sigma = spec.noise_multiplier
    for target in targets:
        key = (target.device_id, spec.dataset)
        budget = rows.get(key)
        if budget is None:
            refused.append({"device_id": target.device_id, "dataset": spec.dataset, "reason": "no privacy budget is set for this dataset"})
            continue
        history = budgets.spends(session, key, fresh=lock)
        base = budgets.curve(history)
        delta = spec.delta or budget.delta
        most = target.planned if target.planned is not None else MAX_TRAINING_STEPS
        own = [accounting.Limit(accounting.zero(), spec.epsilon, delta)] if spec.epsilon is not None else []
        wanted = accounting.max_steps(target.sample_rate, sigma, own, most) if own else most
        affordable = accounting.max_steps(target.sample_rate, sigma, [accounting.Limit(base, budget.epsilon, budget.delta), *own], most)
        if wanted < 1 or affordable < wanted:
            remaining = max(0.0, budget.epsilon - accounting.epsilon(base, budget.delta))
            asked = accounting.run_epsilon(accounting.Run(target.sample_rate, sigma, wanted), budget.delta) if wanted else 0.0
            refused.append({
                "device_id": target.device_id, "dataset": spec.dataset, "budget_epsilon": budget.epsilon, "budget_delta": budget.delta, "remaining_epsilon": remaining,
                "requested_steps": wanted, "requested_epsilon": asked, "affordable_steps": affordable, "sample_rate": target.sample_rate,
                "reason": "the task's epsilon allows no step" if wanted < 1 else "the budget cannot afford the requested steps",
            })  # fmt: skip
            continue
        planned.append((target, accounting.Run(target.sample_rate, sigma, wanted), delta))
    if refused:
        def why(r: dict[str, Any]) -> str:
            if "remaining_epsilon" not in r:
                return str(r["reason"])
            if r["requested_steps"] < 1:
                return "the task's own epsilon allows no step"
            return (f"{r['requested_steps']} steps cost epsilon {r['requested_epsilon']:.3g}, {r['remaining_epsilon']:.3g} of its "
                    f"{r['budget_epsilon']:.3g} remains: it affords {r['affordable_steps']} steps")  # fmt: skip

        shown = "; ".join(f"{r['device_id']} / {r['dataset']}: {why(r)}" for r in refused[:20]) + (f"; and {len(refused) - 20} more" if len(refused) > 20 else "")
        raise Conflict(f"privacy budget exceeded on {len(refused)} of {len(targets)} devices: {shown}. Ask for fewer steps (or epochs), a larger "
                       "noise_multiplier, or raise a budget (PUT /devices/{id}/privacy-budgets/{dataset})",
                       code=ErrorCode.PRIVACY_BUDGET_EXCEEDED, targets=refused)  # fmt: skip
    return planned


def store_body(session: Session, signing: Any, blobs: Any, prepared: Prepared) -> Artifact:
    """The body as a model artefact ``<model>.body`` (:func:`cloud.artifacts.store_derived_model`)."""
    from cloud.artifacts import store_derived_model

    return store_derived_model(session, signing, blobs, f"{prepared.model.name[:123]}.body", prepared.model.version, prepared.body)


# --- placement and orders --------------------------------------------------------------------------


def reserved_targets(session: Session, task_id: str) -> set[str]:
    """Devices holding a reservation of the task that no worker took yet."""
    return set(session.execute(
        select(PrivacySpendRow.device_id).where(
            PrivacySpendRow.task_id == task_id, PrivacySpendRow.state == SpendState.RESERVED.value, PrivacySpendRow.worker_id.is_(None)  # type: ignore[union-attr]
        )
    ).scalars())  # fmt: skip


def only_reserved(session: Session, task_id: str, found: Any) -> Any:
    """The scheduler's candidates (``cloud.placement.Candidates``) cut to the devices holding an unused reservation."""
    from cloud.placement import Candidates

    if not found.eligible:
        return found
    reserved = reserved_targets(session, task_id)
    kept = [c for c in found.eligible if c.id in reserved]
    return Candidates(kept, "" if kept else "no qualifying device holds an unused privacy reservation of this task")


def reservation(session: Session, task_id: str, device_id: str, worker_id: str | None) -> PrivacySpendRow | None:
    query = select(PrivacySpendRow).where(
        PrivacySpendRow.task_id == task_id, PrivacySpendRow.device_id == device_id, PrivacySpendRow.state == SpendState.RESERVED.value,
        PrivacySpendRow.worker_id == worker_id if worker_id is not None else PrivacySpendRow.worker_id.is_(None),  # type: ignore[union-attr]
    )  # fmt: skip
    return session.execute(query.order_by(PrivacySpendRow.id).limit(1)).scalars().first()  # type: ignore[arg-type]


def training_order(session: Session, task: Task, worker: TaskWorker, signing: Any) -> TrainingOrder:
    """The worker's ``TrainingOrder``; binds the device's reservation to the worker (LookupError without one)."""
    from cloud.artifacts import task_input

    plan = session.get(TrainingPlan, task.id)
    if plan is None:
        raise LookupError(f"task {task.id} has no training plan")
    spend = reservation(session, task.id, worker.target_id, worker.id) or reservation(session, task.id, worker.target_id, None)
    if spend is None:
        raise LookupError(f"task {task.id} holds no privacy reservation on {worker.target_id}")
    spend.worker_id = worker.id
    session.add(spend)
    body, model = session.get(Artifact, plan.body_artifact_id), session.get(Artifact, plan.model_artifact_id)
    if body is None or model is None:
        raise LookupError(f"the artefacts of task {task.id}'s plan are gone")
    layer = surgery.DenseLayer.from_json(plan.layer)
    return TrainingOrder(
        body=task_input(session, body.id, worker.target_id, signing, "training body"),
        base_sha256=model.sha256, feature=layer.feature, head=base64.b64encode(plan.head).decode(), max_steps=spend.steps, sample_rate=spend.sample_rate,
    )  # fmt: skip


# --- ends ------------------------------------------------------------------------------------------


def worker_ended(session: Session, task: Task, worker: TaskWorker, state: WorkerState, at: datetime) -> None:
    """Settle the worker's reservation; reserve again on its device for a retry, or give it up (module docstring)."""
    spend = reservation(session, task.id, worker.target_id, worker.id)
    if spend is None:
        return
    result = session.get(TrainingResult, worker.id)
    if result is not None:
        steps = result.steps
    elif state is WorkerState.REJECTED:
        steps = 0
    elif state in (WorkerState.LOST, WorkerState.TIMED_OUT):
        steps = spend.steps
    else:
        steps = worker.items_done or 0
    budgets.settle(session, spend, steps, at)
    hub_log(session, task.id, f"device {worker.target_id}: {spend.steps} DP-SGD steps {'spent' if spend.steps else 'taken: nothing spent'}"
            + (f", epsilon {spend.epsilon:.4g} at delta {spend.delta:g} of dataset {spend.dataset}" if spend.steps else ""), at=at,
            worker_id=worker.id, target_id=worker.target_id)  # fmt: skip
    if state not in WORKER_FAILURES:
        return
    retry = state is not WorkerState.REJECTED and result is None and worker.attempt < retry_of(task).max_attempts and TaskState(task.state) in TASK_ACTIVE
    again = _reserve_again(session, task, spend, at) if retry else None
    if again is None:
        worker.replaced_by = GAVE_UP
        session.add(worker)
        why = ("REJECTED" if state is WorkerState.REJECTED else "its trained layer arrived" if result is not None else "no attempts left" if not retry
               else "the privacy budget allows no further step")  # fmt: skip
        hub_log(session, task.id, f"worker {worker.id} on {worker.target_id} is not replaced: {why}", "warning", at, worker.id, worker.target_id)
    else:
        hub_log(session, task.id, f"reserved {again.steps} steps on {worker.target_id} for another attempt", at=at, worker_id=worker.id, target_id=worker.target_id)


def _reserve_again(session: Session, task: Task, previous: PrivacySpendRow, at: datetime) -> PrivacySpendRow | None:
    spec = IncrementalTrainingSpec.model_validate(task.spec)
    key = (previous.device_id, previous.dataset)
    budget = budgets.lock(session, [key]).get(key)
    if budget is None:
        return None
    base = budgets.curve(budgets.spends(session, key, fresh=True))
    limits = [accounting.Limit(base, budget.epsilon, budget.delta)]
    if spec.epsilon is not None:
        mine = [r for r in budgets.spends(session, key) if r.task_id == task.id]
        limits.append(accounting.Limit(budgets.curve(mine), spec.epsilon, previous.delta))
    steps = accounting.max_steps(previous.sample_rate, previous.noise_multiplier, limits, previous.max_steps)
    if steps < 1:
        return None
    return budgets.reserve(session, key, task.id, accounting.Run(previous.sample_rate, previous.noise_multiplier, steps), previous.delta, at)


def task_ended(session: Session, task: Task, at: datetime) -> None:
    """Release every reservation of the task still open (targets never placed, or never replaced)."""
    for spend in session.execute(select(PrivacySpendRow).where(PrivacySpendRow.task_id == task.id, PrivacySpendRow.state == SpendState.RESERVED.value)).scalars():
        budgets.settle(session, spend, 0, at)


def forget(session: Session, task_id: str) -> None:
    """With the task go its plan and its kept results; the spends stay (privacy once spent stays spent)."""
    session.execute(delete(TrainingPlan).where(TrainingPlan.task_id == task_id))  # type: ignore[arg-type]
    session.execute(delete(TrainingResult).where(TrainingResult.task_id == task_id))  # type: ignore[arg-type]
