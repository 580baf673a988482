"""The real SmolLM2 model, loaded once per test session (converted weights cached under ./var/models)."""

from __future__ import annotations

from pathlib import Path

import pytest

from local_runner.loader import LoadedModel, load_model
from proxy.settings import DEFAULT_MODEL_NAME, DEFAULT_MODEL_SOURCE

REPO = Path(__file__).resolve().parent.parent
MODEL = DEFAULT_MODEL_NAME


@pytest.fixture(scope="session")
def smollm() -> LoadedModel:
    return load_model(
        MODEL, DEFAULT_MODEL_SOURCE, device="cpu", dtype="float32", cache_dir=REPO / "var" / "models"
    )
