"""What the device SDK raises; an embedding application catches :class:`DeviceError` or a branch of it.

The identity and enrolment errors are the agent core's, so the edge agent raises them too (for its node).

::

    DeviceError
     ├── ConfigError              (also a ValueError) a missing or invalid option: device id, broker URL,
     │                            heartbeat interval, a first start without enrol_url and bootstrap_token
     ├── StoredStateError         the data directory holds something unusable
     │    ├── IdentityError       key, certificate or CA missing or inconsistent
     │    │    └── IdentityMismatch   the stored identity belongs to another device (or node) id
     │    └── (event sequence or desired-state file unreadable)
     ├── EnrolmentError           the enrolment endpoint refused (problem+json ``code``, ``detail``, ``status``)
     │    └── EnrolmentUnreachable    connection errors or 5xx on every attempt (the edge's HubUnreachable)
     ├── NotRunning               emit() before start() or after stop()
     └── OutboxFull               too many QoS 1 messages wait for the broker; the event was not queued
"""

from __future__ import annotations


class DeviceError(Exception):
    """Base of everything the device SDK raises on purpose."""


class ConfigError(DeviceError, ValueError):
    """An option is missing or invalid."""


class StoredStateError(DeviceError):
    """A file in the data directory cannot be used."""


class IdentityError(StoredStateError):
    """The stored identity cannot be used."""


class IdentityMismatch(IdentityError):
    """The data directory holds the identity of another device (or, for an edge, of another node)."""


class EnrolmentError(DeviceError):
    """The enrolment endpoint (the device's edge, or the hub) did not issue a certificate."""

    def __init__(self, code: str, detail: str, status: int | None = None) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail
        self.status = status


class EnrolmentUnreachable(EnrolmentError):
    """Every attempt failed with a connection error or a 5xx answer."""


class NotRunning(DeviceError):
    """The device is not started, or already stopped."""


class OutboxFull(DeviceError):
    """The queue of unacknowledged QoS 1 messages is full (the broker has been unreachable for long)."""
