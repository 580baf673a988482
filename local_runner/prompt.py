"""Chat messages -> prompt token ids, through the tokenizer's own chat template.

Only plain text turns are rendered here; anything the template cannot represent faithfully (images,
tool calls, audio) is refused with PromptError so the proxy can send the request upstream instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class PromptError(ValueError):
    """Messages the local runner cannot render; `param` names the offending field for the client."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


def _text_of(content: Any, where: str) -> str:
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


def normalize_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, str]]:
    """OpenAI messages -> the {role, content} strings a chat template expects."""
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        role = _ROLES.get(str(msg.get("role")))
        if role is None:
            raise PromptError(f"{where}.role {msg.get('role')!r} is not served locally", f"{where}.role")
        if msg.get("tool_calls") or msg.get("function_call") or msg.get("audio"):
            raise PromptError(f"{where}: tool calls are not served locally", where)
        out.append({"role": role, "content": _text_of(msg.get("content"), where)})
    if not out:
        raise PromptError("messages: at least one message is required", "messages")
    return out


def render_prompt(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, Any]]) -> list[int]:
    """Token ids of the conversation with the assistant's generation prompt appended."""
    ids = tokenizer.apply_chat_template(
        normalize_messages(messages), add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids)


def truncate_history(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, Any]], max_tokens: int
) -> list[dict[str, Any]]:
    """Drop the oldest turns (never system messages, never the last message) until the prompt fits.

    Leading assistant messages left behind by a dropped user turn go too, so the history still starts
    with a user turn after the system prompt."""
    kept = list(messages)
    while len(render_prompt(tokenizer, kept)) > max_tokens:
        droppable = [i for i, m in enumerate(kept[:-1]) if m.get("role") not in ("system", "developer")]
        if not droppable:
            break
        del kept[droppable[0]]
        while len(kept) > 1 and kept[0].get("role") == "assistant":
            del kept[0]
        first = next((i for i, m in enumerate(kept) if m.get("role") not in ("system", "developer")), None)
        if first is not None and first < len(kept) - 1 and kept[first].get("role") == "assistant":
            del kept[first]
    return kept
