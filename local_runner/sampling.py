"""Next-token choice: greedy at temperature 0, else temperature, top-k and nucleus (top_p) sampling; before it the
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

__all__ = ["RowLogits", "Sampler", "SamplingParams", "StepLogits", "TokenLogprob"]

# The most alternatives a token's log-probabilities list (OpenAI's top_logprobs allows 0-20).
MOST_ALTERNATIVES = 20


def first_max(logits: torch.Tensor) -> torch.Tensor:
    """The index of each row's greatest value, the first where several tie: argmax's answer, by
    torch.max, whose CPU kernel is vectorized for 16-bit rows where argmax's is not (several times
    faster at a step's rows: docs/benchmarks.md, "The greedy choice on a CPU")."""
    return torch.max(logits, dim=-1).indices


class StepLogits:
    """One step's logits ([rows, vocab], on the step's device) and what the step's greedy samplers need
    of them, computed for every row at once at first need: the greedy token, and its log-probability with
    the top alternatives. One transfer to the host per step instead of one (or several) per job; a row
    is computed the same way alone or beside others (row-wise reductions only)."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits
        self._greedy: list[int] | None = None
        self._logprobs: tuple[list[float], list[list[int]], list[list[float]]] | None = None

    def row(self, i: int) -> RowLogits:
        return RowLogits(self, i)

    def greedy(self, i: int) -> int:
        if self._greedy is None:
            self._greedy = first_max(self.logits).tolist()
        return self._greedy[i]

    def greedy_logprob(self, i: int, top: int) -> TokenLogprob:
        """Row i's greedy token with its log-probability and `top` alternatives (the model's own)."""
        if self._logprobs is None:
            logp = torch.log_softmax(self.logits.float(), dim=-1)
            greedy = first_max(self.logits).unsqueeze(1)
            k = min(MOST_ALTERNATIVES, logp.shape[-1])
            top_values, top_ids = torch.topk(logp, k, dim=-1)
            self._logprobs = (logp.gather(1, greedy)[:, 0].tolist(), top_ids.tolist(), top_values.tolist())
        chosen, ids, values = self._logprobs
        alternatives = tuple(zip(ids[i][:top], values[i][:top], strict=True))
        return TokenLogprob(self.greedy(i), chosen[i], alternatives)


class RowLogits:
    """One row of a StepLogits: what a job's sampler gets after a step."""

    __slots__ = ("index", "step")

    def __init__(self, step: StepLogits, index: int) -> None:
        self.step = step
        self.index = index

    @property
    def tensor(self) -> torch.Tensor:
        return self.step.logits[self.index]


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

    @property
    def _processes(self) -> bool:
        """Whether any logits processor applies (bias, penalties, a grammar)."""
        p = self.params
        return bool(p.logit_bias or p.presence_penalty or p.frequency_penalty or self._matcher is not None)

    def _processed(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.params
        if not (self._processes and (p.logit_bias or self._counts or self._matcher is not None)):
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

    def __call__(self, logits: torch.Tensor | RowLogits) -> int:
        """`logits`: the last position's scores, shape [vocab] (or a row of a step's logits)."""
        p = self.params
        if isinstance(logits, RowLogits):
            if p.temperature <= 0 and not self._processes:
                token = logits.step.greedy(logits.index)  # the step's batched choice: no per-job transfer
                if p.logprobs is not None:
                    self.last = logits.step.greedy_logprob(logits.index, p.logprobs)
                self._counts[token] += 1
                return token
            logits = logits.tensor
        if logits.device.type != "cpu":
            logits = logits.float().cpu()  # the processors, the sampling and the logprobs on the host
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
            return int(first_max(logits))
        scaled = logits.float().cpu() / p.temperature
        if torch.isinf(scaled.max()):  # a temperature so close to 0 the division overflows: its limit
            return int(first_max(logits))
        if 0 < p.top_k < scaled.numel():
            kth = torch.topk(scaled, p.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
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
