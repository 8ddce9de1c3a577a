"""Enrolment: trade a CSR and the one-time bootstrap token for a device certificate (DESIGN §4.1, §6).

``POST {enrol_url}/api/v1/devices/{device_id}/certificate``. The enrolment URL is normally the device's
edge, which forwards the request to the hub and answers with the broker its devices use; the hub serves
the same path, so a device may also enrol there directly. Refusals are RFC 9457 problem documents and
become :class:`~device.errors.EnrolmentError` with their ``code``; only connection errors and 5xx
answers are retried (:class:`~device.errors.EnrolmentUnreachable` when every attempt failed). The answer
also carries the hub's artefact-signing key (``signing_key_pem``), which the device pins: without it the
device refuses every update.
"""

from __future__ import annotations

import logging
import random
import time

import httpx
from pydantic import ValidationError

from device.errors import EnrolmentError, EnrolmentUnreachable
from device.tls import tls_verify
from interfaces import API_PREFIX
from interfaces.errors import PROBLEM_MEDIA_TYPE, ErrorCode
from interfaces.nodes import CertificateRequest, DeviceCertificateIssued

log = logging.getLogger("aisynergy.device")

UNREACHABLE = "enrolment_unreachable"
INVALID_RESPONSE = "invalid_response"


def certificate_url(enrol_url: str, device_id: str) -> str:
    return f"{enrol_url.rstrip('/')}{API_PREFIX}/devices/{device_id}/certificate"


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


def request_certificate(
    enrol_url: str,
    device_id: str,
    csr_pem: str,
    bootstrap_token: str,
    *,
    attempts: int = 8,
    max_delay_s: float = 30.0,
    transport: httpx.BaseTransport | None = None,
    verify: str | bool = True,
) -> DeviceCertificateIssued:
    """POST the CSR; retry connection errors and 5xx with jittered back-off, never 4xx."""
    url = certificate_url(enrol_url, device_id)
    body = CertificateRequest(csr_pem=csr_pem, bootstrap_token=bootstrap_token).model_dump(mode="json")
    last = "no attempt made"
    with httpx.Client(transport=transport, verify=tls_verify(verify), timeout=15.0) as client:
        for attempt in range(1, attempts + 1):
            log.info("requesting a certificate for %s from %s (attempt %s of %s)", device_id, url, attempt, attempts)
            try:
                response = client.post(url, json=body)
            except httpx.TransportError as exc:
                last = f"{type(exc).__name__}: {exc}"
            else:
                if response.status_code < 300:
                    return _issued(response, device_id)
                if response.status_code < 500:
                    raise _refusal(response)
                last = str(_refusal(response))
            if attempt < attempts:
                delay = random.uniform(0, min(max_delay_s, 1.5 ** min(10, attempt)))
                log.warning("enrolment endpoint not reachable (%s); retrying in %.1f s", last, delay)
                time.sleep(delay)
    raise EnrolmentUnreachable(UNREACHABLE, f"{url}: {last}")


def _issued(response: httpx.Response, device_id: str) -> DeviceCertificateIssued:
    try:
        issued = DeviceCertificateIssued.model_validate_json(response.content)
    except ValidationError as exc:
        raise EnrolmentError(
            INVALID_RESPONSE, f"the answer is not a DeviceCertificateIssued: {exc}", response.status_code
        ) from exc
    if issued.device_id != device_id:
        raise EnrolmentError(
            INVALID_RESPONSE, f"the certificate was issued for {issued.device_id!r}, not {device_id!r}"
        )
    log.info("certificate issued for %s (serial %s, valid until %s)", device_id, issued.serial, issued.not_after)
    if issued.signing_key_pem is None:
        log.warning("the enrolment answer holds no signing key; this device will refuse every update until it re-enrols")
    return issued
