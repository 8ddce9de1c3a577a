"""The worker programs this target has, by task type, and the checks they share.

Only types whose program exists are listed; an order of any other type is REJECTED ("this target has no
worker program for type X"). Programs are imported when a worker first needs one, so an idle agent does
not load numpy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from device.tasks.worker import Program, Rejected, Worker
from interfaces.tasks import ModelRef, TaskType

if TYPE_CHECKING:
    from device.ota.models import LoadedModel, ModelHost

PROGRAMS: dict[TaskType, str] = {
    TaskType.BATCH_INFERENCE: "device.tasks.batch:run",
    TaskType.INFERENCE: "device.tasks.serve:run",
    TaskType.INCREMENTAL_TRAINING: "device.tasks.incremental:run",
    TaskType.SPLIT_INFERENCE: "device.tasks.split:run",
    TaskType.FEDERATED_TRAINING: "device.tasks.federated:run",
    TaskType.TRAINING: "device.tasks.training:run",
}
"""type -> ``module:function`` of its program"""


def program_for(type: TaskType) -> Program:
    """The program of ``type``; for a type without one, a program that REJECTS the order."""
    target = PROGRAMS.get(type)
    if target is None:

        def missing(worker: Worker) -> None:
            raise Rejected(f"this target has no worker program for type {type.value}")

        return missing
    module, _, name = target.partition(":")
    program: Program = getattr(importlib.import_module(module), name)
    return program


def require_model(models: ModelHost, ref: ModelRef) -> LoadedModel:
    """The loaded model ``ref`` names (and its version, if given); :class:`Rejected` naming what is loaded."""
    from device.ota.models import NoModel

    try:
        model = models.get(ref.name)
    except NoModel:
        model = None
    if model is not None and (ref.version is None or model.version == ref.version):
        return model
    wanted = f"{ref.name} {ref.version}" if ref.version else ref.name
    loaded = ", ".join(f"{m['name']} {m['version']}" for m in models.models()) or "none"
    raise Rejected(f"model {wanted} is not loaded on this target (loaded: {loaded}); deploy it first")
