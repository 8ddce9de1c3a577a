"""The edge's end of the ``infer`` channel (``interfaces.infer``): requests from its devices to the tail workers.

The router subscribes to ``synergy/v1/devices/+/infer`` on the devices' link (the broker's ACL lets the edge read
only its own devices' topics). A request names its task in its user properties; the ``tail`` worker of that
task (:mod:`device.tasks.split`) registered an answer function with :meth:`TailRouter.serve`. The answer is
computed on a small thread pool, so the link's dispatch never waits for a model, and goes to the requesting
device's ``infer/reply`` (that device's topic, whatever response topic the request named) with the request's
correlation data. Only a device that runs a head of the task is answered: the hub's orders say which (the
``tasks`` of each device's desired document, relayed by this edge: :meth:`TailRouter.learn_orders`); any other
device's request is refused without reaching the tail, so a device cannot use another's task, nor learn which
tasks this edge serves. Such a request, one for a task this edge serves no tail of, a malformed one, or one
beyond ``max_pending`` waiting is answered at once with an error, so the device falls back without waiting out
its timeout; one without correlation data cannot be answered and is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import aiomqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from edge.link import Link
from interfaces.infer import MAX_CORRELATION_BYTES, MAX_FRAME_BYTES, InferReply, InferRequest
from interfaces.tasks import SPLIT_HEAD, TaskType, WorkerAction, WorkerOrder
from interfaces.topics import DEVICE_INFER, DEVICE_INFER_REPLY

log = logging.getLogger("aisynergy.edge.split")

Answer = Callable[[InferRequest, bytes], tuple[InferReply, bytes]]
"""A tail worker's answer function (runs on the router's threads)."""
DEFAULT_THREADS = 2
DEFAULT_MAX_PENDING = 256


class TailRouter:
    """Routes the devices' ``infer`` requests to the tail workers; see the module docstring."""

    def __init__(self, threads: int = DEFAULT_THREADS, max_pending: int = DEFAULT_MAX_PENDING) -> None:
        self._lock = threading.Lock()
        self._answers: dict[str, Answer] = {}
        self._heads: dict[str, frozenset[str]] = {}  # device id -> the split tasks it runs a head of
        self._threads, self._max_pending = threads, max_pending
        self._pool: ThreadPoolExecutor | None = None
        self._link: Link | None = None
        self._pending = 0
        self._running: set[asyncio.Task[None]] = set()
        self.counters = {"requests": 0, "answered": 0, "refused": 0, "dropped": 0}

    def attach(self, link: Link) -> None:
        """Take the devices' requests from ``link`` (the downstream link)."""
        self._link = link
        link.route(DEVICE_INFER, self._on_request)

    # ---- the tail workers' side (their threads) ----------------------------------------------------
    def serve(self, task_id: str, answer: Answer) -> None:
        with self._lock:
            if task_id in self._answers and self._answers[task_id] != answer:
                raise ValueError(f"task {task_id} already has a tail on this edge")
            self._answers[task_id] = answer

    def unserve(self, task_id: str, answer: Answer) -> None:
        with self._lock:
            if self._answers.get(task_id) == answer:
                del self._answers[task_id]

    def serving(self) -> list[str]:
        with self._lock:
            return sorted(self._answers)

    # ---- the hub's orders (the relay, on the event loop) ---------------------------------------------
    def learn_orders(self, device_id: str, orders: list[WorkerOrder]) -> None:
        """The task orders of ``device_id``'s newest desired document (empty: none, or the device is gone): from
        now on it is answered for exactly the split tasks it is ordered to run a head of."""
        heads = frozenset(o.task_id for o in orders if o.type is TaskType.SPLIT_INFERENCE and o.role == SPLIT_HEAD and o.action is WorkerAction.RUN)
        with self._lock:
            if heads:
                self._heads[device_id] = heads
            else:
                self._heads.pop(device_id, None)

    def runs_head(self, device_id: str, task_id: str) -> bool:
        with self._lock:
            return task_id in self._heads.get(device_id, ())

    # ---- the link's side (the event loop) ----------------------------------------------------------
    async def _on_request(self, client: aiomqtt.Client, message: aiomqtt.Message, ids: dict[str, str]) -> None:
        self.counters["requests"] += 1
        props = message.properties
        correlation = getattr(props, "CorrelationData", None) if props is not None else None
        if not isinstance(correlation, bytes) or not 0 < len(correlation) <= MAX_CORRELATION_BYTES:
            self.counters["dropped"] += 1
            log.warning("dropped an infer request from %s without usable correlation data", ids["device_id"])
            return
        reply_topic = DEVICE_INFER_REPLY.topic(device_id=ids["device_id"])
        try:
            request = InferRequest.from_pairs(getattr(props, "UserProperty", None))
        except ValueError as exc:
            await self._refuse(reply_topic, correlation, str(exc))
            return
        if len(message.payload or b"") > MAX_FRAME_BYTES:  # type: ignore[arg-type]
            await self._refuse(reply_topic, correlation, f"a frame of more than {MAX_FRAME_BYTES} bytes")
            return
        if not self.runs_head(ids["device_id"], request.task_id):
            await self._refuse(reply_topic, correlation, f"device {ids['device_id']} runs no head of task {request.task_id}")
            return
        with self._lock:
            answer = self._answers.get(request.task_id)
        if answer is None:
            await self._refuse(reply_topic, correlation, f"this edge runs no tail of task {request.task_id}")
            return
        if self._pending >= self._max_pending:
            await self._refuse(reply_topic, correlation, f"the edge has {self._pending} requests waiting; try the device")
            return
        self._pending += 1
        payload = message.payload if isinstance(message.payload, bytes) else bytes(message.payload or b"")  # type: ignore[arg-type]
        task = asyncio.create_task(self._answer(answer, request, payload, reply_topic, correlation))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _answer(self, answer: Answer, request: InferRequest, payload: bytes, topic: str, correlation: bytes) -> None:
        try:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="aisynergy-tail")
            try:
                reply, data = await asyncio.get_running_loop().run_in_executor(self._pool, answer, request, payload)
            except Exception as exc:  # a tail's bug: the device is told, and falls back
                log.exception("the tail of task %s failed", request.task_id)
                reply, data = InferReply(status="error", error=f"{type(exc).__name__}: {exc}"[:500]), b""
            await self._send(topic, correlation, reply, data)
            self.counters["answered"] += 1
        finally:
            self._pending -= 1

    async def _refuse(self, topic: str, correlation: bytes, why: str) -> None:
        self.counters["refused"] += 1
        log.debug("refused an infer request on %s: %s", topic, why)
        await self._send(topic, correlation, InferReply(status="error", error=why[:500]), b"")

    async def _send(self, topic: str, correlation: bytes, reply: InferReply, data: bytes) -> None:
        assert self._link is not None
        props = Properties(PacketTypes.PUBLISH)
        props.CorrelationData = correlation
        props.UserProperty = reply.pairs()
        try:
            await self._link.publish(topic, data, qos=DEVICE_INFER_REPLY.qos, properties=props)
        except aiomqtt.MqttError as exc:  # the device times out and falls back
            log.warning("could not answer on %s: %s", topic, exc)

    async def close(self) -> None:
        for task in list(self._running):
            task.cancel()
        await asyncio.gather(*self._running, return_exceptions=True)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
