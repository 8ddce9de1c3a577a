"""The long schemathesis run against a live hub (run by hand; figures in BENCHMARKS.md).

    .venv/bin/python bench/fuzz_api.py [--max-examples 40] [--seed 1]

The hub runs on SQLite behind uvicorn in this process, seeded as in the CI-sized run (tests/hub/test_schemathesis.py);
the schemathesis CLI runs every check on positive and negative cases in all four phases (tests/hub/fuzz_support.py,
the settings and their reasons in tests/hub/schemathesis.toml). Writes bench/results/fuzz-api-<n>-<commit>.json
(cases, failures by check, answers by status at the hub, wall time, the command) and the CLI's output beside it.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.hub.fuzz_support import live_hub, run, seed  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False, cwd=RESULTS.parent)
    return done.stdout.strip() or "unknown"


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-examples", type=int, default=40, help="per operation and phase (the CI run uses 5)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=3 * 3600, help="seconds before the run is stopped")
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    stem = f"fuzz-api-{args.max_examples}-{_commit()}"
    with tempfile.TemporaryDirectory(prefix="fuzz-api-") as tmp, live_hub(Path(tmp) / "hub") as live:
        seeded = seed(live.hub)
        result = run(live, seeded, max_examples=args.max_examples, seed_value=args.seed, report=Path(tmp) / "report.json", timeout_s=args.timeout)
        statuses = dict(sorted(live.counter.statuses.items()))
    summary = {
        "command": " ".join(sys.argv),
        "schemathesis_command": " ".join(result.command[1:]),
        "machine": {"cpu": _cpu(), "cpus": len(__import__("os").sched_getaffinity(0)), "python": platform.python_version()},
        "max_examples": args.max_examples,
        "seed": args.seed,
        "wall_s": round(result.wall_s, 1),
        "cases": result.cases,
        "requests_answered": sum(statuses.values()),
        "server_errors_5xx": sum(n for s, n in statuses.items() if s >= 500),
        "answers_by_status": statuses,
        "failures_by_check": result.failures,
        "response_schema_violations": result.failed("schema violation", "response violates schema"),
        "errors": result.errors,
        "exit_code": result.returncode,
        "test_cases": result.report.get("test_cases"),
        "phases": result.report.get("phases"),
    }
    (RESULTS / f"{stem}.json").write_text(json.dumps(summary, indent=2) + "\n")
    (RESULTS / f"{stem}.txt").write_text(result.output)
    print(json.dumps({k: summary[k] for k in ("cases", "server_errors_5xx", "failures_by_check", "errors", "wall_s")}, indent=2))
    return 0 if not result.failures and not result.errors and summary["server_errors_5xx"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
