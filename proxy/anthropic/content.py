"""Anthropic's content blocks, tools, tool_choice and cache_control as the chat conversation the serving
layer serves (OpenAI-shaped: system message, assistant `tool_calls`, role "tool" results, function
tools), validated as they are converted: an error names the field as Anthropic's do
(`messages.0.content.1.input: Field required`). Valid content the local engines cannot serve (images,
documents, server tools) is named, not refused: the request then goes upstream.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..errors import APIError, bad_request

# cache_control's ttl -> seconds (no ttl: Anthropic's default, 5 minutes).
CACHE_TTLS = {"5m": 300.0, "1h": 3600.0}
ROLES = ("user", "assistant")
TOOL_CHOICES = ("auto", "any", "tool", "none")
# Blocks dropped when rendering locally: the model's reasoning of an earlier turn (templates drop it too).
DROPPED_BLOCKS = ("thinking", "redacted_thinking")


def fail(where: str, problem: str) -> APIError:
    return bad_request(f"{where}: {problem}", param=where)


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def as_object(value: object, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise fail(where, "Input should be an object")
    return value


def string(obj: dict[str, Any], key: str, where: str, *, required: bool = True) -> str | None:
    value = obj.get(key)
    if value is None:
        if required:
            raise fail(f"{where}.{key}" if where else key, "Field required")
        return None
    if not isinstance(value, str):
        raise fail(f"{where}.{key}" if where else key, "Input should be a valid string")
    return value


def number(body: dict[str, Any], key: str, lo: float, hi: float) -> None:
    value = body.get(key)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise fail(key, f"Input should be a number between {lo:g} and {hi:g}")


# -- cache_control: the retention hint ---------------------------------------------------------------


def _cache_ttl(block: dict[str, Any], where: str) -> float | None:
    """A block's `cache_control` as seconds, or None without one."""
    control = block.get("cache_control")
    if control is None:
        return None
    where = f"{where}.cache_control" if where else "cache_control"
    control = as_object(control, where)
    if control.get("type") != "ephemeral":
        raise fail(f"{where}.type", "Input should be 'ephemeral'")
    ttl = control.get("ttl", "5m")
    if ttl not in CACHE_TTLS:
        raise fail(f"{where}.ttl", "Input should be '5m' or '1h'")
    return CACHE_TTLS[ttl]


class Hints:
    """The longest cache_control ttl seen anywhere in the request (the store's retention hint)."""

    def __init__(self) -> None:
        self.seconds: float | None = None

    def see(self, block: dict[str, Any], where: str) -> None:
        ttl = _cache_ttl(block, where)
        if ttl is not None and (self.seconds is None or ttl > self.seconds):
            self.seconds = ttl


# -- content ---------------------------------------------------------------------------------------


def text_blocks(value: object, where: str, hints: Hints, *, only_text: bool) -> str:
    """A string, or an array of text blocks joined: `system` (`only_text`: text blocks are all it may
    hold), a tool_result's content (images and documents too, which are not served locally)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise fail(where, "Input should be a string or an array of content blocks")
    texts = []
    for i, raw in enumerate(value):
        block_where = f"{where}.{i}"
        block = as_object(raw, block_where)
        kind = string(block, "type", block_where)
        if kind != "text" and only_text:
            raise fail(f"{block_where}.type", "Input should be 'text'")
        if kind != "text":
            raise NotServed(f"{block_where}: {kind!r} blocks are not served locally")
        texts.append(string(block, "text", block_where))
        hints.see(block, block_where)
    return "\n".join(t for t in texts if t is not None)


class NotServed(Exception):
    """Valid input the local engines do not serve (the request goes upstream)."""


@dataclass
class Converter:
    """Anthropic messages -> chat messages, validating as it goes. Content the engines cannot serve
    is still validated as far as its type; the first such thing is remembered in `unserved`.

    Tool use is paired as Anthropic's API pairs it, with its errors: the message after an assistant's
    `tool_use` blocks is a user message with a `tool_result` for each, and a `tool_result` answers a
    `tool_use` of the message just before it. A conversation that ends on tool use is left alone."""

    hints: Hints
    out: list[dict[str, Any]] = field(default_factory=list)
    unserved: str | None = None
    # The last message's index and its tool_use ids, while the next message has yet to answer them.
    _open_calls: tuple[int, list[str]] | None = None

    def _not_served(self, reason: str) -> None:
        self.unserved = self.unserved or reason

    def message(self, raw: object, i: int) -> None:
        where = f"messages.{i}"
        msg = as_object(raw, where)
        role = msg.get("role")
        if role is None:
            raise fail(f"{where}.role", "Field required")
        if role not in ROLES:
            raise fail(f"{where}.role", "Input should be 'user' or 'assistant'")
        if "content" not in msg:
            raise fail(f"{where}.content", "Field required")
        content = msg["content"]
        open_calls, self._open_calls = self._open_calls, None
        results: list[tuple[int, str]] = []  # (block index, tool_use_id) of a user's tool_result blocks
        if isinstance(content, str):
            self.out.append({"role": role, "content": content})
        elif not isinstance(content, list):
            raise fail(f"{where}.content", "Input should be a string or an array of content blocks")
        else:
            before = len(self.out)
            if role == "user":
                results = self._user(content, where)
            elif calls := self._assistant(content, where):
                self._open_calls = (i, calls)
            if len(self.out) == before:  # nothing but dropped blocks: still a turn of its role
                self.out.append({"role": role, "content": ""})
        _check_pairing(open_calls, results, where)

    def _block(self, raw: object, where: str) -> tuple[dict[str, Any], str]:
        block = as_object(raw, where)
        kind = string(block, "type", where)
        assert kind is not None
        self.hints.see(block, where)
        return block, kind

    def _user(self, content: list[Any], where: str) -> list[tuple[int, str]]:
        """A user message's blocks as chat messages; its tool_result blocks' (index, tool_use_id)."""
        texts: list[str] = []
        results: list[tuple[int, str]] = []

        def flush() -> None:
            if texts:
                self.out.append({"role": "user", "content": "\n".join(texts)})
                texts.clear()

        for j, raw in enumerate(content):
            block_where = f"{where}.content.{j}"
            block, kind = self._block(raw, block_where)
            if kind == "text":
                texts.append(string(block, "text", block_where) or "")
            elif kind == "tool_result":
                flush()
                result = self._tool_result(block, block_where)
                self.out.append(result)
                results.append((j, result["tool_call_id"]))
            elif kind == "tool_use":
                raise fail(f"{block_where}.type", "tool_use blocks belong to assistant messages")
            elif kind not in DROPPED_BLOCKS:
                self._not_served(f"{block_where}: {kind!r} blocks are not served locally")
        flush()
        return results

    def _tool_result(self, block: dict[str, Any], where: str) -> dict[str, Any]:
        call_id = string(block, "tool_use_id", where)
        is_error = block.get("is_error", False)
        if is_error is not None and not isinstance(is_error, bool):
            raise fail(f"{where}.is_error", "Input should be a valid boolean")
        text = ""
        if block.get("content") is not None:
            try:
                text = text_blocks(block["content"], f"{where}.content", self.hints, only_text=False)
            except NotServed as exc:
                self._not_served(str(exc))
        if is_error:
            text = f"Error: {text}"
        return {"role": "tool", "tool_call_id": call_id, "content": text}

    def _assistant(self, content: list[Any], where: str) -> list[str]:
        """An assistant message's blocks as one chat message; its tool_use ids."""
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, raw in enumerate(content):
            block_where = f"{where}.content.{j}"
            block, kind = self._block(raw, block_where)
            if kind == "text":
                texts.append(string(block, "text", block_where) or "")
            elif kind == "tool_use":
                call_id = string(block, "id", block_where)
                name = string(block, "name", block_where)
                if "input" not in block:
                    raise fail(f"{block_where}.input", "Field required")
                arguments = as_object(block["input"], f"{block_where}.input")
                # The arguments as the model wrote them (key order kept): the next turn re-renders the
                # same text and reuses its KV.
                fn = {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}
                calls.append({"id": call_id, "type": "function", "function": fn})
            elif kind == "tool_result":
                raise fail(f"{block_where}.type", "tool_result blocks belong to user messages")
            elif kind not in DROPPED_BLOCKS:
                self._not_served(f"{block_where}: {kind!r} blocks are not served locally")
        message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
        if calls:
            message["tool_calls"] = calls
        elif message["content"] is None:
            message["content"] = ""
        self.out.append(message)
        return [call["id"] for call in calls]


def _check_pairing(
    open_calls: tuple[int, list[str]] | None, results: list[tuple[int, str]], where: str
) -> None:
    """A message (`where`) after tool use: its tool_result blocks (`results`) answer exactly the
    previous message's tool_use ids (`open_calls`), in Anthropic's words."""
    calls = open_calls[1] if open_calls else []
    for j, call_id in results:
        if call_id not in calls:
            raise fail(
                f"{where}.content.{j}",
                f"unexpected `tool_use_id` found in `tool_result` blocks: {call_id}. Each `tool_result` "
                "block must have a corresponding `tool_use` block in the previous message.",
            )
    answered = {call_id for _, call_id in results}
    if open_calls and (unanswered := [c for c in calls if c not in answered]):
        raise fail(
            f"messages.{open_calls[0]}",
            f"`tool_use` ids were found without `tool_result` blocks immediately after: "
            f"{', '.join(unanswered)}. Each `tool_use` block must have a corresponding `tool_result` "
            "block in the next message.",
        )


# -- tools -----------------------------------------------------------------------------------------


def convert_tools(body: dict[str, Any], hints: Hints) -> tuple[list[dict[str, Any]], str | None, list[str]]:
    """Anthropic tools as OpenAI function tools, why they cannot be served locally (server tools:
    bash, web search, ... run by Anthropic), and every tool's name (server tools' too: a tool_choice
    may name one, and the turn then goes upstream)."""
    tools = body.get("tools")
    if tools is None:
        return [], None, []
    if not isinstance(tools, list):
        raise fail("tools", "Input should be a valid array")
    out, unserved, names = [], None, []
    for i, raw in enumerate(tools):
        where = f"tools.{i}"
        tool = as_object(raw, where)
        hints.see(tool, where)
        kind = tool.get("type")
        if kind not in (None, "custom"):
            unserved = unserved or f"{where}: server tools ({kind!r}) are not served locally"
            if isinstance(tool.get("name"), str):  # the upstream checks the rest of a server tool
                names.append(tool["name"])
            continue
        name = string(tool, "name", where)
        description = string(tool, "description", where, required=False)
        if "input_schema" not in tool:
            raise fail(f"{where}.input_schema", "Field required")
        schema = as_object(tool["input_schema"], f"{where}.input_schema")
        fn: dict[str, Any] = {"name": name, "parameters": schema}
        if description is not None:
            fn["description"] = description
        strict = tool.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise fail(f"{where}.strict", "Input should be a valid boolean")
        if strict:  # strict tool use: its input follows input_schema, as OpenAI's strict calls
            fn["strict"] = True
        out.append({"type": "function", "function": fn})
        names.append(name)
    return out, unserved, names


def convert_tool_choice(body: dict[str, Any], names: list[str]) -> tuple[Any, bool]:
    """Anthropic's tool_choice as OpenAI's (auto, required, a named function, none) and whether
    parallel calls are allowed."""
    choice = body.get("tool_choice")
    if choice is None:
        return ("auto" if names else None), True
    choice = as_object(choice, "tool_choice")
    kind = choice.get("type")
    if kind not in TOOL_CHOICES:
        raise fail("tool_choice.type", "Input should be 'auto', 'any', 'tool' or 'none'")
    parallel = choice.get("disable_parallel_tool_use", False)
    if not isinstance(parallel, bool):
        raise fail("tool_choice.disable_parallel_tool_use", "Input should be a valid boolean")
    if kind != "none" and not names:
        raise fail("tool_choice", f"tool_choice of type {kind!r} needs tools")
    if kind == "tool":
        name = string(choice, "name", "tool_choice")
        if name not in names:
            raise fail("tool_choice.name", f"no tool named {name!r} in tools")
        return {"type": "function", "function": {"name": name}}, not parallel
    return {"auto": "auto", "any": "required", "none": "none"}[kind], not parallel
