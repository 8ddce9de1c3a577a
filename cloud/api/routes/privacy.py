"""Privacy budgets of the datasets kept on devices: /devices/{id}/privacy-budgets (DESIGN §5)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path

from cloud.api.deps import IdempotencyKey, Operator, SessionDep, Viewer
from cloud.api.problems import PROBLEM_RESPONSES
from cloud.incremental import budgets
from interfaces.privacy import PrivacyBudgetPublic, PrivacyBudgetSet

router = APIRouter(prefix="/devices", tags=["privacy"], responses=PROBLEM_RESPONSES)
Dataset = Annotated[str, Path(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", description="a dataset kept on the device")]


@router.put("/{device_id}/privacy-budgets/{dataset}")
def put_privacy_budget(device_id: str, dataset: Dataset, body: PrivacyBudgetSet, session: SessionDep, _: Operator, __: IdempotencyKey = None) -> PrivacyBudgetPublic:
    """Set what training tasks together may spend of a device's dataset, as (epsilon, delta); what was spent stays spent."""
    return budgets.put_budget(session, device_id, dataset, body)


@router.get("/{device_id}/privacy-budgets")
def list_privacy_budgets(device_id: str, session: SessionDep, _: Viewer) -> list[PrivacyBudgetPublic]:
    """The device's privacy budgets with what is spent, reserved and remaining, and every task's spend."""
    return budgets.list_budgets(session, device_id)
