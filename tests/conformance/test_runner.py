"""The suite's own machinery without a system under test: clause selection, verdicts, reports, and the
README's coverage table kept in step with the catalogue."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import conformance.cases  # noqa: F401 - registers the cases
from conformance.catalogue import CATALOGUE, CLAUSES
from conformance.hub import Target
from conformance.report import by_clause, coverage_table, junit_xml, markdown
from conformance.runner import REGISTRY, Case, Check, Verdict, run_cases, select

ROOT = Path(__file__).resolve().parents[2]


def _target(tmp_path: Path) -> Target:
    return Target("http://127.0.0.1:9", "mqtts://127.0.0.1:9", "token", work_dir=tmp_path)


def test_labels_and_every_case_on_a_testable_clause() -> None:
    assert CLAUSES["7.2.d.3"].label == "7.2 d 3" and CLAUSES["8.1.2"].label == "8.1.2" and CLAUSES["7.3.1.e"].label == "7.3.1 e"
    assert {c.clause for c in REGISTRY} <= {c.id for c in CATALOGUE if c.testable}
    assert all(c.reason for c in CATALOGUE if not c.testable)
    assert len({c.name for c in REGISTRY}) == len(REGISTRY)  # case names are unique (JUnit names)


def test_select_by_glob() -> None:
    assert {c.clause for c in select(REGISTRY, ["8.1.*"])} == {c.id for c in CATALOGUE if c.id.startswith("8.1.")}
    assert {c.clause for c in select(REGISTRY, ["7.2.d.3"])} == {"7.2.d.3"}
    assert {c.clause for c in select(REGISTRY, ["7.2.*", "6.2.2.b"])} == {c.clause for c in REGISTRY if c.clause.startswith("7.2.") or c.clause == "6.2.2.b"}
    assert select(REGISTRY, ["9.*"]) == []


def test_verdicts_reports_and_clean_up(tmp_path: Path) -> None:
    undone: list[str] = []

    def passes(check: Check) -> None:
        check.cleanup("note", lambda: undone.append("passes"))
        check.equal(1, 1, "one")

    def fails(check: Check) -> None:
        check.cleanup("note", lambda: undone.append("fails"))
        check.check(False, "the planted failure")

    def breaks(check: Check) -> None:
        raise KeyError("boom")

    def skips(check: Check) -> None:
        check.skip("no viewer token")

    cases = [Case("8.1.1", "passes", "p", passes), Case("8.1.2", "fails", "f", fails), Case("8.1.3", "breaks", "b", breaks), Case("8.1.4", "skips", "s", skips)]
    results = run_cases(_target(tmp_path), cases)

    assert [r.verdict for r in results] == [Verdict.PASS, Verdict.FAIL, Verdict.ERROR, Verdict.SKIP]
    assert results[1].detail == "the planted failure" and "KeyError" in results[2].detail
    assert undone == ["passes", "fails"]  # clean-ups run whatever the verdict
    verdicts = {v.clause.id: v.verdict for v in by_clause(results)}
    assert (verdicts["8.1.1"], verdicts["8.1.2"], verdicts["8.1.3"], verdicts["8.1.4"], verdicts["8.1.5"]) == ("PASS", "FAIL", "FAIL", "SKIP", "NOT RUN")
    assert verdicts["6.3.2.a"] == "NOT TESTABLE"

    junit_xml(results, tmp_path / "j.xml")
    root = ET.parse(tmp_path / "j.xml").getroot()
    by_name = {tc.get("name"): tc for tc in root.iter("testcase")}
    assert by_name["fails"].find("failure") is not None and by_name["breaks"].find("error") is not None
    assert by_name["skips"].find("skipped") is not None and by_name["passes"].find("failure") is None
    markdown(results, by_clause(results), "here", tmp_path / "r.md")
    report = (tmp_path / "r.md").read_text()
    assert "| 8.1.2 | Enrolment" in report and "the planted failure" in report and "| 6.3.2 a |" in report


def test_readme_coverage_table_is_current() -> None:
    assert coverage_table() in (ROOT / "README.md").read_text(), "regenerate the README table with: aisynergy conformance --coverage"
