"""Static types (``[tool.mypy]`` in pyproject.toml): ``interfaces/`` is strict and has no error; elsewhere no
error that ``tests/mypy-baseline.txt`` does not list. The baseline holds the errors the tree had when the check
began, without line numbers (``path: [code] message``, one line per error); it may only shrink. After fixing
some, write it again: ``python -m tests.test_typing --write`` (from the repository root)."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BASELINE = ROOT / "tests" / "mypy-baseline.txt"
_ERROR = re.compile(r"^(?P<path>[^:\s]+\.py):\d+(?::\d+)?: error: (?P<message>.*?)\s+\[(?P<code>[a-z-]+)\]$")


def mypy_errors() -> Counter[str]:
    """Every error mypy reports on the tree, as ``path: [code] message`` (line numbers out: they move)."""
    done = subprocess.run([sys.executable, "-m", "mypy", "--no-error-summary", "--no-pretty", "--show-error-codes"], cwd=ROOT,
                          capture_output=True, text=True, timeout=1200, check=False)  # fmt: skip
    if done.returncode not in (0, 1):  # 2: mypy itself failed (a configuration or syntax error)
        raise RuntimeError(f"mypy failed ({done.returncode}): {done.stderr[-2000:] or done.stdout[-2000:]}")
    errors: Counter[str] = Counter()
    for line in done.stdout.splitlines():
        if (m := _ERROR.match(line)) is not None:
            message = re.sub(r"\bline \d+\b", "line N", m["message"])
            errors[f"{m['path']}: [{m['code']}] {message}"] += 1
        elif ": error:" in line:
            raise AssertionError(f"an error line the check cannot read: {line}")
    return errors


def baseline() -> Counter[str]:
    return Counter(line for line in BASELINE.read_text().splitlines() if line.strip() and not line.startswith("#"))


def write_baseline(errors: Counter[str]) -> None:
    header = "# mypy errors of the tree outside interfaces/, one per line (tests/test_typing.py); this list may only shrink\n"
    BASELINE.write_text(header + "".join(f"{e}\n" for e in sorted(errors.elements())))


@pytest.mark.timeout(1500)
def test_no_type_error_beyond_the_baseline_and_none_in_interfaces() -> None:
    # Execute
    errors = mypy_errors()

    # Assert
    listed = baseline()
    assert [e for e in listed if e.startswith("interfaces/")] == [], "interfaces/ is strict: its errors are fixed, never listed"
    new = errors - listed
    assert not new, "type errors not in tests/mypy-baseline.txt (fix them):\n" + "\n".join(sorted(new.elements()))


def test_the_error_reader_reads_mypy_s_lines() -> None:
    line = 'cloud/x.py:12: error: Argument 1 to "f" has incompatible type "int"; expected "str"  [arg-type]'
    m = _ERROR.match(line)
    assert m is not None and (m["path"], m["code"]) == ("cloud/x.py", "arg-type")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m tests.test_typing --write")
    found = mypy_errors()
    outside = Counter({e: n for e, n in found.items() if not e.startswith("interfaces/")})
    write_baseline(outside)
    print(f"{sum(outside.values())} errors listed in {BASELINE.relative_to(ROOT)}; {sum(found.values()) - sum(outside.values())} in interfaces/ to fix")
