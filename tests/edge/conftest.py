"""Edge test fixtures; the helpers behind them live in :mod:`tests.edge.support`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.edge.support import Pki, ThrowawayCA


@pytest.fixture(scope="session")
def test_ca() -> ThrowawayCA:
    return ThrowawayCA.create()


@pytest.fixture
def pki(tmp_path: Path, test_ca: ThrowawayCA) -> Pki:
    return Pki(tmp_path / "pki", test_ca)


@pytest.fixture
def cleanup() -> Iterator[list[Callable[[], object]]]:
    """Callables run at teardown, last registered first."""
    actions: list[Callable[[], object]] = []
    yield actions
    for action in reversed(actions):
        action()
