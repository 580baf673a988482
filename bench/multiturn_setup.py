"""What every `attnstore bench` run starts from: the user's settings, the ShareGPT conversations, the
servers' final stats and a description of the machine (so a JSON says where its numbers came from)."""

from __future__ import annotations

import asyncio
import os
import platform
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from .multiturn_options import BenchOptions
from .sharegpt import Conversation, cap_conversation, load_conversations, select


def load_base_settings(options: BenchOptions) -> Any:
    """The settings the in-process servers start from: --settings, $ATTNSTORE_SETTINGS, ./settings.json,
    else the defaults."""
    from proxy.settings import load_settings, parse_settings

    if options.settings or os.environ.get("ATTNSTORE_SETTINGS") or Path("settings.json").is_file():
        return load_settings(options.settings)[0]
    return parse_settings(b"{}", Path.cwd(), env={})


def prepare_conversations(
    options: BenchOptions, tokenizer: Any, count: int, min_turns: int, max_turns: int
) -> list[Conversation]:
    """`count` ShareGPT conversations picked by seed, each with at least `min_turns` user turns, capped
    at `max_turns` turns and `--max-message-tokens` tokens per message."""
    pool = load_conversations(Path(options.data) if options.data else None, min_turns)
    picked = select(pool, count, options.seed)
    return [cap_conversation(c, tokenizer, options.max_message_tokens, max_turns) for c in picked]


async def store_stats(bases: Mapping[str, str]) -> dict[str, Any]:
    """Each server's /v1/attention_store/stats at the end of the run, by label (servers without the
    endpoint, like a peer, are left out)."""
    out: dict[str, Any] = {}
    async with aiohttp.ClientSession() as http:
        for label, base in bases.items():
            try:
                async with http.get(
                    base + "/v1/attention_store/stats", timeout=aiohttp.ClientTimeout(total=10)
                ) as r:
                    if r.status == 200:
                        out[label] = await r.json()
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                continue
    return out


def machine_meta(options: BenchOptions, lm: Any, convs: Sequence[Conversation], seconds: float) -> dict:
    """The run's command, options, model, dtype, torch and machine, its conversations and duration."""
    from dataclasses import asdict

    import torch

    return {
        "command": "attnstore bench " + " ".join(options.argv),
        "options": asdict(options),
        "model": lm.name,
        "dtype": str(lm.dtype).removeprefix("torch."),
        "device": str(lm.device),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "conversations": [{"id": c.id, "turns": c.turns} for c in convs],
        "seconds": seconds,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
