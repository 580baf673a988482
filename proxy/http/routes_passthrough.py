"""Every other path of the API (any method on /v1/...): forwarded to `llm_endpoint.base_url` as it came
(the project's contract, "Every other path of the API passes through"; docs/api.md, "Pass-through").

Registered last, this route sees what no other route serves. Before anything goes upstream it answers
what is the proxy's own: a method that a path served here does not take is a 405 (with Allow), as it
would be without this route; an unknown `/v1/attention_store/...` path is a 404. A JSON body is read to
check the model it names: a local model has nothing upstream to serve it (unless the upstream serves the
same model, `llm_endpoint.model`), so that is a clear 400 instead. Any other body (multipart uploads of
audio or files, binary) is streamed up as it arrives. Paths outside /v1 are not the API and are never
forwarded: they stay 404s.
"""

from __future__ import annotations

import orjson
from aiohttp import web

from ..errors import APIError
from ..settings import SETTINGS, Settings
from ..upstream.forward import forward_upstream
from .limits import read_body

PASSTHROUGH_PATH = "/v1/{tail:.*}"
_STORE_PREFIX = "/v1/attention_store"


async def pass_through(request: web.Request) -> web.StreamResponse:
    await _refuse_own_paths(request)
    settings = request.app[SETTINGS]
    if request.body_exists and request.content_type == "application/json":
        raw = await read_body(request, settings.proxy.body_read_timeout_s)
        _refuse_local_model(settings, request, _named_model(raw))
        return await forward_upstream(request, body=raw, turn=None)
    return await forward_upstream(request, body=None, turn=None)


async def _refuse_own_paths(request: web.Request) -> None:
    """405 for a path another route serves with other methods (the router picks this catch-all before it
    says 405, so the check is made here); 404 for the proxy's own namespace."""
    this = request.match_info.route.resource
    allowed: set[str] = set()
    for resource in request.app.router.resources():
        if resource is not this:
            match, methods = await resource.resolve(request)
            allowed |= methods if match is None else set()
    if allowed:
        raise web.HTTPMethodNotAllowed(request.method, allowed)
    if request.path == _STORE_PREFIX or request.path.startswith(_STORE_PREFIX + "/"):
        raise web.HTTPNotFound()


def _named_model(raw: bytes) -> str | None:
    """The body's "model", when it is a JSON object that names one; anything else goes upstream as it
    came (the upstream judges what it receives)."""
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    model = doc.get("model") if isinstance(doc, dict) else None
    return model if isinstance(model, str) else None


def _refuse_local_model(settings: Settings, request: web.Request, model: str | None) -> None:
    lr = settings.local_runner
    if model is None or not lr.enabled or model not in lr.models or model == settings.llm_endpoint.model:
        return
    raise APIError(
        400,
        f"{request.method} {request.path} is not served for the local model {model!r}: attnstore has no "
        "local implementation of it, and the upstream does not serve that model.",
        param="model",
        code="model_not_supported",
    )
