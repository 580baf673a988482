"""Next-token choice: greedy at temperature 0, else temperature + nucleus (top_p) sampling; before it the
logits processors OpenAI's options ask for (logit_bias, presence and frequency penalties) and the
grammar mask of constrained decoding (xgrammar); after it, the token's log-probabilities when asked.

Log-probabilities are the model's own (raw logits, before bias, penalties and mask), as vLLM reports
them by default: at temperature 0 without processors the chosen token is the most likely one.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from engine_api.sampling import SamplingParams, TokenLogprob

__all__ = ["Sampler", "SamplingParams", "TokenLogprob"]


class Sampler:
    """Per-job sampler; a seeded generator makes a sampled answer reproducible. `grammar` (an xgrammar
    CompiledGrammar for this model's tokenizer) constrains every token to keep the answer valid."""

    def __init__(self, params: SamplingParams, grammar: Any = None):
        self.params = params
        self._generator: torch.Generator | None = None
        if params.temperature > 0:
            self._generator = torch.Generator(device="cpu")
            if params.seed is not None:
                self._generator.manual_seed(params.seed)
            else:
                self._generator.seed()
        self._counts: Counter[int] = Counter()  # generated tokens, for the penalties
        self._matcher: Any = None
        self._bitmask: torch.Tensor | None = None
        if grammar is not None:
            import xgrammar as xgr

            self._matcher = xgr.GrammarMatcher(grammar)
            self._bitmask = xgr.allocate_token_bitmask(1, grammar.tokenizer_info.vocab_size)
        self.last: TokenLogprob | None = None  # the last token's log-probabilities, when asked for

    @property
    def grammar_done(self) -> bool:
        """The grammar is complete: nothing more may follow (the answer ends here)."""
        return self._matcher is not None and self._matcher.is_terminated()

    def _processed(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.params
        if not (p.logit_bias or self._counts or self._matcher is not None):
            return logits
        out = logits.float().clone()
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
            out.index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), dtype=out.dtype))
        if self._counts and (p.presence_penalty or p.frequency_penalty):
            ids = torch.tensor(list(self._counts), dtype=torch.long)
            counts = torch.tensor(list(self._counts.values()), dtype=out.dtype)
            out.index_add_(0, ids, -(p.presence_penalty + p.frequency_penalty * counts))
        if self._matcher is not None:
            import xgrammar as xgr

            assert self._bitmask is not None
            self._matcher.fill_next_token_bitmask(self._bitmask)
            xgr.apply_token_bitmask_inplace(out.unsqueeze(0), self._bitmask)
        return out

    def __call__(self, logits: torch.Tensor) -> int:
        """`logits`: the last position's scores, shape [vocab]."""
        token = self._choose(self._processed(logits))
        if self.params.logprobs is not None:
            self.last = _logprobs(logits, token, self.params.logprobs)
        if self._matcher is not None and not self._matcher.accept_token(token):
            raise RuntimeError(f"the grammar refused token {token} it allowed")
        self._counts[token] += 1
        return token

    def _choose(self, logits: torch.Tensor) -> int:
        p = self.params
        if p.temperature <= 0:
            return int(torch.argmax(logits))
        scaled = logits.float().cpu() / p.temperature
        if torch.isinf(scaled.max()):  # a temperature so close to 0 the division overflows: its limit
            return int(torch.argmax(logits))
        probs = torch.softmax(scaled, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < p.top_p
            keep[0] = True
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
        return int(torch.multinomial(probs, 1, generator=self._generator))


def _logprobs(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    logp = torch.log_softmax(logits.float(), dim=-1)
    alternatives: tuple[tuple[int, float], ...] = ()
    if top:
        values, ids = torch.topk(logp, top)
        alternatives = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(token, float(logp[token]), alternatives)
