"""Sampling parameters as plain data (no torch import: the proxy validates requests with them)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    # vLLM's extension, for benchmarks and tests that need answers of a fixed length: decode on past the
    # end-of-sequence token until max_tokens.
    ignore_eos: bool = False
