"""Property-based API testing of a live hub: schemathesis generates requests from the COMMITTED
interfaces/openapi.json and sends them over real connections to the hub behind uvicorn (tests/hub/fuzz_support).

Every check runs (no server error, status codes, content types, response headers and bodies against the
schema, error bodies against the Problem schema, schema-valid requests accepted, schema-violating ones refused,
missing or ignored authentication, undeclared methods, use after delete, resources available after creation),
on positive and negative cases, in all four phases, the stateful one following the links schemathesis infers.
Path ids are drawn half from the generator and half from rows seeded beforehand. The seed is fixed, shrinking
and health checks are off: the same cases every run, however busy the machine. The long run is
bench/fuzz_api.py (its figures in BENCHMARKS.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.hub.fuzz_support import live_hub, run, seed

MAX_EXAMPLES = 5  # per operation and phase: about 1,500 cases over the 67 operations
MIN_CASES = 1000
SEED = 1


@pytest.mark.timeout(900)  # about 2 minutes here; a busy 2-core machine may take several times that
def test_generated_requests_get_documented_answers_and_never_a_server_error(tmp_path: Path) -> None:
    # Prepare
    with live_hub(tmp_path / "hub") as live:
        seeded = seed(live.hub)

        # Execute
        result = run(live, seeded, max_examples=MAX_EXAMPLES, seed_value=SEED, report=tmp_path / "report.json", timeout_s=800)

        # Assert
        assert live.server_errors == 0, live.counter.statuses
    assert result.failures == {} and result.errors == 0, result.output[-12000:]
    assert result.returncode == 0, result.output[-12000:]
    assert result.cases >= MIN_CASES, result.report.get("test_cases")
    assert sum(live.counter.statuses.values()) >= MIN_CASES, live.counter.statuses
    assert any(200 <= s < 300 for s in live.counter.statuses), live.counter.statuses  # not everything was refused
