"""Two function tools in OpenAI's shape, shared by the agents' tests and the user trial: one with an
enum and no extra properties (a named or required call must fill both), one with a length bound."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# ChatML with Hermes `<tool_call>` blocks, as Qwen2.5's: SmolLM2's own template renders no tools.
TOOLS_TEMPLATE = Path(__file__).parent.parent / "templates" / "chatml_tools.jinja"

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
SEARCH: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "search_files",
        "description": "Search the repository for a text.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "maxLength": 40}, "limit": {"type": "integer"}},
            "required": ["query"],
        },
    },
}
TOOLS = [WEATHER, SEARCH]
# A strict JSON schema for response_format. Bounded, as a schema for a small greedy model must be:
# unbounded, it may repeat to max_tokens.
PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
    "required": ["name", "age", "hobbies"],
    "additionalProperties": False,
}


def responses_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A chat function tool in the Responses API's shape (name and parameters in the tool itself)."""
    return {"type": "function", **tool["function"]}


RESPONSES_TOOLS = [responses_tool(t) for t in TOOLS]
