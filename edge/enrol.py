"""Enrolment: trade a CSR and the one-time bootstrap token for a node certificate (DESIGN §4.1, §6).

Errors::

    EnrolmentError            the hub refused (4xx problem+json) or answered nonsense; ``code``, ``detail``
     └── HubUnreachable       connection errors or 5xx on every attempt
"""

from __future__ import annotations

import asyncio
import logging
import random

import httpx
from pydantic import ValidationError

from interfaces import API_PREFIX
from interfaces.errors import PROBLEM_MEDIA_TYPE, ErrorCode
from interfaces.nodes import CertificateIssued, CertificateRequest

log = logging.getLogger("aisynergy.edge")

HUB_UNREACHABLE = ErrorCode.HUB_UNREACHABLE.value
INVALID_RESPONSE = ErrorCode.INVALID_RESPONSE.value


class EnrolmentError(Exception):
    """The hub did not issue a certificate."""

    def __init__(self, code: str, detail: str, status: int | None = None) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail
        self.status = status


class HubUnreachable(EnrolmentError):
    """Every attempt failed with a connection error or a 5xx answer."""


def certificate_url(hub_url: str, node_id: str) -> str:
    return f"{hub_url.rstrip('/')}{API_PREFIX}/nodes/{node_id}/certificate"


def _refusal(response: httpx.Response) -> EnrolmentError:
    """Map a problem+json answer (or anything else) to an :class:`EnrolmentError`."""
    code, detail = f"http_{response.status_code}", response.reason_phrase
    try:
        problem = response.json()
    except ValueError:
        problem = None
    if isinstance(problem, dict):
        code = str(problem.get("code") or code)
        detail = str(problem.get("detail") or problem.get("title") or detail)
    elif PROBLEM_MEDIA_TYPE not in response.headers.get("content-type", ""):
        detail = f"{detail} (not a problem document)"
    if response.status_code == 404 and code == f"http_{response.status_code}":
        code = ErrorCode.NOT_FOUND.value
    return EnrolmentError(code, detail, response.status_code)


async def request_certificate(
    hub_url: str,
    node_id: str,
    csr_pem: str,
    bootstrap_token: str,
    *,
    attempts: int = 8,
    max_delay_s: float = 30.0,
    transport: httpx.AsyncBaseTransport | None = None,
    verify: str | bool = True,
) -> CertificateIssued:
    """POST the CSR; retry connection errors and 5xx with jittered back-off, never 4xx."""
    url = certificate_url(hub_url, node_id)
    body = CertificateRequest(csr_pem=csr_pem, bootstrap_token=bootstrap_token).model_dump(mode="json")
    last = "no attempt made"
    async with httpx.AsyncClient(transport=transport, verify=verify, timeout=15.0) as client:
        for attempt in range(1, attempts + 1):
            log.info("requesting a certificate for %s from %s (attempt %s of %s)", node_id, url, attempt, attempts)
            try:
                response = await client.post(url, json=body)
            except httpx.TransportError as exc:
                last = f"{type(exc).__name__}: {exc}"
            else:
                if response.status_code < 300:
                    return _issued(response, node_id)
                if response.status_code < 500:
                    raise _refusal(response)
                last = str(_refusal(response))
            if attempt < attempts:
                delay = random.uniform(0, min(max_delay_s, 1.5 ** min(10, attempt)))
                log.warning("hub not reachable (%s); retrying in %.1f s", last, delay)
                await asyncio.sleep(delay)
    raise HubUnreachable(HUB_UNREACHABLE, f"{url}: {last}")


def _issued(response: httpx.Response, node_id: str) -> CertificateIssued:
    try:
        issued = CertificateIssued.model_validate_json(response.content)
    except ValidationError as exc:
        raise EnrolmentError(
            INVALID_RESPONSE, f"the hub's answer is not a CertificateIssued: {exc}", response.status_code
        ) from exc
    if issued.node_id != node_id:
        raise EnrolmentError(INVALID_RESPONSE, f"the hub issued a certificate for {issued.node_id!r}, not {node_id!r}")
    log.info("certificate issued for %s (serial %s, valid until %s)", node_id, issued.serial, issued.not_after)
    if issued.signing_key_pem is None:
        log.warning("the hub sent no signing key with the certificate; the agent fetches it from the hub when it starts")
    return issued
