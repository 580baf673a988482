"""The fields OpenAI requires in the messages of a turn, checked before the turn is routed.

A request the upstream would refuse is refused here too, locally or not: the local engine must not serve
what OpenAI answers with a 400 (a user message without `content` rendered as an empty turn), and the
client gets OpenAI's own error: `param` names the field as OpenAI does (`messages[0].content`,
`messages[1].tool_calls[0].function.name`, `input[2].call_id`), `code` says what is wrong with it:

    missing_required_parameter   "Missing required parameter: 'messages[0].content'."
    invalid_type                 "Invalid type for 'messages[0].content': expected ..., but got ... instead."
    invalid_value                "Invalid value: 'robot'. Supported values are: ..."

What is required follows OpenAI's API reference, role by role and part by part (the types of the official
`openai` package mark the same fields `Required`). A Responses input item of a kind the local engine does
not serve (computer calls, reasoning, ...) is checked by the upstream that serves it; the message items
and the function-call items a client sends back are checked here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import APIError, bad_request

MISSING = "missing_required_parameter"
INVALID_TYPE = "invalid_type"
INVALID_VALUE = "invalid_value"

# A field's expected JSON kind, as OpenAI's messages name it.
STRING = "a string"
OBJECT = "an object"
TEXT_OR_PARTS = "one of a string or array of objects"


def missing(param: str) -> APIError:
    return bad_request(f"Missing required parameter: '{param}'.", param=param, code=MISSING)


def _kind_of(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a decimal"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def wrong_type(param: str, expected: str, value: object) -> APIError:
    return bad_request(
        f"Invalid type for '{param}': expected {expected}, but got {_kind_of(value)} instead.",
        param=param,
        code=INVALID_TYPE,
    )


def invalid_value(param: str, value: object, allowed: tuple[str, ...]) -> APIError:
    supported = ", ".join(f"'{a}'" for a in allowed)
    return bad_request(
        f"Invalid value: {value!r}. Supported values are: {supported}.", param=param, code=INVALID_VALUE
    )


def _matches(value: object, expected: str) -> bool:
    if expected == STRING:
        return isinstance(value, str)
    if expected == OBJECT:
        return isinstance(value, dict)
    return isinstance(value, str | list)  # TEXT_OR_PARTS


def require(obj: Mapping[str, Any], key: str, where: str, expected: str, *, nullable: bool = False) -> Any:
    """obj[key], present and of the expected kind (null allowed where `nullable`); else OpenAI's 400."""
    param = f"{where}.{key}" if where else key
    if key not in obj:
        raise missing(param)
    value = obj[key]
    if not (_matches(value, expected) or (nullable and value is None)):
        raise wrong_type(param, expected, value)
    return value


def require_fields(obj: Mapping[str, Any], fields: tuple[tuple[str, str], ...], where: str) -> None:
    """Every (dotted path, kind) of `fields` present in `obj`: `image_url.url` needs an object
    `image_url` holding a string `url`."""
    for path, expected in fields:
        node, prefix = obj, where
        *parents, leaf = path.split(".")
        for parent in parents:
            node = require(node, parent, prefix, OBJECT)
            prefix = f"{prefix}.{parent}"
        require(node, leaf, prefix, expected)


def _object(value: object, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise wrong_type(param, OBJECT, value)
    return value


# ---- Chat Completions ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatRole:
    """What a message of one role must carry: `content` (`nullable`: null allowed; `optional`: may be
    left out when the message carries tool_calls or function_call, the assistant's rule), the content
    part types it may hold, and its other required string fields."""

    parts: tuple[str, ...]
    nullable: bool = False
    optional: bool = False
    string_only: bool = False
    also: tuple[str, ...] = ()


CHAT_ROLES: dict[str, ChatRole] = {
    "developer": ChatRole(parts=("text",)),
    "system": ChatRole(parts=("text",)),
    "user": ChatRole(parts=("text", "image_url", "input_audio", "file")),
    "assistant": ChatRole(parts=("text", "refusal"), nullable=True, optional=True),
    "tool": ChatRole(parts=("text",), also=("tool_call_id",)),
    "function": ChatRole(parts=(), nullable=True, string_only=True, also=("name",)),
}

# Content part type -> its required fields (dotted paths into the part).
CHAT_PARTS: dict[str, tuple[tuple[str, str], ...]] = {
    "text": (("text", STRING),),
    "image_url": (("image_url.url", STRING),),
    "input_audio": (("input_audio.data", STRING), ("input_audio.format", STRING)),
    "file": (("file", OBJECT),),
    "refusal": (("refusal", STRING),),
}

# An assistant's deprecated `function_call`.
FUNCTION_CALL = (("name", STRING), ("arguments", STRING))

# An assistant's tool call, by its type -> the required fields besides `id` and `type`.
TOOL_CALLS: dict[str, tuple[tuple[str, str], ...]] = {
    "function": (("function.name", STRING), ("function.arguments", STRING)),
    "custom": (("custom.name", STRING), ("custom.input", STRING)),
}


def _typed(obj: dict[str, Any], where: str, allowed: tuple[str, ...]) -> str:
    kind = require(obj, "type", where, STRING)
    if kind not in allowed:
        raise invalid_value(f"{where}.type", kind, allowed)
    return str(kind)


def _chat_parts(parts: list[Any], where: str, allowed: tuple[str, ...]) -> None:
    for j, raw in enumerate(parts):
        part_where = f"{where}.content[{j}]"
        part = _object(raw, part_where)
        require_fields(part, CHAT_PARTS[_typed(part, part_where, allowed)], part_where)


def _tool_calls(calls: object, where: str) -> None:
    if not isinstance(calls, list):
        raise wrong_type(f"{where}.tool_calls", "an array", calls)
    for j, raw in enumerate(calls):
        call_where = f"{where}.tool_calls[{j}]"
        call = _object(raw, call_where)
        require(call, "id", call_where, STRING)
        require_fields(call, TOOL_CALLS[_typed(call, call_where, tuple(TOOL_CALLS))], call_where)


def check_chat_message(raw: object, i: int) -> dict[str, Any]:
    """messages[i] holds every field OpenAI requires of its role, each of the right kind."""
    where = f"messages[{i}]"
    msg = _object(raw, where)
    role = require(msg, "role", where, STRING)
    rule = CHAT_ROLES.get(role)
    if rule is None:
        raise invalid_value(f"{where}.role", role, tuple(CHAT_ROLES))
    calls = msg.get("tool_calls")
    if role == "assistant" and calls is not None:
        _tool_calls(calls, where)
    if role == "assistant" and msg.get("function_call") is not None:
        call_where = f"{where}.function_call"
        require_fields(_object(msg["function_call"], call_where), FUNCTION_CALL, call_where)
    carries_call = bool(calls) or msg.get("function_call") is not None
    if "content" in msg or not (rule.optional and carries_call):
        expected = STRING if rule.string_only else TEXT_OR_PARTS
        content = require(msg, "content", where, expected, nullable=rule.nullable)
        if isinstance(content, list):
            _chat_parts(content, where, rule.parts)
    for name in rule.also:
        require(msg, name, where, STRING)
    return msg


# ---- Responses --------------------------------------------------------------------------------------

RESPONSES_ROLES = ("user", "assistant", "system", "developer")
# Content part type -> its required fields; other part types (input_image, input_file, ...) are the
# upstream's to check (the local engine does not serve them).
RESPONSES_PARTS: dict[str, tuple[tuple[str, str], ...]] = {
    "input_text": (("text", STRING),),
    "output_text": (("text", STRING),),
    "text": (("text", STRING),),  # accepted here as chat's text part
    "refusal": (("refusal", STRING),),
}
# Input item type -> its required fields, for the items a client sends back in a conversation.
RESPONSES_ITEMS: dict[str, tuple[tuple[str, str], ...]] = {
    "function_call": (("call_id", STRING), ("name", STRING), ("arguments", STRING)),
    "function_call_output": (("call_id", STRING), ("output", TEXT_OR_PARTS)),
    "item_reference": (("id", STRING),),
}


def check_input_item(raw: object, i: int) -> None:
    """input[i] holds every field OpenAI requires of its kind (a message, or a function call and its
    output); a plain string is a user message."""
    if isinstance(raw, str):
        return
    where = f"input[{i}]"
    item = _object(raw, where)
    kind = item.get("type", "message")
    if kind != "message":
        if not isinstance(kind, str):
            raise wrong_type(f"{where}.type", STRING, kind)
        require_fields(item, RESPONSES_ITEMS.get(kind, ()), where)
        if kind == "function_call_output":
            _check_parts(item["output"], f"{where}.output")
        return
    role = require(item, "role", where, STRING)
    if role not in RESPONSES_ROLES:
        raise invalid_value(f"{where}.role", role, RESPONSES_ROLES)
    _check_parts(require(item, "content", where, TEXT_OR_PARTS), f"{where}.content")


def _check_parts(content: object, where: str) -> None:
    """A Responses content (a message's, a call output's): a string, or parts each with its type's
    required fields."""
    if isinstance(content, list):
        for j, raw_part in enumerate(content):
            part_where = f"{where}[{j}]"
            part = _object(raw_part, part_where)
            kind = require(part, "type", part_where, STRING)
            require_fields(part, RESPONSES_PARTS.get(kind, ()), part_where)
