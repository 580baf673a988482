"""Sampling parameters as plain data (no torch import: the proxy validates requests with them)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    # Only the k most likely tokens are sampled from (Anthropic's `top_k`, vLLM's extension); 0: all.
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    # vLLM's extension, for benchmarks and tests that need answers of a fixed length: decode on past the
    # end-of-sequence token until max_tokens.
    ignore_eos: bool = False
    # OpenAI's penalties on tokens the answer already holds: presence once per token seen, frequency per
    # occurrence (both -2..2), and a bias added to given token ids' logits (-100..100).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Per generated token, its log-probability and the `logprobs` most likely alternatives (0-20);
    # None: none reported.
    logprobs: int | None = None
    # Constrained decoding: a grammar in xgrammar's EBNF that the answer must match (JSON of a schema, a
    # tool call); None: free text. The engine compiles it for its tokenizer.
    grammar: str | None = None


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token's log-probability and its most likely alternatives (ids, most likely first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
