"""Session id: the body field named by `attention_store.session_key`, else header X-Session-Id, else
OpenAI's `prompt_cache_key` (a client that names its conversation for OpenAI's prompt cache names it for
ours; the field stays in the body and goes upstream), else a fingerprint of the conversation's prefix
(model + messages up to the first user message), which stays the same on every turn of a conversation,
so unmodified clients get a stable session too."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Mapping
from typing import Any

import orjson

from ..errors import bad_request
from ..openai.requests import prompt_cache_key

SESSION_HEADER = "X-Session-Id"
_VALID = re.compile(r"^[\x21-\x7e]{1,128}$")  # visible ASCII: safe to echo in a response header


def is_valid_session_id(value: object) -> bool:
    """1-128 visible ASCII characters: safe to echo in a response header and in the log line."""
    return isinstance(value, str) and _VALID.match(value) is not None


def prefix_fingerprint(model: str, messages: list[Any]) -> str:
    """Short hex hash of model + messages up to and including the first user message."""
    end = len(messages)
    for i, msg in enumerate(messages):
        if isinstance(msg, dict) and msg.get("role") == "user":
            end = i + 1
            break
    blob = orjson.dumps([model, messages[:end]], option=orjson.OPT_SORT_KEYS)
    return "fp-" + hashlib.sha256(blob).hexdigest()[:16]


def cache_key_session(key: str) -> str:
    """A `prompt_cache_key` as a session id: itself where it is one (visible ASCII, 1-128 characters),
    else a hash of it (OpenAI takes any string; ours is echoed in a header and the log line)."""
    return key if is_valid_session_id(key) else "pck-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def resolve_session(
    body: dict[str, Any],
    headers: Mapping[str, str],
    session_key: str,
    fingerprint: Callable[[], str] | None = None,
) -> str:
    """The request's session id; removes `session_key` from `body` (it never goes upstream), never
    `prompt_cache_key` (OpenAI's own field). Without either, nor the header, `fingerprint()` (default:
    the chat conversation's prefix fingerprint)."""
    given = body.pop(session_key, None)
    param = session_key
    if given is None:
        given = headers.get(SESSION_HEADER)
        param = SESSION_HEADER
    if given is None:
        key = prompt_cache_key(body)
        if key:  # "" names nothing: as if absent
            return cache_key_session(key)
    if given is None:
        if fingerprint is not None:
            return fingerprint()
        return prefix_fingerprint(str(body.get("model", "")), body.get("messages") or [])
    if not isinstance(given, str) or not is_valid_session_id(given):
        raise bad_request(f"'{param}' must be a string of 1-128 visible ASCII characters.", param=param)
    return given
