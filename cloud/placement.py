"""Where a task's workers may run, and how a sharded task's chunks are split (DESIGN §4.3).

A target qualifies when (in this order; the first rule that removes the last candidates is the reason a
task waits in PENDING):

1. it matches the placement's ``ids`` or ``selector`` (every target of the kind when neither is given)
   and is not DELETED;
2. its node (for a device: its edge's node) is admin-state UNLOCKED (standard 7.2 c 4: a LOCKED node gets
   no new workers);
3. it is ONLINE, and for a device its edge is connected too;
4. it runs the model the spec names (``installed["model"]`` in its reported document, name and version);
5. it reports at least ``min_memory_bytes`` available;
6. no worker of this task was REJECTED there (it said it cannot run it);
7. it runs fewer than ``MAX_WORKERS_PER_TARGET`` active workers (what one desired document carries);
8. every requested accelerator is free on it: of the accelerators it reports with that type (and a
   matching declared purpose and enough memory), the count not reserved by another active worker
   (standard 7.3.2: training cards and inference cards).

Capability (standard 7.2 d 4): a target's weight is its free compute, ``cores * (1 - utilisation)``
from its latest heartbeat (at least 5 % of its cores), times ``1 + count`` of the matching accelerators
it contributes, shared with the workers it already runs (divided by ``1 + active workers``, so tasks
placed one after another spread over equal targets); a sharded task gives each worker a contiguous
run of chunks in proportion to its weight (largest remainder, at least one chunk each while there are
chunks).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError
from sqlalchemy import select
from sqlmodel import Session

from cloud.services.labels import selector_clause
from cloud.services.paging import parse_selector_or_400
from cloud.tables import Device, Node, TaskWorker
from interfaces.deployments import INSTALLED_KEY, InstalledArtifact, TargetKind
from interfaces.lifecycle import CONNECTED_STATES, AdminState, NodeState
from interfaces.resources import Resources
from interfaces.tasks import MAX_WORKERS_PER_TARGET, WORKER_ACTIVE, AcceleratorRequest, ModelRef, Placement

MIN_SHARE = 0.05


@dataclass
class Candidate:
    kind: TargetKind
    id: str
    node_id: str
    weight: float
    resources: Resources | None = None
    reserved: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Candidates:
    eligible: list[Candidate]
    why_not: str = ""
    """why the last rule that removed targets removed them (empty when some qualify)"""


def weight(resources: Resources | None, accelerators: list[AcceleratorRequest] | None = None) -> float:
    if resources is None:
        return 1.0
    cores = resources.cpu.cores
    free = cores * max(MIN_SHARE, 1.0 - resources.cpu.utilisation)
    extra = sum(r.count for r in accelerators or [])
    return round(free * (1 + extra), 6)


def _resources(row: Any) -> Resources | None:
    if not row.resources:
        return None
    try:
        return Resources.model_validate(row.resources)
    except ValidationError:
        return None


def installed_model(row: Any) -> InstalledArtifact | None:
    """The model a device or node reports installed (``installed["model"]``), or None."""
    entry = (row.reported or {}).get(INSTALLED_KEY, {})
    entry = entry.get("model") if isinstance(entry, dict) else None
    if not isinstance(entry, dict):
        return None
    try:
        return InstalledArtifact.model_validate(entry)
    except ValidationError:
        return None


def _runs_model(row: Any, model: ModelRef) -> bool:
    installed = installed_model(row)
    return installed is not None and installed.name == model.name and (model.version is None or installed.version == model.version)


def matching_devices(session: Session, placement: Placement) -> list[Device]:
    """The devices a placement's ``ids`` or ``selector`` names (every device when neither), not DELETED, by id."""
    query = select(Device).where(Device.state != NodeState.DELETED.value)
    if placement.ids is not None:
        query = query.where(Device.id.in_(placement.ids))  # type: ignore[attr-defined]
    elif placement.selector:
        query = query.where(*selector_clause(Device.id, parse_selector_or_400(placement.selector)))
    return list(session.execute(query.order_by(Device.id)).scalars())


def installed_version(session: Session, placement: Placement, name: str, keep: Any = None) -> str:
    """The one version of model ``name`` the placement's devices run (those ``keep(device)`` accepts);
    a 422 when they run none or several."""
    from cloud.errors import BadRequest

    versions = sorted({m.version for d in matching_devices(session, placement) if (m := installed_model(d)) is not None and m.name == name
                       and (keep is None or keep(d))})  # fmt: skip
    if len(versions) != 1:
        why = "no device of the placement runs it" if not versions else f"the devices run {', '.join(versions)}"
        raise BadRequest(f"say which version of {name} to use: {why}", status=422)
    return versions[0]


def _matches(acc: Any, req: AcceleratorRequest) -> bool:
    if acc.type != req.type:
        return False
    if req.purpose is not None and acc.purpose not in (None, "both", req.purpose):
        return False
    return req.min_memory_bytes is None or acc.memory_bytes >= req.min_memory_bytes


def _preference(acc: Any, req: AcceleratorRequest) -> int:
    """Which matching card a reservation is counted against first: one declared for its purpose, then
    one for both, then one with no declared purpose (so that the flexible cards stay free longest)."""
    if req.purpose is not None and acc.purpose == req.purpose:
        return 0
    return 1 if acc.purpose == "both" else 2


def card_order(cards: list[tuple[int, Any]], req: AcceleratorRequest) -> list[tuple[int, Any]]:
    """The cards (index, accelerator entry) that match ``req``, in the order a reservation takes them."""
    return sorted(((i, acc) for i, acc in cards if _matches(acc, req)), key=lambda c: (_preference(c[1], req), c[0]))


def free_accelerators(resources: Resources | None, reserved: list[dict[str, Any]], req: AcceleratorRequest) -> int:
    """How many accelerators matching ``req`` the target has that active workers did not reserve. Each
    reservation is counted against the cards it could have been given (by type, purpose and memory), so
    a training card held by one worker leaves the target's inference card free for another."""
    if resources is None:
        return 0
    left = [[acc, acc.count] for acc in resources.accelerators]
    for r in reserved:
        try:
            other = AcceleratorRequest.model_validate(r)
        except ValidationError:
            continue
        need = other.count
        for pool in sorted((p for p in left if _matches(p[0], other)), key=lambda p: _preference(p[0], other)):
            used = min(need, pool[1])
            pool[1] -= used
            need -= used
            if need == 0:
                break
    return sum(count for acc, count in left if _matches(acc, req))


def find(session: Session, placement: Placement, model: ModelRef | None, rejected: set[str] | frozenset[str] = frozenset(),
         exclude: set[str] | frozenset[str] = frozenset()) -> Candidates:  # fmt: skip
    """The qualifying targets, by id; ``exclude``: targets that already run a worker of this task."""
    table = Device if placement.target is TargetKind.DEVICE else Node
    query = select(table).where(table.state != NodeState.DELETED.value)
    if placement.ids is not None:
        query = query.where(table.id.in_(placement.ids))  # type: ignore[attr-defined]
    elif placement.selector:
        query = query.where(*selector_clause(table.id, parse_selector_or_400(placement.selector)))
    rows = list(session.execute(query.order_by(table.id)).scalars())
    if not rows:
        return Candidates([], "no target matches the placement")
    node_of = {row.id: (row.node_id if table is Device else row.id) for row in rows}
    nodes = {n.id: n for n in session.execute(select(Node).where(Node.id.in_(set(node_of.values())))).scalars()}  # type: ignore[attr-defined]

    def step(kept: list[Any], rule: Any, why: str) -> tuple[list[Any], str]:
        out = [row for row in kept if rule(row)]
        return out, (why if kept and not out else "")

    why = ""
    for rule, text in (
        (lambda r: nodes.get(node_of[r.id]) is not None and nodes[node_of[r.id]].admin_state == AdminState.UNLOCKED.value, "every matching target is on a LOCKED node"),
        (lambda r: r.state == NodeState.ONLINE.value and (table is Node or (nodes[node_of[r.id]].state in CONNECTED_STATES)), "no matching target is ONLINE"),
        (lambda r: model is None or _runs_model(r, model), f"no matching online target runs model {model.name}{' ' + model.version if model and model.version else ''}" if model else ""),
        (lambda r: placement.min_memory_bytes is None or ((res := _resources(r)) is not None and res.memory.available_bytes >= placement.min_memory_bytes),
         f"no matching target reports {placement.min_memory_bytes} bytes of available memory"),
        (lambda r: r.id not in rejected, "every remaining target rejected this task"),
        (lambda r: r.id not in exclude, ""),
    ):  # fmt: skip
        rows, reason = step(rows, rule, text)
        why = why or reason
        if not rows:
            return Candidates([], why or "no target left")
    reserved: dict[str, list[dict[str, Any]]] = defaultdict(list)
    running: dict[str, int] = defaultdict(int)
    for target_id, accs in session.execute(
        select(TaskWorker.target_id, TaskWorker.accelerators).where(
            TaskWorker.target_id.in_([r.id for r in rows]), TaskWorker.state.in_([s.value for s in WORKER_ACTIVE])  # type: ignore[attr-defined]
        )
    ).all():  # fmt: skip
        reserved[target_id].extend(accs or [])
        running[target_id] += 1
    rows, reason = step(rows, lambda r: running[r.id] < MAX_WORKERS_PER_TARGET, f"every matching target already runs {MAX_WORKERS_PER_TARGET} workers")
    if not rows:
        return Candidates([], why or reason)
    eligible: list[Candidate] = []
    for row in rows:
        res = _resources(row)
        if any(free_accelerators(res, reserved[row.id], req) < req.count for req in placement.accelerators):
            continue
        share = weight(res, placement.accelerators) / (1 + running[row.id])
        eligible.append(Candidate(placement.target, row.id, node_of[row.id], round(share, 6), res, reserved[row.id]))
    if not eligible:
        wanted = ", ".join(f"{r.count} {r.type.value}" for r in placement.accelerators)
        return Candidates([], f"no matching target has {wanted} free")
    return Candidates(eligible)


def split(indices: list[int], weights: list[float]) -> list[list[int]]:
    """Contiguous runs of ``indices`` in proportion to ``weights`` (largest remainder; at least one each
    while there are indices to give)."""
    n, k = len(indices), len(weights)
    if k == 0:
        return []
    total = sum(weights) or float(k)
    shares = [w / total * n if sum(weights) else n / k for w in weights]
    counts = [math.floor(s) for s in shares]
    if n >= k:
        for i in range(k):
            if counts[i] == 0:
                counts[i] = 1
    while sum(counts) > n:
        i = max(range(k), key=lambda j: (counts[j] - shares[j], counts[j]))
        counts[i] -= 1
    order = sorted(range(k), key=lambda j: shares[j] - counts[j], reverse=True)
    i = 0
    while sum(counts) < n:
        counts[order[i % k]] += 1
        i += 1
    out, start = [], 0
    for c in counts:
        out.append(indices[start : start + c])
        start += c
    return out


def ranges(indices: list[int]) -> list[tuple[int, int]]:
    """``[3, 4, 5, 9]`` -> ``[(3, 6), (9, 10)]``."""
    out: list[tuple[int, int]] = []
    for i in sorted(indices):
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


@dataclass
class CompanionChanges:
    wanted: set[str]
    """edge nodes with a device worker under them"""
    covered: set[str]
    """edge nodes with an active companion"""
    place: list[str]
    """wanted nodes without a companion that can take one now (ONLINE, UNLOCKED)"""
    withdraw: list[TaskWorker]
    """active companions on nodes without device workers"""


def companion_changes(session: Session, active: list[TaskWorker], device_role: str, node_role: str) -> CompanionChanges:
    """A task whose device workers (``device_role``) need one worker on their edge node (``node_role``: a split
    inference tail, a federated aggregator): what to place and withdraw, given its active workers."""
    heads = [w for w in active if w.role == device_role and w.target_kind == TargetKind.DEVICE.value]
    companions = {w.target_id: w for w in active if w.role == node_role}
    device_ids = [w.target_id for w in heads]
    node_of = dict(session.execute(select(Device.id, Device.node_id).where(Device.id.in_(device_ids))).all()) if device_ids else {}  # type: ignore[attr-defined]
    wanted = set(node_of.values())
    missing = sorted(wanted - companions.keys())
    ready = {
        n.id for n in session.execute(select(Node).where(Node.id.in_(missing))).scalars()  # type: ignore[attr-defined]
        if n.state == NodeState.ONLINE.value and n.admin_state == AdminState.UNLOCKED.value
    } if missing else set()  # fmt: skip
    return CompanionChanges(wanted, set(companions), [n for n in missing if n in ready], [w for node, w in sorted(companions.items()) if node not in wanted])
