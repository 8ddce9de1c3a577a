"""Fixtures for the ML tests: the committed digits models (tests/fixtures/make_digits_models.py) and the digits
test split they were trained against."""

from __future__ import annotations

from pathlib import Path

import pytest

MODELS = Path(__file__).parent.parent / "fixtures" / "models"
KINDS = ("mlp", "cnn")


def model_path(kind: str, suffix: str) -> Path:
    return MODELS / f"digits-{kind}.{suffix}"


@pytest.fixture(scope="session")
def digits():  # type: ignore[no-untyped-def]
    pytest.importorskip("sklearn")
    from cloud.ml.train import load_digits_split

    return load_digits_split()
