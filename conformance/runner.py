"""Cases, verdicts and the run loop.

A case is a function registered under one clause of the catalogue (:mod:`conformance.catalogue`) with
:func:`case`. It gets a :class:`Check`: the system under test (:class:`conformance.hub.Target`), a
place to write evidence, assertions that end the case with a FAIL, and ``cleanup`` for what it made.
A case that raises anything else ends in ERROR; both count as failures of the clause.
"""

from __future__ import annotations

import fnmatch
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from conformance.outcomes import CaseFailed, CaseSkipped

if TYPE_CHECKING:
    from conformance.hub import Target


class Verdict(StrEnum):
    PASS = "PASS"
    FAIL = "FAIL"
    ERROR = "ERROR"  # the case itself broke (an unexpected exception): the clause is not shown to hold
    SKIP = "SKIP"  # a precondition of the case is missing (said why)


FAILING = frozenset({Verdict.FAIL, Verdict.ERROR})


@dataclass(frozen=True)
class Case:
    clause: str
    name: str
    title: str
    func: Callable[[Check], None]


REGISTRY: list[Case] = []


def case(clause: str, title: str) -> Callable[[Callable[[Check], None]], Callable[[Check], None]]:
    """Register ``func`` as a case of ``clause`` (a catalogue id such as ``8.1.2`` or ``7.2.d.3``)."""

    def register(func: Callable[[Check], None]) -> Callable[[Check], None]:
        from conformance.catalogue import CLAUSES

        if clause not in CLAUSES:
            raise ValueError(f"case {func.__name__}: clause {clause} is not in the catalogue")
        if not CLAUSES[clause].testable:
            raise ValueError(f"case {func.__name__}: clause {clause} is listed as not testable from outside")
        REGISTRY.append(Case(clause, func.__name__, title, func))
        return func

    return register


@dataclass
class Result:
    clause: str
    case: str
    title: str
    verdict: Verdict
    evidence: list[str]
    duration_s: float
    detail: str = ""


@dataclass
class Check:
    """What a case works with: the target, evidence lines, assertions and clean-up."""

    target: Target
    evidence: list[str] = field(default_factory=list)
    _cleanups: list[tuple[str, Callable[[], object]]] = field(default_factory=list)

    def note(self, line: str) -> None:
        self.evidence.append(line)

    def check(self, condition: object, message: str) -> None:
        """Fail the case with ``message`` unless ``condition``; on success ``message`` becomes evidence."""
        if not condition:
            raise CaseFailed(message)
        self.evidence.append(f"ok: {message}")

    def equal(self, actual: object, expected: object, what: str) -> None:
        if actual != expected:
            raise CaseFailed(f"{what}: expected {expected!r}, got {actual!r}")
        self.evidence.append(f"ok: {what} = {actual!r}")

    def fail(self, message: str) -> None:
        raise CaseFailed(message)

    def skip(self, message: str) -> None:
        raise CaseSkipped(message)

    def wait(self, predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
        """Poll ``predicate`` until it returns something true; FAIL with ``what`` after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while True:
            last = predicate()
            if last:
                return last
            if time.monotonic() >= deadline:
                raise CaseFailed(f"{what}: not seen within {timeout:g} s (last: {str(last)[:300]})")
            time.sleep(interval)

    def stays(self, predicate: Callable[[], Any], seconds: float, what: str, interval: float = 0.2) -> Any:
        """Watch that ``predicate`` holds for ``seconds`` (something that must not happen does not): FAIL with
        ``what`` at the first read where it does not; the last value. Read all through the watch, not once at its end."""
        deadline = time.monotonic() + seconds
        while True:
            last = predicate()
            if not last:
                raise CaseFailed(f"{what}: no longer so after {seconds - max(0.0, deadline - time.monotonic()):.1f} of {seconds:g} s")
            if time.monotonic() >= deadline:
                self.evidence.append(f"ok: {what} (watched {seconds:g} s)")
                return last
            time.sleep(interval)

    def cleanup(self, what: str, action: Callable[[], object]) -> None:
        """Run ``action`` after the case (last registered first), whatever its verdict."""
        self._cleanups.append((what, action))

    def run_cleanups(self) -> list[str]:
        problems = []
        while self._cleanups:
            what, action = self._cleanups.pop()
            try:
                action()
            except Exception as exc:  # noqa: BLE001 - clean-up goes on and reports what it could not undo
                problems.append(f"clean-up '{what}' failed: {type(exc).__name__}: {exc}")
        return problems


def select(cases: Iterable[Case], patterns: list[str]) -> list[Case]:
    """The cases whose clause matches one of the glob ``patterns`` (all when there are none)."""
    if not patterns:
        return list(cases)
    return [c for c in cases if any(fnmatch.fnmatchcase(c.clause, p) or c.clause == p.rstrip(".*") for p in patterns)]


def run_cases(target: Target, cases: list[Case], on_result: Callable[[Result], None] | None = None) -> list[Result]:
    results = []
    for item in cases:
        check = Check(target)
        started = time.monotonic()
        verdict, detail = Verdict.PASS, ""
        try:
            item.func(check)
        except AssertionError as exc:  # CaseFailed, or an answer that is not the documented one
            verdict, detail = Verdict.FAIL, str(exc)
        except CaseSkipped as exc:
            verdict, detail = Verdict.SKIP, str(exc)
        except Exception as exc:  # noqa: BLE001 - any other exception is the case's ERROR verdict
            verdict = Verdict.ERROR
            detail = f"{type(exc).__name__}: {exc}"
            check.note("traceback: " + " | ".join(traceback.format_exc().strip().splitlines()[-6:]))
        for problem in check.run_cleanups():
            check.note(problem)
        result = Result(item.clause, item.name, item.title, verdict, check.evidence, time.monotonic() - started, detail)
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results
