"""How the hub's answers to a certificate request map to EnrolmentError, and which are retried."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from edge.enrol import EnrolmentError, HubUnreachable, request_certificate

CSR = "-----BEGIN CERTIFICATE REQUEST-----\n" + "A" * 64 + "\n-----END CERTIFICATE REQUEST-----\n"
TOKEN = "t" * 32


def _problem(status: int, code: str, detail: str) -> httpx.Response:
    body = {"type": f"urn:aisynergy:error:{code}", "title": code, "status": status, "code": code, "detail": detail}
    return httpx.Response(status, json=body, headers={"content-type": "application/problem+json"})


def _enrol(handler, attempts: int = 3):  # type: ignore[no-untyped-def]
    return asyncio.run(
        request_certificate(
            "http://hub",
            "nd-0001",
            CSR,
            TOKEN,
            attempts=attempts,
            max_delay_s=0,
            transport=httpx.MockTransport(handler),
        )
    )


@pytest.mark.parametrize(
    ("status", "code"),
    [(401, "bootstrap_token_invalid"), (410, "bootstrap_token_expired"), (409, "bootstrap_token_used"),
     (410, "node_deleted"), (404, "not_found"), (422, "csr_invalid")],
)  # fmt: skip
def test_a_refusal_is_typed_and_never_retried(status: int, code: str) -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return _problem(status, code, f"because {code}")

    with pytest.raises(EnrolmentError) as caught:
        _enrol(handler)

    assert (caught.value.code, caught.value.detail, caught.value.status) == (code, f"because {code}", status)
    assert not isinstance(caught.value, HubUnreachable)
    assert len(seen) == 1
    assert seen[0].url.path == "/api/v1/nodes/nd-0001/certificate"
    assert json.loads(seen[0].content) == {"csr_pem": CSR, "bootstrap_token": TOKEN}


def test_a_plain_404_without_problem_document_is_not_found() -> None:
    with pytest.raises(EnrolmentError) as caught:
        _enrol(lambda request: httpx.Response(404, text="nope"))

    assert caught.value.code == "not_found"


def test_5xx_and_connection_errors_are_retried_then_reported_unreachable() -> None:
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise httpx.ConnectError("refused", request=request)
        return _problem(503, "internal_error", "db down")

    with pytest.raises(HubUnreachable) as caught:
        _enrol(handler, attempts=3)

    assert calls == 3
    assert caught.value.code == "hub_unreachable"
    assert "db down" in caught.value.detail


def test_an_answer_that_is_not_a_certificate_is_refused() -> None:
    with pytest.raises(EnrolmentError) as caught:
        _enrol(lambda request: httpx.Response(201, json={"node_id": "nd-0001"}))

    assert caught.value.code == "invalid_response"


def test_a_certificate_for_another_node_is_refused() -> None:
    issued = {
        "node_id": "nd-0002", "certificate_pem": "c", "ca_pem": "ca", "serial": "01",
        "not_after": "2030-01-01T00:00:00Z", "mqtt_url": "mqtts://broker:8883", "heartbeat_interval_s": 5.0,
    }  # fmt: skip

    with pytest.raises(EnrolmentError) as caught:
        _enrol(lambda request: httpx.Response(201, json=issued))

    assert caught.value.code == "invalid_response"
    assert "nd-0002" in caught.value.detail


def test_cancelling_stops_an_enrolment_waiting_for_the_hub() -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        await asyncio.Event().wait()  # a hub that never answers
        raise AssertionError("unreachable")

    async def enrol_for_a_moment() -> float:
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(
                request_certificate("http://hub", "nd-0001", CSR, TOKEN, transport=httpx.MockTransport(handler)), 0.2
            )
        return time.monotonic() - started

    assert asyncio.run(enrol_for_a_moment()) < 2.0
