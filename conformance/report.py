"""Reports: a console summary, JUnit XML (one testsuite per clause) and a Markdown report."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from conformance.catalogue import CATALOGUE, Clause
from conformance.runner import FAILING, Result, Verdict


@dataclass(frozen=True)
class ClauseVerdict:
    clause: Clause
    verdict: str  # PASS | FAIL | SKIP | NOT TESTABLE | NOT RUN
    results: list[Result]


def by_clause(results: list[Result], selected: set[str] | None = None) -> list[ClauseVerdict]:
    """Each clause's verdict: FAIL if any case failed or broke, PASS if at least one passed and none
    failed, SKIP if all were skipped; NOT TESTABLE from the catalogue; NOT RUN when not selected."""
    out = []
    for clause in CATALOGUE:
        mine = [r for r in results if r.clause == clause.id]
        if not clause.testable:
            verdict = "NOT TESTABLE"
        elif not mine:
            verdict = "NOT RUN"
        elif any(r.verdict in FAILING for r in mine):
            verdict = "FAIL"
        elif any(r.verdict is Verdict.PASS for r in mine):
            verdict = "PASS"
        else:
            verdict = "SKIP"
        if selected is not None and clause.testable and clause.id not in selected:
            continue
        out.append(ClauseVerdict(clause, verdict, mine))
    return out


def failed_clauses(results: list[Result]) -> list[str]:
    return sorted({r.clause for r in results if r.verdict in FAILING})


def console_line(result: Result) -> str:
    text = f"{result.verdict.value:5} {result.clause:10} {result.case} ({result.duration_s:.1f} s)"
    return text + (f"\n      {result.detail}" if result.detail else "")


def summary(results: list[Result], verdicts: list[ClauseVerdict]) -> str:
    cases = Counter(r.verdict.value for r in results)
    clauses = Counter(v.verdict for v in verdicts)
    lines = [
        "",
        "cases:   " + ", ".join(f"{cases.get(v.value, 0)} {v.value}" for v in Verdict),
        "clauses: " + ", ".join(f"{n} {k}" for k, n in sorted(clauses.items())),
    ]
    failing = [v for v in verdicts if v.verdict == "FAIL"]
    if failing:
        lines.append("FAILED clauses: " + ", ".join(f"{v.clause.label} ({v.clause.title})" for v in failing))
    return "\n".join(lines)


def junit_xml(results: list[Result], path: Path, name: str = "aisynergy-conformance") -> None:
    root = ET.Element("testsuites", name=name)
    groups: dict[str, list[Result]] = {}
    for r in results:
        groups.setdefault(r.clause, []).append(r)
    for clause, items in groups.items():
        suite = ET.SubElement(root, "testsuite", name=f"clause {clause}", tests=str(len(items)),
                              failures=str(sum(r.verdict is Verdict.FAIL for r in items)), errors=str(sum(r.verdict is Verdict.ERROR for r in items)),
                              skipped=str(sum(r.verdict is Verdict.SKIP for r in items)), time=f"{sum(r.duration_s for r in items):.3f}")  # fmt: skip
        for r in items:
            tc = ET.SubElement(suite, "testcase", classname=f"clause.{clause}", name=r.case, time=f"{r.duration_s:.3f}")
            if r.verdict is Verdict.FAIL:
                ET.SubElement(tc, "failure", message=r.detail[:1000]).text = "\n".join(r.evidence)
            elif r.verdict is Verdict.ERROR:
                ET.SubElement(tc, "error", message=r.detail[:1000]).text = "\n".join(r.evidence)
            elif r.verdict is Verdict.SKIP:
                ET.SubElement(tc, "skipped", message=r.detail[:1000])
            ET.SubElement(tc, "system-out").text = "\n".join(r.evidence)
    ET.indent(root)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", "<br>")


def markdown(results: list[Result], verdicts: list[ClauseVerdict], target: str, path: Path) -> None:
    counts = Counter(v.verdict for v in verdicts)
    lines = [
        "# Conformance report",
        "",
        f"Target: {target}  ",
        f"Finished: {datetime.now(UTC).isoformat(timespec='seconds')}  ",
        "Clauses: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())),
        "",
        "## Clauses",
        "",
        "| clause | requirement | level | verdict | cases |",
        "|---|---|---|---|---|",
    ]
    for v in verdicts:
        cases = f"{sum(r.verdict is Verdict.PASS for r in v.results)}/{len(v.results)} passed" if v.results else (v.clause.reason or "-")
        lines.append(f"| {v.clause.label} | {_cell(v.clause.title)} | {v.clause.level} | **{v.verdict}** | {_cell(cases)} |")
    lines += ["", "## Cases", "", "| clause | case | verdict | evidence |", "|---|---|---|---|"]
    for r in results:
        evidence = [*([r.detail] if r.detail else []), *r.evidence]
        lines.append(f"| {r.clause} | {_cell(r.title)} (`{r.case}`) | **{r.verdict.value}** | {_cell(chr(10).join(evidence)[:3000])} |")
    path.write_text("\n".join(lines) + "\n")


def coverage_table() -> str:
    """How many clauses, how many with cases, per group (for the README)."""
    from conformance.runner import REGISTRY

    with_cases = {c.clause for c in REGISTRY}
    groups: dict[str, list[Clause]] = {}
    for clause in CATALOGUE:
        parts = clause.id.split(".")
        key = ".".join(parts[:2]) if parts[0] == "8" else parts[0]  # 8.0 ... 8.3 each; the standard's 6 and 7 whole
        groups.setdefault(key, []).append(clause)
    lines = ["| clauses | listed | tested (cases) | not testable from outside |", "|---|---|---|---|"]
    for key, items in groups.items():
        tested = [c for c in items if c.id in with_cases]
        cases = sum(1 for r in REGISTRY if r.clause in {c.id for c in items})
        lines.append(f"| {key} | {len(items)} | {len(tested)} ({cases}) | {sum(not c.testable for c in items)} |")
    total_cases = len(REGISTRY)
    lines.append(f"| **all** | **{len(CATALOGUE)}** | **{len(with_cases)} ({total_cases})** | **{sum(not c.testable for c in CATALOGUE)}** |")
    return "\n".join(lines)
