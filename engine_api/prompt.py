"""Chat messages -> prompt token ids, through the tokenizer's own chat template: the one rendering path
of every engine (the serving layer renders through `fit_turn`, so every engine cuts a conversation at
the same place).

Text turns, an assistant's tool calls and tool results are rendered here (tools through the template's
own tool rendering); anything else (images, audio) is refused with PromptError so the proxy can send
the request upstream instead.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


@dataclass(frozen=True)
class RenderedPrompt:
    ids: list[int]
    dropped_messages: int = 0  # the oldest messages truncation left out (0: the whole conversation is in)


class PromptError(ValueError):
    """Messages the local runner cannot render; `param` names the offending field for the client."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


def _text_of(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise PromptError(
                    f"{where}.content[{j}]: only text parts are served locally", f"{where}.content"
                )
            parts.append(part["text"])
        return "".join(parts)
    raise PromptError(f"{where}.content: expected a string or a list of text parts", f"{where}.content")


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's tool_calls as chat templates expect them: the arguments as an object
    (templates write them with `tojson`), in the order the client sent them."""
    if not isinstance(calls, list):
        raise PromptError(f"{where}.tool_calls must be an array", f"{where}.tool_calls")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise PromptError(f"{where}.tool_calls[{j}] needs function.name", f"{where}.tool_calls")
        arguments = fn.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except ValueError:
                raise PromptError(
                    f"{where}.tool_calls[{j}].function.arguments is not valid JSON", f"{where}.tool_calls"
                ) from None
        out.append(
            {
                "id": call.get("id"),
                "type": "function",
                "function": {"name": fn["name"], "arguments": arguments},
            }
        )
    return out


def normalize_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages -> the messages a chat template expects: {role, content} strings, an assistant's
    tool_calls (arguments as objects), a tool result's tool_call_id."""
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        role = _ROLES.get(str(msg.get("role")))
        if role is None:
            raise PromptError(f"{where}.role {msg.get('role')!r} is not served locally", f"{where}.role")
        if msg.get("function_call") or msg.get("audio"):
            raise PromptError(f"{where}: function_call and audio are not served locally", where)
        rendered: dict[str, Any] = {"role": role, "content": _text_of(msg.get("content"), where)}
        if msg.get("tool_calls"):
            if role != "assistant":
                raise PromptError(f"{where}: only assistant messages carry tool_calls", where)
            rendered["tool_calls"] = _tool_calls(msg["tool_calls"], where)
        if role == "tool" and msg.get("tool_call_id") is not None:
            rendered["tool_call_id"] = str(msg["tool_call_id"])
        out.append(rendered)
    if not out:
        raise PromptError("messages: at least one message is required", "messages")
    return out


@dataclass(frozen=True)
class PromptFormat:
    """How a model's conversation is written: its tools (the request's, rendered by the template) and
    the template itself when settings override the model's own (local_runner.chat_templates)."""

    tools: tuple[dict[str, Any], ...] = ()
    template: str | None = None


PLAIN = PromptFormat()


def render_prompt(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, Any]], chat: PromptFormat = PLAIN
) -> list[int]:
    """Token ids of the conversation with the assistant's generation prompt appended."""
    ids = tokenizer.apply_chat_template(
        normalize_messages(messages),
        tools=list(chat.tools) or None,
        chat_template=chat.template,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    return list(ids)


# Truncation leaves room: a turn cuts when its prompt would take more than 1 - ANSWER_ROOM of the context,
# and then drops whole turns until the prompt takes at most 1 - ANSWER_ROOM - HEADROOM. The HEADROOM
# quarter is what the conversation grows into before it must cut again, so a long conversation cuts once
# every few turns, and every turn in between is an ordinary prefix hit on the truncated history.
ANSWER_ROOM = 0.125
HEADROOM = 0.25


def _is_system(message: dict[str, Any]) -> bool:
    return message.get("role") in ("system", "developer")


def _kept(messages: Sequence[dict[str, Any]], cut: int, end: int) -> list[dict[str, Any]]:
    """messages[:end] without the non-system messages before index `cut`."""
    return [m for i, m in enumerate(messages[:end]) if i >= cut or _is_system(m)]


def fit_history(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[dict[str, Any]],
    limit: int,
    reserve: int = 1,
    chat: PromptFormat = PLAIN,
) -> tuple[list[int], int]:
    """(prompt ids, messages dropped): the conversation cut so that it fits `limit` with `reserve` tokens
    left for the answer, dropping the oldest whole turns (a user message and what follows it up to the
    next user message) and never a system message or the last message.

    The cut is a function of the conversation that stays put as it grows: the history is replayed turn by
    turn (the prompt each earlier turn sent ends at its user message) and a turn that crosses the
    trigger moves the cut forward, with headroom (module constants). The next turn, which the client
    sends with the whole history again, replays the same earlier turns, finds the same cut, and starts
    with the same tokens as this turn's prompt and answer: a plain prefix hit. Only a turn whose own
    `reserve` does not fit (a large max_tokens) cuts further, for itself alone."""

    def length(cut: int, end: int) -> int:
        return len(render_prompt(tokenizer, _kept(messages, cut, end), chat))

    n = len(messages)
    trigger = limit - max(1, int(limit * ANSWER_ROOM))
    target = int(limit * (1 - ANSWER_ROOM - HEADROOM))
    ids = render_prompt(tokenizer, messages, chat)
    if len(ids) <= trigger and len(ids) + reserve <= limit:
        return ids, 0  # it never crossed the trigger: no earlier turn cut either (prompts only grow)
    starts = [i for i, m in enumerate(messages) if not _is_system(m) and m.get("role") == "user"]
    ends = [s + 1 for s in starts if s + 1 < n] + [n]  # each earlier turn's prompt, then this one
    cut, k = 0, 0
    while k < len(ends):
        # The first turn from k on whose prompt crosses the trigger with the current cut (prompts grow).
        k = bisect.bisect_right(range(len(ends)), trigger, lo=k, key=lambda j: length(cut, ends[j]))
        if k == len(ends):
            break
        cut = _cut_to(length, starts, cut, ends[k], target)
        k += 1
    if length(cut, n) + reserve > limit:  # this turn's answer needs more room than the headroom left
        cut = _cut_to(length, starts, cut, n, limit - reserve)
    kept = _kept(messages, cut, n)
    return render_prompt(tokenizer, kept, chat), n - len(kept)


def fit_turn(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[dict[str, Any]],
    *,
    model: str,
    limit: int,
    reserve: int,
    truncate: bool,
    chat: PromptFormat = PLAIN,
) -> RenderedPrompt:
    """The prompt of one turn, leaving `reserve` tokens of `limit` for the answer (at most a quarter of
    the context: a large max_tokens is capped, never a reason to refuse).

    A conversation that has outgrown the context loses its oldest whole turns when `truncate` is set
    (`fit_history`); otherwise, or when even that cannot fit it, PromptError (context_length_exceeded)."""
    reserve = max(1, min(reserve, limit // 4))
    if truncate:
        ids, dropped = fit_history(tokenizer, messages, limit, reserve, chat)
    else:
        ids, dropped = render_prompt(tokenizer, messages, chat), 0
    check_fits(ids, model=model, limit=limit, reserve=reserve)
    return RenderedPrompt(ids, dropped)


def check_fits(ids: Sequence[int], *, model: str, limit: int, reserve: int, param: str = "messages") -> None:
    """PromptError (context_length_exceeded) unless the prompt leaves `reserve` of `limit` tokens."""
    if len(ids) + reserve > limit:
        raise PromptError(
            f"the prompt has {len(ids)} tokens; {model} takes at most {limit - reserve} here",
            param,
            code="context_length_exceeded",
        )


def _cut_to(length: Callable[[int, int], int], starts: list[int], cut: int, end: int, target: int) -> int:
    """The earliest turn start after `cut` from which messages up to `end` fit `target` tokens, or the
    latest one before the last message when none does (that turn's prompt is then refused or served)."""
    candidates = [s for s in starts if cut < s < end]  # a cut at end - 1 keeps the last message alone
    if not candidates:
        return cut
    i = bisect.bisect_left(candidates, -target, key=lambda s: -length(s, end))
    return candidates[min(i, len(candidates) - 1)]
