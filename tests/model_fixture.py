"""The real SmolLM2 model, loaded once per test session and dtype (converted weights cached under
./var/models)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from local_runner.loader import LoadedModel, load_model, pick_dtype
from proxy.settings import DEFAULT_MODEL_NAME, DEFAULT_MODEL_SOURCE

REPO = Path(__file__).resolve().parent.parent
MODEL = DEFAULT_MODEL_NAME

# What `dtype: auto` loads on this machine's CPU (bfloat16 where it has native bfloat16 arithmetic): the
# dtype a server started at its default settings runs, so a recompute compared with one must run it too.
DEFAULT_DTYPE = str(pick_dtype("auto", torch.device("cpu"))).removeprefix("torch.")


@pytest.fixture(scope="session")
def load_smollm() -> Callable[[str], LoadedModel]:
    """The real model in a given dtype ("float32", "bfloat16"), each loaded once per session."""
    loaded: dict[str, LoadedModel] = {}

    def load(dtype: str) -> LoadedModel:
        if dtype not in loaded:
            loaded[dtype] = load_model(
                MODEL, DEFAULT_MODEL_SOURCE, device="cpu", dtype=dtype, cache_dir=REPO / "var" / "models"
            )
        return loaded[dtype]

    return load


@pytest.fixture(scope="session")
def smollm(load_smollm) -> LoadedModel:
    """The model most tests share: float32, the same on every CPU."""
    return load_smollm("float32")
