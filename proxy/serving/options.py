"""Which options of each API the local engines serve, and their validated sampling values.

An option the engines do not implement (tools, n>1, logprobs, images...) is not an error: the request
goes upstream, or gets a clear 400 when there is none. A supported option with a wrong value is the
client's error (400 naming the param) wherever the request would go.
"""

from __future__ import annotations

from typing import Any

from local_runner.params import SamplingParams

from ..errors import bad_request
from ..openai.requests import ApiRequest, ChatRequest, CompletionRequest, ResponsesRequest


def _common_unsupported(body: dict[str, Any]) -> str | None:
    n = body.get("n")
    if n not in (None, 1):
        return "n > 1 is not served locally"
    if body.get("logit_bias"):
        return "logit_bias is not served locally"
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            return f"{name} is not served locally"
    return None


def _chat_unsupported(body: dict[str, Any]) -> str | None:
    if body.get("tools") or body.get("functions"):
        return "tools are not served locally"
    if body.get("tool_choice") not in (None, "none") or body.get("function_call") not in (None, "none"):
        return "tool_choice is not served locally"
    if body.get("logprobs") or body.get("top_logprobs"):
        return "logprobs are not served locally"
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return "response_format is not served locally"
    modalities = body.get("modalities")
    if body.get("audio") or (modalities is not None and modalities != ["text"]):
        return "audio is not served locally"
    if body.get("prediction") or body.get("web_search_options"):
        return "prediction and web search are not served locally"
    for i, msg in enumerate(body["messages"]):
        if msg.get("role") not in ("system", "developer", "user", "assistant"):
            return f"messages[{i}]: role {msg.get('role')!r} is not served locally"
        if msg.get("tool_calls") or msg.get("function_call") or msg.get("audio"):
            return f"messages[{i}]: tool calls are not served locally"
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


def _responses_unsupported(req: ResponsesRequest) -> str | None:
    body = req.body
    if req.unserved:
        return req.unserved
    if body.get("tools"):
        return "tools are not served locally"
    if body.get("tool_choice") not in (None, "none", "auto"):
        return "tool_choice is not served locally"
    if body.get("background"):
        return "background mode is not served locally"
    for name in ("conversation", "prompt", "reasoning", "include", "top_logprobs"):
        if body.get(name):
            return f"{name} is not served locally"
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return "text.format is not served locally"
    return None


def unsupported_reason(req: ApiRequest) -> str | None:
    """Why the local engines cannot serve this request faithfully, or None when they can."""
    common = _common_unsupported(req.body)
    if common is not None:
        return common
    if isinstance(req, ChatRequest):
        return _chat_unsupported(req.body)
    if isinstance(req, CompletionRequest):
        return _completion_unsupported(req)
    if isinstance(req, ResponsesRequest):
        return _responses_unsupported(req)
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


def sampling_params(req: ApiRequest, default_max_tokens: int) -> SamplingParams:
    """Validated sampling settings; OpenAI's defaults (temperature 1, top_p 1) where absent."""
    body = req.body
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
        seed=seed,
        stop=[] if isinstance(req, ResponsesRequest) else _stops(body),
    )
