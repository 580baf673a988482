"""The tier names are importable without torch: the proxy takes them from kvtier without loading it."""

from __future__ import annotations

import subprocess
import sys
from typing import get_args

import kvtier
from kvtier import TIERS, Tier
from kvtier.tier_names import MEMORY_TIERS, tier_rank


def _loaded_after(code: str) -> set[str]:
    """The modules a fresh interpreter has loaded after running `code`."""
    probe = f"import sys\n{code}\nprint(' '.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_tier_names_load_no_torch():
    for code in ("from kvtier import TIERS, MEMORY_TIERS, Tier", "import kvtier.tier_names"):
        loaded = _loaded_after(code)
        assert "kvtier.tier_names" in loaded  # the probe sees what was imported
        assert "torch" not in loaded, code


def test_tier_names_are_one_spelling_in_rank_order():
    assert TIERS == get_args(Tier) == ("l0", "l1", "l2")
    assert set(MEMORY_TIERS) < set(TIERS)
    assert [tier_rank(t) for t in TIERS] == [0, 1, 2]


def test_every_exported_name_resolves():
    for name in kvtier.__all__:
        assert getattr(kvtier, name) is not None
    assert set(kvtier.__all__) <= set(dir(kvtier))
