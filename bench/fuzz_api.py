"""The long schemathesis run against a live hub (run by hand; figures in BENCHMARKS.md).

    .venv/bin/python bench/fuzz_api.py [--max-examples 20] [--seed 1] [--runs 3]

The hub runs on SQLite behind uvicorn in this process, seeded as in the CI-sized run (tests/hub/test_schemathesis.py);
the schemathesis CLI runs every check on positive and negative cases in all four phases (tests/hub/fuzz_support.py,
the settings and their reasons in tests/hub/schemathesis.toml). Writes bench/results/fuzz-api-<n>-<commit>.json
(cases, failures by check, answers by status at the hub, wall time, the command) and the CLI's output beside it.
``--runs N`` runs the CLI N times against the same hub, with seeds seed .. seed+N-1: the hub keeps what each run
made, and the figures are the sums.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.hub.fuzz_support import live_hub, run, seed  # noqa: E402
from tests.support import start_broker, stop, wait_for  # noqa: E402

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
    parser.add_argument("--max-examples", type=int, default=20, help="per operation and phase (the CI run uses 5)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--runs", type=int, default=3, help="CLI runs against the one hub, one seed each")
    parser.add_argument("--timeout", type=float, default=3 * 3600, help="seconds before the run is stopped")
    parser.add_argument("--broker", action="store_true", help="the hub with a real Mosquitto (aisynergy broker run) and its MQTT bridge on")
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    stem = f"fuzz-api-{args.max_examples}x{args.runs}{'-broker' if args.broker else ''}-{_commit()}"
    results = []
    with tempfile.TemporaryDirectory(prefix="fuzz-api-") as tmp, contextlib.ExitStack() as stack:
        data_dir, settings = Path(tmp) / "hub", {}
        if args.broker:  # the broker makes the hub's CA in the shared data directory; the hub's bridge connects to it
            broker = start_broker(data_dir)
            stack.callback(stop, broker.proc)
            settings = {"enable_mqtt": True, "broker_url": broker.url}
        live = stack.enter_context(live_hub(data_dir, **settings))
        if args.broker:
            bridge = live.hub.state.bridge
            assert bridge is not None
            wait_for(bridge.connected.is_set, 60, what="the hub's bridge connected to the broker")
        seeded = seed(live.hub)
        for n in range(args.runs):
            report = Path(tmp) / f"report-{n}.json"
            results.append(run(live, seeded, max_examples=args.max_examples, seed_value=args.seed + n, report=report, timeout_s=args.timeout))
        statuses = dict(sorted(live.counter.statuses.items()))
    failures: dict[str, int] = {}
    for result in results:
        for title, count in result.failures.items():
            failures[title] = failures.get(title, 0) + count
    summary = {
        "broker": "mosquitto (aisynergy broker run), the bridge connected" if args.broker else "none (enable_mqtt false)",
        "command": " ".join(sys.argv),
        "schemathesis_commands": [" ".join(r.command[1:]) for r in results],
        "machine": {"cpu": _cpu(), "cpus": len(os.sched_getaffinity(0)), "python": platform.python_version()},
        "max_examples": args.max_examples,
        "seeds": [args.seed + n for n in range(args.runs)],
        "wall_s": round(sum(r.wall_s for r in results), 1),
        "cases": sum(r.cases for r in results),
        "requests_answered": sum(statuses.values()),
        "server_errors_5xx": sum(n for s, n in statuses.items() if s >= 500),
        "answers_by_status": statuses,
        "failures_by_check": failures,
        "response_schema_violations": sum(r.failed("schema violation", "response violates schema") for r in results),
        "errors": sum(r.errors for r in results),
        "exit_codes": [r.returncode for r in results],
        "runs": [{"seed": args.seed + n, "cases": r.cases, "wall_s": round(r.wall_s, 1), "test_cases": r.report.get("test_cases"), "phases": r.report.get("phases")}
                 for n, r in enumerate(results)],
    }  # fmt: skip
    (RESULTS / f"{stem}.json").write_text(json.dumps(summary, indent=2) + "\n")
    (RESULTS / f"{stem}.txt").write_text("\n".join(r.output for r in results))
    print(json.dumps({k: summary[k] for k in ("cases", "server_errors_5xx", "failures_by_check", "errors", "wall_s")}, indent=2))
    return 0 if not failures and not summary["errors"] and summary["server_errors_5xx"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
