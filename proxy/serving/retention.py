"""How long a finished turn's session is retained (the store holds it: kvtier/retention.py).

A turn that carried a retention hint (OpenAI's `prompt_cache_retention`, Anthropic's `cache_control.ttl`:
`ApiRequest.retention_hint_s`) is held for the hint, capped by `max_hint_s`; else a turn whose answer
ended in tool calls is held for `tool_call_wait_s` (its agent comes back with the tool's result, and LRU
would have given up its KV while the tool ran); else nothing is asked, and a hold still running (an
earlier turn's) runs out on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..settings import Settings


@dataclass(frozen=True)
class RetentionPolicy:
    tool_call_wait_s: float
    max_hint_s: float

    @classmethod
    def from_settings(cls, settings: Settings) -> RetentionPolicy | None:
        """The policy `attention_store.retention` describes; None when retention is off (or the store)."""
        store = settings.attention_store
        if not (store.enabled and store.retention.enabled):
            return None
        return cls(store.retention.tool_call_wait_s, store.retention.max_hint_s)

    def seconds(self, hint_s: float | None, ended_in_tool_calls: bool) -> float:
        """How long to hold the session after this turn; 0: ask nothing."""
        if hint_s is not None:
            return max(0.0, min(hint_s, self.max_hint_s))
        return self.tool_call_wait_s if ended_in_tool_calls else 0.0
