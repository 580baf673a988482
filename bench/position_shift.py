"""Positional decoupling against recompute: TTFT and quality at every truncating turn.

    python -m bench.position_shift [--conversations 4] [--min-turns 8] [--context 4096]
        [--message-tokens 400] [--answer-tokens 64] [--document-tokens 6000] [--chunk-tokens 256]
        [--dtype auto] [--threads 0] [--repeats 3] [--no-quality] [--breakdown] [--compare-elementwise]
        [--json PATH]

    # a quick check that it runs (minutes on a small CPU):
    python -m bench.position_shift --conversations 1 --min-turns 6 --max-turns 12 --context 512 \\
        --message-tokens 80 --answer-tokens 8 --document-tokens 400 --repeats 1 --no-quality

Conversations: long ShareGPT conversations (their user turns, capped at --message-tokens each) and a long
document sent in parts of --message-tokens ("here is part k, summarise it"). Each is driven through the
local engine (the server's defaults: dtype auto, the exact step, 16 running jobs) with the model's own
greedy answers in a context of --context tokens, truncation on and decouple on, so the engine cuts with
its headroom as the proxy would. At every turn where the engine moves the kept turns' KV (a position
shift T > 0):

- TTFT (submit to first token), `--repeats` times each, interleaved (shifted, in place, recompute,
  shifted, ...): the turn served with the previous sequence's KV moved, as the engine serves it; the
  same number of tokens reused in place (an ordinary hit of that length: what a reuse costs); and a full
  recompute. Printed per turn and at the end: the median of (shifted TTFT / recompute TTFT) over every
  repeat of every truncating turn, and the same for the in-place reuse. `--breakdown`: where the
  shifted turn's time went (its start: lookups and realignment; waits for restored layers; moving the
  kept KV); `--compare-elementwise`: each repeat also serves the shifted turn with the move before
  issue 39 (every layer's keys rotated by RopeShift.rotate's elementwise passes), first;
- quality (unless --no-quality): with the reused (moved) KV as prefix, and with a recompute of the same
  prefix, the model scores the turn's new tokens and then the recompute's greedy answer (teacher-forced):
  top-1 next-token agreement and mean KL(recompute || reused) over each part, and the length of the
  common prefix of the two greedy answers.

Targets: issue 12, >= 97% top-1 agreement and TTFT with ~2,000 kept tokens >= 5x faster than recompute;
issue 39, a truncating turn's TTFT <= 0.5x its recompute (median of >= 3).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from engine_api.prompt import fit_turn
from engine_api.sampling import SamplingParams
from engine_api.turn import Finished, FirstToken, GenerationRequest, TextDelta
from kvtier import KVStore, StoreConfig
from local_runner.engine import EmbeddedEngine
from local_runner.job_kv import JobKV
from local_runner.job_state import JobState
from local_runner.kv_cache import job_cache
from local_runner.loader import LoadedModel, load_model
from local_runner.realign import ShiftedKV
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
    # TTFT of each repeat, the variants interleaved (shifted, in place, recompute, shifted, ...)
    ttft_shifted_s: list[float]
    ttft_in_place_s: list[float]
    ttft_recompute_s: list[float]
    # --compare-elementwise: the shifted turn again with each layer's keys rotated elementwise
    ttft_elementwise_s: list[float] = field(default_factory=list)
    # --breakdown: seconds of the shifted turns spent starting (lookups, realignment), waiting for the
    # restore, and moving the kept KV (rotation and copies), per repeat
    begin_s: list[float] = field(default_factory=list)
    restore_wait_s: list[float] = field(default_factory=list)
    move_s: list[float] = field(default_factory=list)
    move_elementwise_s: list[float] = field(default_factory=list)
    top1_new: float | None = None
    kl_new: float | None = None
    top1_answer: float | None = None
    kl_answer: float | None = None
    same_answer_prefix: int | None = None

    @property
    def shifted_over_recompute(self) -> float:
        return statistics.median(
            a / b for a, b in zip(self.ttft_shifted_s, self.ttft_recompute_s, strict=True)
        )

    @property
    def in_place_over_recompute(self) -> float:
        return statistics.median(
            a / b for a, b in zip(self.ttft_in_place_s, self.ttft_recompute_s, strict=True)
        )


class Breakdown:
    """Where a shifted turn's time goes (--breakdown): the job's start (JobState._begin_shifted), the
    waits for restored layers and the moves (ShiftedKV.wait_layer around them), summed until `take()`."""

    def __init__(self) -> None:
        self.begin = self.wait = self.move = 0.0
        begin, wait_layer = JobState._begin_shifted, ShiftedKV.wait_layer
        timing = self

        def timed_begin(state: JobState, in_place: int) -> bool:
            t = time.perf_counter()
            try:
                return begin(state, in_place)
            finally:
                timing.begin += time.perf_counter() - t

        def timed_wait_layer(shifted: ShiftedKV, i: int) -> None:
            t = time.perf_counter()
            shifted._restored.wait_layer(i)
            t1 = time.perf_counter()
            wait_layer(shifted, i)
            timing.wait += t1 - t
            timing.move += time.perf_counter() - t1

        JobState._begin_shifted = timed_begin  # type: ignore[method-assign]
        ShiftedKV.wait_layer = timed_wait_layer  # type: ignore[method-assign]

    def take(self) -> tuple[float, float, float]:
        out = (self.begin, self.wait, self.move)
        self.begin = self.wait = self.move = 0.0
        return out


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
    capacity = len(ids) + len(answer)
    page = store.config.chunk_tokens
    moved_kv = JobKV.standalone(lm.layout, lm.device, capacity, page_tokens=page)
    moved_kv.restoring_from(store.load(match, out=moved_kv.restore_target(match.tokens)), reused - 1)
    moved = tail_logits(lm, moved_kv, tail)
    fresh_kv = JobKV.standalone(lm.layout, lm.device, capacity, page_tokens=page)
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


def elementwise_move(shifted: ShiftedKV, i: int) -> None:
    """ShiftedKV.wait_layer with the move before issue 39: each layer's kept keys rotated by
    RopeShift.rotate's elementwise passes (--compare-elementwise samples it beside the engine's move)."""
    shifted._restored.wait_layer(i)
    with shifted._lock:
        if i not in shifted._done:
            k_pages, v_pages = shifted._kv.pool.layer(i)
            src_pages, src_offsets, dst_pages, dst_offsets = shifted._indices(k_pages.device)
            with torch.inference_mode():
                moved = shifted._rope.rotate(k_pages[src_pages, :, src_offsets], -shifted._found.shift)
                values = v_pages[src_pages, :, src_offsets]
                k_pages[dst_pages, :, dst_offsets] = moved
                v_pages[dst_pages, :, dst_offsets] = values
            shifted._done.add(i)


# ShiftedKV.wait_layer goes through this (install_move_switch), so a sample can use another move.
ORIGINAL_MOVE = ShiftedKV.wait_layer
MOVE = [ORIGINAL_MOVE]


def install_move_switch() -> None:
    def wait_layer(shifted: ShiftedKV, i: int) -> None:
        MOVE[0](shifted, i)

    ShiftedKV.wait_layer = wait_layer  # type: ignore[method-assign]


# The session of the measuring probes, whose KV is never saved: a probe must leave the store as it found it
# (a save would also supersede the partial chunk the conversation's next turn reuses).
PROBE = "bench-probe"


def skip_probe_saves() -> None:
    put = JobState._put

    def put_unless_probe(state: JobState) -> list[str]:
        return [] if state.job.request.session == PROBE else put(state)

    JobState._put = put_unless_probe  # type: ignore[method-assign]


def measure(
    args, engine: EmbeddedEngine, store: KVStore, name: str, turn: int, ids: list[int], prev: list[str],
    breakdown: Breakdown | None,
) -> Row | None:  # fmt: skip
    """A truncating turn's TTFT, `--repeats` times each, interleaved: served with the previous
    sequence's KV moved (what the engine does), with the same tokens reused in place (an ordinary hit
    of the same length: what a reuse costs), and recomputed. The probes save nothing (`skip_probe_saves`),
    so every repeat starts from the same store. None when the engine does not shift this turn."""
    ns = f"bench-{name}"
    shifted: list[float] = []
    in_place: list[float] = []
    recompute: list[float] = []
    parts: list[tuple[float, float, float]] = []
    first = None
    if breakdown is not None:
        breakdown.take()
    elementwise: list[float] = []
    elementwise_moves: list[float] = []
    for r in range(args.repeats):
        if args.compare_elementwise:
            MOVE[0] = elementwise_move
            try:
                ttft, first, *_ = asyncio.run(
                    run_job(engine, ids, 1, namespace=ns, session=PROBE, previous_keys=prev)
                )
            finally:
                MOVE[0] = ORIGINAL_MOVE
            if not first.position_shift:
                return None
            elementwise.append(ttft)
            if breakdown is not None:
                elementwise_moves.append(breakdown.take()[2])
        ttft, first, *_ = asyncio.run(
            run_job(engine, ids, 1, namespace=ns, session=PROBE, previous_keys=prev)
        )
        if not first.position_shift:
            return None
        shifted.append(ttft)
        if breakdown is not None:
            parts.append(breakdown.take())
        # The same reused tokens stored in place (a namespace of their own), then the turn as a plain hit.
        in_place_ns = f"{ns}-in-place-{turn}-{r}"
        asyncio.run(run_job(engine, ids[: first.reused_tokens], 1, namespace=in_place_ns))
        store.flush()
        ttft, hit, *_ = asyncio.run(run_job(engine, ids, 1, namespace=in_place_ns, session=PROBE))
        assert abs(hit.reused_tokens - first.reused_tokens) <= 1, (hit.reused_tokens, first.reused_tokens)
        in_place.append(ttft)
        ttft, *_ = asyncio.run(run_job(engine, ids, 1, reuse=False))
        recompute.append(ttft)
    assert first is not None
    row = Row(
        name, turn, len(ids), first.reused_tokens, first.position_shift, len(ids) - first.reused_tokens,
        shifted, in_place, recompute,
    )  # fmt: skip
    if parts:
        row.begin_s, row.restore_wait_s, row.move_s = (list(p) for p in zip(*parts, strict=True))
    row.ttft_elementwise_s, row.move_elementwise_s = elementwise, elementwise_moves
    return row


def drive(
    args, lm: LoadedModel, engine: EmbeddedEngine, store: KVStore, name: str, messages: list[str]
) -> list[Row]:
    rows = []
    history: list[dict] = [SYSTEM]
    keys: list[str] = []
    ns = f"bench-{name}"
    breakdown = Breakdown() if args.breakdown else None
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
        row = measure(args, engine, store, name, turn, rendered.ids, prev, breakdown) if prev else None
        _, first, end, answer = asyncio.run(
            run_job(engine, rendered.ids, args.answer_tokens, namespace=ns, session=name, previous_keys=prev)
        )
        keys = end.chunk_keys
        if row is None:
            print(
                f"{name} turn {turn}: prompt {len(rendered.ids)}, dropped {rendered.dropped_messages} messages, "
                f"reused {first.reused_tokens}, shift {first.position_shift}",
                flush=True,
            )
            history.append({"role": "assistant", "content": answer})
            continue
        med = statistics.median
        line = (
            f"{name} turn {turn}: prompt {row.prompt_tokens}, reused {row.reused_tokens} (shift {row.shift}), "
            f"new {row.new_tokens}; TTFT shifted {med(row.ttft_shifted_s):.3f} s, in place "
            f"{med(row.ttft_in_place_s):.3f} s, recompute {med(row.ttft_recompute_s):.3f} s: shifted / recompute "
            f"{row.shifted_over_recompute:.2f}, in place / recompute {row.in_place_over_recompute:.2f}"
        )
        if row.ttft_elementwise_s:
            ratio = med(a / b for a, b in zip(row.ttft_elementwise_s, row.ttft_recompute_s, strict=True))
            line += f"; elementwise move: TTFT {med(row.ttft_elementwise_s):.3f} s, / recompute {ratio:.2f}"
            if row.move_elementwise_s:
                line += f", moving KV {med(row.move_elementwise_s) * 1e3:.0f} ms"
        if row.move_s:
            line += (
                f"; shifted turn: start {med(row.begin_s) * 1e3:.0f} ms, restore waits "
                f"{med(row.restore_wait_s) * 1e3:.0f} ms, moving KV {med(row.move_s) * 1e3:.0f} ms"
            )
        if args.quality:
            store.flush()
            q = quality(lm, store, ns, rendered.ids, first.reused_tokens, args.answer_tokens)
            row.top1_new, row.kl_new, row.top1_answer, row.kl_answer, row.same_answer_prefix = q[:5]
            line += (
                f"; top-1 new {row.top1_new:.3f} answer {row.top1_answer:.3f}, KL {row.kl_new:.4f}/"
                f"{row.kl_answer:.4f}, same greedy prefix {row.same_answer_prefix}"
            )
        print(line, flush=True)
        rows.append(row)
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
    ap.add_argument("--dtype", default="auto", help="auto (the server's default), float32, bfloat16")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="TTFT samples per variant and truncating turn")
    ap.add_argument("--no-quality", dest="quality", action="store_false", help="TTFT only")
    ap.add_argument("--breakdown", action="store_true", help="where a shifted turn's time goes")
    ap.add_argument(
        "--compare-elementwise",
        action="store_true",
        help="also sample the shifted turn with the elementwise rotation (the move before issue 39)",
    )
    ap.add_argument("--json", type=Path, help="write every row here")
    args = ap.parse_args(argv)

    skip_probe_saves()
    install_move_switch()
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
                max_running=16, max_context_tokens=args.context, truncate_on_overflow=True, decouple=True
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
    med = statistics.median
    mean = statistics.mean
    shifted = [a / b for r in rows for a, b in zip(r.ttft_shifted_s, r.ttft_recompute_s, strict=True)]
    in_place = [a / b for r in rows for a, b in zip(r.ttft_in_place_s, r.ttft_recompute_s, strict=True)]
    print()
    print(
        "| truncating turns | mean prompt / reused / shift | TTFT shifted s | TTFT in place s | TTFT recompute s "
        "| shifted / recompute | in place / recompute |"
    )
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {len(rows)} x {args.repeats} | {mean(r.prompt_tokens for r in rows):.0f} / "
        f"{mean(r.reused_tokens for r in rows):.0f} / {mean(r.shift for r in rows):.0f} "
        f"| {med(t for r in rows for t in r.ttft_shifted_s):.3f} | {med(t for r in rows for t in r.ttft_in_place_s):.3f} "
        f"| {med(t for r in rows for t in r.ttft_recompute_s):.3f} | {med(shifted):.2f} | {med(in_place):.2f} |"
    )
    if args.quality:
        print()
        print("| top-1 new | top-1 answer | KL new | KL answer |")
        print("|---|---|---|---|")
        print(
            f"| {mean(r.top1_new or 0 for r in rows):.3f} | {mean(r.top1_answer or 0 for r in rows):.3f} "
            f"| {mean(r.kl_new or 0 for r in rows):.4f} | {mean(r.kl_answer or 0 for r in rows):.4f} |"
        )
    elementwise = [
        a / b for r in rows for a, b in zip(r.ttft_elementwise_s, r.ttft_recompute_s, strict=False)
    ]
    if elementwise:
        print(f"\nWith the elementwise move: median {med(elementwise):.2f} over {len(elementwise)} samples")
    print(
        f"\nA truncating turn's TTFT / its recompute: median {med(shifted):.2f} over {len(shifted)} samples "
        f"({len(rows)} turns x {args.repeats} repeats, interleaved); an in-place reuse of as many tokens: "
        f"{med(in_place):.2f}"
    )
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
