"""The three-tier stack most integration tests start (``tests/integration/devstack.py``): hub on SQLite, two brokers,
an edge process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.devstack import DevStack, start_devstack


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[DevStack]:
    s = start_devstack(tmp_path, f"sqlite:///{tmp_path / 'hub.db'}")
    try:
        yield s
    finally:
        s.close()
