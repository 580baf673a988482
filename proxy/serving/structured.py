"""Structured outputs: `response_format` (`json_object`, `json_schema`) as a grammar the engine decodes
under (xgrammar EBNF), so every answer parses and, with a schema, validates.

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
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return _json_grammar({"type": "object"})
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise bad_request(
                "'response_format.json_schema' must be an object with a 'name' and a 'schema'.",
                param="response_format",
            )
        schema = spec.get("schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise bad_request(
                "'response_format.json_schema.schema' must be an object.", param="response_format"
            )
        return _json_grammar(schema)  # strict or not, every answer validates
    raise bad_request(
        "'response_format.type' must be 'text', 'json_object' or 'json_schema'.", param="response_format"
    )


def _json_grammar(schema: dict[str, Any]) -> str:
    import xgrammar as xgr

    try:
        grammar = xgr.Grammar.from_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(", ", ": "), strict_mode=True
        )
    except (RuntimeError, ValueError, TypeError) as exc:
        raise bad_request(
            f"response_format's JSON Schema cannot be compiled for constrained decoding: {exc}",
            param="response_format",
        ) from None
    return str(grammar)
