"""Reading a stored task, and the hub's own lines in its log (DESIGN §4.3)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlmodel import Session

from cloud.tables import Device, Node, Task, TaskLog
from interfaces.deployments import TargetKind
from interfaces.tasks import TASK_TYPES, Placement, RetryPolicy, TaskType, TaskTypeInfo


def now() -> datetime:
    return datetime.now(UTC)


def type_info(task: Task) -> TaskTypeInfo:
    return TASK_TYPES[TaskType(task.type)]


def spec_of(task: Task) -> Any:
    model = type_info(task).spec
    assert model is not None
    return model.model_validate(task.spec)


def placement_of(task: Task) -> Placement:
    return Placement.model_validate(task.placement)


def retry_of(task: Task) -> RetryPolicy:
    return RetryPolicy.model_validate(task.retry)


def target_table(kind: TargetKind | str) -> Any:
    return Device if TargetKind(kind) is TargetKind.DEVICE else Node


def hub_log(session: Session, task_id: str, text: str, level: str = "info", at: datetime | None = None,
            worker_id: str | None = None, target_id: str | None = None) -> None:  # fmt: skip
    session.add(TaskLog(task_id=task_id, worker_id=worker_id, target_id=target_id, ts=at or now(), level=level, text=f"[hub] {text}"[:4096]))
