"""What the updater keeps across restarts (``<data_dir>/ota/state.json``, written atomically).

* ``current`` / ``previous``: per artefact kind, what runs and what ran before it (its file is kept as
  the rollback target and as a delta base).
* ``finished``: the final progress of every execution already done (the newest ``MAX_FINISHED``), so
  that an order delivered again — the retained desired document after a reconnect or a restart — is
  only reported again, never installed twice.
* ``firmware_pending``: firmware executions whose image waits in the inactive slot for the reboot.
"""

from __future__ import annotations

import threading
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

from device.errors import StoredStateError
from device.files import write_atomic
from interfaces.deployments import ArtifactFormat, ExecutionProgress, InstalledArtifact, OrderAction

MAX_FINISHED = 256


class InstalledEntry(BaseModel):
    artifact: InstalledArtifact
    format: ArtifactFormat
    file: str = Field(description="the artefact as downloaded and verified (rollback target, delta base)")


class OtaState(BaseModel):
    current: dict[str, InstalledEntry] = Field(default_factory=dict)
    previous: dict[str, InstalledEntry] = Field(default_factory=dict)
    finished: dict[str, ExecutionProgress] = Field(default_factory=dict, description="'<action>:<execution id>' -> final progress")
    firmware_pending: dict[str, OrderAction] = Field(default_factory=dict, description="execution id -> action")


def finished_key(action: OrderAction, execution_id: str) -> str:
    return f"{action.value}:{execution_id}"


class OtaStore:
    """Thread-safe access to ``state.json``; every change is written before it is visible."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._state = self._read()

    def _read(self) -> OtaState:
        try:
            return OtaState.model_validate_json(self.path.read_bytes())
        except FileNotFoundError:
            return OtaState()
        except (OSError, ValidationError) as exc:
            raise StoredStateError(f"cannot read {self.path}: {exc}") from exc

    @property
    def state(self) -> OtaState:
        with self._lock:
            return self._state.model_copy(deep=True)

    def finished(self, action: OrderAction, execution_id: str) -> ExecutionProgress | None:
        with self._lock:
            return self._state.finished.get(finished_key(action, execution_id))

    def finish(self, action: OrderAction, progress: ExecutionProgress) -> None:
        with self._lock:
            state = self._state.model_copy(deep=True)
            state.finished[finished_key(action, progress.execution_id)] = progress
            for old in list(state.finished)[: max(0, len(state.finished) - MAX_FINISHED)]:
                del state.finished[old]
            state.firmware_pending.pop(progress.execution_id, None)
            self._write(state)

    def installed(self, kind: str, entry: InstalledEntry) -> None:
        """``entry`` runs now for ``kind``; what ran before becomes ``previous`` (unless it is the same file)."""
        with self._lock:
            state = self._state.model_copy(deep=True)
            old = state.current.get(kind)
            if old is not None and old.artifact.sha256 != entry.artifact.sha256:
                state.previous[kind] = old
            state.current[kind] = entry
            self._write(state)

    def firmware_waits(self, execution_id: str, action: OrderAction) -> None:
        with self._lock:
            state = self._state.model_copy(deep=True)
            state.firmware_pending[execution_id] = action
            self._write(state)

    def _write(self, state: OtaState) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(self.path, state.model_dump_json().encode(), mode=0o600)
        self._state = state
