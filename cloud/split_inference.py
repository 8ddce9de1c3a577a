"""The ``split_inference`` task type on the hub (DESIGN §5): admission (the cut model), orders, tail workers.

**Admission** (:func:`admit`, from ``POST /tasks``): the model is the stored artefact the spec names; a missing
version is resolved from the placement's devices that run the model (one version among them, else 422) and
pinned in the stored spec, so that placement sticks to it. It must be ONNX with one float32 input (422
otherwise). The cuts: the pinned ``cut`` (a candidate tensor, or device-only / edge-only), the spec's ``cuts``
(each a candidate: 422 naming the candidates otherwise), or the model's candidate cuts
(:func:`cloud.ml.partition.candidate_cuts`), at most ``MAX_SPLIT_CUTS`` spread evenly over its depth. Each is
split into a head and a tail (both checked by the ONNX checker) and stored as signed model artefacts
``<model>.split<k>.head`` / ``.tail`` (``k``: the cut's place among the model's candidates; the model's version;
reused when the same bytes are stored), recorded in ``split_plans`` / ``split_parts`` with the task. None of
them can be deleted while the task exists.

**Workers**: each placed device runs a ``head`` worker (placement as for ``inference``: the device must run
the model); every edge node with a device running a head gets one ``tail`` worker
(:func:`cloud.placement.companion_changes`, each scheduler tick): placed when its node is ONLINE and UNLOCKED, withdrawn (CANCELED) when no head runs under it,
replaced when it ended while heads still need it. Tails do not count for the task's end: the task ends with
its heads (SUCCEEDED when a head succeeded, ``duration_s``), and then its tails end with it.

**Orders** (:func:`split_order`): a head's order carries the heads (one per cut), a tail's the tails and the
whole model (for edge-only), each an ``InputRef`` (signed manifest, download token for that target).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from sqlalchemy import delete, select
from sqlmodel import Session

from cloud.errors import BadRequest
from cloud.placement import installed_version
from cloud.tables import Artifact, SplitPartRow, SplitPlan, Task, TaskWorker
from cloud.tasks.kind import ActiveWorker, HubParts, TaskKind
from interfaces.tasks import (
    MAX_SPLIT_CUTS, SPLIT_DEVICE_ONLY, SPLIT_EDGE_ONLY, SPLIT_HEAD, SPLIT_TAIL, InputRef, Placement, SplitInferenceSpec, SplitOrder, SplitPart,
    TaskType,
)  # fmt: skip

if TYPE_CHECKING:
    from pydantic import BaseModel

    from interfaces.tasks import WorkerOrder

log = logging.getLogger("aisynergy.hub.split")


# --- admission -------------------------------------------------------------------------------------


def admit(session: Session, task: Task, spec: SplitInferenceSpec, placement: Placement, blobs: Any, signing: Any) -> SplitInferenceSpec:
    """Cut the model and store its parts (see the module docstring); adds the plan to ``session`` (the caller
    commits it with the task) and returns the spec with its model version pinned."""
    import onnx

    from cloud.artifacts import onnx_model_artifact, read_blob, store_derived_model
    from cloud.ml.partition import candidate_cuts, split_model

    if blobs is None or signing is None:
        raise RuntimeError("admitting a split_inference task needs the blob store and the signing key")
    version = spec.model.version or installed_version(session, placement, spec.model.name)
    spec = spec.model_copy(update={"model": spec.model.model_copy(update={"version": version})})
    model = onnx_model_artifact(session, spec.model.name, version, "split inference")
    try:
        graph = onnx.load_from_string(read_blob(blobs, model.sha256))
    except Exception as exc:  # noqa: BLE001 - a stored ONNX artefact that does not parse
        raise BadRequest(f"model {model.name} {model.version} does not load as ONNX: {exc}", status=422) from None
    initializers = {i.name for i in graph.graph.initializer}
    inputs = [i for i in graph.graph.input if i.name not in initializers]
    if len(inputs) != 1 or inputs[0].type.tensor_type.elem_type != onnx.TensorProto.FLOAT:
        what = [(i.name, onnx.TensorProto.DataType.Name(i.type.tensor_type.elem_type)) for i in inputs]
        raise BadRequest(f"split inference needs a model with one float32 input; {model.name} {model.version} takes {what}", status=422)
    candidates = candidate_cuts(graph)
    cuts = _cuts(spec, candidates, f"{model.name} {model.version}")
    parts = []
    base = model.name[:100]
    for cut in cuts:
        k = candidates.index(cut) + 1
        try:
            head, tail = split_model(graph, cut)
        except ValueError as exc:
            raise BadRequest(f"cannot cut {model.name} {model.version} at {cut}: {exc}", status=422) from None
        head_row = store_derived_model(session, signing, blobs, f"{base}.split{k}.head", model.version, head.SerializeToString())
        tail_row = store_derived_model(session, signing, blobs, f"{base}.split{k}.tail", model.version, tail.SerializeToString())
        parts.append((cut, head_row.id, tail_row.id))
    session.add(SplitPlan(task_id=task.id, model_artifact_id=model.id, input=inputs[0].name))
    for position, (cut, head_id, tail_id) in enumerate(parts, start=1):
        session.add(SplitPartRow(task_id=task.id, position=position, cut=cut, head_artifact_id=head_id, tail_artifact_id=tail_id))
    return spec


def _cuts(spec: SplitInferenceSpec, candidates: list[str], what: str) -> list[str]:
    def named() -> str:
        shown = ", ".join(candidates[:40]) + (" ..." if len(candidates) > 40 else "")
        return f"the candidate cuts of {what} are: {shown or 'none'}"

    if spec.cut is not None:
        if spec.cut in (SPLIT_DEVICE_ONLY, SPLIT_EDGE_ONLY):
            return []
        if spec.cut not in candidates:
            raise BadRequest(f"{spec.cut!r} is not a clean cut; {named()}", status=422)
        return [spec.cut]
    if spec.cuts is not None:
        unknown = [c for c in spec.cuts if c not in candidates]
        if unknown:
            raise BadRequest(f"not clean cuts: {', '.join(map(repr, unknown))}; {named()}", status=422)
        return sorted(spec.cuts, key=candidates.index)
    return spread(candidates, MAX_SPLIT_CUTS)


def spread(items: list[str], most: int) -> list[str]:
    """At most ``most`` of ``items``, evenly spaced, first and last included, in order."""
    if len(items) <= most:
        return list(items)
    picks = sorted({round(i * (len(items) - 1) / (most - 1)) for i in range(most)})
    return [items[i] for i in picks]


def forget(session: Session, task_id: str) -> None:
    """A deleted task's plan (its artefacts stay; they can be deleted now)."""
    session.execute(delete(SplitPartRow).where(SplitPartRow.task_id == task_id))  # type: ignore[arg-type]
    session.execute(delete(SplitPlan).where(SplitPlan.task_id == task_id))  # type: ignore[arg-type]


# --- orders ----------------------------------------------------------------------------------------


def split_order(session: Session, task: Task, worker: TaskWorker, signing: Any) -> SplitOrder:
    """The ``SplitOrder`` of a head or tail worker (``LookupError`` when the plan or an artefact is gone)."""
    from cloud.artifacts import task_input

    plan = session.get(SplitPlan, task.id)
    if plan is None:
        raise LookupError(f"task {task.id} has no split plan")
    rows = list(session.execute(select(SplitPartRow).where(SplitPartRow.task_id == task.id).order_by(SplitPartRow.position)).scalars())  # type: ignore[arg-type]

    def ref(artifact_id: str) -> InputRef:
        return task_input(session, artifact_id, worker.target_id, signing, f"task {task.id}'s split part")

    model = session.get(Artifact, plan.model_artifact_id)
    if model is None:
        raise LookupError(f"the model of task {task.id}'s split plan is gone")
    if worker.role == SPLIT_TAIL:
        parts = [SplitPart(cut=r.cut, tail=ref(r.tail_artifact_id)) for r in rows]
        return SplitOrder(base_sha256=model.sha256, input=plan.input, parts=parts, whole=ref(model.id))
    return SplitOrder(base_sha256=model.sha256, input=plan.input, parts=[SplitPart(cut=r.cut, head=ref(r.head_artifact_id)) for r in rows])


# --- the kind ----------------------------------------------------------------------------------------


class SplitInference(TaskKind):
    """Devices run ``head`` workers; the scheduler keeps one ``tail`` worker on every edge node under a head
    (companions) and withdraws tails with no head under them. Tails do not count for the task's end."""

    type: ClassVar[TaskType] = TaskType.SPLIT_INFERENCE
    node_roles: ClassVar[frozenset[str]] = frozenset({SPLIT_TAIL})

    def admit(self, session: Session, task: Task, spec: BaseModel, placement: Placement, hub: HubParts) -> BaseModel:
        assert isinstance(spec, SplitInferenceSpec)
        return admit(session, task, spec, placement, hub.blobs, hub.signing)

    def order(self, session: Session, task: Task, worker: TaskWorker, signing: Any, order: WorkerOrder) -> WorkerOrder:
        return order.model_copy(update={"split": split_order(session, task, worker, signing)})

    def worker_role(self, task: Task) -> str:
        return SPLIT_HEAD

    def companion_roles(self, task: Task) -> tuple[str, str] | None:
        return SPLIT_HEAD, SPLIT_TAIL

    def is_due(self, active: Iterable[ActiveWorker], node_of: Mapping[str, str]) -> bool:
        """The tails are not on exactly the edge nodes of the heads."""
        workers = list(active)
        return {w.target_id for w in workers if w.role == SPLIT_TAIL} != {node_of.get(w.target_id) for w in workers if w.role != SPLIT_TAIL}

    def forget(self, session: Session, task_id: str) -> None:
        forget(session, task_id)


KIND = SplitInference()
