"""One running job between steps: its reused KV, how much of its prompt is fed, what it has generated.

The worker decides what runs in each step; a JobState says what its job needs next (`next_tokens`) and
takes the result (`advance`). Prefill reuses the longest stored KV prefix for the job's tenant and model
and computes only the rest; a stored chunk that fails to load is never fatal: the job recomputes from
scratch. When the job ends, the KV of every token it fed (prompt + answer) goes back to the store,
which keeps only the chunks it lacks.
"""

from __future__ import annotations

import logging
import time
from contextlib import ExitStack

import torch

from kvtier import KVLoadError, KVStore, PrefixMatch, RestoredKV

from .job_kv import JobKV
from .jobs import Failed, Finished, FirstToken, Job, TextDelta
from .loader import LoadedModel
from .realign import Realignment, ShiftedKV, ShiftStats, find_realignment, used_tokens_by_tier
from .rope_shift import RopeShift
from .sampling import Sampler
from .text_stream import TextStream

log = logging.getLogger("attnstore.runner")


class JobState:
    def __init__(
        self,
        job: Job,
        lm: LoadedModel,
        store: KVStore | None,
        *,
        rope: RopeShift | None = None,
        shift_stats: ShiftStats | None = None,
    ):
        self.job = job
        self.lm = lm
        self.store = store if job.request.reuse else None
        req = job.request
        self.sampler = Sampler(req.sampling)
        self.text = TextStream(lm.tokenizers.get(), req.sampling.stop)
        self.capacity = len(req.prompt_ids) + req.sampling.max_tokens
        self.fed_ids: list[int] = []  # tokens whose KV is in self.kv
        self.generated: list[int] = []
        self.pending_token: int | None = None  # sampled, not yet fed
        self.match: PrefixMatch | None = None
        self.restored: RestoredKV | None = None  # until the restore is known to have succeeded
        self.reused = 0
        self.rope = rope  # the model's RoPE where a truncated turn may move stored KV
        self.shift_stats = shift_stats
        self.realigned: Realignment | None = None  # the kept turns' KV, moved after a truncation
        self._pins = ExitStack()
        self.kv = JobKV(lm.layout, lm.device, self.capacity)
        self.finished = False
        self.finish_reason: str | None = None
        self._retried_lookup = False  # recompute() looks the prompt up again once

    # -- start ----------------------------------------------------------------------------------------

    def begin(self) -> None:
        """Find the stored prefix and start restoring it in the background (never waits for it)."""
        req = self.job.request
        if self.store is None:
            return
        # The last prompt token is always computed: its logits choose the first answer token.
        match = self.store.lookup(req.namespace, req.prompt_ids[:-1], hint_keys=req.hint_keys)
        if self.rope is not None and req.previous_keys and self._begin_shifted(match.tokens):
            return
        if not match.tokens:
            return
        self._pins.enter_context(self.store.acquire(match))
        self.match = match
        self.restored = self.store.load(match, capacity=self.capacity)
        self.kv = JobKV(self.lm.layout, self.lm.device, self.capacity, self.restored, match.tokens)
        self.fed_ids = list(req.prompt_ids[: match.tokens])
        self.reused = match.tokens

    def _begin_shifted(self, in_place: int) -> bool:
        """A truncated turn: restore the session's previous sequence and move the kept turns' KV to their
        new positions (realign.py), when that reuses more than the `in_place` tokens of an ordinary
        lookup. The dropped turns in between are read too (one ordinary load), then overwritten."""
        assert self.store is not None and self.rope is not None
        req = self.job.request
        previous = self.store.chain_tokens(req.namespace, req.previous_keys)
        found = find_realignment(req.prompt_ids, previous)
        if found is None or found.reused <= in_place:
            return False
        source = self.store.lookup(req.namespace, previous[: found.source_end], count=False)
        found = found.within(source.tokens)
        if found is None or found.reused <= in_place:
            return False
        self._pins.enter_context(self.store.acquire(source))
        self.match = source
        self.restored = self.store.load(source, capacity=max(self.capacity, found.source_end))
        shifted = ShiftedKV(self.restored, found, self.rope)
        self.kv = JobKV(self.lm.layout, self.lm.device, self.capacity, shifted, found.reused)
        self.fed_ids = list(req.prompt_ids[: found.reused])
        self.reused = found.reused
        self.realigned = found
        return True

    @property
    def restoring(self) -> bool:
        """Its stored KV is still being read: a batch with other jobs leaves it out (never waits on a disk)."""
        return self.restored is not None and not self.restored.ready

    def wait_restore(self, timeout: float) -> None:
        """Block until the restore is ready or `timeout` seconds pass (overlap_with_compute off)."""
        if self.restored is not None:
            self.restored.wait_ready(timeout)

    def settle_restore(self) -> None:
        """Once the restore is ready: keep it, or recompute from scratch if it failed."""
        if self.restored is None or not self.restored.ready:
            return
        try:
            self.restored.wait()
        except KVLoadError as exc:
            self.recompute(exc)
        else:
            self.restored = None

    def recompute(self, exc: BaseException) -> None:
        log.warning("stored KV unreadable (%s); recomputing the prompt", exc)
        self._pins.close()
        self.match, self.restored, self.reused, self.realigned = None, None, 0, None
        self.kv.drop_restored()
        self.fed_ids = []
        if not self._retried_lookup:
            # The store has dropped every bad chunk of the match by now: look up again once, so the
            # valid chunks before the first bad one are still reused (issue 13).
            self._retried_lookup = True
            try:
                self.begin()
            except Exception:
                log.warning("a second lookup after a failed restore failed; recomputing", exc_info=True)
                self._pins.close()
                self.match, self.restored, self.reused, self.fed_ids = None, None, 0, []
                self.kv.drop_restored()

    # -- steps ----------------------------------------------------------------------------------------

    @property
    def prefilling(self) -> bool:
        return len(self.fed_ids) < len(self.job.request.prompt_ids)

    def next_tokens(self, budget: int) -> list[int]:
        """The tokens to feed in the next step: up to `budget` of the prompt, or the one sampled token."""
        if self.prefilling:
            start = len(self.fed_ids)
            return list(self.job.request.prompt_ids[start : start + max(1, budget)])
        assert self.pending_token is not None
        return [self.pending_token]

    def advance(self, fed: list[int], logits: torch.Tensor | None) -> None:
        """The step fed `fed` (their KV is in self.kv); `logits` score the next token after them, given
        when the prompt is complete. Never raises: a failure ends this job only."""
        try:
            self.fed_ids.extend(fed)
            if logits is None:
                return
            if self.pending_token is None:
                self._first_token(logits)
            else:
                self._accept(self.sampler(logits))
        except Exception as exc:
            self.fail(exc)

    def _first_token(self, logits: torch.Tensor) -> None:
        self._pins.close()  # the restored KV lives in the job's own buffers now
        token = self.sampler(logits)
        tiers = self._reused_by_tier()
        if self.realigned is not None and self.shift_stats is not None:
            self.shift_stats.count(self.realigned.n)
        self.job.emit(
            FirstToken(
                reused_tokens=self.reused,
                # The slowest tier the reused KV came from (the one the turn waited on).
                tier=next((t for t, n in reversed(tiers.items()) if n), None),
                tiers=tiers,
                at=time.monotonic(),
                position_shift=self.realigned.shift if self.realigned else 0,
            )
        )
        self._accept(token)

    def _reused_by_tier(self) -> dict[str, int]:
        """Reused tokens per tier, every tier named ({} on a miss); of a shifted restore, only the tokens
        the prompt uses."""
        if not (self.match and self.reused):
            return {}
        if self.realigned is not None:
            return used_tokens_by_tier(self.match, self.realigned)
        return {str(t): n for t, n in self.match.tokens_by_tier().items()}

    def _accept(self, token: int) -> None:
        if token in self.lm.eos_token_ids:
            self.finish("stop")
            return
        self.generated.append(token)
        delta = self.text.push(token)
        if delta:
            self.job.emit(TextDelta(delta))
        if self.text.stopped:
            self.finish("stop")
        elif len(self.generated) >= self.job.request.sampling.max_tokens:
            self.finish("length")
        else:
            self.pending_token = token

    # -- end ------------------------------------------------------------------------------------------

    def fail(self, exc: BaseException, *, status: int = 500, code: str | None = None) -> None:
        log.error("job failed: %s", exc, exc_info=exc if status == 500 else None)
        self._end()
        self.job.emit(Failed(f"local generation failed: {exc}", status=status, code=code))

    def finish(self, reason: str) -> None:
        self._end()
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

    def _end(self) -> None:
        self._pins.close()
        self.finished = True

    def _save(self) -> list[str]:
        """Hand the KV of every fed token to the store before the job reports its end, so the client's
        next turn (which may follow at once) finds it. The store copies only chunks it lacks."""
        if self.restored is not None:
            if len(self.fed_ids) <= self.reused:
                return []  # cancelled before computing anything: all it holds is stored already
            # It ended on its first step, which read every layer while the store was still settling
            # the restore (promotion, unpinning): the KV is complete, only the bookkeeping lags.
            self.restored.wait_ready(10.0)
            self.settle_restore()
        if self.store is None or not self.fed_ids or self.restored is not None:
            return []
        req = self.job.request
        try:
            return self.store.put(req.namespace, self.fed_ids, self.kv.layers(), session=req.session)
        except Exception:  # saving is an optimisation: the answer stands without it
            log.exception("saving KV failed; the answer is unaffected")
            return []
