"""The device's copy of its desired-state document and of what it last applied (``desired.json``).

The broker retains the desired document and redelivers it on every (re)connect; the version numbers
decide what to do with it: a version at or below the applied one is old news, a newer one is stored
before it is applied, so a crash between the two applies it on the next start. The deployment orders
(``DesiredBody.deployments``) have their own version, ``deployments_version``: newer orders make the
document pending even when its ``version`` (the spec's) did not change. The task orders
(``DesiredBody.tasks``, DESIGN §4.3) likewise have ``tasks_version``. A ``desired.json`` written before
either existed still reads (the missing fields take their defaults).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, ValidationError

from device.errors import StoredStateError
from device.files import write_atomic
from interfaces.deployments import DeploymentOrder
from interfaces.messages import DesiredBody
from interfaces.tasks import WorkerOrder

NONE = -1  # no version yet; real versions are >= 0


class DesiredRecord(BaseModel):
    version: int = NONE
    spec: dict[str, Any] = Field(default_factory=dict)
    message_id: str | None = Field(default=None, description="the envelope id of the desired document")
    applied_version: int = NONE
    status: dict[str, Any] = Field(default_factory=dict, description="the status reported for applied_version")
    deployments: list[DeploymentOrder] = Field(default_factory=list)
    deployments_version: int = NONE
    applied_deployments_version: int = NONE
    tasks: list[WorkerOrder] = Field(default_factory=list)
    tasks_version: int = NONE
    applied_tasks_version: int = NONE

    @property
    def pending(self) -> bool:
        """A stored desired document that has not been applied yet."""
        return self.version > self.applied_version or self.orders_pending or self.tasks_pending

    @property
    def orders_pending(self) -> bool:
        return self.deployments_version > self.applied_deployments_version

    @property
    def tasks_pending(self) -> bool:
        return self.tasks_version > self.applied_tasks_version


class DesiredStore:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._record = self._read()

    def _read(self) -> DesiredRecord:
        try:
            return DesiredRecord.model_validate_json(self.path.read_bytes())
        except FileNotFoundError:
            return DesiredRecord()
        except (OSError, ValidationError) as exc:
            raise StoredStateError(f"cannot read {self.path}: {exc}; remove it to take the broker's copy") from exc

    @property
    def record(self) -> DesiredRecord:
        with self._lock:
            return self._record.model_copy(deep=True)

    def offer(self, desired: DesiredBody, message_id: str | None = None) -> bool:
        """Store ``desired`` if its spec, its deployment orders or its task orders are newer than anything
        seen; ``False`` for a stale or repeated document."""
        with self._lock:
            record = self._record
            spec_new = desired.version > max(record.version, record.applied_version)
            orders_new = desired.deployments_version > max(record.deployments_version, record.applied_deployments_version)
            tasks_new = desired.tasks_version > max(record.tasks_version, record.applied_tasks_version)
            if not (spec_new or orders_new or tasks_new):
                return False
            update: dict[str, Any] = {"message_id": message_id}
            if spec_new:
                update |= {"version": desired.version, "spec": desired.spec}
            if orders_new:
                update |= {"deployments": desired.deployments, "deployments_version": desired.deployments_version}
            if tasks_new:
                update |= {"tasks": desired.tasks, "tasks_version": desired.tasks_version}
            self._write(record.model_copy(update=update))
            return True

    def applied(
        self, version: int, status: dict[str, Any], deployments_version: int | None = None, tasks_version: int | None = None
    ) -> None:
        """Record ``version`` (and the orders of ``deployments_version`` and ``tasks_version``; default: those
        stored now) as applied."""
        with self._lock:
            record = self._record
            orders = record.deployments_version if deployments_version is None else deployments_version
            tasks = record.tasks_version if tasks_version is None else tasks_version
            update = {"applied_version": version, "status": status, "applied_deployments_version": orders, "applied_tasks_version": tasks}
            self._write(self._record.model_copy(update=update))

    def _write(self, record: DesiredRecord) -> None:
        write_atomic(self.path, record.model_dump_json().encode(), mode=0o600)
        self._record = record
