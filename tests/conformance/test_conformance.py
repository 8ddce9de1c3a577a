"""The conformance suite against running systems, the way a certifier runs it: ``aisynergy conformance``
as a child process against a stack started with ``aisynergy up``; and against a hub configured out of
spec, where exactly the matching clause must fail."""

from __future__ import annotations

import ssl
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.support import AISYNERGY, create_token, free_port, start, start_broker, stop, wait_for

pytestmark = pytest.mark.broker

SUITE_TIMEOUT_S = 600
FAST_LIVENESS = {"AISYNERGY_HEARTBEAT_INTERVAL_S": "1", "AISYNERGY_LIVENESS_CHECK_INTERVAL_S": "0.2"}


@dataclass
class Running:
    hub_url: str
    broker_url: str
    ca: Path
    tokens: dict[str, str]


def _healthy(url: str, ca: Path | None = None) -> bool:
    verify = ssl.create_default_context(cafile=str(ca)) if ca is not None else True
    try:
        return httpx.get(url + "/healthz", timeout=1, verify=verify).json().get("mqtt", {}).get("connected", False)  # type: ignore[no-any-return]
    except (httpx.HTTPError, ValueError):
        return False


def _start_suite(system: Running, out: Path) -> subprocess.Popen[str]:
    """``aisynergy conformance`` against ``system``, every clause, reports under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    args = [*AISYNERGY, "conformance", "--hub", system.hub_url, "--broker", system.broker_url, "--token", system.tokens["admin"],
            "--ca", str(system.ca), "--junit", str(out / "junit.xml"), "--report", str(out / "report.md")]  # fmt: skip
    for role in ("operator", "viewer"):
        if role in system.tokens:
            args += [f"--{role}-token", system.tokens[role]]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen[str], out: Path) -> tuple[int, str, ET.Element, str]:
    output, _ = proc.communicate(timeout=SUITE_TIMEOUT_S)
    return proc.returncode, output, ET.parse(out / "junit.xml").getroot(), (out / "report.md").read_text()


def _failed_clauses(junit: ET.Element) -> set[str]:
    return {tc.get("classname", "").removeprefix("clause.") for tc in junit.iter("testcase") if tc.find("failure") is not None or tc.find("error") is not None}


def _registered_cases() -> int:
    import conformance.cases  # noqa: F401
    from conformance.runner import REGISTRY

    return len(REGISTRY)


@pytest.fixture
def our_stack(tmp_path: Path) -> Iterator[Running]:
    """``aisynergy up`` (broker, hub on SQLite, one edge agent, one device) on free ports, as a user starts it."""
    data = tmp_path / "stack"
    hub_port, broker_port = free_port(), free_port()
    proc = start([*AISYNERGY, "up", "--data-dir", str(data), "--hub-port", str(hub_port), "--broker-port", str(broker_port),
                  "--enrol-port", str(free_port()), "--devices", "1", "--no-table"], tmp_path / "up.log", env=FAST_LIVENESS)  # fmt: skip
    try:
        hub_url = f"https://127.0.0.1:{hub_port}"  # as aisynergy up serves it: HTTPS, a certificate from the hub CA
        wait_for(lambda: "devices " in (tmp_path / "up.log").read_text() or proc.poll() is not None, 120, interval=0.5, what="aisynergy up")
        assert proc.poll() is None, (tmp_path / "up.log").read_text()[-3000:]
        assert _healthy(hub_url, data / "pki" / "ca.crt")
        db = f"sqlite:///{data / 'hub.db'}"
        tokens = {"admin": (data / "admin.token").read_text().strip(), **{r: create_token(data, db, r) for r in ("operator", "viewer")}}
        yield Running(hub_url, f"mqtts://127.0.0.1:{broker_port}", data / "pki" / "ca.crt", tokens)
    finally:
        stop(proc, timeout=20)


@pytest.fixture
def out_of_spec(tmp_path: Path) -> Iterator[Running]:
    """A broker and a hub whose offline timeout (1 s x 100,000 missed heartbeats) is far beyond the documented 3,000 s."""
    data = tmp_path / "out-of-spec"
    broker = start_broker(data)
    port = free_port()
    hub = start([sys.executable, "-m", "tests.conformance.nonconforming_hub", "--data-dir", str(data), "--port", str(port),
                 "--broker-url", broker.url, "--offline-after-missed", "100000"], data / "hub.log")  # fmt: skip
    try:
        hub_url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _healthy(hub_url) or hub.poll() is not None, 60, what="hub up")
        assert hub.poll() is None, (data / "hub.log").read_text()[-3000:]
        db = f"sqlite:///{(data / 'hub.db').resolve()}"
        yield Running(hub_url, broker.url, data / "pki" / "ca.crt", {r: create_token(data, db, r) for r in ("admin", "operator", "viewer")})
    finally:
        stop(hub)
        stop(broker.proc)


@pytest.mark.timeout(2 * SUITE_TIMEOUT_S + 300)  # both runs, and starting both systems, on a busy machine
def test_suite_passes_on_our_stack_and_fails_exactly_the_broken_clause_of_a_hub_out_of_spec(our_stack: Running, out_of_spec: Running, tmp_path: Path) -> None:
    # Execute: the whole suite against both systems at once (the cases mostly wait on the systems)
    ours, broken = _start_suite(our_stack, tmp_path / "ours"), _start_suite(out_of_spec, tmp_path / "broken")
    rc, output, junit, report = _finish(ours, tmp_path / "ours")
    rc_broken, output_broken, junit_broken, report_broken = _finish(broken, tmp_path / "broken")

    # Assert (our stack): every case ran and passed (none skipped: all tokens were given), the reports agree
    assert rc == 0, output[-6000:]
    cases = list(junit.iter("testcase"))
    assert len(cases) == _registered_cases()
    assert not [tc.get("name") for tc in cases if tc.find("skipped") is not None]
    assert _failed_clauses(junit) == set()
    assert "| 7.2 d 3 |" in report and "**FAIL**" not in report
    assert "NOT TESTABLE" in report  # the clauses no interface can observe are listed with their reason

    # Assert (out of spec): a non-zero exit, and the only failing clause is 7.2 d 3, for the reason planted
    assert rc_broken == 1, output_broken[-4000:]
    assert _failed_clauses(junit_broken) == {"7.2.d.3"}, output_broken[-6000:]
    failure = next(tc.find("failure") for tc in junit_broken.iter("testcase") if tc.get("name") == "offline_timeout")
    assert failure is not None and "documented maximum" in failure.get("message", ""), output_broken[-4000:]
    assert "| 7.2 d 3 |" in report_broken and report_broken.count("**FAIL**") == 2  # the clause row and its case row
