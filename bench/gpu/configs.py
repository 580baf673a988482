"""The kernel configs a device session compares: the engine's first, then the alternatives that the
engine itself times at a model's first start on a device (local_runner/kernel_choice.py), here timed
wider by bench/gpu/kernels.py and compiled by bench/gpu/triton_aot.py."""

from __future__ import annotations

from local_runner.kernel_choice import LINEAR_CANDIDATES as LINEAR_CONFIGS
from local_runner.kernel_choice import attention_candidates as attention_configs

__all__ = ["LINEAR_CONFIGS", "attention_configs"]
