"""One job's generation, as steps the worker interleaves: prefill chunks, then one token per step.

Prefill reuses the longest stored KV prefix for the job's tenant and model and computes only the rest;
a stored chunk that fails to load is never fatal: the job recomputes from scratch. When the job ends,
the KV of every token it fed (prompt + answer) goes back to the store, which keeps only new chunks.
"""

from __future__ import annotations

import logging
import time
from contextlib import ExitStack

import torch

from kvtier import KVLoadError, KVStore, PrefixMatch

from .jobs import Failed, Finished, FirstToken, Job, TextDelta
from .kv_cache import cache_layers, job_cache
from .loader import LoadedModel
from .sampling import Sampler
from .text_stream import TextStream

log = logging.getLogger("attnstore.runner")


class JobState:
    """Everything the worker keeps for a running job between its steps."""

    def __init__(self, job: Job, lm: LoadedModel, store: KVStore | None, prefill_chunk: int):
        self.job = job
        self.lm = lm
        self.store = store if job.request.reuse else None
        self.prefill_chunk = prefill_chunk
        req = job.request
        self.sampler = Sampler(req.sampling)
        self.text = TextStream(lm.tokenizer, req.sampling.stop)
        self.fed_ids: list[int] = []  # tokens whose KV is in the cache
        self.generated: list[int] = []
        self.pending_token: int | None = None  # sampled, not yet fed
        self.cache = None
        self.match: PrefixMatch | None = None
        self.reused = 0
        self.prefill_started: float | None = None
        self._pins = ExitStack()
        self.finished = False
        self.finish_reason: str | None = None

    # -- steps -------------------------------------------------------------------------------------

    def step(self) -> None:
        """Run the job's next unit of work; never raises (a failure ends the job with Failed)."""
        try:
            if self.job.cancelled:
                self._finish("cancelled")
            elif self.cache is None:
                self._begin()
            elif len(self.fed_ids) < len(self.job.request.prompt_ids):
                self._prefill_more()
            else:
                self._decode()
        except Exception as exc:  # a bug or an OOM must end this job only, never the worker
            log.exception("job failed")
            self._pins.close()
            self.finished = True
            self.job.emit(Failed(f"local generation failed: {exc}"))

    def _begin(self) -> None:
        req = self.job.request
        self.prefill_started = time.monotonic()
        capacity = len(req.prompt_ids) + req.sampling.max_tokens
        if self.store is not None:
            # The last prompt token is always computed: its logits choose the first answer token.
            match = self.store.lookup(req.namespace, req.prompt_ids[:-1], hint_keys=req.hint_keys)
            if match.tokens:
                self._pins.enter_context(self.store.acquire(match))
                self.match = match
                restored = self.store.load(match, capacity=capacity)
                self.cache = job_cache(self.lm.model.config, capacity, restored, match.tokens)
                self.fed_ids = list(req.prompt_ids[: match.tokens])
                self.reused = match.tokens
                try:
                    self._prefill_more()
                    return
                except KVLoadError as exc:
                    log.warning("stored KV unreadable (%s); recomputing the prompt", exc)
                    self._pins.close()
                    self.match, self.reused = None, 0
        self.cache = job_cache(self.lm.model.config, capacity)
        self.fed_ids = []
        self._prefill_more()

    def _prefill_more(self) -> None:
        prompt = self.job.request.prompt_ids
        start = len(self.fed_ids)
        end = min(len(prompt), start + self.prefill_chunk)
        logits = self._forward(prompt[start:end])
        self.fed_ids.extend(prompt[start:end])
        if end < len(prompt):
            return
        self._pins.close()  # restored KV now lives in the job's own buffers
        token = self.sampler(logits)
        now = time.monotonic()
        self.job.emit(
            FirstToken(
                reused_tokens=self.reused,
                tier=self.match.tier if self.match and self.reused else None,
                at=now,
                prefill_seconds=now - (self.prefill_started or now),
            )
        )
        self._accept(token)

    def _decode(self) -> None:
        token = self.pending_token
        assert token is not None
        logits = self._forward([token])
        self.fed_ids.append(token)
        self._accept(self.sampler(logits))

    # -- helpers -----------------------------------------------------------------------------------

    @torch.inference_mode()
    def _forward(self, ids: list[int]) -> torch.Tensor:
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.lm.device)
        out = self.lm.model(input_ids=input_ids, cache=self.cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1]

    def _accept(self, token: int) -> None:
        sampling = self.job.request.sampling
        if token in self.lm.eos_token_ids:
            self._finish("stop")
            return
        self.generated.append(token)
        delta = self.text.push(token)
        if delta:
            self.job.emit(TextDelta(delta))
        if self.text.stopped:
            self._finish("stop")
        elif len(self.generated) >= sampling.max_tokens:
            self._finish("length")
        else:
            self.pending_token = token

    def _finish(self, reason: str) -> None:
        self._pins.close()
        self.finished = True
        self.finish_reason = reason
        rest = self.text.finish() if reason != "cancelled" else ""
        if rest:
            self.job.emit(TextDelta(rest))
        keys = self._save()
        req = self.job.request
        self.job.emit(
            Finished(
                finish_reason=reason,
                prompt_tokens=len(req.prompt_ids),
                completion_tokens=len(self.generated),
                reused_tokens=self.reused,
                chunk_keys=keys,
            )
        )

    def _save(self) -> list[str]:
        """Hand the KV of every fed token to the store before the job reports its end, so the client's
        next turn (which may follow at once) finds it. The store copies only chunks it lacks."""
        if self.store is None or self.cache is None or not self.fed_ids:
            return []
        req = self.job.request
        try:
            return self.store.put(req.namespace, self.fed_ids, cache_layers(self.cache), session=req.session)
        except Exception:  # saving is an optimisation: the answer stands without it
            log.exception("saving KV failed; the answer is unaffected")
            return []
