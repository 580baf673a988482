"""Next-token choice: greedy at temperature 0, else temperature + nucleus (top_p) sampling."""

from __future__ import annotations

import torch

from .params import SamplingParams

__all__ = ["Sampler", "SamplingParams"]


class Sampler:
    """Per-job sampler; a seeded generator makes a sampled answer reproducible."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self._generator: torch.Generator | None = None
        if params.temperature > 0:
            self._generator = torch.Generator(device="cpu")
            if params.seed is not None:
                self._generator.manual_seed(params.seed)
            else:
                self._generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        """`logits`: the last position's scores, shape [vocab]."""
        p = self.params
        if p.temperature <= 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float().cpu() / p.temperature, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < p.top_p
            keep[0] = True
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
        return int(torch.multinomial(probs, 1, generator=self._generator))
