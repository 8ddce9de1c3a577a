"""The node's identity on disk: the agent core's identity store (:mod:`device.identity`) for the node tier.

The files are those of a device with ``node`` for ``device`` (``identity/node.key``, ``identity/node.crt``,
``identity/ca.crt``, ``identity/signing.pub``, ``enrolment.json``); the record holds the node id and the hub
it enrolled with. Errors are the core's (:mod:`device.errors`)::

    IdentityError             the stored identity is unusable (missing file, key and certificate disagree)
     └── IdentityMismatch     the stored identity belongs to another node id
"""

from __future__ import annotations

from device.errors import IdentityError, IdentityMismatch
from device.identity import AgentIdentityStore, EnrolmentRecord

__all__ = ["Enrolment", "IdentityError", "IdentityMismatch", "IdentityStore"]


class Enrolment(EnrolmentRecord):
    """What the agent keeps from the hub's answer: its node id and the hub it enrolled with."""

    tier = "node"
    owner_field = "node_id"
    url_field = "hub_url"

    node_id: str
    hub_url: str


class IdentityStore(AgentIdentityStore[Enrolment]):
    """The node's identity kept in ``data_dir``."""

    record = Enrolment
