"""Task run management (DESIGN §4.3, standard §8.3): tasks, workers, orders, worker reports, type registry.

One package, four modules, everything re-exported here: ``states`` (types, states, moves, event types, limits),
``specs`` (each type's spec, placement, retries, ``TASK_TYPES``), ``rest`` (the REST models) and ``wire`` (orders
and reports over MQTT).

The wire contract between the hub, edges and devices for running AI tasks:

* REST models: ``TaskCreate``, ``TaskPublic``, ``WorkerPublic``, ``TaskLogLine``, ``TaskMetrics``, ``TaskOutputs``.
* Orders (``WorkerOrder``) travel to a target inside its retained ``desired`` document
  (``DesiredBody.tasks``, versioned by ``tasks_version``), so a target that restarts converges on what it
  must run; a withdrawn order means "stop this worker".
* Workers report on ``events``: ``TASK_WORKER_EVENT`` (state and progress, also the worker's heartbeat),
  ``TASK_LOG_EVENT`` (log lines), ``TASK_METRICS_EVENT`` (numbers) and ``TASK_OUTPUT_EVENT`` (one finished
  chunk of a sharded task's outputs, as safetensors bytes). The hub keeps each line, sample and chunk once.
* ``TASK_TYPES`` is the registry: each type's spec model, how it is placed, what happens when a worker is
  lost, and which targets can run it.
* ``incremental_training`` (``IncrementalTrainingSpec``): the hub splits the installed model at the input of
  its last dense layer; the order's ``training`` (``TrainingOrder``) names the frozen body (a signed model
  artefact) and carries the last layer's weights, the sample rate and ``max_steps`` (what the device's
  privacy budget allows, ``interfaces.privacy``). The device trains that layer with DP-SGD on a dataset that
  never leaves it and sends the new weights as its one ``WorkerOutput`` (chunk 0, ``items`` = steps taken).
* ``split_inference`` (``SplitInferenceSpec``): the hub cuts the model into heads and tails (signed artefacts);
  each placed device gets a ``head`` worker, its edge node one ``tail`` worker for the task (the order's
  ``split``, ``SplitOrder``). Requests cross on the ``infer`` channel (``interfaces.topics.DEVICE_INFER``).
  A type whose spec model is ``None`` is known to the contract but not yet runnable (``POST /tasks`` refuses
  it with a 422).

* ``training`` (``TrainingSpec``): a user's algorithm (an ``algorithm`` artefact, ``interfaces.algorithms``) trained
  on one site's own datasets; the order's ``run`` (``AlgorithmRun``) carries the signed package, the limits and a
  ``PublishGrant``. The site runs it in a limited process, publishes the parameters and the ONNX export through the
  chunked upload API with the grant, and reports them with one ``TASK_TRAINED_EVENT`` (``TrainedModel``).

State machines (the transitions below are the only legal moves)::

    task:   PENDING -> SCHEDULED -> RUNNING <-> PAUSED
            PENDING | SCHEDULED | RUNNING | PAUSED -> SUCCEEDED | FAILED | CANCELED | TIMED_OUT
            FAILED | CANCELED | TIMED_OUT -> PENDING            (retry)
    worker: QUEUED -> RUNNING -> SUCCEEDED
            QUEUED | RUNNING -> FAILED | TIMED_OUT | REJECTED | LOST | CANCELED
"""

from __future__ import annotations

from interfaces.tasks.rest import (
    TASK_DETAIL as TASK_DETAIL,
    TASK_PUBLIC as TASK_PUBLIC,
    BatchInferenceTask as BatchInferenceTask,
    BatchInferenceTaskDetail as BatchInferenceTaskDetail,
    FederatedTrainingTask as FederatedTrainingTask,
    FederatedTrainingTaskDetail as FederatedTrainingTaskDetail,
    IncrementalTrainingTask as IncrementalTrainingTask,
    IncrementalTrainingTaskDetail as IncrementalTrainingTaskDetail,
    InferenceTask as InferenceTask,
    InferenceTaskDetail as InferenceTaskDetail,
    SplitInferenceTask as SplitInferenceTask,
    SplitInferenceTaskDetail as SplitInferenceTaskDetail,
    TaskDetailBody as TaskDetailBody,
    TaskPublicBody as TaskPublicBody,
    TASK_CREATE_VARIANTS as TASK_CREATE_VARIANTS,
    TrainedSummary as TrainedSummary,
    CrossScore as CrossScore,
    RoundScore as RoundScore,
    TrainingTask as TrainingTask,
    TrainingTaskCreate as TrainingTaskCreate,
    TrainingTaskDetail as TrainingTaskDetail,
)
from interfaces.tasks.specs import (
    MAX_TRAINING_DATASETS as MAX_TRAINING_DATASETS,
    FlVariant as FlVariant,
    AlgorithmLimits as AlgorithmLimits,
    AlgorithmRef as AlgorithmRef,
    TrainingSpec as TrainingSpec,
)
from interfaces.tasks.states import (
    TASK_TRAINED_EVENT as TASK_TRAINED_EVENT,
)
from interfaces.tasks.wire import (
    FL_UPDATE_PREFIX as FL_UPDATE_PREFIX,
    FL_UPDATES_PATH as FL_UPDATES_PATH,
    PARAMETERS_SUFFIX as PARAMETERS_SUFFIX,
    fl_update_identity as fl_update_identity,
    AlgorithmRun as AlgorithmRun,
    PublishGrant as PublishGrant,
    TrainedModel as TrainedModel,
    TrainingTaskOrder as TrainingTaskOrder,
)
from interfaces.tasks.rest import (
    BatchInferenceTaskCreate as BatchInferenceTaskCreate,
)
from interfaces.tasks.rest import (
    FederatedTrainingTaskCreate as FederatedTrainingTaskCreate,
)
from interfaces.tasks.rest import (
    IncrementalTrainingTaskCreate as IncrementalTrainingTaskCreate,
)
from interfaces.tasks.rest import (
    InferenceTaskCreate as InferenceTaskCreate,
)
from interfaces.tasks.rest import (
    MetricSample as MetricSample,
)
from interfaces.tasks.rest import (
    SplitInferenceTaskCreate as SplitInferenceTaskCreate,
)
from interfaces.tasks.rest import (
    TaskCreate as TaskCreate,
)
from interfaces.tasks.rest import (
    TaskCreateBody as TaskCreateBody,
)
from interfaces.tasks.rest import (
    TaskDetail as TaskDetail,
)
from interfaces.tasks.rest import (
    TaskLogLine as TaskLogLine,
)
from interfaces.tasks.rest import (
    TaskMetrics as TaskMetrics,
)
from interfaces.tasks.rest import (
    TaskOutputs as TaskOutputs,
)
from interfaces.tasks.rest import (
    TaskProgress as TaskProgress,
)
from interfaces.tasks.rest import (
    TaskPublic as TaskPublic,
)
from interfaces.tasks.rest import (
    TaskTransition as TaskTransition,
)
from interfaces.tasks.rest import (
    TensorInfo as TensorInfo,
)
from interfaces.tasks.rest import (
    WorkerPublic as WorkerPublic,
)
from interfaces.tasks.specs import (
    FL_AGGREGATOR as FL_AGGREGATOR,
)
from interfaces.tasks.specs import (
    FL_STRATEGIES as FL_STRATEGIES,
)
from interfaces.tasks.specs import (
    MAX_FL_UPDATE_BYTES as MAX_FL_UPDATE_BYTES,
)
from interfaces.tasks.specs import (
    MAX_SPLIT_CUTS as MAX_SPLIT_CUTS,
)
from interfaces.tasks.specs import (
    SPLIT_DEVICE_ONLY as SPLIT_DEVICE_ONLY,
)
from interfaces.tasks.specs import (
    SPLIT_EDGE_ONLY as SPLIT_EDGE_ONLY,
)
from interfaces.tasks.specs import (
    SPLIT_HEAD as SPLIT_HEAD,
)
from interfaces.tasks.specs import (
    SPLIT_TAIL as SPLIT_TAIL,
)
from interfaces.tasks.specs import (
    TASK_TYPES as TASK_TYPES,
)
from interfaces.tasks.specs import (
    AcceleratorRequest as AcceleratorRequest,
)
from interfaces.tasks.specs import (
    BatchInferenceSpec as BatchInferenceSpec,
)
from interfaces.tasks.specs import (
    FederatedTrainingSpec as FederatedTrainingSpec,
)
from interfaces.tasks.specs import (
    FlPrivacy as FlPrivacy,
)
from interfaces.tasks.specs import (
    IncrementalTrainingSpec as IncrementalTrainingSpec,
)
from interfaces.tasks.specs import (
    InferenceSpec as InferenceSpec,
)
from interfaces.tasks.specs import (
    ModelRef as ModelRef,
)
from interfaces.tasks.specs import (
    Placement as Placement,
)
from interfaces.tasks.specs import (
    RetryPolicy as RetryPolicy,
)
from interfaces.tasks.specs import (
    SplitInferenceSpec as SplitInferenceSpec,
)
from interfaces.tasks.specs import (
    TaskTypeInfo as TaskTypeInfo,
)
from interfaces.tasks.specs import (
    TensorName as TensorName,
)
from interfaces.tasks.specs import (
    TrainingOutput as TrainingOutput,
)
from interfaces.tasks.states import (
    FL_KEY_EVENT as FL_KEY_EVENT,
)
from interfaces.tasks.states import (
    FL_REVEAL_EVENT as FL_REVEAL_EVENT,
    FL_EVALUATION_EVENT as FL_EVALUATION_EVENT,
)
from interfaces.tasks.states import (
    FL_UPDATE_EVENT as FL_UPDATE_EVENT,
)
from interfaces.tasks.states import (
    MAX_CHUNK_OUTPUT_BYTES as MAX_CHUNK_OUTPUT_BYTES,
)
from interfaces.tasks.states import (
    MAX_HEAD_BYTES as MAX_HEAD_BYTES,
)
from interfaces.tasks.states import (
    MAX_TRAINING_STEPS as MAX_TRAINING_STEPS,
)
from interfaces.tasks.states import (
    MAX_WORKERS_PER_TARGET as MAX_WORKERS_PER_TARGET,
)
from interfaces.tasks.states import (
    TASK_ACTIVE as TASK_ACTIVE,
)
from interfaces.tasks.states import (
    TASK_EVENTS as TASK_EVENTS,
)
from interfaces.tasks.states import (
    TASK_FINAL as TASK_FINAL,
)
from interfaces.tasks.states import (
    TASK_LOG_EVENT as TASK_LOG_EVENT,
)
from interfaces.tasks.states import (
    TASK_METRICS_EVENT as TASK_METRICS_EVENT,
)
from interfaces.tasks.states import (
    TASK_OUTPUT_EVENT as TASK_OUTPUT_EVENT,
)
from interfaces.tasks.states import (
    TASK_TRANSITIONS as TASK_TRANSITIONS,
)
from interfaces.tasks.states import (
    TASK_WORKER_EVENT as TASK_WORKER_EVENT,
)
from interfaces.tasks.states import (
    WORKER_ACTIVE as WORKER_ACTIVE,
)
from interfaces.tasks.states import (
    WORKER_FAILURES as WORKER_FAILURES,
)
from interfaces.tasks.states import (
    WORKER_FINAL as WORKER_FINAL,
)
from interfaces.tasks.states import (
    WORKER_TRANSITIONS as WORKER_TRANSITIONS,
)
from interfaces.tasks.states import (
    ChunkIndex as ChunkIndex,
)
from interfaces.tasks.states import (
    Id as Id,
)
from interfaces.tasks.states import (
    IllegalTaskTransition as IllegalTaskTransition,
)
from interfaces.tasks.states import (
    MetricName as MetricName,
)
from interfaces.tasks.states import (
    PublicKey as PublicKey,
)
from interfaces.tasks.states import (
    TaskAction as TaskAction,
)
from interfaces.tasks.states import (
    TaskState as TaskState,
)
from interfaces.tasks.states import (
    TaskType as TaskType,
)
from interfaces.tasks.states import (
    WorkerState as WorkerState,
)
from interfaces.tasks.states import (
    worker_path as worker_path,
)
from interfaces.tasks.wire import (
    ORDER_ADAPTER as ORDER_ADAPTER,
)
from interfaces.tasks.wire import (
    ORDER_VARIANTS as ORDER_VARIANTS,
)
from interfaces.tasks.wire import (
    BatchInferenceOrder as BatchInferenceOrder,
)
from interfaces.tasks.wire import (
    FederatedTrainingOrder as FederatedTrainingOrder,
)
from interfaces.tasks.wire import (
    FlKey as FlKey,
)
from interfaces.tasks.wire import (
    FlOrder as FlOrder,
)
from interfaces.tasks.wire import (
    FlReveal as FlReveal,
    FlEvaluation as FlEvaluation,
    FlEvaluationOrder as FlEvaluationOrder,
    FlExportOrder as FlExportOrder,
    FlScore as FlScore,
    EVALUATED_GLOBAL as EVALUATED_GLOBAL,
)
from interfaces.tasks.wire import (
    FlUpdate as FlUpdate,
)
from interfaces.tasks.wire import (
    IncrementalTrainingOrder as IncrementalTrainingOrder,
)
from interfaces.tasks.wire import (
    InferenceOrder as InferenceOrder,
)
from interfaces.tasks.wire import (
    InputRef as InputRef,
)
from interfaces.tasks.wire import (
    KindReport as KindReport,
)
from interfaces.tasks.wire import (
    LogLine as LogLine,
)
from interfaces.tasks.wire import (
    SplitInferenceOrder as SplitInferenceOrder,
)
from interfaces.tasks.wire import (
    SplitOrder as SplitOrder,
)
from interfaces.tasks.wire import (
    SplitPart as SplitPart,
)
from interfaces.tasks.wire import (
    TaskReportData as TaskReportData,
)
from interfaces.tasks.wire import (
    TrainingOrder as TrainingOrder,
)
from interfaces.tasks.wire import (
    WorkerAction as WorkerAction,
)
from interfaces.tasks.wire import (
    WorkerLog as WorkerLog,
)
from interfaces.tasks.wire import (
    WorkerMetrics as WorkerMetrics,
)
from interfaces.tasks.wire import (
    WorkerOrder as WorkerOrder,
)
from interfaces.tasks.wire import (
    WorkerOutput as WorkerOutput,
)
from interfaces.tasks.wire import (
    WorkerReport as WorkerReport,
)
from interfaces.tasks.wire import (
    worker_order as worker_order,
)
