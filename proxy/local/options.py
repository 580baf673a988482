"""Which Chat Completions options the local runner serves, and their validated sampling values.

An option the runner does not implement (tools, n>1, logprobs, images...) is not an error: the request
goes upstream, or gets a clear 400 when there is none. A supported option with a wrong value is the
client's error (400 naming the param) wherever the request would go.
"""

from __future__ import annotations

from typing import Any

from local_runner.params import SamplingParams

from ..errors import bad_request


def unsupported_reason(body: dict[str, Any]) -> str | None:
    """Why the local runner cannot serve this body faithfully, or None when it can."""
    n = body.get("n")
    if n not in (None, 1):
        return "n > 1 is not served locally"
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
    if body.get("prediction") or body.get("logit_bias") or body.get("web_search_options"):
        return "prediction, logit_bias and web search are not served locally"
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            return f"{name} is not served locally"
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


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise bad_request(f"'{name}' must be a number between {lo} and {hi}.", param=name)
    return float(value)


def sampling_params(body: dict[str, Any], default_max_tokens: int) -> SamplingParams:
    """Validated sampling settings; OpenAI's defaults (temperature 1, top_p 1) where absent."""
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = default_max_tokens
    elif isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise bad_request("'max_tokens' must be a positive integer.", param="max_tokens")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise bad_request("'seed' must be an integer.", param="seed")
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise bad_request("'stop' must be a string or a list of up to 4 strings.", param="stop")
    for i, msg in enumerate(body["messages"]):
        content = msg.get("content")
        if content is not None and not isinstance(content, str | list):
            raise bad_request(f"messages[{i}].content must be a string or an array.", param="messages")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise bad_request("'ignore_eos' must be a boolean.", param="ignore_eos")
    return SamplingParams(
        max_tokens=max_tokens,
        ignore_eos=ignore_eos,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        seed=seed,
        stop=stops,
    )
