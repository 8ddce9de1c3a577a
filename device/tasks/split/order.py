"""What both roles of a ``split_inference`` worker read of their order: its split part and the cut models in it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from device.tasks.worker import Rejected, Worker
from interfaces.tasks import SplitInferenceOrder, SplitOrder

if TYPE_CHECKING:
    from device.runtime import Runtime

MAX_LATENCIES = 100_000  # latencies kept between two metrics samples


def split_order(worker: Worker) -> SplitOrder:
    split = worker.order_as(SplitInferenceOrder).split
    if split is None:
        raise Rejected("a split_inference order must carry its split part (the cut model)")
    return split


def open_part(worker: Worker, ref: Any, what: str) -> Runtime:
    from device.runtime import open_model

    path = worker.fetch_inputs(ref)
    try:
        return open_model(path, threads=1)
    except Exception as exc:  # noqa: BLE001 - a file that verified but does not load: the hub cut it wrong
        raise Rejected(f"the {what} does not load: {exc}") from None
