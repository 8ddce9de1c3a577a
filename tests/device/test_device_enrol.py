"""Enrolment against a real (local) HTTP server: success, typed refusals, what is retried."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from device.enrol import DEVICE, Enrolling, request_certificate
from device.errors import EnrolmentError, EnrolmentUnreachable
from device.identity import IdentityStore
from tests.device.conftest import EnrolmentServer, free_port

TOKEN = "t" * 32
REPO = Path(__file__).resolve().parents[2]


def _enrol(server_url: str, tmp_path: Path, device_id: str = "dv-0001", attempts: int = 3):  # type: ignore[no-untyped-def]
    csr = IdentityStore(tmp_path).make_csr(device_id)
    return request_certificate(server_url, device_id, csr, TOKEN, attempts=attempts, max_delay_s=0)


def test_a_csr_and_token_are_traded_for_a_certificate(tmp_path: Path, enrolment_server: EnrolmentServer) -> None:
    enrolment_server.tokens["dv-0001"] = TOKEN

    issued = _enrol(enrolment_server.url, tmp_path)
    enrolment = IdentityStore(tmp_path).save(issued, enrolment_server.url)

    assert enrolment_server.requests == ["/api/v1/devices/dv-0001/certificate"]
    assert (enrolment.device_id, enrolment.node_id, enrolment.mqtt_url) == (
        "dv-0001",
        "nd-edge-1",
        enrolment_server.mqtt_url,
    )


@pytest.mark.parametrize(
    ("status", "code"),
    [(401, "bootstrap_token_invalid"), (410, "bootstrap_token_expired"), (409, "bootstrap_token_used"),
     (404, "not_found"), (422, "csr_invalid")],
)  # fmt: skip
def test_a_refusal_is_typed_and_never_retried(
    tmp_path: Path, enrolment_server: EnrolmentServer, status: int, code: str
) -> None:
    enrolment_server.scripted.append((status, code))
    enrolment_server.tokens["dv-0001"] = TOKEN  # a retry would succeed

    with pytest.raises(EnrolmentError) as caught:
        _enrol(enrolment_server.url, tmp_path)

    assert (caught.value.code, caught.value.detail, caught.value.status) == (code, f"because {code}", status)
    assert not isinstance(caught.value, EnrolmentUnreachable)
    assert len(enrolment_server.requests) == 1


def test_a_used_token_is_refused_on_a_second_enrolment(tmp_path: Path, enrolment_server: EnrolmentServer) -> None:
    enrolment_server.tokens["dv-0001"] = TOKEN
    _enrol(enrolment_server.url, tmp_path)

    with pytest.raises(EnrolmentError) as caught:
        _enrol(enrolment_server.url, tmp_path)

    assert caught.value.code == "bootstrap_token_used"


def test_5xx_is_retried_until_it_succeeds(tmp_path: Path, enrolment_server: EnrolmentServer) -> None:
    enrolment_server.scripted += [(503, "internal_error"), (502, "internal_error")]
    enrolment_server.tokens["dv-0001"] = TOKEN

    issued = _enrol(enrolment_server.url, tmp_path, attempts=3)

    assert issued.device_id == "dv-0001"
    assert len(enrolment_server.requests) == 3


def test_an_endpoint_that_never_answers_is_unreachable(tmp_path: Path) -> None:
    with pytest.raises(EnrolmentUnreachable) as caught:
        _enrol(f"http://127.0.0.1:{free_port()}", tmp_path, attempts=2)

    assert caught.value.code == "enrolment_unreachable"
    assert "ConnectError" in caught.value.detail


def test_an_answer_that_is_not_a_certificate_is_refused(tmp_path: Path, enrolment_server: EnrolmentServer) -> None:
    enrolment_server.scripted.append((201, "surprise"))

    with pytest.raises(EnrolmentError) as caught:
        _enrol(enrolment_server.url, tmp_path)

    assert caught.value.code == "invalid_response"
    assert len(enrolment_server.requests) == 1


def test_attempts_wait_with_the_agents_back_off_and_never_before_the_first() -> None:
    enrolling = Enrolling(DEVICE, "http://edge", "dv-0001", "c" * 64, TOKEN, attempts=6, max_delay_s=0.75)

    delays = list(enrolling.delays())

    assert len(delays) == 6
    assert delays[0] == 0.0
    assert all(0.0 <= delay <= 0.75 for delay in delays[1:])


def test_enrolling_loads_no_asyncio() -> None:
    script = (
        "import sys; from device.enrol import request_certificate; from device.errors import EnrolmentUnreachable\n"
        f"try: request_certificate('http://127.0.0.1:{free_port()}', 'dv-0001', 'c' * 64, {TOKEN!r}, attempts=1)\n"
        "except EnrolmentUnreachable: print('asyncio' in sys.modules)"
    )

    loaded = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=REPO)

    assert loaded.stdout.strip() == "False"
