"""The prompt bound: whether a prompt can possibly fit the model's context, answered before it is tokenized.

Tokenizing is the first expensive step of a local turn (its cost grows with the body), so a prompt
that cannot fit is refused by counting characters first. A model's tokens decode to at most
`max_chars_per_token` characters each (the longest token of its vocabulary, measured once per model), so
text of more than `max_chars_per_token * limit` characters has more than `limit` tokens and can never
fit, and neither can more messages than `limit` (every message renders at least one token). This bound
never refuses a prompt that would fit; what it lets through, the tokenizer decides. With
`truncate_on_overflow`, the system messages and the last message are always kept, so only they are held
to the bound; older turns that certainly cannot fit are dropped before tokenizing, oldest first (the
rendering's truncation then drops more by tokens where needed).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import APIError

_SYSTEM = ("system", "developer")


def chars_of(msg: Any) -> int:
    """Characters of a message's text (a string, or text parts); anything else counts as nothing here
    (the renderer refuses it)."""
    if not isinstance(msg, dict):
        return 0
    content = msg.get("content")
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0


def _too_long(model: str, limit: int, what: str) -> APIError:
    return APIError(
        400,
        f"the prompt cannot fit: {what}; {model} takes at most {limit} tokens here",
        param="messages",
        code="context_length_exceeded",
    )


def _role(msg: Any) -> Any:
    return msg.get("role") if isinstance(msg, dict) else None


def precheck_prompt(
    model: str,
    messages: Sequence[dict[str, Any]],
    *,
    limit: int,
    max_chars_per_token: int,
    truncate: bool,
) -> list[dict[str, Any]]:
    """The messages worth tokenizing, or a 400 `context_length_exceeded` when they certainly cannot fit
    in `limit` tokens (see the module's docstring for the bound). Linear in the number of messages."""
    max_chars = max_chars_per_token * limit
    msgs = list(messages)
    body, last = msgs[:-1], msgs[-1:]
    fixed_chars = sum(chars_of(m) for m in body if _role(m) in _SYSTEM) + sum(chars_of(m) for m in last)
    if fixed_chars > max_chars:
        raise _too_long(model, limit, f"its system and last messages have {fixed_chars} characters")
    total, count = fixed_chars, len(msgs)
    older = [i for i, m in enumerate(body) if _role(m) not in _SYSTEM]
    older_chars = [chars_of(body[i]) for i in older]
    total += sum(older_chars)
    if not truncate:
        if total > max_chars:
            raise _too_long(model, limit, f"its messages have {total} characters")
        if count > limit:
            raise _too_long(model, limit, f"it has {count} messages")
        return msgs
    # Drop the oldest turns that certainly cannot fit, then any assistant turns left at the head of
    # the history, which (as after the runner's truncation) starts with a user turn.
    j = 0
    while j < len(older) and (total > max_chars or count > limit):
        total, count, j = total - older_chars[j], count - 1, j + 1
    if j:
        while j < len(older) and _role(body[older[j]]) == "assistant":
            total, count, j = total - older_chars[j], count - 1, j + 1
    if count > limit:
        raise _too_long(model, limit, f"it has {count} system messages")
    if not j:
        return msgs
    dropped = set(older[:j])
    return [m for i, m in enumerate(body) if i not in dropped] + last


def max_chars_per_token(tokenizer: Any) -> int:
    """The most characters one token of this tokenizer's vocabulary decodes to (at least 1)."""
    vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max(1, max((len(tokenizer.convert_tokens_to_string([t])) for t in vocab if t), default=1))
