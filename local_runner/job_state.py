"""One admitted job between steps: its pages and reused KV, how much of its prompt is fed, what it generated.

A job's life is an explicit `Status`:

    RESTORING   its stored prefix is still being read into its pages: steps leave it out (unless nothing
                else can run, and then it computes while its layers arrive)
    PREFILLING  feeding prompt tokens, in chunks under the step's token budget
    DECODING    one sampled token per step
    SAVING      ended (its last text is sent); its KV is being handed to the store off the step thread,
                then `Finished` goes out and its pages are free
    DONE        nothing left: its pages are back in the pool

A job the pool cannot grow (every page taken, on a device) may be preempted: its pages go back and it
waits again; when it runs again it feeds its prompt and the tokens it generated so far once more
(`preempt`), then decodes on.

The worker decides what runs in each step; a JobState says what it needs next (`next_tokens`) and takes
the result (`advance`). Prefill reuses the longest stored KV prefix for the job's tenant and model and
computes only the rest; a stored chunk that fails to load is never fatal: the job recomputes.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from contextlib import ExitStack

from engine_api.sampling import TokenLogprob
from engine_api.turn import Failed, Finished, FirstToken, TextDelta
from kvtier import KVLoadError, KVStore, PrefixMatch, RestoredKV

from .job_kv import JobKV
from .jobs import Job
from .kv_pages import PagePool, PoolExhausted
from .loader import LoadedModel
from .realign import Realignment, ShiftedKV, ShiftStats, find_realignment, used_tokens_by_tier
from .rope_shift import RopeShift
from .sampling import RowLogits, Sampler
from .text_stream import TextStream

log = logging.getLogger("attnstore.runner")

# How often the save hand-off says it still waits for a restore to settle (a restore reads from memory or
# disk: this only makes a hang visible).
SETTLE_TIMEOUT_S = 60.0


class Status(enum.Enum):
    RESTORING = "restoring"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    SAVING = "saving"
    DONE = "done"


class JobState:
    """The engine's view of one admitted job (nano-vllm's `Sequence`, with `Job` as its client side).

    Owners: every field here, `status` included, is written by this object's own methods, which run on
    the worker's thread (steps) or, after the job left `running`, on the save hand-off's thread (`save`),
    never both at once; the scheduler and the engine only read them. `job` is shared with the client
    (see `Job`), `pool` and `store` are the engine's, and `shift_stats` is the engine's counter, which
    locks itself."""

    def __init__(
        self,
        job: Job,
        lm: LoadedModel,
        store: KVStore | None,
        kv: JobKV,
        *,
        rope: RopeShift | None = None,
        shift_stats: ShiftStats | None = None,
        fork_source: JobState | None = None,
        restore_plan: Callable[[PrefixMatch], PrefixMatch] | None = None,
    ):
        self.job = job
        self.lm = lm
        self.store = store if job.request.reuse else None
        self.pool: PagePool = kv.pool
        req = job.request
        self.sampler = Sampler(req.sampling, req.compiled_grammar)
        self._logprobs: list[TokenLogprob] = []  # tokens accepted since the last TextDelta (when asked)
        self.text = TextStream(lm.tokenizers.get(), req.sampling.stop)
        self.fed_ids: list[int] = []  # tokens whose KV is in self.kv
        self.feed: list[int] = req.prompt_ids  # what prefill feeds: the prompt (or a preempted job's tokens)
        self._replaying = False  # a preempted job feeding its tokens again (their logits are not sampled)
        self.generated: list[int] = []
        self.pending_token: int | None = None  # sampled, not yet fed
        self.match: PrefixMatch | None = None
        self.restored: RestoredKV | None = None  # until the restore is known to have succeeded
        self.reused = 0
        self.skipped = 0  # stored tokens recomputed: loading them was measured slower (reuse_policy)
        self._restore_plan = restore_plan
        self.rope = rope  # the model's RoPE where a truncated turn may move stored KV
        self.shift_stats = shift_stats
        self.realigned: Realignment | None = None  # the kept turns' KV, moved after a truncation
        self._pins = ExitStack()
        self.kv = kv
        self.status = Status.PREFILLING
        self.finish_reason: str | None = None
        self._retried_lookup = False  # recompute() looks the prompt up again once
        # n > 1: the running job whose pages hold this prompt's KV (read once, in begin()).
        self._fork_source = fork_source
        self.forked = 0  # prompt tokens whose KV was copied from that job's pages

    # -- start ----------------------------------------------------------------------------------------

    def begin(self) -> None:
        """Find the stored prefix and start restoring it into its pages (never waits for it)."""
        req = self.job.request
        if self._fork_source is not None:
            self._begin_forked(self._fork_source)
            self._fork_source = None
            return
        if self.store is None:
            return
        # The last prompt token is always computed: its logits choose the first answer token.
        match = self.store.lookup(req.namespace, req.prompt_ids[:-1], hint_keys=req.hint_keys)
        if self.rope is not None and req.previous_keys and self._begin_shifted(match.tokens):
            return
        if self._restore_plan is not None and match.tokens:
            kept = self._restore_plan(match)
            self.skipped = match.tokens - kept.tokens
            match = kept
        if not match.tokens:
            return
        self._pins.enter_context(self.store.acquire(match))
        self.match = match
        self.restored = self.store.load(match, out=self.kv.restore_target(match.tokens))
        self.kv.restoring_from(self.restored, match.tokens)
        self.fed_ids = list(req.prompt_ids[: match.tokens])
        self.reused = match.tokens
        self.status = Status.RESTORING

    def _begin_forked(self, source: JobState) -> None:
        """Copy the prompt's KV (but its last token, whose logits each answer computes for itself) from
        the pages of the job answering the same prompt: a copy per page instead of a prefill."""
        n = len(self.job.request.prompt_ids) - 1
        self.kv.copy_from(source.kv, n)
        self.fed_ids = list(self.job.request.prompt_ids[:n])
        self.reused = self.forked = n

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
        try:
            target = self.kv.restore_target(source.tokens)  # the dropped turns are read too, then overwritten
        except PoolExhausted:
            return False  # no room for them: an ordinary lookup instead
        self._pins.enter_context(self.store.acquire(source))
        self.match = source
        self.restored = self.store.load(source, out=target)
        self.kv.restoring_from(ShiftedKV(self.restored, found, self.rope, self.kv), found.reused)
        self.fed_ids = list(req.prompt_ids[: found.reused])
        self.reused = found.reused
        self.realigned = found
        self.status = Status.RESTORING
        return True

    def release_pins(self) -> None:
        """Let the store evict the matched chunks again (they are in its pages, or no longer needed)."""
        self._pins.close()

    @property
    def restore_pending(self) -> bool:
        """Its restore is still writing into its pages (they may not be reused before it is over)."""
        return self.restored is not None and not self.restored.ready

    @property
    def computing(self) -> bool:
        return self.status in (Status.RESTORING, Status.PREFILLING, Status.DECODING)

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
            if self.status is Status.RESTORING:
                self.status = Status.PREFILLING

    def recompute(self, exc: BaseException) -> None:
        """The stored KV could not be read: start over without it (the store dropped the bad chunks, so a
        second lookup still reuses the valid ones before them)."""
        log.warning("stored KV unreadable (%s); recomputing the prompt", exc)
        self._pins.close()
        self.match, self.restored, self.reused, self.realigned = None, None, 0, None
        self.kv.reset()
        self.fed_ids = []
        self.status = Status.PREFILLING
        if not self._retried_lookup:
            self._retried_lookup = True
            try:
                self.begin()
            except Exception:
                log.warning("a second lookup after a failed restore failed; recomputing", exc_info=True)
                self._pins.close()
                self.match, self.restored, self.reused, self.fed_ids = None, None, 0, []
                self.kv.reset()
                self.status = Status.PREFILLING

    # -- steps ----------------------------------------------------------------------------------------

    @property
    def prefilling(self) -> bool:
        return len(self.fed_ids) < len(self.feed)

    def next_tokens(self, budget: int) -> list[int]:
        """The tokens to feed in the next step: up to `budget` of the prompt, or the one sampled token."""
        if self.prefilling:
            start = len(self.fed_ids)
            return list(self.feed[start : start + max(1, budget)])
        assert self.pending_token is not None
        return [self.pending_token]

    def preempt(self) -> None:
        """The pool is short: give the pages back (after any restore into them is over: the caller checks
        `restore_pending`) and feed everything again when the job runs next (its answer so far is sent;
        the next token sampled stays pending)."""
        self._pins.close()
        self.feed = (
            list(self.fed_ids) if self.pending_token is not None else list(self.job.request.prompt_ids)
        )
        self._replaying = self.pending_token is not None
        self.fed_ids = []
        self.match, self.restored = None, None
        self.kv.release()
        self.status = Status.PREFILLING

    def advance(self, fed: list[int], logits: RowLogits | None) -> None:
        """The step fed `fed` (their KV is in self.kv); `logits` score the next token after them, given
        when the prompt is complete. Never raises: a failure ends this job only."""
        try:
            self.fed_ids.extend(fed)
            if logits is not None and self._replaying:  # the pending token was sampled before
                self._replaying = False
                return
            if logits is None:
                return
            if self.pending_token is None:
                self._first_token(logits)
            else:
                self._accept(self.sampler(logits))
        except Exception as exc:
            self.fail(exc)

    def _first_token(self, logits: RowLogits) -> None:
        self._pins.close()  # the restored KV lives in the job's pages now
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
                skipped_tokens=self.skipped,
            )
        )
        self.status = Status.DECODING
        self._accept(token)

    def _reused_by_tier(self) -> dict[str, int]:
        """Reused tokens per tier, every tier named ({} on a miss); of a shifted restore, only the tokens
        the prompt uses."""
        if self.forked:
            return {"l0": self.forked}  # from another job's pages, in the runner's device memory
        if not (self.match and self.reused):
            return {}
        if self.realigned is not None:
            return used_tokens_by_tier(self.match, self.realigned)
        return {str(t): n for t, n in self.match.tokens_by_tier().items()}

    def _accept(self, token: int) -> None:
        # `ignore_eos` decodes past the end of text, never past the end of a grammar: once the grammar
        # has taken the end of text (its matcher then allows nothing more), the answer is complete.
        ignore_eos = self.job.request.sampling.ignore_eos and not self.sampler.grammar_done
        if token in self.lm.eos_token_ids and not ignore_eos:
            self.finish("stop")
            return
        self.generated.append(token)
        if self.sampler.last is not None:
            self._logprobs.append(self.sampler.last)
        delta = self.text.push(token)
        if delta:
            self._emit_text(delta)
        if self.text.stopped:
            self.finish("stop")
        elif len(self.generated) >= self.job.max_tokens:
            self.finish("length")
        else:
            self.pending_token = token

    def _emit_text(self, text: str) -> None:
        """Text for the client, with the log-probabilities of the tokens it comes from when asked."""
        logprobs = None
        if self.job.request.sampling.logprobs is not None:
            logprobs, self._logprobs = self._logprobs, []
        self.job.emit(TextDelta(text, logprobs))

    # -- end ------------------------------------------------------------------------------------------

    def fail(self, exc: BaseException, *, status: int = 500, code: str | None = None) -> None:
        """End with an error; the pages are kept until a restore still writing into them is over."""
        log.error("job failed: %s", exc, exc_info=exc if status == 500 else None)
        self._pins.close()
        self.job.emit(Failed(f"local generation failed: {exc}", status=status, code=code))
        self.finish_reason = "error"
        self.status = Status.SAVING  # nothing to save; the hand-off only waits for the restore

    def finish(self, reason: str) -> None:
        """End normally (stop, length) or cancelled: the last text goes out now; the KV goes to the store
        and `Finished` follows from the save hand-off (see `save`), off the step thread."""
        self._pins.close()
        self.finish_reason = reason
        rest = self.text.finish() if reason != "cancelled" else ""
        if rest or (self._logprobs and reason != "cancelled"):
            self._emit_text(rest)
        self.status = Status.SAVING

    def save(self) -> None:
        """The save hand-off (a thread of the runner's, never the step's): wait for a restore still
        settling, give the KV of every fed token to the store, which copies only the chunks it lacks,
        then report the end. `Finished` carries the chunk keys, so the proxy records the session before
        the client sees the end of the answer (its next turn finds the KV)."""
        keys: list[str] = []
        if self.restored is not None:
            # The pages are reused once this returns: the restore must have stopped writing into them.
            while not self.restored.wait_ready(SETTLE_TIMEOUT_S):
                log.warning("a restore has not settled in %.0f s; its pages wait for it", SETTLE_TIMEOUT_S)
            try:
                self.restored.wait()
                self.restored = None  # it ended on its first step while the store was still settling
            except KVLoadError:
                pass  # nothing restored that could be saved; the answer (if any) stands
        if self.finish_reason != "error":
            keys = self._put()
            req = self.job.request
            self.job.emit(
                Finished(
                    finish_reason=self.finish_reason or "stop",
                    prompt_tokens=len(req.prompt_ids),
                    completion_tokens=len(self.generated),
                    reused_tokens=self.reused,
                    chunk_keys=keys,
                    stop_sequence=self.text.stop_sequence,
                )
            )
        self.status = Status.DONE

    def _put(self) -> list[str]:
        if self.store is None or not self.fed_ids or self.restored is not None:
            return []  # nothing to save, or a restore that failed or never settled
        if len(self.fed_ids) <= self.reused:
            return []  # cancelled before computing anything: all it holds is stored already
        req = self.job.request
        try:
            return self.store.put(
                req.namespace,
                self.fed_ids,
                blocks=self.kv.chunk_blocks(),
                session=req.session,
                on_blocks_read=self.kv.read_until,  # the pages are freed after put, read a while longer
            )
        except Exception:  # saving is an optimisation: the answer stands without it
            log.exception("saving KV failed; the answer is unaffected")
            return []
