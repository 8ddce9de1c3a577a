"""The device's end of the ``infer`` channel (``interfaces.infer``): one request, one answer, or a timeout.

:meth:`InferChannel.call` publishes a frame on the device's ``infer`` topic (QoS 0, the device's ``infer/reply``
as response topic, fresh correlation data) and waits for the answer that carries the same correlation data; the
agent hands every message on ``infer/reply`` to :meth:`InferChannel.on_reply` (paho's thread). Anything that does
not match a request in flight (late, duplicated, malformed) is dropped and counted. A request the edge does not
answer in time, or answers with an error, raises :class:`SplitUnavailable` (the head runs the whole model then).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from interfaces.infer import MAX_CORRELATION_BYTES, InferReply, InferRequest
from interfaces.topics import DEVICE_INFER, DEVICE_INFER_REPLY

log = logging.getLogger("aisynergy.device.split")

Publish = Callable[[str, bytes, int, Properties], bool]
"""``publish(topic, payload, qos, properties) -> handed to the connection`` (False: not connected)."""


class SplitUnavailable(Exception):
    """The edge did not answer this request: it is not connected, too slow, or said why not."""


class EdgeTimeout(SplitUnavailable):
    pass


class EdgeError(SplitUnavailable):
    pass


class NotConnected(SplitUnavailable):
    pass


@dataclass
class _Waiting:
    done: threading.Event = field(default_factory=threading.Event)
    reply: InferReply | None = None
    payload: bytes = b""


class InferChannel:
    """Requests to the edge's tail workers for one device; see the module docstring."""

    def __init__(self, device_id: str, publish: Publish) -> None:
        self.device_id = device_id
        self.topic = DEVICE_INFER.topic(device_id=device_id)
        self.reply_topic = DEVICE_INFER_REPLY.topic(device_id=device_id)
        self._publish = publish
        self._lock = threading.Lock()
        self._waiting: dict[bytes, _Waiting] = {}
        self.dropped = 0
        """answers that matched no request in flight, or were malformed"""

    def call(self, request: InferRequest, payload: bytes, timeout_s: float) -> tuple[InferReply, bytes]:
        """Send one request and return the edge's answer (status ok); :class:`SplitUnavailable` otherwise."""
        correlation = os.urandom(16)
        props = Properties(PacketTypes.PUBLISH)
        props.ResponseTopic = self.reply_topic
        props.CorrelationData = correlation
        props.UserProperty = request.pairs()
        waiting = _Waiting()
        with self._lock:
            self._waiting[correlation] = waiting
        try:
            if not self._publish(self.topic, payload, DEVICE_INFER.qos, props):
                raise NotConnected("the device is not connected to its broker")
            if not waiting.done.wait(timeout_s):
                raise EdgeTimeout(f"the edge did not answer within {timeout_s * 1000:g} ms")
        finally:
            with self._lock:
                self._waiting.pop(correlation, None)
        assert waiting.reply is not None
        if waiting.reply.status != "ok":
            raise EdgeError(f"the edge could not run it: {waiting.reply.error or 'no reason given'}")
        return waiting.reply, waiting.payload

    def on_reply(self, payload: bytes, properties: Properties | None) -> None:
        """An answer arrived on ``infer/reply`` (paho's thread)."""
        correlation = getattr(properties, "CorrelationData", None) if properties is not None else None
        try:
            if not isinstance(correlation, bytes) or not 0 < len(correlation) <= MAX_CORRELATION_BYTES:
                raise ValueError("no correlation data")
            reply = InferReply.from_pairs(getattr(properties, "UserProperty", None))
        except ValueError as exc:
            self._drop(f"malformed answer: {exc}")
            return
        with self._lock:
            waiting = self._waiting.get(correlation)
            if waiting is None or waiting.done.is_set():
                self.dropped += 1
                log.debug("an answer on %s matched no request in flight (late or repeated)", self.reply_topic)
                return
            waiting.reply, waiting.payload = reply, bytes(payload)
            waiting.done.set()

    def _drop(self, why: str) -> None:
        with self._lock:
            self.dropped += 1
        log.warning("dropped an answer on %s: %s", self.reply_topic, why)
