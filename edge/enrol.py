"""Enrolment of the node: trade a CSR and the one-time bootstrap token for a node certificate (DESIGN §4.1, §6).

The agent core's enrolment client (:mod:`device.enrol`), awaited, for the node tier:
``POST {hub_url}/api/v1/nodes/{node_id}/certificate``. Errors are the core's (:mod:`device.errors`)::

    EnrolmentError            the hub refused (4xx problem+json) or answered nonsense; ``code``, ``detail``
     └── HubUnreachable       connection errors or 5xx on every attempt (``EnrolmentUnreachable``, code
                              ``hub_unreachable``)
"""

from __future__ import annotations

from typing import Unpack

import httpx

from device.enrol import Enrolling, EnrolmentTier, Retry, enrol_async
from device.errors import EnrolmentError, EnrolmentUnreachable
from interfaces.errors import ErrorCode
from interfaces.nodes import CertificateIssued

__all__ = ["NODE", "EnrolmentError", "HubUnreachable", "request_certificate"]

HubUnreachable = EnrolmentUnreachable

NODE = EnrolmentTier(
    "nodes",
    CertificateIssued,
    "node_id",
    ErrorCode.HUB_UNREACHABLE.value,
    "the hub sent no signing key with the certificate; the agent fetches it from the hub when it starts",
)


async def request_certificate(
    hub_url: str,
    node_id: str,
    csr_pem: str,
    bootstrap_token: str,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    **retry: Unpack[Retry],
) -> CertificateIssued:
    """The node's enrolment: :func:`device.enrol.enrol_async` for the node tier, at the hub."""
    return await enrol_async(Enrolling(NODE, hub_url, node_id, csr_pem, bootstrap_token, **retry), transport)
