"""Differential privacy on the device (DESIGN §5, standard 6.3.2 c 3): local datasets and privacy budgets.

* A device reports the datasets that live on it (and never leave it) in its reported document, under
  ``DATASETS_KEY``: ``{name: LocalDataset}`` (rows and the shape of one row). The hub needs the rows for
  the privacy accounting of DP-SGD (the sample rate is ``batch_size / rows``).
* Each (device, dataset) has an (ε, δ) budget kept by the hub (``PUT /devices/{id}/privacy-budgets/{dataset}``).
  An ``incremental_training`` task reserves what it may spend on each of its devices when it is created
  (refused with 409 ``privacy_budget_exceeded`` when a budget cannot afford it) and settles the reservation
  with the steps its worker actually took. Every spend is a Poisson-sampled Gaussian mechanism run
  ``steps`` times (sample rate q, noise multiplier σ); ``spent``, ``reserved`` and ``remaining`` are ε of the
  RDP composition of the spends at the budget's δ (dp_accounting's ``RdpAccountant``).
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from interfaces.strict import INT64_MAX, WireModel
from interfaces.text import NoNul

DATASETS_KEY = "datasets"
"""Key in ``ReportedBody.status``: the device's local datasets, ``{name: LocalDataset}``."""

DatasetName = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")]
Epsilon = Annotated[float, Field(gt=0, le=1e6, description="ε of (ε, δ)-differential privacy")]
Delta = Annotated[float, Field(gt=0, lt=1, description="δ of (ε, δ)-differential privacy (well below 1 / rows)")]


class LocalDataset(WireModel):
    """One entry of ``ReportedBody.status["datasets"]``: a dataset kept on the device (inputs ``x``, labels ``y``)."""

    model_config = ConfigDict(extra="forbid")

    rows: int = Field(ge=0, le=INT64_MAX)
    shape: list[Annotated[int, Field(ge=0, le=INT64_MAX)]] = Field(max_length=8, description="the shape of one input row")
    dtype: str = Field(max_length=16)


class PrivacyBudgetSet(NoNul):
    """``PUT /devices/{id}/privacy-budgets/{dataset}``: what all tasks together may spend of that dataset's privacy."""

    model_config = ConfigDict(extra="forbid")

    epsilon: Epsilon
    delta: Delta


class SpendState(StrEnum):
    RESERVED = "reserved"  # held for a task's worker that has not ended yet
    SPENT = "spent"  # the worker ended: ε of the steps it took
    RELEASED = "released"  # the worker took no step (or never ran): nothing spent


class PrivacySpend(BaseModel):
    """One task's use of one device's dataset (one per worker run)."""

    task_id: str
    worker_id: str | None
    device_id: str
    dataset: str
    state: SpendState
    steps: int = Field(description="reserved: the most steps the worker may take; spent: the steps it took")
    max_steps: int = Field(description="the most steps the worker was allowed (the order's max_steps)")
    sample_rate: float = Field(description="Poisson sampling rate q = batch_size / rows")
    noise_multiplier: float
    delta: float = Field(description="the δ of this task's own ε")
    epsilon: float = Field(description="this run's own ε for its steps at delta (RDP accountant)")
    created_at: datetime
    settled_at: datetime | None


class PrivacyBudgetPublic(BaseModel):
    device_id: str
    dataset: str
    epsilon: float = Field(description="the budget")
    delta: float
    spent: float = Field(description="ε of every settled spend composed, at the budget's δ")
    reserved: float = Field(description="what the open reservations add to spent (ε of all composed minus spent)")
    remaining: float = Field(description="epsilon minus ε of every spend and reservation composed (never below 0)")
    rows: int | None = Field(description="the dataset's rows as the device last reported them")
    created_at: datetime
    updated_at: datetime
    spends: list[PrivacySpend] = Field(default_factory=list, description="oldest first")
