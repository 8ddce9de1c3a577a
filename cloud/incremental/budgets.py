"""Privacy budgets per (device, dataset) and what training tasks spend of them, in the hub's database (DESIGN §5).

Rows: ``PrivacyBudget`` (ε, δ of one device's dataset) and ``PrivacySpendRow`` (one worker run: sample rate,
noise multiplier, steps; ``reserved`` while the run may still happen, then ``spent`` or ``released``).

* **Usage.** ``spent`` is ε at the budget's δ of the RDP composition of the settled runs; ``reserved`` what
  the open reservations add to it; ``remaining`` the budget's ε minus ε of everything composed. Changing a
  budget's (ε, δ) re-evaluates the same runs: nothing is recorded as ε alone.
* **Serialising admissions.** :func:`lock` bumps each budget's ``revision`` (in key order) before the
  spends are read: on PostgreSQL the UPDATE holds the row lock, on SQLite it takes the database's write
  lock, to the end of the transaction either way. Two admissions against the same budget thus run one
  after the other and the second sees the first's reservation: they cannot overspend together.
* **Settling** a reservation (:func:`settle`) only lowers what it stands for (the steps taken, at most
  the steps reserved), so it needs no lock.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select, update
from sqlmodel import Session

from cloud.convert import utc
from cloud.errors import NotFound
from cloud.incremental import accounting
from cloud.tables import Device, PrivacyBudget, PrivacySpendRow
from interfaces.ids import is_id
from interfaces.lifecycle import NodeState
from interfaces.privacy import DATASETS_KEY, LocalDataset, PrivacyBudgetPublic, PrivacyBudgetSet, PrivacySpend, SpendState

log = logging.getLogger("aisynergy.hub.privacy")
Key = tuple[str, str]  # (device id, dataset)
OPEN = (SpendState.RESERVED.value, SpendState.SPENT.value)


def now() -> datetime:
    return datetime.now(UTC)


def _device(session: Session, device_id: str) -> Device:
    device = session.get(Device, device_id) if is_id(device_id) else None
    if device is None or device.state == NodeState.DELETED.value:
        raise NotFound(f"device {device_id} does not exist")
    return device


def reported_dataset(device: Device, dataset: str) -> LocalDataset | None:
    """What the device last reported of ``dataset`` (None: not reported, or not readable)."""
    datasets = (device.reported or {}).get(DATASETS_KEY)
    entry = datasets.get(dataset) if isinstance(datasets, dict) else None
    if entry is None:
        return None
    try:
        return LocalDataset.model_validate(entry)
    except ValueError:
        return None


# --- reading ---------------------------------------------------------------------------------------


def spends(session: Session, key: Key, states: tuple[str, ...] = OPEN, fresh: bool = False) -> list[PrivacySpendRow]:
    query = select(PrivacySpendRow).where(PrivacySpendRow.device_id == key[0], PrivacySpendRow.dataset == key[1], PrivacySpendRow.state.in_(states))  # type: ignore[attr-defined]
    if fresh:
        query = query.execution_options(populate_existing=True)
    return list(session.execute(query.order_by(PrivacySpendRow.id)).scalars())  # type: ignore[arg-type]


def run_of(row: PrivacySpendRow) -> accounting.Run:
    return accounting.Run(row.sample_rate, row.noise_multiplier, row.steps)


def curve(rows: list[PrivacySpendRow]) -> Any:
    """The RDP curve of the runs ``rows`` stand for (reserved ones at their reserved steps)."""
    return accounting.curve(run_of(r) for r in rows if r.state in OPEN)


def usage(budget: PrivacyBudget, rows: list[PrivacySpendRow]) -> tuple[float, float, float]:
    """(spent, reserved, remaining) in ε at the budget's δ."""
    spent = accounting.epsilon(curve([r for r in rows if r.state == SpendState.SPENT.value]), budget.delta)
    total = accounting.epsilon(curve(rows), budget.delta)
    return spent, max(0.0, total - spent), max(0.0, budget.epsilon - total)


def lock(session: Session, keys: list[Key]) -> dict[Key, PrivacyBudget]:
    """Take the budgets of ``keys`` for this transaction (see the module docstring); the rows that exist."""
    found: dict[Key, PrivacyBudget] = {}
    for device_id, dataset in sorted(set(keys)):
        session.execute(
            update(PrivacyBudget).where(PrivacyBudget.device_id == device_id, PrivacyBudget.dataset == dataset).values(revision=PrivacyBudget.revision + 1)  # type: ignore[arg-type]
        )  # fmt: skip
        row = session.execute(
            select(PrivacyBudget).where(PrivacyBudget.device_id == device_id, PrivacyBudget.dataset == dataset).execution_options(populate_existing=True)
        ).scalars().first()  # fmt: skip
        if row is not None:
            found[(device_id, dataset)] = row
    return found


def read(session: Session, keys: list[Key]) -> dict[Key, PrivacyBudget]:
    """The budgets of ``keys`` without taking them (a first look before anything is written)."""
    found = {}
    for key in set(keys):
        row = session.get(PrivacyBudget, key)
        if row is not None:
            found[key] = row
    return found


# --- writing ---------------------------------------------------------------------------------------


def reserve(session: Session, key: Key, task_id: str, run: accounting.Run, delta: float, at: datetime) -> PrivacySpendRow:
    row = PrivacySpendRow(
        device_id=key[0], dataset=key[1], task_id=task_id, worker_id=None, state=SpendState.RESERVED.value, sample_rate=run.sample_rate,
        noise_multiplier=run.noise_multiplier, steps=run.steps, max_steps=run.steps, delta=delta, epsilon=accounting.run_epsilon(run, delta),
        created_at=at,
    )  # fmt: skip
    session.add(row)
    return row


def settle(session: Session, row: PrivacySpendRow, steps: int, at: datetime) -> None:
    """The run took ``steps``: ``spent`` (ε of those steps at the row's δ), or ``released`` when it took none."""
    row.steps = max(0, steps)
    row.state = (SpendState.SPENT if row.steps else SpendState.RELEASED).value
    row.epsilon = accounting.run_epsilon(run_of(row), row.delta) if row.steps else 0.0
    row.settled_at = at
    session.add(row)


# --- REST ------------------------------------------------------------------------------------------


def put_budget(session: Session, device_id: str, dataset: str, body: PrivacyBudgetSet) -> PrivacyBudgetPublic:
    _device(session, device_id)
    at = now()
    row = session.get(PrivacyBudget, (device_id, dataset))
    if row is None:
        row = PrivacyBudget(device_id=device_id, dataset=dataset, epsilon=body.epsilon, delta=body.delta, created_at=at, updated_at=at)
    else:
        row.epsilon, row.delta, row.updated_at = body.epsilon, body.delta, at
    session.add(row)
    session.commit()
    log.info("privacy budget of %s / %s set to epsilon=%g delta=%g", device_id, dataset, body.epsilon, body.delta)
    return to_wire(session, row)


def list_budgets(session: Session, device_id: str) -> list[PrivacyBudgetPublic]:
    _device(session, device_id)
    rows = session.execute(select(PrivacyBudget).where(PrivacyBudget.device_id == device_id).order_by(PrivacyBudget.dataset)).scalars()
    return [to_wire(session, row) for row in rows]


def to_wire(session: Session, row: PrivacyBudget) -> PrivacyBudgetPublic:
    key = (row.device_id, row.dataset)
    history = spends(session, key, tuple(s.value for s in SpendState))
    spent, reserved, remaining = usage(row, history)
    device = session.get(Device, row.device_id)
    reported = reported_dataset(device, row.dataset) if device is not None else None
    return PrivacyBudgetPublic(
        device_id=row.device_id, dataset=row.dataset, epsilon=row.epsilon, delta=row.delta, spent=spent, reserved=reserved, remaining=remaining,
        rows=reported.rows if reported else None, created_at=utc(row.created_at), updated_at=utc(row.updated_at),
        spends=[spend_to_wire(s) for s in history],
    )  # fmt: skip


def spend_to_wire(row: PrivacySpendRow) -> PrivacySpend:
    return PrivacySpend(
        task_id=row.task_id, worker_id=row.worker_id, device_id=row.device_id, dataset=row.dataset, state=SpendState(row.state), steps=row.steps,
        max_steps=row.max_steps, sample_rate=row.sample_rate, noise_multiplier=row.noise_multiplier, delta=row.delta, epsilon=row.epsilon,
        created_at=utc(row.created_at), settled_at=utc(row.settled_at),
    )  # fmt: skip
