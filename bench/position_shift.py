"""Positional decoupling against recompute: quality and TTFT at every truncating turn.

    python -m bench.position_shift [--conversations 4] [--min-turns 8] [--context 4096]
        [--message-tokens 400] [--answer-tokens 64] [--document-tokens 6000] [--no-document]
        [--chunk-tokens 256] [--dtype float32] [--threads 0] [--json PATH]

    # a quick check that it runs (minutes on a small CPU):
    python -m bench.position_shift --conversations 1 --min-turns 6 --max-turns 12 --context 512 \\
        --message-tokens 80 --answer-tokens 8 --document-tokens 400

Conversations: long ShareGPT conversations (their user turns, capped at --message-tokens each) and a long
document sent in parts of --message-tokens ("here is part k, summarise it"). Each is driven through the
local engine with the model's own greedy answers in a context of --context tokens, truncation on and
decouple on, so the engine cuts with its headroom as the proxy would. At every turn where the engine
moves the kept turns' KV (a position shift T > 0), the same prompt is also run as a full recompute, and:

- quality: with the reused (moved) KV as prefix, and with a recompute of the same prefix, the model
  scores the turn's new tokens and then the recompute's 64-token greedy answer (teacher-forced): top-1
  next-token agreement and mean KL(recompute || reused) over each part, and the length of the common
  prefix of the two greedy answers;
- TTFT of the turn as the engine serves it (submit to first token), reused vs recompute, interleaved.

Targets (issue 12): >= 97% top-1 agreement; TTFT with ~2,000 kept tokens >= 5x faster than recompute.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine_api.prompt import fit_turn
from engine_api.sampling import SamplingParams
from engine_api.turn import Finished, FirstToken, GenerationRequest, TextDelta
from kvtier import KVStore, StoreConfig
from local_runner.engine import EmbeddedEngine
from local_runner.job_kv import JobKV
from local_runner.kv_cache import job_cache
from local_runner.loader import LoadedModel, load_model
from proxy.local.config import engine_config
from proxy.settings import DEFAULT_MODEL_NAME, DEFAULT_MODEL_SOURCE

from .sharegpt import cap_text, default_path, iter_json_array, to_conversation

NAME = DEFAULT_MODEL_NAME
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
REPO = Path(__file__).resolve().parent.parent


@dataclass
class Row:
    conversation: str
    turn: int
    prompt_tokens: int
    reused_tokens: int
    shift: int
    new_tokens: int
    top1_new: float
    kl_new: float
    top1_answer: float
    kl_answer: float
    same_answer_prefix: int
    ttft_reuse_s: float
    ttft_recompute_s: float


async def run_job(
    engine: EmbeddedEngine, ids: list[int], answer_tokens: int, **kw
) -> tuple[float, FirstToken, Finished, str]:
    """(TTFT seconds, first event, end event, answer text) of one greedy job."""
    job = engine.submit(
        GenerationRequest(NAME, ids, SamplingParams(max_tokens=answer_tokens, temperature=0), **kw)
    )
    start = time.monotonic()
    first: FirstToken | None = None
    text: list[str] = []
    async for event in job.events():
        if isinstance(event, FirstToken):
            first = event
        elif isinstance(event, TextDelta):
            text.append(event.text)
        elif isinstance(event, Finished):
            assert first is not None
            return first.at - start, first, event, "".join(text)
    raise RuntimeError("job failed")


@torch.inference_mode()
def tail_logits(lm: LoadedModel, prefix: JobKV, tokens: list[int]) -> torch.Tensor:
    """Logits of `tokens` fed after `prefix` ([n, vocab], float32)."""
    out = lm.model(
        input_ids=torch.tensor([tokens], device=lm.device),
        cache=job_cache(lm.model.config, prefix),
        use_cache=True,
    )
    prefix.length += len(tokens)
    return out.logits[0].float()


@torch.inference_mode()
def greedy(lm: LoadedModel, ids: list[int], n: int) -> list[int]:
    out = lm.model.generate(torch.tensor([ids], device=lm.device), max_new_tokens=n, do_sample=False)
    return out[0, len(ids) :].tolist()


def compare(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    """(top-1 agreement, mean KL(ref || got)) over the rows."""
    if ref.shape[0] == 0:
        return 1.0, 0.0
    agree = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    kl = F.kl_div(F.log_softmax(got, -1), F.log_softmax(ref, -1), log_target=True, reduction="none").sum(-1)
    return agree, kl.mean().item()


def quality(lm: LoadedModel, store: KVStore, ns: str, ids: list[int], reused: int, n_answer: int):
    """Teacher-forced scores of the turn's new tokens and of the recompute's greedy answer: with the
    reused (moved) KV the engine saved as prefix, and with a recompute of the same prefix."""
    answer = greedy(lm, ids, n_answer)  # the recompute's answer (generate recomputes everything)
    tail = ids[reused - 1 :] + answer
    match = store.lookup(ns, ids[: reused - 1], count=False)
    assert match.tokens == reused - 1, (match.tokens, reused)
    restored = store.load(match, capacity=len(ids) + len(answer))
    moved = tail_logits(lm, JobKV(lm.layout, lm.device, len(ids) + len(answer), restored, reused - 1), tail)
    fresh_kv = JobKV(lm.layout, lm.device, len(ids) + len(answer))
    tail_logits(lm, fresh_kv, ids[: reused - 1])
    exact = tail_logits(lm, fresh_kv, tail)
    # Row j scores tail[j + 1]: rows [0, new) score the new prompt tokens, the rest the answer.
    new = len(ids) - reused
    top1_new, kl_new = compare(exact[:new], moved[:new])
    top1_ans, kl_ans = compare(exact[new:-1], moved[new:-1])
    moved_answer = moved[new:-1].argmax(-1).tolist()
    # Up to the first disagreement, teacher forcing is free-running greedy: the common prefix of answers.
    same = next(
        (i for i, (a, b) in enumerate(zip(answer, moved_answer, strict=False)) if a != b), len(answer)
    )
    return top1_new, kl_new, top1_ans, kl_ans, same, answer


def conversations(args, tokenizer) -> list[tuple[str, list[str]]]:
    out: list[tuple[str, list[str]]] = []
    for obj in iter_json_array(default_path()):
        if len(out) >= args.conversations:
            break
        conv = to_conversation(obj)
        if conv is not None and conv.turns >= args.min_turns:
            msgs = [cap_text(tokenizer, m, args.message_tokens) for m in conv.user_messages[: args.max_turns]]
            # Long ones only: their user turns alone fill the context one and a half times.
            if sum(len(tokenizer.encode(m, add_special_tokens=False)) for m in msgs) >= 1.5 * args.context:
                out.append((f"sharegpt:{conv.id}", msgs))
    if args.document_tokens:
        files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
        text = "\n\n".join(p.read_text() for p in files if p.is_file())
        doc = tokenizer.encode(text, add_special_tokens=False)[: args.document_tokens]
        parts = [doc[i : i + args.message_tokens] for i in range(0, len(doc), args.message_tokens)]
        msgs = [
            f"Here is part {k + 1} of a document.\n\n{tokenizer.decode(p)}\n\nSummarise this part in one sentence."
            for k, p in enumerate(parts)
        ]
        out.append(("document", msgs))
    return out


def drive(
    args, lm: LoadedModel, engine: EmbeddedEngine, store: KVStore, name: str, messages: list[str]
) -> list[Row]:
    rows = []
    history: list[dict] = [SYSTEM]
    keys: list[str] = []
    ns = f"bench-{name}"
    for turn, text in enumerate(messages):
        history.append({"role": "user", "content": text})
        rendered = fit_turn(
            engine.tokenizer(NAME),
            history,
            model=NAME,
            limit=engine.context_limit(NAME),
            reserve=args.answer_tokens,
            truncate=True,
        )
        prev = keys if rendered.dropped_messages else []
        ttft, first, end, answer = asyncio.run(
            run_job(engine, rendered.ids, args.answer_tokens, namespace=ns, session=name, previous_keys=prev)
        )
        keys = end.chunk_keys
        if not first.position_shift:
            print(
                f"{name} turn {turn}: prompt {len(rendered.ids)}, dropped {rendered.dropped_messages} messages, "
                f"reused {first.reused_tokens}",
                flush=True,
            )
        if first.position_shift:
            store.flush()
            ttft_re, *_ = asyncio.run(run_job(engine, rendered.ids, args.answer_tokens, reuse=False))
            q = quality(lm, store, ns, rendered.ids, first.reused_tokens, args.answer_tokens)
            row = Row(
                name, turn, len(rendered.ids), first.reused_tokens, first.position_shift,
                len(rendered.ids) - first.reused_tokens, *q[:5], ttft, ttft_re,
            )  # fmt: skip
            rows.append(row)
            print(
                f"{name} turn {turn}: prompt {row.prompt_tokens}, reused {row.reused_tokens} (shift {row.shift}), "
                f"top-1 new {row.top1_new:.3f} answer {row.top1_answer:.3f}, KL {row.kl_new:.4f}/{row.kl_answer:.4f}, "
                f"same greedy prefix {row.same_answer_prefix}, TTFT {ttft:.2f} s vs {ttft_re:.2f} s",
                flush=True,
            )
        history.append({"role": "assistant", "content": answer})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=4, help="long ShareGPT conversations")
    ap.add_argument("--min-turns", type=int, default=8)
    ap.add_argument("--max-turns", type=int, default=24)
    ap.add_argument("--context", type=int, default=4096, help="max_context_tokens")
    ap.add_argument("--message-tokens", type=int, default=400, help="cap per user message / document part")
    ap.add_argument("--answer-tokens", type=int, default=64)
    ap.add_argument("--document-tokens", type=int, default=6000, help="0: no document conversation")
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write every row here")
    args = ap.parse_args(argv)

    lm = load_model(
        NAME,
        DEFAULT_MODEL_SOURCE,
        device="cpu",
        dtype=args.dtype,
        cache_dir=REPO / "var" / "models",
        threads=args.threads,
    )
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="attnstore-bench-shift-") as l2:
        gb = 1 << 30
        store = KVStore(
            StoreConfig(8 * gb, 8 * gb, 32 * gb, Path(l2), chunk_tokens=args.chunk_tokens),
            lm.layout,
            lm.fingerprint,
        )
        engine = EmbeddedEngine(
            {NAME: lm},
            {NAME: store},
            config=engine_config(
                max_running=4,
                max_context_tokens=args.context,
                truncate_on_overflow=True,
                decouple=True,
                min_free_memory_bytes=0,
            ),
        ).start()
        try:
            for name, msgs in conversations(args, lm.tokenizer):
                rows += drive(args, lm, engine, store, name, msgs)
        finally:
            engine.close()
    if not rows:
        print("no turn was truncated: raise --min-turns / --message-tokens or lower --context")
        return 1
    print()
    print(
        "| turns | mean reused | mean shift | top-1 new | top-1 answer | KL new | KL answer | TTFT reuse s | TTFT recompute s | speed-up |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    med = statistics.median
    print(
        f"| {len(rows)} | {statistics.mean(r.reused_tokens for r in rows):.0f} | {statistics.mean(r.shift for r in rows):.0f} "
        f"| {statistics.mean(r.top1_new for r in rows):.3f} | {statistics.mean(r.top1_answer for r in rows):.3f} "
        f"| {statistics.mean(r.kl_new for r in rows):.4f} | {statistics.mean(r.kl_answer for r in rows):.4f} "
        f"| {med(r.ttft_reuse_s for r in rows):.2f} | {med(r.ttft_recompute_s for r in rows):.2f} "
        f"| {med(r.ttft_recompute_s / r.ttft_reuse_s for r in rows):.1f}x |"
    )
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
