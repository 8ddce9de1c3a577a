"""The ``batch_inference`` worker program (``BatchInferenceSpec``): a model over the rows of a dataset, chunk by chunk.

The model must be loaded here (name, and version if given) and take one input: ``input_name``, or its
only input; otherwise the order is REJECTED. The dataset is fetched (verified against the hub's key),
then each chunk the order owns and that is not done yet runs in index order through
:meth:`~device.ota.models.ModelHost.infer`; its outputs leave as one ``WorkerOutput`` (a safetensors frame,
one tensor per model output, first axis = the chunk's rows). Pause and stop take effect between chunks.
When every owned chunk is done the worker stays RUNNING, waiting: the hub may give it more chunks, and
ends it by withdrawing the order. Inputs that do not fit the model FAIL the worker with the runtime's
message; outputs too big for one message FAIL it with the advice to lower ``chunk_size``.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING

from device.tasks.datasets import Dataset, open_dataset
from device.tasks.programs import require_model
from device.tasks.worker import Failed, Rejected, Worker
from interfaces.tasks import BatchInferenceSpec

if TYPE_CHECKING:
    import numpy as np

    from device.ota.models import LoadedModel

RECENT_CHUNKS = 10  # chunk_ms is the mean of this many last chunks


def run(worker: Worker) -> None:
    spec = worker.spec(BatchInferenceSpec)
    order = worker.order
    if order.inputs is None or order.items is None:
        raise Rejected("a batch_inference order must name its inputs and their number of items")
    model = require_model(worker.models, spec.model)
    feed = _input_of(model, spec.input_name)
    worker.log(f"model {model.name} {model.version} loaded; feeding input {feed}")
    progress = _Progress()
    worker.metrics_source(progress.sample)
    worker.running()
    manifest = order.inputs.signed_manifest.manifest
    path = worker.fetch_inputs(order.inputs)
    dataset = open_dataset(path, manifest.format, spec.input_name, feed)
    try:
        worker.log(f"inputs {order.inputs.artifact_id}: {dataset.describe()}")
        if dataset.rows != order.items:
            raise Failed(f"the dataset has {dataset.rows} rows; the order counts {order.items}")
        _work(worker, model.name, feed, dataset, progress, spec.chunk_size)
    finally:
        dataset.close()


def _work(worker: Worker, model: str, feed: str, dataset: Dataset, progress: _Progress, default_chunk_size: int) -> None:
    """Every owned chunk not done yet, in index order, until stopped (a new order may add or take chunks)."""
    done: set[int] = set()
    seen, todo = None, deque[int]()
    waiting = False
    while worker.checkpoint():
        order = worker.order
        if order is not seen:  # the order changed: what is left to do, again
            seen, todo = order, deque(i for i in sorted(set(order.chunk_indices())) if i not in done)
            if order.chunk_size is None:
                order = order.model_copy(update={"chunk_size": default_chunk_size})
            bounds = order.chunk_bounds
        if not todo:
            if not waiting:
                worker.log(f"done: {len(done)} chunks, {worker.items_done} inputs; waiting for more chunks")
                worker.report_now()
                waiting = True
            worker.wait()
            continue
        waiting = False
        index = todo.popleft()
        start, end = bounds(index)
        if start >= end:
            raise Failed(f"chunk {index} lies beyond the {order.items} inputs")
        started = time.perf_counter()
        try:
            result = worker.models.infer({feed: dataset.read(start, end)}, model)
        except Exception as exc:  # inputs that do not fit the model: the runtime says why
            raise Failed(f"chunk {index} (rows {start}–{end - 1}): {type(exc).__name__}: {exc}") from exc
        seconds = time.perf_counter() - started
        worker.output(index, end - start, _frame(result.outputs, index, end - start))
        done.add(index)
        worker.items_done += end - start
        progress.chunk(end - start, seconds)
        worker.log(f"chunk {index}: rows {start}–{end - 1}, {seconds * 1000:.1f} ms")


def _input_of(model: LoadedModel, name: str | None) -> str:
    names = [t.name for t in model.inputs]
    if len(names) != 1:
        raise Rejected(f"batch inference feeds one input; {model.name} {model.version} takes {names}")
    if name is not None and name != names[0]:
        raise Rejected(f"{model.name} {model.version} has no input {name!r} (its input is {names[0]!r})")
    return names[0]


def _frame(outputs: dict[str, np.ndarray], chunk: int, rows: int) -> bytes:
    import numpy as np
    from safetensors.numpy import save

    for name, value in outputs.items():
        if value.ndim == 0 or value.shape[0] != rows:
            raise Failed(f"chunk {chunk}: output {name} has shape {list(value.shape)}, not one row per input ({rows})")
    return save({name: np.ascontiguousarray(value) for name, value in outputs.items()})


class _Progress:
    """Counts for the metrics samples (written by the worker, read by the host's ticker)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items = self._chunks = 0
        self._recent: deque[float] = deque(maxlen=RECENT_CHUNKS)
        self._last_at, self._last_items = time.monotonic(), 0

    def chunk(self, items: int, seconds: float) -> None:
        with self._lock:
            self._items += items
            self._chunks += 1
            self._recent.append(seconds)

    def sample(self) -> dict[str, float]:
        with self._lock:
            now = time.monotonic()
            rate = (self._items - self._last_items) / max(now - self._last_at, 1e-9)
            self._last_at, self._last_items = now, self._items
            values = {"items_done": self._items, "chunks_done": self._chunks, "items_per_s": rate}
            if self._recent:
                values["chunk_ms"] = 1000 * sum(self._recent) / len(self._recent)
            return values
