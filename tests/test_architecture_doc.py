"""ARCHITECTURE.md names only files and folders that exist: a map that points at nothing misleads."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATH = re.compile(r"`((?:cloud|edge|device|interfaces|conformance|tests)/[A-Za-z0-9_./]*)`")


def test_every_path_architecture_md_names_exists() -> None:
    named = sorted(set(PATH.findall((ROOT / "ARCHITECTURE.md").read_text())))
    assert len(named) > 40  # the layers, the owners and four paths through them
    assert [p for p in named if not (ROOT / p).exists()] == []
