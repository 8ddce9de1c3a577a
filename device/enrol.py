"""Enrolment, for either tier: trade a CSR and the one-time bootstrap token for a certificate (DESIGN §4.1, §6).

A device posts to ``{enrol_url}/api/v1/devices/{device_id}/certificate``: the enrolment URL is normally the
device's edge, which forwards the request to the hub and answers with the broker its devices use; the hub
serves the same path, so a device may also enrol there directly. A node posts to
``{hub_url}/api/v1/nodes/{node_id}/certificate`` (``edge.enrol``). Refusals are RFC 9457 problem documents
and become :class:`~device.errors.EnrolmentError` with their ``code``; only connection errors and 5xx answers
are retried, with the agents' back-off (:func:`interfaces.reconnect.reconnect_delay`), and
:class:`~device.errors.EnrolmentUnreachable` is raised when every attempt failed. The answer also carries the
hub's artefact-signing key (``signing_key_pem``), which the agent pins.

Trust (DESIGN §6). The agent is given, beside its bootstrap token, the SHA-256 fingerprint of the hub CA
(``ca_sha256``: the hub prints it with every bootstrap token), as ``kubeadm join`` is given
``--discovery-token-ca-cert-hash``. Over HTTPS the agent first fetches the CA from ``{url}/api/v1/ca.crt``
without trusting it, compares its fingerprint with the pin (:data:`CA_PIN_MISMATCH` and nothing sent
otherwise), and then sends its token and CSR only over a connection verified against that CA (and the
system's CAs, for a hub whose operator gave it a certificate from elsewhere); the
answer's ``ca_pem`` must be the same CA. ``server_name`` is the name the server's certificate must carry
when it is not the URL's host: an edge's listener presents its node certificate, whose name is the node id
(as ``tls-server-name`` in a kubeconfig). Without a pin the first answer's CA is trusted as it comes, and
over plain HTTP the token travels in clear: both are logged as warnings.

Renewal (DESIGN §6, :mod:`device.renewal`) is the same exchange from the identity the agent holds: its
certificate and a CSR of the same key, posted to ``.../certificate/renewal`` at the URL it enrolled with, over
a connection verified against the stored CA alone (and the name it stored), whose answer must name that CA
(:class:`Renewing`). No token travels: the CSR's signature proves the key.

What a tier differs in is an :class:`EnrolmentTier`; the request, the retry decisions and the reading of
answers are one :class:`Enrolling`, which does no I/O. Two faces drive it, each only the loop (wait, send,
judge): :func:`enrol` with a blocking ``httpx.Client`` for the device, whose SDK is synchronous and never
loads asyncio, and :func:`enrol_async` with an ``httpx.AsyncClient`` for the edge, which runs in asyncio. The
edge does not run the blocking face in a thread (``asyncio.to_thread``) instead: a thread cannot be
cancelled, so an edge stopped while the hub is away would wait out its remaining attempts (minutes of
back-off and 15 s timeouts) before it exits, where an awaited face stops at once.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import ssl
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic, TypedDict, TypeVar, Unpack
from urllib.parse import urlsplit

import httpx
from pydantic import ValidationError

from device.errors import ConfigError, EnrolmentError, EnrolmentUnreachable
from device.tls import hub_ca_context, server_name_extension, tls_verify
from interfaces import API_PREFIX
from interfaces.errors import PROBLEM_MEDIA_TYPE, ErrorCode
from interfaces.nodes import CertificateIssued, CertificateRenewal, CertificateRequest, DeviceCertificateIssued
from interfaces.reconnect import reconnect_delay

log = logging.getLogger("aisynergy.device")

UNREACHABLE = "enrolment_unreachable"
INVALID_RESPONSE = ErrorCode.INVALID_RESPONSE.value
CA_PIN_MISMATCH = "ca_pin_mismatch"  # the endpoint's CA is not the one the agent was told to trust
TIMEOUT_S = 15.0
CA_PATH = f"{API_PREFIX}/ca.crt"  # the hub CA's certificate (PEM), at the hub and at every edge's listener
_PIN = re.compile(r"^(?:sha256:)?([0-9a-fA-F]{64})$")


def parse_ca_pin(value: str) -> str:
    """A CA fingerprint as given (``sha256:<64 hex>`` or the 64 hex digits alone) -> the lower-case hex digits;
    :class:`~device.errors.ConfigError` for anything else."""
    match = _PIN.match(value.strip())
    if match is None:
        raise ConfigError(f"{value!r} is not a CA fingerprint (sha256:<64 hex digits>)")
    return match.group(1).lower()


def ca_fingerprint(ca_pem: str) -> str:
    """SHA-256 of a PEM certificate's DER encoding, in lower-case hex (what a pin names)."""
    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(ca_pem.strip())).hexdigest()


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

    def renewal_url(self, base_url: str, owner_id: str) -> str:
        return f"{self.certificate_url(base_url, owner_id)}/renewal"


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
    verify: str | bool  # a CA bundle, or False; default: the system's CAs (unused with a pin)
    ca_sha256: str | None  # the hub CA's fingerprint (see the module docstring); None: trust the first answer
    server_name: str | None  # the name in the server's certificate when it is not the URL's host


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
        ca_sha256: str | None = None,
        server_name: str | None = None,
    ) -> None:
        self._start(tier, base_url, owner_id, tier.certificate_url(base_url, owner_id), attempts, max_delay_s)
        self.body = CertificateRequest(csr_pem=csr_pem, bootstrap_token=bootstrap_token).model_dump(mode="json")
        self.verify = verify
        self.pin = parse_ca_pin(ca_sha256) if ca_sha256 is not None else None
        self.server_name = server_name
        if self.pin is None:
            log.warning("no CA fingerprint given: the CA in the enrolment answer is trusted as it comes")
        if not self.https:
            log.warning("enrolling over plain HTTP: the bootstrap token travels in clear (use https://)")

    def _start(self, tier: EnrolmentTier[C], base_url: str, owner_id: str, url: str, attempts: int, max_delay_s: float) -> None:
        self.tier = tier
        self.owner_id = owner_id
        self.url = url
        self.ca_url = f"{base_url.rstrip('/')}{CA_PATH}"
        self.attempts = attempts
        self.max_delay_s = max_delay_s
        self.https = urlsplit(base_url).scheme == "https"
        self.trusted_ca: str | None = None  # the endpoint's CA, once its fingerprint matched the pin
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

    def needs_ca(self) -> bool:
        """Whether this attempt must first fetch the endpoint's CA and check it against the pin."""
        return self.https and self.pin is not None and self.trusted_ca is None

    def ca_request(self, client: httpx.Client | httpx.AsyncClient) -> httpx.Request:
        """The GET of the endpoint's CA, on a connection that trusts nothing yet (``verify=False``)."""
        return client.build_request("GET", self.ca_url)

    def ca_answered(self, response: httpx.Response) -> bool:
        """Keep the CA when it matches the pin; ``False`` for a 5xx (retried); raises :class:`EnrolmentError` for
        a refusal or a CA that is not the pinned one (never retried: nothing from this endpoint is trusted)."""
        if response.status_code >= 500:
            self.last = str(_refusal(response))
            return False
        if response.status_code != 200:
            raise _refusal(response)
        self._check_pin(response.text, f"the CA at {self.ca_url}", "; nothing was sent to it")
        self.trusted_ca = response.text
        return True

    def _check_pin(self, ca_pem: str, what: str, consequence: str = "") -> None:
        """:class:`EnrolmentError` unless ``ca_pem`` is the pinned CA (``what`` names where it came from)."""
        try:
            found = ca_fingerprint(ca_pem)
        except ValueError as exc:
            raise EnrolmentError(INVALID_RESPONSE, f"{what} is not a PEM certificate: {exc}") from None
        if found != self.pin:
            raise EnrolmentError(
                CA_PIN_MISMATCH, f"{what} has the fingerprint sha256:{found}, not the sha256:{self.pin} this agent was given{consequence}"
            )

    def trust(self) -> ssl.SSLContext | str | bool:
        """What the certificate request's connection verifies the server with: the pinned CA alone once it
        is known, else ``verify``."""
        return hub_ca_context(cadata=self.trusted_ca) if self.trusted_ca is not None else tls_verify(self.verify)

    def request(self, client: httpx.Client | httpx.AsyncClient) -> httpx.Request:
        """The POST of this attempt (built by ``client``, so that its timeout applies)."""
        log.info(
            "requesting %s for %s from %s (attempt %s of %s)",
            self.what,
            self.owner_id,
            self.url,
            self.attempt,
            self.attempts,
        )
        return client.build_request("POST", self.url, json=self.body, extensions=server_name_extension(self.server_name))

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

    what = "a certificate"  # in the log line of each attempt

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
        if self.pin is not None:
            self._check_pin(issued.ca_pem, "the answer's CA")
        issued_to = getattr(issued, self.tier.owner_field)
        if issued_to != self.owner_id:
            raise EnrolmentError(
                INVALID_RESPONSE, f"the certificate was issued for {issued_to!r}, not {self.owner_id!r}"
            )
        log.info("certificate issued for %s (serial %s, valid until %s)", issued_to, issued.serial, issued.not_after)
        if issued.signing_key_pem is None:
            log.warning("%s", self.tier.without_signing_key)
        return issued


class Renewing(Enrolling[C]):
    """A renewal from the identity held: ``certificate_pem`` and a CSR of its key, to ``.../certificate/renewal`` at
    ``base_url`` (where the agent enrolled), trusting ``ca_pem`` (the stored CA) alone, and ``server_name``; the
    answer must name that CA. Both faces drive it as they drive an enrolment."""

    what = "the renewal of its certificate"

    def __init__(self, tier: EnrolmentTier[C], base_url: str, owner_id: str, csr_pem: str, certificate_pem: str, ca_pem: str, *,
                 attempts: int = 3, max_delay_s: float = 30.0, server_name: str | None = None) -> None:  # fmt: skip
        self._start(tier, base_url, owner_id, tier.renewal_url(base_url, owner_id), attempts, max_delay_s)
        self.body = CertificateRenewal(certificate_pem=certificate_pem, csr_pem=csr_pem).model_dump(mode="json")
        self.verify = True
        self.pin = ca_fingerprint(ca_pem)
        self.trusted_ca = ca_pem
        self.server_name = server_name


def enrol(enrolling: Enrolling[C], transport: httpx.BaseTransport | None = None) -> C:
    """POST the CSR, blocking; retry connection errors and 5xx with jittered back-off, never 4xx."""
    with contextlib.ExitStack() as stack:
        client: httpx.Client | None = None
        for delay in enrolling.delays():
            time.sleep(delay)
            try:
                if enrolling.needs_ca():
                    with httpx.Client(transport=transport, verify=False, timeout=TIMEOUT_S) as bare:
                        if not enrolling.ca_answered(bare.send(enrolling.ca_request(bare))):
                            continue
                if client is None:
                    client = stack.enter_context(httpx.Client(transport=transport, verify=enrolling.trust(), timeout=TIMEOUT_S))
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

    async with contextlib.AsyncExitStack() as stack:
        client: httpx.AsyncClient | None = None
        for delay in enrolling.delays():
            await asyncio.sleep(delay)
            try:
                if enrolling.needs_ca():
                    async with httpx.AsyncClient(transport=transport, verify=False, timeout=TIMEOUT_S) as bare:
                        if not enrolling.ca_answered(await bare.send(enrolling.ca_request(bare))):
                            continue
                if client is None:
                    client = await stack.enter_async_context(
                        httpx.AsyncClient(transport=transport, verify=enrolling.trust(), timeout=TIMEOUT_S)
                    )
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
