"""The one log line per chat request (logger "attnstore"); never carries API keys or message text."""

from __future__ import annotations

import logging

log = logging.getLogger("attnstore")


def log_turn(
    *, session: str, turn: int, cache: str, reused: int, prompt: int, ttft_ms: float, shift: int = 0
) -> None:
    """`[AttentionStore] session=<id> turn=<n> <cache> reused=<n> prompt=<n> ttft_ms=<x>`, then
    ` shift=<T>` when the reused KV was moved by T positions after a truncation (the seed's format stays
    a prefix of every line)."""
    if log.isEnabledFor(logging.INFO):
        log.info(
            "[AttentionStore] session=%s turn=%d %s reused=%d prompt=%d ttft_ms=%.2f%s",
            session,
            turn,
            cache,
            reused,
            prompt,
            ttft_ms,
            f" shift={shift}" if shift > 0 else "",
        )
