"""Structured outputs: `response_format` (`json_object`, `json_schema`; the Responses API's
`text.format`) as a grammar the engine decodes under (xgrammar EBNF), so every answer parses and, with
a schema, validates.

JSON is written compactly (no free whitespace): a small model given free whitespace can spend its whole
answer on it. A schema xgrammar cannot compile is the client's 400, naming it.
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import bad_request


def response_format_grammar(body: dict[str, Any]) -> str | None:
    """The grammar `response_format` asks for, or None for free text."""
    fmt = body.get("response_format")
    spec = fmt.get("json_schema") if isinstance(fmt, dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise bad_request(
                "'response_format.json_schema' must be an object with a 'name' and a 'schema'.",
                param="response_format",
            )
        if not isinstance(spec.get("schema", {}), dict):
            raise bad_request(
                "'response_format.json_schema.schema' must be an object.", param="response_format"
            )
    schema = spec.get("schema", {"type": "object"}) if isinstance(spec, dict) else None
    return _format_grammar(fmt, schema, "response_format", "response_format")


def text_format_grammar(body: dict[str, Any]) -> str | None:
    """The grammar the Responses API's `text.format` asks for (its own shape: the schema's name and
    the schema sit in the format), or None for free text."""
    text = body.get("text")
    if text is not None and not isinstance(text, dict):
        raise bad_request("'text' must be an object.", param="text")
    fmt = (text or {}).get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("name"), str) or not fmt["name"]:
            raise bad_request("'text.format.name' must be a non-empty string.", param="text.format.name")
        if not isinstance(fmt.get("schema"), dict):
            raise bad_request(
                "'text.format.schema' must be a JSON Schema object.", param="text.format.schema"
            )
    schema = fmt.get("schema") if isinstance(fmt, dict) else None
    return _format_grammar(fmt, schema, "text.format", "text.format.type")


def _format_grammar(fmt: Any, schema: dict[str, Any] | None, param: str, type_param: str) -> str | None:
    """Either API's format (checked by its caller as far as its own shape goes) as a grammar: None for
    text, any JSON object, or JSON of `schema`; another type is a 400 naming `type_param`."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return _json_grammar({"type": "object"}, param)
    if kind == "json_schema" and schema is not None:
        return _json_grammar(schema, param)  # strict or not, every answer validates
    raise bad_request(f"'{param}.type' must be 'text', 'json_object' or 'json_schema'.", param=type_param)


def _json_grammar(schema: dict[str, Any], param: str = "response_format") -> str:
    import xgrammar as xgr

    try:
        grammar = xgr.Grammar.from_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(", ", ": "), strict_mode=True
        )
    except (RuntimeError, ValueError, TypeError) as exc:
        raise bad_request(
            f"{param}'s JSON Schema cannot be compiled for constrained decoding: {exc}", param=param
        ) from None
    return str(grammar)
