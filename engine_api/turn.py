"""A turn as an engine takes it (`GenerationRequest`) and the events it yields back, in order:

    FirstToken   the prompt is processed: reused tokens per tier, position shift, when
    TextDelta    text of the answer, in order (with the tokens' log-probabilities when asked)
    Finished     the end: finish reason, token counts, reused tokens, the chunk keys it saved
    Failed       an error; before FirstToken it is the client's answer (status, code)

Both engines produce these; the serving layer writes them in whichever API shape the client asked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .sampling import SamplingParams, TokenLogprob


@dataclass
class GenerationRequest:
    """What a caller asks for. Owned by its caller, and read-only once submitted: the serving layer
    derives variants with `dataclasses.replace` (a compiled grammar, an n > 1 fork), and an engine
    keeps what it decides about a turn on its own records (the embedded engine's `Job.max_tokens`),
    never here."""

    model: str
    prompt_ids: list[int]
    sampling: SamplingParams
    namespace: str = "anonymous"  # the tenant: KV is never shared across namespaces
    session: str | None = None
    hint_keys: Sequence[str] = ()  # KV chunk keys another replica may have saved on the shared disk
    previous_keys: Sequence[str] = ()  # a truncated turn: the session's previous sequence, as chunk keys
    reuse: bool = True
    client: str = ""  # who is asking (a tenant, or an address without a key): admission is fair per client
    # A miss that the upstream could serve instead (it serves the same model): while it waits, a hit
    # that finds the queue full may take its place, and it goes upstream (cost-aware routing).
    may_overflow: bool = False
    # sampling.grammar compiled for this model's tokenizer (the engine's `Grammars.compile`), or None.
    compiled_grammar: object | None = None
    # n > 1: another answer to `fork_of`'s prompt, submitted once that job has its first token; its
    # prompt's KV is copied from that job's KV (the prompt is computed once for the n answers).
    fork_of: GenerationRequest | None = None


@dataclass
class FirstToken:
    """The prompt is processed and the first token chosen: the moment TTFT measures."""

    reused_tokens: int
    tier: str | None  # the slowest tier the reused KV came from ("l0"/"l1"/"l2"), None on a miss
    at: float  # time.monotonic()
    tiers: dict[str, int] = field(default_factory=dict)  # reused tokens per tier
    position_shift: int = 0  # positions the reused KV was moved by after a truncation
    skipped_tokens: int = 0  # stored tokens recomputed, not restored: loading them was measured slower


@dataclass
class TextDelta:
    text: str
    # The tokens this text comes from, when the request asked for logprobs (a delta may carry tokens
    # whose text is still held back, and the last delta may carry tokens without text).
    logprobs: list[TokenLogprob] | None = None


@dataclass
class Finished:
    finish_reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    completion_tokens: int
    reused_tokens: int
    chunk_keys: list[str] = field(default_factory=list)  # the conversation's KV chunks, for the session index
    # The stop string that ended the answer (finish_reason "stop"), None when it ended otherwise (its
    # end-of-sequence token, a grammar's end): Anthropic's `stop_sequence` names it.
    stop_sequence: str | None = None


@dataclass
class Failed:
    message: str
    status: int = 500  # what the proxy answers when nothing was sent yet
    code: str | None = None  # OpenAI error code, when there is one
    retry_after_s: float | None = None  # a 429: when the client may try again


Event = FirstToken | TextDelta | Finished | Failed
