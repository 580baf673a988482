"""Which options of each API the local engines serve, and their validated sampling values.

An option the engines do not implement (n>1, images, audio, tools for a model whose template renders
none...) is not an error: the request goes upstream, or gets a clear 400 when there is none. A supported option with a wrong value is the
client's error (400 naming the param) wherever the request would go.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine_api.sampling import SamplingParams

from ..errors import bad_request
from ..openai.requests import ApiRequest, ChatRequest, CompletionRequest, ResponsesRequest


@dataclass(frozen=True)
class ChatSetup:
    """What a local model's chat template can do: the template (settings' override, or None for the
    model's own), whether it renders tools, and the tool-call format its output is parsed with."""

    template: str | None = None
    tools: bool = False
    parser: str | None = None


MAX_N = 16  # answers of one local turn (each takes a running slot); more go upstream


def _common_unsupported(req: ApiRequest) -> str | None:
    n = req.body.get("n")
    # The Responses API has no `n`: a local Responses turn answers it as OpenAI does (CHAT_ONLY_FIELDS).
    if isinstance(n, int) and n > MAX_N and not isinstance(req, ResponsesRequest):
        return f"n > {MAX_N} is not served locally"
    return None


NO_TOOLS_TEMPLATE = "tools are not served locally (the model's chat template renders none)"


def _tools_unrendered(has_tools: bool, messages: list[dict[str, Any]], setup: ChatSetup) -> bool:
    """Whether a turn's tools, or tool calls and results in its history, need a template the model
    lacks (one that renders tools, and a known format to parse calls with)."""
    used = has_tools or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)
    return used and not (setup.tools and setup.parser)


# A free choice narrowed by allowed_tools is held to its functions by a grammar triggered at a call's
# start tag; a llama3_json call is the whole answer, with no start tag to trigger on.
LLAMA3_ALLOWED_AUTO = "allowed_tools in mode auto is not served locally for llama3_json models"


def _chat_unsupported(body: dict[str, Any], setup: ChatSetup) -> str | None:
    if _tools_unrendered(bool(body.get("tools")), body["messages"], setup):
        return NO_TOOLS_TEMPLATE
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools" and setup.parser == "llama3_json":
        spec = choice.get("allowed_tools")
        if isinstance(spec, dict) and spec.get("mode") == "auto":
            return LLAMA3_ALLOWED_AUTO
    if body.get("functions") or body.get("function_call") not in (None, "none"):
        return "functions (the deprecated form of tools) are not served locally"
    modalities = body.get("modalities")
    if body.get("audio") or (modalities is not None and modalities != ["text"]):
        return "audio is not served locally"
    if body.get("prediction") or body.get("web_search_options"):
        return "prediction and web search are not served locally"
    if body.get("reasoning_effort") is not None or body.get("verbosity") is not None:
        return "reasoning_effort and verbosity are not served locally (the local models do not reason)"
    for i, msg in enumerate(body["messages"]):
        if msg.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            return f"messages[{i}]: role {msg.get('role')!r} is not served locally"
        if msg.get("function_call") or msg.get("audio"):
            return f"messages[{i}]: function_call and audio are not served locally"
        content = msg.get("content")
        if isinstance(content, list) and any(
            not (isinstance(p, dict) and p.get("type") == "text") for p in content
        ):
            return f"messages[{i}]: only text content is served locally"
    return None


def _completion_unsupported(req: CompletionRequest) -> str | None:
    body = req.body
    if req.prompt is None:
        return "a batch of several prompts is not served locally"
    if body.get("best_of") not in (None, 1):
        return "best_of > 1 is not served locally"
    if body.get("echo"):
        return "echo is not served locally"
    if body.get("logprobs") is not None:
        return "logprobs are not served locally"
    if body.get("suffix"):
        return "suffix is not served locally"
    return None


def _responses_unsupported(req: ResponsesRequest, setup: ChatSetup) -> str | None:
    body = req.body
    if req.unserved:
        return req.unserved
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        tools = [tools]  # not an array: served, so that the tools' check answers its 400
    kinds = {t.get("type") for t in tools if isinstance(t, dict)} - {"function"}
    if kinds:  # the hosted tools (web search, file search, MCP, ...) are OpenAI's to run
        return f"tools of type {sorted(map(str, kinds))[0]!r} are not served locally"
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        listed = choice.get("tools")
        if isinstance(listed, list) and any(
            isinstance(t, dict) and t.get("type") != "function" for t in listed
        ):
            return "allowed_tools naming hosted tools are not served locally"
        if choice.get("mode") == "auto" and setup.parser == "llama3_json":
            return LLAMA3_ALLOWED_AUTO
    elif isinstance(choice, dict) and choice.get("type") != "function":
        return f"a tool_choice of type {choice.get('type')!r} is not served locally"
    if _tools_unrendered(bool(tools), req.input_messages or [], setup):
        return NO_TOOLS_TEMPLATE
    if body.get("background"):
        return "background mode is not served locally"
    for name in ("conversation", "prompt", "reasoning", "include", "top_logprobs"):
        if body.get(name):
            return f"{name} is not served locally"
    return None


def unsupported_reason(req: ApiRequest, setup: ChatSetup) -> str | None:
    """Why the local engines cannot serve this request faithfully, or None when they can."""
    common = _common_unsupported(req)
    if common is not None:
        return common
    if isinstance(req, ChatRequest):
        return _chat_unsupported(req.body, setup)
    if isinstance(req, CompletionRequest):
        return _completion_unsupported(req)
    if isinstance(req, ResponsesRequest):
        return _responses_unsupported(req, setup)
    return f"{type(req).__name__} is not served locally"


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise bad_request(f"'{name}' must be a number between {lo} and {hi}.", param=name)
    return float(value)


def _max_tokens(req: ApiRequest, default: int) -> int:
    """The answer's token limit under each API's name for it; OpenAI's legacy completions default to 16
    tokens, the others to the model's room (here `default`, local_runner.max_tokens_default)."""
    body = req.body
    if isinstance(req, ResponsesRequest):
        name, value = "max_output_tokens", body.get("max_output_tokens")
    elif isinstance(req, CompletionRequest):
        name, value, default = "max_tokens", body.get("max_tokens"), 16
    else:
        name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise bad_request(f"'{name}' must be a positive integer.", param=name)
    return value


def _stops(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) for s in stop):
        return list(stop)
    raise bad_request("'stop' must be a string or a list of up to 4 strings.", param="stop")


def _logit_bias(body: dict[str, Any], vocab: int) -> dict[int, float]:
    bias = body.get("logit_bias")
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise bad_request("'logit_bias' must be an object of token id -> bias.", param="logit_bias")
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            token = -1
        if not 0 <= token < vocab:
            raise bad_request(
                f"'logit_bias' names {key!r}, not a token id (0-{vocab - 1}).", param="logit_bias"
            )
        if isinstance(value, bool) or not isinstance(value, int | float) or not -100 <= value <= 100:
            raise bad_request("'logit_bias' values must be numbers between -100 and 100.", param="logit_bias")
        out[token] = float(value)
    return out


def _logprobs(req: ApiRequest) -> int | None:
    """Chat's `logprobs` / `top_logprobs` (0-20 alternatives per token); None: not asked for."""
    if not isinstance(req, ChatRequest):
        return None
    body = req.body
    wanted, top = body.get("logprobs"), body.get("top_logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise bad_request("'logprobs' must be a boolean.", param="logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20):
        raise bad_request("'top_logprobs' must be an integer between 0 and 20.", param="top_logprobs")
    if top is not None and not wanted:
        raise bad_request("'top_logprobs' needs 'logprobs': true.", param="top_logprobs")
    return (top or 0) if wanted else None


def _top_k(body: dict[str, Any]) -> int:
    """`top_k` (Anthropic's, and vLLM's extension of OpenAI's): sample from the k likeliest tokens; 0 or
    absent: from all."""
    value = body.get("top_k")
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise bad_request("'top_k' must be a non-negative integer.", param="top_k")
    return value


# Chat Completions' fields that OpenAI's Responses API does not define. OpenAI answers a Responses
# request naming one with a 400 `unknown_parameter`, and so does a local Responses turn: serving them
# would make a client's request work here and fail at OpenAI. (vLLM's extensions `top_k` and
# `ignore_eos` stay accepted, on every endpoint.)
CHAT_ONLY_FIELDS = (
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "max_tokens",
    "max_completion_tokens",
    "response_format",
    "n",
)


def _refuse_chat_only_fields(body: dict[str, Any]) -> None:
    for name in CHAT_ONLY_FIELDS:
        if name in body:
            raise bad_request(f"Unknown parameter: '{name}'.", param=name, code="unknown_parameter")


def sampling_params(req: ApiRequest, default_max_tokens: int, *, vocab: int) -> SamplingParams:
    """Validated sampling settings; OpenAI's defaults (temperature 1, top_p 1) where absent. The
    grammar (tools, response_format) is the caller's to add."""
    body = req.body
    if isinstance(req, ResponsesRequest):
        _refuse_chat_only_fields(body)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise bad_request("'seed' must be an integer.", param="seed")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise bad_request("'ignore_eos' must be a boolean.", param="ignore_eos")
    return SamplingParams(
        max_tokens=_max_tokens(req, default_max_tokens),
        ignore_eos=ignore_eos,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        top_k=_top_k(body),
        seed=seed,
        stop=_stops(body),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        logit_bias=_logit_bias(body, vocab),
        logprobs=_logprobs(req),
    )
