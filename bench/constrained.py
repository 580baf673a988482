"""What constrained decoding and tool-call parsing cost per token, against plain decoding, in one run.

    python -m bench.constrained [--streams 1 8] [--tokens 64] [--reps 3] [--dtype auto] [--compile]

Each variant runs `streams` greedy jobs at once on the embedded engine (the real model), decoding
`tokens` tokens each (ignore_eos, so every variant decodes as many), and reports the decode phase's
milliseconds per token (first token -> end, over all streams) as a median of `reps`, variants
interleaved: plain text; a JSON Schema grammar (xgrammar's mask on every token: what
response_format json_schema costs); a forced Hermes tool call's grammar (tool_choice named); strict
tools under a free choice (free text until a call's start tag: the prompt asks for none). Tool
parsing (the hermes parser over the streamed deltas, on the serving layer's thread) is timed on the
answers the tool-call variant produced. Then (alone with `--grammars-only`, no model) what building a
turn's grammar costs the event loop, for 1, 10 and 30 strict tools: built, against remembered (the
serving layer keeps the recent ones: an agent sends the same tools every turn). Run it alone on the
machine.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

import torch

from engine_api.prompt import render_prompt
from engine_api.sampling import SamplingParams
from engine_api.turn import Finished, FirstToken, GenerationRequest, TextDelta
from local_runner.compiled import use_cache_dir
from local_runner.engine import EmbeddedEngine
from local_runner.grammars import Grammars
from local_runner.loader import load_model
from local_runner.sampling import Sampler
from proxy.local.config import engine_config
from proxy.serving.service import LocalServing
from proxy.serving.structured import response_format_grammar
from proxy.serving.tools import ToolCallParser, constrained_calls_grammar, forced_call_grammar, tool_request
from proxy.settings import DEFAULT_MODEL_NAME, DEFAULT_MODEL_SOURCE

from .support.waiting import wait_until

# Unbounded on purpose: every variant may decode `tokens` tokens without the grammar ending first.
LIST_SCHEMA = {"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string"}}}}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "write_notes",
            "parameters": {
                "type": "object",
                "properties": {"notes": {"type": "array", "items": {"type": "string"}}},
                "required": ["notes"],
            },
        },
    }
]


def grammars() -> dict[str, str | None]:
    fmt = {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": LIST_SCHEMA}}}
    named = tool_request(
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "write_notes"}}}
    )
    strict = tool_request({"tools": [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]})
    assert named is not None and strict is not None
    return {
        "plain": None,
        "json_schema": response_format_grammar(fmt),
        "tool_call": forced_call_grammar(named, "hermes"),
        "strict_auto": constrained_calls_grammar(strict, "hermes"),
    }


# Variants whose answer is free text, the end of text included: they decode all `tokens` (ignore_eos).
FREE_TEXT = ("plain", "strict_auto")


async def run_variant(
    engine: EmbeddedEngine,
    compiled: object | None,
    prompt: list[int],
    streams: int,
    tokens: int,
    free_text: bool = True,
) -> tuple[float, list[list[str]]]:
    """(decode ms per token over all streams, each stream's text deltas)."""

    async def one() -> tuple[float, float, int, list[str]]:
        sampling = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=free_text)
        job = engine.submit(
            GenerationRequest(DEFAULT_MODEL_NAME, prompt, sampling, reuse=False, compiled_grammar=compiled)
        )
        first_at, deltas = 0.0, []
        async for event in job.events():
            if isinstance(event, FirstToken):
                first_at = time.perf_counter()
            elif isinstance(event, TextDelta):
                deltas.append(event.text)
            elif isinstance(event, Finished):
                return first_at, time.perf_counter(), event.completion_tokens, deltas
        raise RuntimeError("the job failed")

    results = await asyncio.gather(*(one() for _ in range(streams)))
    start, end = min(r[0] for r in results), max(r[1] for r in results)
    decoded = sum(r[2] - 1 for r in results)  # the first token belongs to the prefill
    return (end - start) * 1000 / max(1, decoded), [r[3] for r in results]


def sampler_ms(compiled: object | None, vocab: int, tokens: int) -> float:
    """Milliseconds per token of the sampler alone (greedy; with a grammar: the mask filled and applied,
    the token accepted), on fixed random logits, along a path the grammar allows."""
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(0))
    sampler = Sampler(SamplingParams(temperature=0), compiled)
    started, n = time.perf_counter(), 0
    while n < tokens and not sampler.grammar_done:
        sampler(logits)
        n += 1
    return (time.perf_counter() - started) * 1000 / max(1, n)


def parse_us_per_token(answers: list[list[str]]) -> float:
    """Microseconds per delta of the hermes parser over streamed answers."""
    deltas = sum(len(a) for a in answers)
    started = time.perf_counter()
    for _ in range(20):
        for answer in answers:
            parser = ToolCallParser("hermes")
            for delta in answer:
                parser.feed(delta)
            parser.finish()
    return (time.perf_counter() - started) * 1e6 / (20 * max(1, deltas))


async def main_async(args: argparse.Namespace) -> None:
    lm = load_model(DEFAULT_MODEL_NAME, DEFAULT_MODEL_SOURCE, dtype=args.dtype, cache_dir=args.cache_dir)
    engine = EmbeddedEngine(
        {DEFAULT_MODEL_NAME: lm},
        config=engine_config(max_running=max(args.streams), compile=args.compile, min_free_memory_bytes=0),
    ).start()
    wait_until(lambda: not engine.steps[DEFAULT_MODEL_NAME].compiling, "the compile", 900, interval=0.5)
    compiler = Grammars(lm)
    compiled = {name: compiler.compile(g) if g else None for name, g in grammars().items()}
    prompt = render_prompt(lm.tokenizer, [{"role": "user", "content": "Write notes about the sea, as JSON."}])
    print(
        f"{lm.dtype}, {'compiled' if args.compile else 'eager'} step, {args.tokens} tokens per stream, medians of {args.reps}"
    )
    answers: list[list[str]] = []
    try:
        for streams in args.streams:
            times: dict[str, list[float]] = {name: [] for name in compiled}
            await run_variant(engine, None, prompt, streams, 8)  # warm the shapes
            for _ in range(args.reps):
                for name, grammar in compiled.items():
                    ms, texts = await run_variant(
                        engine, grammar, prompt, streams, args.tokens, free_text=name in FREE_TEXT
                    )
                    times[name].append(ms)
                    if name == "tool_call":
                        answers = texts
            plain = statistics.median(times["plain"])
            print(f"\n{streams} stream(s)\n| variant | ms per token | against plain |\n|---|---|---|")
            for name, values in times.items():
                ms = statistics.median(values)
                print(f"| {name} | {ms:.2f} | {ms / plain:.3f} |")
        vocab = lm.model.config.vocab_size
        print(
            "\nthe sampler alone, ms per token: "
            + ", ".join(
                f"{name} {sampler_ms(grammar, vocab, args.tokens):.3f}" for name, grammar in compiled.items()
            )
        )
        print(f"hermes tool parsing: {parse_us_per_token(answers):.1f} us per streamed delta")
    finally:
        engine.close()


def strict_tool(name: str) -> dict:
    params = {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "unit": {"type": "string", "enum": ["c", "f"]},
            "days": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["city", "unit", "days", "tags"],
        "additionalProperties": False,
    }
    return {"type": "function", "function": {"name": name, "strict": True, "parameters": params}}


def serving_for_grammars(model: str = "m", parser: str = "hermes") -> LocalServing:
    """A serving layer without an engine whose `model` renders tools and writes `parser`'s calls: all
    that building a turn's grammar asks of it. Shut its `prompts.pool` down after."""
    from proxy.cluster.session_index import MemorySessionIndex
    from proxy.serving.options import ChatSetup

    serving = LocalServing(
        None,  # type: ignore[arg-type] - grammars ask the engine nothing once the setup is known
        MemorySessionIndex(),
        replica="bench",
        reuse=True,
        default_max_tokens=16,
        truncate_on_overflow=True,
    )
    serving._setups[model] = ChatSetup(None, True, parser)
    return serving


def grammar_building(reps: int = 200) -> None:
    """A turn's grammar on the event loop: built (xgrammar, `LocalServing._build_grammar`) against
    remembered (`LocalServing._grammar`'s memo), for the same request."""
    import orjson

    from proxy.openai.requests import parse_chat
    from proxy.serving.service import _tools

    serving = serving_for_grammars()
    print("\n| strict tools | built, ms | remembered, us | ratio |\n|---|---|---|---|")
    for count in (1, 10, 30):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        body["tools"] = [strict_tool(f"tool_{i}") for i in range(count)]
        chat = parse_chat(orjson.dumps(body))
        tools = _tools(chat)
        serving._build_grammar(chat, tools)  # the imports, once
        built, remembered = [], []
        for _ in range(reps // 10):
            started = time.perf_counter()
            serving._build_grammar(chat, tools)
            built.append(time.perf_counter() - started)
        serving._grammar(chat, tools)
        for _ in range(reps):
            started = time.perf_counter()
            serving._grammar(chat, tools)
            remembered.append(time.perf_counter() - started)
        b, r = statistics.median(built), statistics.median(remembered)
        print(f"| {count} | {b * 1e3:.2f} | {r * 1e6:.1f} | {b / r:.0f}x |")
    serving.prompts.pool.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--cache-dir", type=Path, default=Path("var/models"))
    parser.add_argument("--grammars-only", action="store_true", help="only the grammars' building")
    args = parser.parse_args()
    if not args.grammars_only:
        use_cache_dir(args.cache_dir / "compiled")
        asyncio.run(main_async(args))
    grammar_building()


if __name__ == "__main__":
    main()
