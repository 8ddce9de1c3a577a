"""DESIGN §2: what may import what. Read from the source with ``ast`` (imports inside functions count)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = {"interfaces", "cloud", "edge", "device", "conformance", "firmware_images", "tests"}
MAY_IMPORT = {
    "interfaces": {"interfaces"},
    "device": {"interfaces", "device"},
    "edge": {"interfaces", "device", "edge"},
    "cloud": {"interfaces", "cloud"},
    "conformance": {"interfaces", "conformance"},
}


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & OURS


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_package_imports_only_what_design_allows(package: str) -> None:
    wrong = {str(p.relative_to(ROOT)): sorted(_imports(p) - MAY_IMPORT[package]) for p in sorted((ROOT / package).rglob("*.py"))}
    assert {p: w for p, w in wrong.items() if w} == {}
