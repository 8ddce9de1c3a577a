"""Task workers on a device or an edge node (DESIGN §4.3): the hub's ``WorkerOrder``s, run and reported.

::

    desired document (tasks, tasks_version)
        -> WorkerHost.apply(orders)           host.py: one Worker thread per order; withdrawn: stopped
            -> Worker                         worker.py: order, pause/stop, reports, logs, metrics, outputs
                -> program by TaskType        programs.py: batch.py (batch_inference), serve.py (inference),
                                              incremental.py (incremental_training: DP-SGD, device.training)
                    -> ModelHost.infer        the target's loaded models (device.ota.models)
                    -> fetch_inputs(ref)      inputs.py: signed, verified dataset artefacts and training bodies
                    -> datasets               the device's local datasets (device.local_data)
    events: task.worker, task.log, task.metrics, task.output (interfaces.tasks)

Nothing here imports numpy until a worker runs.
"""

from device.tasks.host import WorkerHost
from device.tasks.inputs import InputFetcher
from device.tasks.worker import Failed, Rejected, WorkerInfo

__all__ = ["Failed", "InputFetcher", "Rejected", "WorkerHost", "WorkerInfo"]
