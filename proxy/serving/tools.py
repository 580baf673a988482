"""Tool calls served locally: the request's `tools` and `tool_choice` validated, the model's output parsed
into OpenAI `tool_calls` (streamed or not), and the grammar that makes `required` and a named choice
always a valid call.

How a model writes a call depends on its family; a parser per format:

    hermes       <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>   (Qwen2.5/3, Hermes, SmolLM3)
    llama3_json  {"name": ..., "parameters": {...}}  as the whole answer  (Llama 3.1+ JSON tool calling)
    mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]  (Mistral)

`detect_parser` picks one from the chat template's text where it can; `local_runner.tool_call_parsers`
names it otherwise. The grammar of a forced call writes it exactly as the model's template renders an
assistant's tool call (`tojson`'s separators, the schema's key order), so the next turn, whose history
holds that call, re-renders to the same tokens and reuses its KV.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import bad_request

PARSERS = ("hermes", "llama3_json", "mistral")
# What jinja's tojson writes in transformers' chat templates (json.dumps' defaults).
SEPARATORS = (", ", ": ")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# -- the request --------------------------------------------------------------------------------------


# A hermes call's start and end tags.
HERMES_CALL = ("<tool_call>", "</tool_call>")


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools, validated: what the template renders and what the answer may call."""

    tools: tuple[dict[str, Any], ...]  # as the client sent them (the template renders these)
    choice: str  # "none" | "auto" | "required" | "named"
    named: str | None = None  # the function a named choice forces
    parallel: bool = True
    strict: frozenset[str] = frozenset()  # the functions declared `strict: true`
    # The functions a call may name (tool_choice `allowed_tools`: every tool is rendered, so the prompt
    # and its KV stay the same while the choice narrows); None: any tool.
    allowed: frozenset[str] | None = None

    @property
    def max_calls(self) -> int | None:
        """The calls an answer may hold: one without parallel calls, else any number."""
        return None if self.parallel else 1

    def stops(self, parser: str) -> list[str]:
        """Stop strings that end the answer once its one call is written (`parallel_tool_calls: false`
        with a free choice; a forced call's grammar already ends after one): a format whose calls
        close with a tag stops at that tag, and the parser counts the call as whole without it."""
        if self.parallel or self.choice != "auto" or parser != "hermes":
            return []
        return [HERMES_CALL[1]]

    def schemas(self) -> dict[str, dict[str, Any]]:
        """The arguments' schema of each function a call may name."""
        return {
            t["function"]["name"]: t["function"].get("parameters") or {"type": "object"}
            for t in self.tools
            if self.allowed is None or t["function"]["name"] in self.allowed
        }

    def grammar_inputs(self) -> list[Any]:
        """Every field (what a grammar built from this request may depend on) as JSON-able values: a
        memo's key, which a field added later cannot be left out of."""
        values = (getattr(self, f.name) for f in dataclasses.fields(self))
        return [sorted(v) if isinstance(v, frozenset) else v for v in values]

    @property
    def constrained(self) -> bool:
        """Whether a free choice's calls are held to a grammar: strict tools, or a narrowed choice."""
        return bool(self.strict) or self.allowed is not None


def _tools_and_choice(body: dict[str, Any]) -> tuple[list[Any] | None, Any]:
    """The request's tools (an array, or None without any) and its tool_choice, either API's; a
    choice that needs tools, or tools that are not an array, is a 400."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise bad_request("'tool_choice' needs 'tools'.", param="tool_choice")
        return None, choice
    if not isinstance(tools, list):
        raise bad_request("'tools' must be an array.", param="tools")
    return tools, choice


def tool_request(body: dict[str, Any]) -> ToolRequest | None:
    """The request's tools and tool_choice, validated (400 naming the param); None without tools."""
    tools, choice = _tools_and_choice(body)
    if tools is None:
        return None
    names, strict = set(), set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise bad_request(
                f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}.", param="tools"
            )
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"tools[{i}].function.name must be a non-empty string.", param="tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON Schema object.", param="tools")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise bad_request(f"tools[{i}].function.strict must be a boolean.", param="tools")
        names.add(fn["name"])
        if fn.get("strict"):
            strict.add(fn["name"])
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be a boolean.", param="parallel_tool_calls")
    if choice is None or choice in ("none", "auto", "required"):
        return ToolRequest(tuple(tools), choice or "auto", parallel=parallel, strict=frozenset(strict))
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        mode, allowed = _allowed_tools(choice.get("allowed_tools"), names)
        return ToolRequest(tuple(tools), mode, parallel=parallel, strict=frozenset(strict), allowed=allowed)
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(fn, dict) or choice.get("type") != "function" or fn.get("name") not in names:
        raise bad_request(
            "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
            "{'name': <one of the tools>}}.",
            param="tool_choice",
        )
    return ToolRequest(tuple(tools), "named", fn["name"], parallel, frozenset(strict))


def _allowed_tools(spec: object, names: set[str]) -> tuple[str, frozenset[str]]:
    """A chat tool_choice's `allowed_tools` ({"mode": "auto" | "required", "tools": [{"type":
    "function", "function": {"name": ...}}, ...]}): its mode and the functions it names."""
    param = "tool_choice.allowed_tools"
    if not isinstance(spec, dict) or spec.get("mode") not in ("auto", "required"):
        raise bad_request(f"'{param}.mode' must be 'auto' or 'required'.", param=f"{param}.mode")
    listed = spec.get("tools")
    if not isinstance(listed, list) or not listed:
        raise bad_request(f"'{param}.tools' must be a non-empty array.", param=f"{param}.tools")
    allowed = set()
    for j, tool in enumerate(listed):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type") != "function" or fn.get("name") not in names:
            raise bad_request(
                f"{param}.tools[{j}] must be {{'type': 'function', 'function': {{'name': <one of the tools>}}}}.",
                param=f"{param}.tools",
            )
        allowed.add(fn["name"])
    return spec["mode"], frozenset(allowed)


def responses_tool_request(body: dict[str, Any]) -> ToolRequest | None:
    """The Responses API's function tools and tool_choice (its own shapes: a tool's name and
    parameters sit in the tool, a named choice is {"type": "function", "name": ...}), validated with
    its param names, as the chat form `tool_request` holds them; None without tools."""
    tools, choice = _tools_and_choice(body)
    if tools is None:
        return None
    chat_tools: list[dict[str, Any]] = []
    names: set[str] = set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or not tool["name"]:
            raise bad_request(f"tools[{i}].name must be a non-empty string.", param=f"tools[{i}].name")
        params = tool.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(
                f"tools[{i}].parameters must be a JSON Schema object.", param=f"tools[{i}].parameters"
            )
        if tool.get("strict") is not None and not isinstance(tool["strict"], bool):
            raise bad_request(f"tools[{i}].strict must be a boolean.", param=f"tools[{i}].strict")
        keys = ("name", "description", "parameters", "strict")
        function = {k: tool[k] for k in keys if tool.get(k) is not None}
        chat_tools.append({"type": "function", "function": function})
        names.add(tool["name"])
    chat: dict[str, Any] = {"tools": chat_tools, "parallel_tool_calls": body.get("parallel_tool_calls", True)}
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        listed = choice.get("tools")
        chat_listed = [
            {"type": t.get("type"), "function": {"name": t.get("name")}} if isinstance(t, dict) else t
            for t in (listed if isinstance(listed, list) else [])
        ]
        spec = {"mode": choice.get("mode"), "tools": chat_listed if isinstance(listed, list) else listed}
        chat["tool_choice"] = {"type": "allowed_tools", "allowed_tools": spec}
    elif isinstance(choice, dict):
        if choice.get("name") not in names:
            raise bad_request(
                "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'name': <one of "
                "the tools>}.",
                param="tool_choice",
            )
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None:
        chat["tool_choice"] = choice
    return tool_request(chat)


# -- the grammar of a forced call ------------------------------------------------------------------------


def _call_schema(name: str, parameters: dict[str, Any], arguments_key: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, arguments_key: parameters},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def _call_json(parser: str, schemas: dict[str, dict[str, Any]], *, array: bool = False) -> Any:
    """The grammar of one call's JSON object (`{"name": ..., "arguments": ...}`) of any function in
    `schemas` (name -> its arguments' schema), or with `array` of a JSON array of one call or more,
    written with `tojson`'s separators. A schema xgrammar cannot compile is the client's 400."""
    import xgrammar as xgr

    key = "parameters" if parser == "llama3_json" else "arguments"
    variants = [_call_schema(name, schema, key) for name, schema in schemas.items()]
    schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
    if array:
        schema = {"type": "array", "items": schema, "minItems": 1}
    try:
        return xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, separators=SEPARATORS)
    except (RuntimeError, ValueError) as exc:
        raise bad_request(f"a tool's parameters schema cannot be compiled: {exc}", param="tools") from None


def forced_call_grammar(req: ToolRequest, parser: str) -> str:
    """xgrammar EBNF for one call of the named function (or of any tool, for `required`), written as
    the parser's format writes it. A schema xgrammar cannot compile is the client's 400."""
    import xgrammar as xgr

    schemas = req.schemas()
    call = _call_json(parser, {req.named: schemas[req.named]} if req.named else schemas)
    if parser == "hermes":
        return str(xgr.Grammar.concat(_literal("<tool_call>\n"), call, _literal("\n</tool_call>")))
    if parser == "mistral":
        return str(xgr.Grammar.concat(_literal("[TOOL_CALLS]["), call, _literal("]")))
    return str(call)


def call_or_answer_grammar(req: ToolRequest, parser: str, answer: str) -> str:
    """A free choice (`auto`) with response_format: the answer is one call of any tool, or the text
    `answer`'s grammar allows (the format's JSON), as OpenAI's models may call a tool or answer in the
    format. Without it, the format's grammar alone would leave no way to write a call."""
    import xgrammar as xgr

    call = forced_call_grammar(dataclasses.replace(req, choice="required", named=None), parser)
    return str(xgr.Grammar.union(xgr.Grammar.from_ebnf(call), xgr.Grammar.from_ebnf(answer)))


def constrained_calls_grammar(req: ToolRequest, parser: str) -> str | None:
    """A free choice (`auto`) whose calls are constrained (`req.constrained`: OpenAI's strict function
    calling, or `allowed_tools` in mode auto): the answer is any text, and once a call's start tag is
    written the call is one of a function the choice allows, a strict tool's arguments following its
    schema (another's, any JSON object), closed by its end tag (xgrammar's triggered structural tags);
    without parallel calls, the answer ends after the first. None for a format whose calls have no start
    tag to trigger on (llama3_json: a call is the whole answer)."""
    import xgrammar as xgr
    from xgrammar import structural_tag as tags

    if parser == "llama3_json":
        return None
    schemas = {
        name: schema if name in req.strict else {"type": "object"} for name, schema in req.schemas().items()
    }
    if parser == "hermes":  # the trigger is the start tag; the call's JSON follows its newline
        trigger, begin, end = "<tool_call>", "<tool_call>\n", "\n</tool_call>"
        content = _call_json(parser, schemas)
    elif req.parallel:  # mistral: [TOOL_CALLS] and the calls' JSON array, to the end of the answer
        trigger, begin, end = "[TOOL_CALLS]", "[TOOL_CALLS]", ""
        content = _call_json(parser, schemas, array=True)
    else:
        trigger, begin, end = "[TOOL_CALLS]", "[TOOL_CALLS][", "]"
        content = _call_json(parser, schemas)
    tag = tags.TagFormat(begin=begin, content=tags.GrammarFormat(grammar=str(content)), end=end)
    triggered = tags.TriggeredTagsFormat(
        triggers=[trigger], tags=[tag], stop_after_first=not req.parallel or parser == "mistral"
    )
    return str(xgr.Grammar.from_structural_tag(tags.StructuralTag(format=triggered)))


def _literal(text: str) -> Any:
    import xgrammar as xgr

    return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text)}")


# -- parsing the output ----------------------------------------------------------------------------------


def _calls_from_json(doc: Any, arguments_key: str) -> list[ToolCall] | None:
    """Calls from a decoded call object or array of them; None when it is not one."""
    items = doc if isinstance(doc, list) else [doc]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        arguments = item.get(arguments_key, item.get("arguments", {}))
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        calls.append(ToolCall(item["name"], text, new_call_id()))
    return calls


@dataclass
class Parsed:
    """What the parser has to say so far: text the client may see, and completed calls."""

    content: str = ""
    calls: tuple[ToolCall, ...] = ()


class ToolCallParser:
    """Streaming parser: `feed` text as it comes, `finish` at the end. Text that could be the start of a
    call is held back until it is known; a call goes out whole once its end is seen.

    `max_calls` (1 for `parallel_tool_calls: false`, Anthropic's `disable_parallel_tool_use`): calls
    past it, and everything the answer says after the last one allowed, are dropped, so a client that
    asked for one call never gets two."""

    def __init__(self, parser: str, max_calls: int | None = None) -> None:
        self.format = parser
        self.max_calls = max_calls
        self._buffer = ""
        self._in_call = False
        self.calls: list[ToolCall] = []
        self.content: list[str] = []

    @property
    def full(self) -> bool:
        """Whether the answer holds every call it may: the rest of it is dropped."""
        return self.max_calls is not None and len(self.calls) >= self.max_calls

    # The markers of each format: (start, end); an end of None runs to the end of the answer.
    _MARKERS = {"hermes": HERMES_CALL, "mistral": ("[TOOL_CALLS]", None)}

    def feed(self, text: str) -> Parsed:
        if self.full:
            return Parsed()
        self._buffer += text
        if self.format == "text":  # an answer that turned out to hold no call
            out, self._buffer = Parsed(self._buffer), ""
            self._record(out)
            return out
        if self.format == "llama3_json":
            return self._feed_whole_answer()
        start, end = self._MARKERS[self.format]
        out = Parsed()
        calls: list[ToolCall] = []
        while True:
            if not self._in_call:
                at = self._buffer.find(start)
                if at == -1:
                    keep = _partial_suffix(self._buffer, start)
                    out.content += self._buffer[: len(self._buffer) - keep]
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    break
                out.content += self._buffer[:at]
                self._buffer = self._buffer[at + len(start) :]
                self._in_call = True
            if end is None:
                break  # the call runs to the end of the answer
            at = self._buffer.find(end)
            if at == -1:
                break
            calls.extend(self._parse(self._buffer[:at]) or [])
            self._buffer = self._buffer[at + len(end) :]
            self._in_call = False
            if self.max_calls is not None and len(self.calls) + len(calls) >= self.max_calls:
                self._buffer = ""  # the rest of the answer is dropped
                break
        out.calls = tuple(calls)
        self._record(out)
        return out

    def _feed_whole_answer(self) -> Parsed:
        """llama3_json: a call is the whole answer, so text that starts like one waits for the end."""
        stripped = self._buffer.lstrip()
        tag = "<|python_tag|>"
        if not stripped or stripped.startswith(("{", tag)) or tag.startswith(stripped):
            return Parsed()
        out = Parsed(self._buffer)
        self._buffer = ""
        self.format = "text"  # no call in this answer
        self._record(out)
        return out

    def finish(self) -> Parsed:
        """The end of the answer: a call still open is parsed (a format whose calls run to the end, or an
        answer cut off by max_tokens: its call counts when its JSON is whole, as vLLM's hermes parser
        counts an unclosed `<tool_call>`, else it is text); what was held back goes out."""
        rest, self._buffer = self._buffer, ""
        out = Parsed()  # a full answer's rest is dropped
        if self.full:
            pass
        elif self.format == "text":
            out = Parsed(rest)
        elif self.format == "llama3_json":
            body = rest.strip().removeprefix("<|python_tag|>")
            calls = self._parse(body)
            out = Parsed(calls=tuple(calls)) if calls else Parsed(rest)
        elif self._in_call:
            start, end = self._MARKERS[self.format]
            body = rest[: len(rest) - _partial_suffix(rest, end)] if end is not None else rest
            calls = self._parse(body)
            out = Parsed(calls=tuple(calls)) if calls else Parsed(start + rest)
        else:
            out = Parsed(rest)
        self._record(out)
        return out

    def _parse(self, text: str) -> list[ToolCall] | None:
        try:
            doc = json.loads(text.strip())
        except ValueError:
            return None
        return _calls_from_json(doc, "parameters" if self.format == "llama3_json" else "arguments")

    def _record(self, out: Parsed) -> None:
        """Keep what `out` says, cut to the calls allowed (in place: the caller sends `out`)."""
        if self.max_calls is not None:
            out.calls = out.calls[: max(0, self.max_calls - len(self.calls))]
        if out.content:
            self.content.append(out.content)
        self.calls.extend(out.calls)


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a start of `marker` (held back: it may be one)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def detect_parser(template: str) -> str | None:
    """The tool-call format a chat template writes, when its text says so."""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or '"parameters"' in template:
        return "llama3_json"
    return None


def renders_tools(render: Any, probe: Sequence[dict[str, Any]]) -> bool:
    """Whether a template writes tools at all: the same conversation rendered with a tool and without
    differs (`render(messages, tools)` -> token ids)."""
    tool = {"type": "function", "function": {"name": "probe", "parameters": {"type": "object"}}}
    return bool(render(probe, (tool,)) != render(probe, ()))
