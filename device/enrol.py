"""Enrolment, for either tier: trade a CSR and the one-time bootstrap token for a certificate (DESIGN §4.1, §6).

A device posts to ``{enrol_url}/api/v1/devices/{device_id}/certificate``: the enrolment URL is normally the
device's edge, which forwards the request to the hub and answers with the broker its devices use; the hub
serves the same path, so a device may also enrol there directly. A node posts to
``{hub_url}/api/v1/nodes/{node_id}/certificate`` (``edge.enrol``). Refusals are RFC 9457 problem documents
and become :class:`~device.errors.EnrolmentError` with their ``code``; only connection errors and 5xx answers
are retried, with the agents' back-off (:func:`interfaces.reconnect.reconnect_delay`), and
:class:`~device.errors.EnrolmentUnreachable` is raised when every attempt failed. The answer also carries the
hub's artefact-signing key (``signing_key_pem``), which the agent pins.

What a tier differs in is an :class:`EnrolmentTier`; the request, the retry decisions and the reading of
answers are one :class:`Enrolling`, which does no I/O. Two faces drive it, each only the loop (wait, send,
judge): :func:`enrol` with a blocking ``httpx.Client`` for the device, whose SDK is synchronous and never
loads asyncio, and :func:`enrol_async` with an ``httpx.AsyncClient`` for the edge, which runs in asyncio. The
edge does not run the blocking face in a thread (``asyncio.to_thread``) instead: a thread cannot be
cancelled, so an edge stopped while the hub is away would wait out its remaining attempts (minutes of
back-off and 15 s timeouts) before it exits, where an awaited face stops at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic, TypedDict, TypeVar, Unpack

import httpx
from pydantic import ValidationError

from device.errors import EnrolmentError, EnrolmentUnreachable
from device.tls import tls_verify
from interfaces import API_PREFIX
from interfaces.errors import PROBLEM_MEDIA_TYPE, ErrorCode
from interfaces.nodes import CertificateIssued, CertificateRequest, DeviceCertificateIssued
from interfaces.reconnect import reconnect_delay

log = logging.getLogger("aisynergy.device")

UNREACHABLE = "enrolment_unreachable"
INVALID_RESPONSE = ErrorCode.INVALID_RESPONSE.value
TIMEOUT_S = 15.0

C = TypeVar("C", CertificateIssued, DeviceCertificateIssued)  # the model of the issued certificate


@dataclass(frozen=True)
class EnrolmentTier(Generic[C]):
    """What one tier's enrolment differs in."""

    collection: str  # the REST collection of the agents of this tier: "devices", "nodes"
    answer: type[C]  # the model of the endpoint's answer
    owner_field: str  # the answer's field naming whom the certificate is for
    unreachable_code: str  # the code of EnrolmentUnreachable when every attempt failed
    without_signing_key: str  # what it means when the answer holds no signing key (logged as a warning)

    def certificate_url(self, base_url: str, owner_id: str) -> str:
        return f"{base_url.rstrip('/')}{API_PREFIX}/{self.collection}/{owner_id}/certificate"


DEVICE = EnrolmentTier(
    "devices",
    DeviceCertificateIssued,
    "device_id",
    UNREACHABLE,
    "the enrolment answer holds no signing key; this device will refuse every update until it re-enrols",
)


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


class Retry(TypedDict, total=False):
    """How an enrolment retries, and what it trusts; every key is optional."""

    attempts: int  # POSTs at most (default 8)
    max_delay_s: float  # the cap of the back-off between them (default 30)
    verify: str | bool  # a CA bundle, or False; default: the system's CAs


class Enrolling(Generic[C]):
    """One agent's certificate request and the retry loop's decisions, without I/O: what both faces drive."""

    def __init__(
        self,
        tier: EnrolmentTier[C],
        base_url: str,
        owner_id: str,
        csr_pem: str,
        bootstrap_token: str,
        *,
        attempts: int = 8,
        max_delay_s: float = 30.0,
        verify: str | bool = True,
    ) -> None:
        self.tier = tier
        self.owner_id = owner_id
        self.url = tier.certificate_url(base_url, owner_id)
        self.body = CertificateRequest(csr_pem=csr_pem, bootstrap_token=bootstrap_token).model_dump(mode="json")
        self.attempts = attempts
        self.max_delay_s = max_delay_s
        self.verify = verify
        self.attempt = 0
        self.last = "no attempt made"

    def delays(self) -> Iterator[float]:
        """Seconds to wait before each attempt: none before the first, jittered back-off before the others."""
        for attempt in range(1, self.attempts + 1):
            delay = 0.0
            if attempt > 1:
                delay = reconnect_delay(attempt - 1, self.max_delay_s)
                log.warning("enrolment endpoint not reachable (%s); retrying in %.1f s", self.last, delay)
            self.attempt = attempt
            yield delay

    def request(self, client: httpx.Client | httpx.AsyncClient) -> httpx.Request:
        """The POST of this attempt (built by ``client``, so that its timeout applies)."""
        log.info(
            "requesting a certificate for %s from %s (attempt %s of %s)",
            self.owner_id,
            self.url,
            self.attempt,
            self.attempts,
        )
        return client.build_request("POST", self.url, json=self.body)

    def failed(self, exc: httpx.TransportError) -> None:
        """The attempt got no answer; it is retried."""
        self.last = f"{type(exc).__name__}: {exc}"

    def answered(self, response: httpx.Response) -> C | None:
        """The issued certificate; ``None`` for a 5xx (retried); raises :class:`EnrolmentError` for a refusal
        (never retried) or an answer that is not a certificate for us."""
        if response.status_code < 300:
            return self._issued(response)
        refusal = _refusal(response)
        if response.status_code < 500:
            raise refusal
        self.last = str(refusal)
        return None

    def unreachable(self) -> EnrolmentUnreachable:
        """What to raise when every attempt failed."""
        return EnrolmentUnreachable(self.tier.unreachable_code, f"{self.url}: {self.last}")

    def _issued(self, response: httpx.Response) -> C:
        try:
            issued = self.tier.answer.model_validate_json(response.content)
        except ValidationError as exc:
            raise EnrolmentError(
                INVALID_RESPONSE, f"the answer is not a {self.tier.answer.__name__}: {exc}", response.status_code
            ) from exc
        issued_to = getattr(issued, self.tier.owner_field)
        if issued_to != self.owner_id:
            raise EnrolmentError(
                INVALID_RESPONSE, f"the certificate was issued for {issued_to!r}, not {self.owner_id!r}"
            )
        log.info("certificate issued for %s (serial %s, valid until %s)", issued_to, issued.serial, issued.not_after)
        if issued.signing_key_pem is None:
            log.warning("%s", self.tier.without_signing_key)
        return issued


def enrol(enrolling: Enrolling[C], transport: httpx.BaseTransport | None = None) -> C:
    """POST the CSR, blocking; retry connection errors and 5xx with jittered back-off, never 4xx."""
    with httpx.Client(transport=transport, verify=tls_verify(enrolling.verify), timeout=TIMEOUT_S) as client:
        for delay in enrolling.delays():
            time.sleep(delay)
            try:
                response = client.send(enrolling.request(client))
            except httpx.TransportError as exc:
                enrolling.failed(exc)
            else:
                if (issued := enrolling.answered(response)) is not None:
                    return issued
    raise enrolling.unreachable()


async def enrol_async(enrolling: Enrolling[C], transport: httpx.AsyncBaseTransport | None = None) -> C:
    """:func:`enrol` for an event loop: the waits and the requests are awaited, and cancelling stops them."""
    import asyncio  # here, so that a device, which never awaits, does not load it

    async with httpx.AsyncClient(transport=transport, verify=tls_verify(enrolling.verify), timeout=TIMEOUT_S) as client:
        for delay in enrolling.delays():
            await asyncio.sleep(delay)
            try:
                response = await client.send(enrolling.request(client))
            except httpx.TransportError as exc:
                enrolling.failed(exc)
            else:
                if (issued := enrolling.answered(response)) is not None:
                    return issued
    raise enrolling.unreachable()


def request_certificate(
    enrol_url: str,
    device_id: str,
    csr_pem: str,
    bootstrap_token: str,
    *,
    transport: httpx.BaseTransport | None = None,
    **retry: Unpack[Retry],
) -> DeviceCertificateIssued:
    """The device's enrolment: :func:`enrol` for the device tier, at ``enrol_url``."""
    return enrol(Enrolling(DEVICE, enrol_url, device_id, csr_pem, bootstrap_token, **retry), transport)
