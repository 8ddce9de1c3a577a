"""The ``federated_training`` task type on the hub (DESIGN §5, seeds/000): admission, placement rules, orders.

**Admission** (:func:`admit`, from ``POST /tasks``): the model is the stored ONNX artefact the spec names (a
missing version resolved from the placement's devices that keep ``dataset`` and pinned in the stored spec); at
least ``min_participants`` devices of the placement must keep the dataset and run that model (422 otherwise,
naming them). The model is cut at the input of its last dense layer (``cloud.incremental.surgery``, as for
incremental training): the frozen body is a signed model artefact (reused when stored), the layer's weight and
bias are the first round's global layer. The strategy is built once to check its parameters (422). The plan
(``fl_plans``) is stored with the task: the round in progress, its deadline and participants, the global layer and
the strategy's state live there, so that a restarted hub resumes the task at the round it was in.

**Placement**: devices of the placement that run the model and keep the dataset (``datasets`` in their reported
document); every one that qualifies takes part (``max_nodes`` caps it). ``hierarchical`` tasks with a decomposable
strategy also run an ``aggregator`` worker on every edge node with a participant under it (placed and withdrawn
like split inference's tails); median and trimmed mean need every update, so their devices always report to the
hub directly.

**Privacy** (``dp``): each device's budget for the dataset must afford every round's steps at q = batch_size /
rows (``cloud.incremental.task.plan_steps``; 409 ``privacy_budget_exceeded``); one reservation per device is taken
with the task, only devices holding one take part, and when the task ends each is charged for the round attempts
it was a participant of (:func:`task_ended`), the rest released.

**Orders** (:func:`fl_order`): the round in progress (round, attempt, deadline), the global layer as a signed
safetensors artefact (one per round: ``<model>.fl`` version ``<model version>-<task>.r<round>``), the body and
where to send the update (``via_edge``); an aggregator's also lists its devices in the round. No round open yet:
no ``fl`` part (the worker waits for it).
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from sqlalchemy import delete, select
from sqlmodel import Session

from cloud.convert import utc
from cloud.errors import BadRequest
from cloud.incremental import budgets, surgery
from cloud.placement import Candidates, installed_model, installed_version, matching_devices
from cloud.tables import Artifact, Device, FlPlan, FlRoundRow, FlUpdateRow, Task, TaskWorker
from interfaces.aggregation import strategy_from_spec
from interfaces.deployments import TargetKind
from interfaces.tasks import FL_AGGREGATOR, MAX_FL_UPDATE_BYTES, FederatedTrainingSpec, FlOrder, InputRef, Placement

log = logging.getLogger("aisynergy.hub.fl")


def spec_of(task: Task) -> FederatedTrainingSpec:
    return FederatedTrainingSpec.model_validate(task.spec)


def via_edge(spec: FederatedTrainingSpec) -> bool:
    """Whether devices send their updates to their edge's aggregator (else to the hub, as events)."""
    if spec.whole:  # flat unless asked: a whole model's device uploads through its edge's relay; hierarchical: to its edge's aggregator
        return spec.topology == "hierarchical" and strategy_from_spec(spec.strategy, **spec.strategy_params).decomposable
    return (spec.topology or "hierarchical") == "hierarchical" and strategy_from_spec(spec.strategy, **spec.strategy_params).decomposable


# --- admission -------------------------------------------------------------------------------------


def admit(session: Session, task: Task, spec: FederatedTrainingSpec, placement: Placement, blobs: Any, signing: Any) -> FederatedTrainingSpec:
    """Check and cut (see the module docstring); adds the plan to ``session`` and returns the spec with its version pinned."""

    from cloud.artifacts import onnx_model_artifact, read_blob, store_derived_model

    if blobs is None or signing is None:
        raise RuntimeError("admitting a federated_training task needs the blob store and the signing key")
    try:
        strategy = strategy_from_spec(spec.strategy, **spec.strategy_params)
    except ValueError as exc:
        raise BadRequest(str(exc), status=422) from None
    if spec.min_participants < strategy.min_updates:
        raise BadRequest(f"{spec.strategy} needs at least {strategy.min_updates} updates per round; min_participants is {spec.min_participants}", status=422)
    if spec.whole:
        from cloud.fl import whole

        if spec.topology == "hierarchical" and placement.target is not TargetKind.DEVICE:
            raise BadRequest("hierarchical whole-model rounds combine devices' updates on their edge: placement.target device (sites take part flat)", status=422)
        if spec.dp is None:
            return whole.admit(session, task, spec, blobs)
        if placement.target is not TargetKind.DEVICE:
            raise BadRequest("dp on whole models charges each participant's privacy budget, which devices keep: placement.target device", status=422)
        devices = [d.id for d in matching_devices(session, placement)]
        _whole_privacy(session, spec, devices, lock=False)  # refuse before anything is stored
        spec = whole.admit(session, task, spec, blobs)
        for target, run, delta, name in _whole_privacy(session, spec, devices, lock=True):
            budgets.reserve(session, (target.device_id, name), task.id, run, delta, task.created_at)
        return spec
    if placement.target is not TargetKind.DEVICE:
        raise BadRequest("a last-layer task (model) does not run on nodes: it trains on devices (placement.target device); sites train whole models (algorithm)", status=422)
    ref, dataset = spec.model, spec.dataset
    assert ref is not None and dataset is not None
    keeps = lambda d: budgets.reported_dataset(d, dataset) is not None  # noqa: E731
    version = ref.version or installed_version(session, placement, ref.name, keep=keeps)
    spec = spec.model_copy(update={"model": ref.model_copy(update={"version": version})})
    model = onnx_model_artifact(session, ref.name, version, "federated training")
    able = [d.id for d in matching_devices(session, placement) if keeps(d) and _runs(d, model)]
    if len(able) < spec.min_participants:
        raise BadRequest(
            f"{len(able)} device(s) of the placement keep dataset {spec.dataset} and run {model.name} {model.version}; "
            f"min_participants is {spec.min_participants}", status=422, able_ids=able[:100],
        )  # fmt: skip
    try:
        found = surgery.cut(read_blob(blobs, model.sha256), spec.layer, MAX_FL_UPDATE_BYTES, "an update")
    except surgery.SurgeryError as exc:
        raise BadRequest(f"model {model.name} {model.version}: {exc}", status=422) from None
    layer, weights, body = found.layer, found.head, found.body
    if spec.dp is not None:  # refuse before anything is stored
        _privacy(session, spec, able, lock=False)
    if spec.eval_inputs is not None:
        from cloud.fl import evaluate

        evaluate.load(session, blobs, spec.eval_inputs, layer.classes)
    body_row = store_derived_model(session, signing, blobs, f"{model.name[:123]}.body", model.version, body)
    if spec.dp is not None:  # take the budgets and check again, now that writes follow
        for target, run, delta in _privacy(session, spec, able, lock=True):
            budgets.reserve(session, (target.device_id, dataset), task.id, run, delta, task.created_at)
    session.add(FlPlan(
        task_id=task.id, model_artifact_id=model.id, body_artifact_id=body_row.id, layer=layer.to_json(), weights=weights,
    ))  # fmt: skip
    return spec


def _privacy(session: Session, spec: FederatedTrainingSpec, device_ids: list[str], lock: bool) -> list[Any]:
    """Each device's run (q, σ, every round's steps) against its budget: ``cloud.incremental.task.plan_steps`` (409
    ``privacy_budget_exceeded`` naming every device that cannot afford it, or whose share of the task's ε is short)."""
    from cloud.errors import Conflict
    from cloud.incremental.task import Target, plan_steps
    from interfaces.errors import ErrorCode
    from interfaces.tasks import MAX_TRAINING_STEPS, IncrementalTrainingSpec

    assert spec.dp is not None and spec.model is not None and spec.dataset is not None
    steps = spec.rounds * spec.local_steps
    if steps > MAX_TRAINING_STEPS:
        raise BadRequest(f"rounds x local_steps = {steps} DP-SGD steps; at most {MAX_TRAINING_STEPS}", status=422)
    rows = {d.id: d for d in session.execute(select(Device).where(Device.id.in_(device_ids))).scalars()}  # type: ignore[attr-defined]
    targets = []
    for device_id in device_ids:
        data = budgets.reported_dataset(rows[device_id], spec.dataset)
        count = max(1, data.rows if data else 1)
        targets.append(Target(device_id, count, min(1.0, spec.batch_size / count), steps))
    shim = IncrementalTrainingSpec(
        model=spec.model, dataset=spec.dataset, steps=steps, batch_size=spec.batch_size, learning_rate=spec.learning_rate, clip_norm=spec.dp.clip_norm,
        noise_multiplier=spec.dp.noise_multiplier, delta=spec.dp.delta, epsilon=spec.dp.epsilon,
    )  # fmt: skip
    planned = plan_steps(session, shim, targets, lock=lock)
    short = [t.device_id for t, run, _ in planned if run.steps < steps]
    if short:
        raise Conflict(f"the task's epsilon affords fewer than the {steps} steps of its rounds on {', '.join(short[:20])}",
                       code=ErrorCode.PRIVACY_BUDGET_EXCEEDED, targets=[{"device_id": d, "requested_steps": steps} for d in short])  # fmt: skip
    return planned


def _whole_privacy(session: Session, spec: FederatedTrainingSpec, device_ids: list[str], lock: bool) -> list[tuple[Any, Any, float, str]]:
    """DP-FedAvg: each device's budget for each of the task's datasets against ``rounds`` Gaussian mechanisms (DP-SGD
    steps at sample rate 1, noise multiplier z; ``cloud.incremental.task.plan_steps``): (target, run, δ, dataset)
    each; 409 ``privacy_budget_exceeded`` naming the devices that cannot afford them."""
    from cloud.errors import Conflict
    from cloud.incremental.task import Target, plan_steps
    from interfaces.errors import ErrorCode
    from interfaces.tasks import IncrementalTrainingSpec

    assert spec.dp is not None and spec.algorithm is not None
    out = []
    for dataset in sorted(set(spec.datasets.values())):
        shim = IncrementalTrainingSpec.model_validate({
            "model": {"name": spec.algorithm.name}, "dataset": dataset, "steps": spec.rounds, "batch_size": 1, "clip_norm": spec.dp.clip_norm,
            "noise_multiplier": spec.dp.noise_multiplier, "delta": spec.dp.delta, "epsilon": spec.dp.epsilon,
        })  # fmt: skip
        planned = plan_steps(session, shim, [Target(d, 1, 1.0, spec.rounds) for d in device_ids], lock=lock)
        short = [t.device_id for t, run, _ in planned if run.steps < spec.rounds]
        if short:
            raise Conflict(f"the task's epsilon affords fewer than its {spec.rounds} rounds on {', '.join(short[:20])} ({dataset})",
                           code=ErrorCode.PRIVACY_BUDGET_EXCEEDED, targets=[{"device_id": d, "dataset": dataset, "requested_steps": spec.rounds} for d in short])  # fmt: skip
        out += [(target, run, delta, dataset) for target, run, delta in planned]
    return out


def readmit(session: Session, task: Task, at: datetime) -> None:
    """A retried task goes on from the round it was in, as a fresh attempt of it: the open attempt's unused updates go,
    and a DP task reserves again on the devices of its placement that can still afford all its rounds (409 otherwise)."""
    from cloud.errors import Conflict
    from interfaces.errors import ErrorCode

    plan = session.get(FlPlan, task.id, with_for_update=True)
    if plan is None:
        raise Conflict(f"task {task.id} has lost its federated plan; create a new task", code=ErrorCode.ILLEGAL_TRANSITION, current_state=task.state)
    session.execute(delete(FlUpdateRow).where(FlUpdateRow.task_id == task.id, FlUpdateRow.round >= plan.round, FlUpdateRow.used_in.is_(None)))  # type: ignore[attr-defined,union-attr]
    plan.attempt, plan.participants, plan.opened_at, plan.deadline_at = 0, [], None, None
    plan.unmasking, plan.reveals, plan.total_examples, plan.keys = [], {}, None, {}
    session.add(plan)
    spec = spec_of(task)
    if spec.dp is not None and spec.whole:
        devices = [d.id for d in matching_devices(session, Placement.model_validate(task.placement))]
        for target, run, delta, dataset in _whole_privacy(session, spec, devices, lock=True):
            budgets.reserve(session, (target.device_id, dataset), task.id, run, delta, at)
        plan.trained = {}
    elif spec.dp is not None and spec.dataset is not None:
        model = session.get(Artifact, plan.model_artifact_id)
        placement = Placement.model_validate(task.placement)
        able = [d.id for d in matching_devices(session, placement) if budgets.reported_dataset(d, spec.dataset) is not None and model is not None and _runs(d, model)]
        for target, run, delta in _privacy(session, spec, able, lock=True):
            budgets.reserve(session, (target.device_id, spec.dataset), task.id, run, delta, at)
        plan.trained = {}


def reserved(session: Session, task_id: str, device_id: str) -> Any:
    """The device's open privacy reservation for the task (a DP task), or None."""
    from cloud.tables import PrivacySpendRow
    from interfaces.privacy import SpendState

    return session.execute(
        select(PrivacySpendRow).where(PrivacySpendRow.task_id == task_id, PrivacySpendRow.device_id == device_id, PrivacySpendRow.state == SpendState.RESERVED.value)
        .order_by(PrivacySpendRow.id).limit(1)  # type: ignore[arg-type]
    ).scalars().first()  # fmt: skip


def task_ended(session: Session, task: Task, at: datetime) -> None:
    """A DP task's devices are charged for the round attempts they took part in (each ``local_steps`` steps, at
    most what was reserved); a device that took part in none is released."""
    from cloud.tables import PrivacySpendRow
    from interfaces.privacy import SpendState

    plan = session.get(FlPlan, task.id)
    spec = spec_of(task)
    for spend in session.execute(select(PrivacySpendRow).where(PrivacySpendRow.task_id == task.id, PrivacySpendRow.state == SpendState.RESERVED.value)).scalars():
        per = 1 if spec.whole else spec.local_steps  # a whole-model round is one Gaussian mechanism on the device's data
        taken = (plan.trained.get(spend.device_id, 0) if plan is not None else spend.max_steps) * per
        budgets.settle(session, spend, min(spend.max_steps, taken), at)


def _runs(device: Device, model: Artifact) -> bool:
    installed = installed_model(device)
    return installed is not None and (installed.name, installed.version, installed.sha256) == (model.name, model.version, model.sha256)


def keeping_dataset(session: Session, task: Task, found: Candidates) -> Candidates:
    """The scheduler's candidates cut to the devices that report the task's dataset."""
    if not found.eligible:
        return found
    spec = spec_of(task)
    if spec.whole:
        from cloud.fl import whole

        found = whole.candidates(session, task, found)
        if spec.dp is None:
            return found
        kept = [c for c in found.eligible if reserved(session, task.id, c.id) is not None]  # DP-FedAvg: only devices whose budgets were reserved
        return Candidates(kept, "" if kept else (found.why_not or "no participant qualifies") + "; only devices holding a privacy reservation of this task take part")
    assert spec.dataset is not None
    rows = {d.id: d for d in session.execute(select(Device).where(Device.id.in_([c.id for c in found.eligible]))).scalars()}  # type: ignore[attr-defined]
    kept = [c for c in found.eligible if c.id in rows and budgets.reported_dataset(rows[c.id], spec.dataset) is not None]
    if spec.dp is not None:  # only devices whose budget was reserved at creation
        kept = [c for c in kept if reserved(session, task.id, c.id) is not None]
    why = f"no qualifying device reports dataset {spec.dataset}" + (" and holds a privacy reservation of this task" if spec.dp is not None else "")
    return Candidates(kept, "" if kept else why)


def forget(session: Session, task_id: str) -> None:
    """A deleted task's plan, updates and round history (its artefacts stay and can be deleted now)."""
    from cloud.tables import TrainingManifest

    from cloud.fl import whole

    for table in (FlUpdateRow, FlRoundRow, FlPlan, TrainingManifest):
        session.execute(delete(table).where(table.task_id == task_id))  # type: ignore[attr-defined]
    whole.sweep_due(session)  # its update artefacts are orphans now


# --- orders ----------------------------------------------------------------------------------------


def fl_order(session: Session, task: Task, worker: TaskWorker, signing: Any) -> FlOrder | None:
    """The worker's ``FlOrder`` for the round in progress; None while no round is open."""
    from cloud.artifacts import task_input

    plan = session.get(FlPlan, task.id)
    if plan is None:
        raise LookupError(f"task {task.id} has no federated plan")
    if plan.attempt == 0 or plan.weights_artifact_id is None or plan.deadline_at is None:
        return None

    def ref(artifact_id: str) -> InputRef:
        return task_input(session, artifact_id, worker.target_id, signing, f"task {task.id}'s federated")

    spec = spec_of(task)
    if spec.whole:
        from cloud.fl import whole

        run, config = whole.run_for(session, task, plan, worker, signing)  # an aggregator's: the grant for its devices' weighted mean
        deadline = utc(plan.deadline_at)
        assert deadline is not None
        secure = spec.secure_aggregation
        return FlOrder(round=plan.round, attempt=plan.attempt, deadline_at=deadline, weights=ref(plan.weights_artifact_id), via_edge=via_edge(spec),
                       run=run, participant=worker.target_id, config=config, secure=secure, participants=_under(session, worker, plan),
                       peers={d: plan.keys[d]["key"] for d in plan.participants if d in plan.keys} if secure else {},
                       total_examples=plan.total_examples if secure else None, reveal=list(plan.unmasking),
                       weight=whole.WholePlan.of(plan).weights.get(worker.target_id) if secure else None)  # fmt: skip
    model = session.get(Artifact, plan.model_artifact_id)
    if model is None:
        raise LookupError(f"the model of task {task.id}'s federated plan is gone")
    layer = surgery.DenseLayer.from_json(plan.layer)
    participants = _under(session, worker, plan)
    return FlOrder(
        round=plan.round, attempt=plan.attempt, deadline_at=utc(plan.deadline_at), weights=ref(plan.weights_artifact_id), body=ref(plan.body_artifact_id),
        base_sha256=model.sha256, feature=layer.feature, via_edge=via_edge(spec), participants=participants, secure=spec.secure_aggregation,
        sample_rate=spend.sample_rate if spec.dp is not None and worker.role != FL_AGGREGATOR and (spend := reserved(session, task.id, worker.target_id)) else None,
        peers={d: plan.keys[d]["key"] for d in plan.participants if d in plan.keys} if spec.secure_aggregation else {},
        total_examples=plan.total_examples if spec.secure_aggregation else None, reveal=list(plan.unmasking),
    )  # fmt: skip


def _under(session: Session, worker: TaskWorker, plan: FlPlan) -> list[str]:
    """An aggregator's devices in the round attempt in progress (the participants under its node); [] for the others."""
    if worker.role != FL_AGGREGATOR:
        return []
    under = set(session.execute(select(Device.id).where(Device.node_id == worker.target_id, Device.id.in_(plan.participants))).scalars())  # type: ignore[attr-defined]
    return [d for d in plan.participants if d in under]
