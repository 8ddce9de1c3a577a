"""Malformed messages an agent drops (DESIGN §6), the same at both tiers: each one counted, logged and answered
with a ``message_rejected`` event (:func:`interfaces.messages.rejection_event`) that the caller sends on its
``events`` channel (a device to its edge; an edge node to the hub)."""

from __future__ import annotations

import logging
import threading
from typing import Any

from pydantic import ValidationError

from interfaces.messages import EventBody, rejection_event


class Rejections:
    """The count of dropped messages of one agent (or one part of it) and the events that answer them."""

    def __init__(self, logger: logging.Logger) -> None:
        self._log = logger
        self._lock = threading.Lock()
        self._total = 0

    @property
    def total(self) -> int:
        with self._lock:
            return self._total

    def count(self) -> int:
        """Count one dropped message that is answered otherwise (a malformed command gets a failed result)."""
        with self._lock:
            self._total += 1
            return self._total

    def reject(self, topic: str, reason: ValidationError | ValueError | str, payload: bytes = b"", **data: Any) -> EventBody:
        """Count one dropped message on ``topic`` and return the event that says why."""
        total = self.count()
        if isinstance(reason, ValidationError):
            summary = f"{reason.error_count()} errors: {str(reason).splitlines()[1] if reason.error_count() else ''}"
        else:
            summary = str(reason).splitlines()[0] if str(reason) else type(reason).__name__
        self._log.warning("rejected a malformed message on %s: %s", topic, summary)
        if payload:
            self._log.debug("malformed payload: %r", payload[:1024])
        return rejection_event(topic, reason, total, **data)
