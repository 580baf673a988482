"""The one log line per chat request (logger "attnstore"); never carries API keys or message text."""

from __future__ import annotations

import logging

log = logging.getLogger("attnstore")


def log_turn(*, session: str, turn: int, cache: str, reused: int, prompt: int, ttft_ms: float) -> None:
    """`[AttentionStore] session=<id> turn=<n> <cache> reused=<n> prompt=<n> ttft_ms=<x>`."""
    if log.isEnabledFor(logging.INFO):
        log.info(
            "[AttentionStore] session=%s turn=%d %s reused=%d prompt=%d ttft_ms=%.2f",
            session,
            turn,
            cache,
            reused,
            prompt,
            ttft_ms,
        )
