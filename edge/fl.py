"""The edge's end of federated training's ``fl`` channel: its devices' updates to the task's aggregator worker.

The router subscribes to ``synergy/v1/devices/+/fl`` on the devices' link (the broker's ACL lets the edge read only
its own devices). An update must be a valid ``Envelope[FlUpdateBody]`` within the message size limit, and name
exactly the device it came from as its one contributor (a device speaks only for itself); it goes to the
``aggregator`` worker of its task on this node (:mod:`device.tasks.federated`), which registered with
:meth:`FlRouter.serve`. An update for a task this node aggregates nothing of is dropped and counted (the hub's
round closes with k of n without it).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import aiomqtt
from pydantic import ValidationError

from edge.link import Link
from interfaces.messages import MAX_MESSAGE_BYTES
from interfaces.tasks import FlUpdate
from interfaces.topics import DEVICE_FL

log = logging.getLogger("aisynergy.edge.fl")

Offer = Callable[[FlUpdate], None]
"""An aggregator's intake (called on the event loop: it must only store the update and return)."""


class FlRouter:
    """Routes the devices' federated updates to the aggregator workers; see the module docstring."""

    def __init__(self, identity: str) -> None:
        self.identity = identity
        self._lock = threading.Lock()
        self._offers: dict[str, Offer] = {}
        self.counters = {"received": 0, "routed": 0, "dropped": 0, "rejected": 0}

    def attach(self, link: Link) -> None:
        link.route(DEVICE_FL, self._on_update)

    def serve(self, task_id: str, offer: Offer) -> None:
        with self._lock:
            if task_id in self._offers and self._offers[task_id] != offer:
                raise ValueError(f"task {task_id} already has an aggregator on this edge")
            self._offers[task_id] = offer

    def unserve(self, task_id: str, offer: Offer) -> None:
        with self._lock:
            if self._offers.get(task_id) == offer:
                del self._offers[task_id]

    async def _on_update(self, client: aiomqtt.Client, message: aiomqtt.Message, ids: dict[str, str]) -> None:
        self.counters["received"] += 1
        device_id = ids["device_id"]
        payload = message.payload if isinstance(message.payload, bytes) else bytes(message.payload or b"")  # type: ignore[arg-type]
        try:
            if len(payload) > MAX_MESSAGE_BYTES:
                raise ValueError(f"{len(payload)} bytes exceed the {MAX_MESSAGE_BYTES} byte limit")
            update = DEVICE_FL.payload.model_validate_json(payload).body.update
            if update.contributors != [device_id]:
                raise ValueError(f"it names contributors {update.contributors[:5]}, not the device it came from")
        except (ValidationError, ValueError) as exc:
            self.counters["rejected"] += 1
            log.warning("rejected a federated update from %s: %s", device_id, str(exc).splitlines()[0])
            return
        with self._lock:
            offer = self._offers.get(update.task_id)
        if offer is None:
            self.counters["dropped"] += 1
            log.info("dropped %s's update for task %s: this node runs no aggregator of it", device_id, update.task_id)
            return
        offer(update)
        self.counters["routed"] += 1
