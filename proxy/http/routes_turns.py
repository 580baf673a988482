"""The turn endpoints: POST /v1/chat/completions, /v1/completions, /v1/responses (with GET and DELETE
/v1/responses/{id}, GET /v1/responses/{id}/input_items and POST /v1/responses/input_tokens) and Anthropic's /v1/messages (with /v1/messages/count_tokens). Each parses its body,
resolves tenant and session, and routes the turn: served locally (the serving layer, either engine) or
upstream.

The request's `Turn` (opened by the middleware) learns who is asking and where the turn goes; whoever
serves it reports the rest to it, and an error raised anywhere is answered and finished by the middleware.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web
from multidict import MultiMapping

from ..anthropic.requests import messages_fingerprint, parse_messages
from ..cluster.forwarding import FORWARDER
from ..cluster.session_index import SESSION_INDEX
from ..errors import APIError, bad_request
from ..openai.requests import (
    ApiRequest,
    CompletionRequest,
    ResponsesRequest,
    parse_chat,
    parse_completion,
    parse_responses,
)
from ..openai.required import invalid_value
from ..openai.responses import input_items, item_page, new_response_id
from ..serving.response_store import ResponseStore
from ..settings import SETTINGS
from ..turns.backend import LocalBackend
from ..turns.local_start import LOCAL_START, local_engine
from ..turns.routing import Route, choose_route
from ..turns.session import resolve_session
from ..turns.tenant import tenant_of
from ..turns.turn import TURN
from ..upstream.forward import forward_chat, forward_upstream
from .limits import read_body, refuse_oversized_local_body


async def _read(request: web.Request) -> bytes:
    settings = request.app[SETTINGS]
    engine = local_engine(request.app)
    if engine is not None and not settings.llm_endpoint.base_url:
        # Local models only: a body larger than any of their contexts is refused before it is read.
        refuse_oversized_local_body(request, engine.max_context_tokens())
    return await read_body(request, settings.proxy.body_read_timeout_s)


async def _route(request: web.Request, req: ApiRequest, *, forwardable: bool = True) -> web.StreamResponse:
    """Serve the identified turn locally (on the replica holding its KV, when that is another one) or
    upstream, or refuse it with the reason."""
    turn = request[TURN]
    backend = await _backend(request, req)
    route = choose_route(request.app[SETTINGS], req, backend)
    if route.kind == "local" and backend is not None:
        turn.serve_locally()
        forwarder = request.app.get(FORWARDER)
        if forwardable and forwarder is not None:  # another replica holds this session's KV in memory
            forwarded = await forwarder.try_forward(request, req, turn)
            if forwarded is not None:
                return forwarded
        return await backend.handle(request, req, turn)
    if route.kind == "upstream":
        return await forward_chat(request, req, turn)
    raise _unservable(route)


async def _backend(request: web.Request, req: ApiRequest) -> LocalBackend | None:
    """The local backend to route `req` with: a turn for a local model that arrives while local serving
    starts waits for it (`LocalStart`)."""
    return await request.app[LOCAL_START].backend_for(req.model)


def _unservable(route: Route) -> APIError:
    """Why a turn has nowhere to go: OpenAI's 404 model_not_found for a model neither local nor
    upstream (its SDK's NotFoundError), else a 400 with the reason (an option the local model does not
    serve, and no upstream to send it to)."""
    if route.unknown_model:
        return APIError(
            404, f"The model does not exist here: {route.reason}.", param="model", code="model_not_found"
        )
    return APIError(400, f"Cannot serve this request: {route.reason}.", param="model")


def _session(request: web.Request, req: ApiRequest, fingerprint: Callable[[], str] | None = None) -> str:
    """The session field (removed from the body: it never goes upstream) or header, else the
    fingerprint of the conversation's prefix."""
    key = request.app[SETTINGS].attention_store.session_key
    req.body_modified = key in req.body
    return resolve_session(req.body, request.headers, key, fingerprint)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    chat = parse_chat(await _read(request))
    request[TURN].identify(session=_session(request, chat), tenant=tenant_of(request.headers), turn=chat.turn)
    return await _route(request, chat)


def completion_fingerprint(model: str, req: CompletionRequest) -> str:
    """A completion's session without an id: the model and the start of its prompt (its first 32
    characters or 8 token ids), the same for every completion that extends an earlier one. Reuse
    does not depend on it (it matches token ids); the session names the KV for stats and forgetting."""
    start = req.prompt[:32] if isinstance(req.prompt, str) else (req.prompt or [])[:8]
    blob = orjson.dumps([model, start])
    return "fp-" + hashlib.sha256(blob).hexdigest()[:16]


async def completions(request: web.Request) -> web.StreamResponse:
    req = parse_completion(await _read(request))
    session = _session(request, req, lambda: completion_fingerprint(req.model, req))
    request[TURN].identify(session=session, tenant=tenant_of(request.headers), turn=0)
    return await _route(request, req)


def _known_model(request: web.Request, model: str) -> None:
    """Anthropic answers a model it does not have with 404 not_found_error (its SDK's NotFoundError):
    so does attnstore, for a model neither local nor upstream (no upstream is configured)."""
    settings = request.app[SETTINGS]
    lr = settings.local_runner
    if not settings.llm_endpoint.base_url and not (lr.enabled and model in lr.models):
        raise APIError(404, f"model: {model}", param="model", code="model_not_found")


async def messages(request: web.Request) -> web.StreamResponse:
    """An Anthropic Messages turn, served as chat is (the same serving layer and reuse) and answered in
    Anthropic's shape; without a session id, its session is the fingerprint of its model, system prompt
    and first user message."""
    req = parse_messages(await _read(request))
    _known_model(request, req.model)
    session = _session(request, req, lambda: messages_fingerprint(req.body))
    request[TURN].identify(session=session, tenant=tenant_of(request.headers), turn=req.turn)
    return await _route(request, req)


async def count_tokens(request: web.Request) -> web.StreamResponse:
    """Anthropic's count_tokens: for a local model, the prompt tokens its turn would have (the same
    rendering: input_tokens + cache_read + cache_creation of that turn's usage); for any other model,
    the upstream's answer."""
    req = parse_messages(await _read(request), count_only=True)
    _known_model(request, req.model)
    _session(request, req, lambda: "")  # the session field never goes upstream; counting needs none
    backend = await _backend(request, req)
    route = choose_route(request.app[SETTINGS], req, backend)
    if route.kind == "local" and backend is not None:
        body = {"input_tokens": await backend.count_prompt_tokens(req)}
        return web.Response(body=orjson.dumps(body), content_type="application/json")
    if route.kind == "upstream":
        return await forward_upstream(request, body=req.upstream_bytes(), turn=None)
    raise _unservable(route)


def _responses(request: web.Request) -> ResponseStore:
    return ResponseStore(request.app[SESSION_INDEX], request.app[SETTINGS].proxy.max_stored_responses)


def _not_found(response_id: str) -> APIError:
    return APIError(
        404, f"No response with id '{response_id}' found.", param="response_id", code="response_not_found"
    )


async def create_response(request: web.Request) -> web.StreamResponse:
    """A Responses turn. Served locally, it is a session named by its new id: `previous_response_id`
    continues a stored response's conversation (this tenant's only), whose KV the turn reuses."""
    req = parse_responses(await _read(request))
    tenant = tenant_of(request.headers)
    _session(request, req)  # the session field never goes upstream; the response's id is the session
    if choose_route(request.app[SETTINGS], req, await _backend(request, req)).kind == "local":
        await _continue(request, req, tenant)
    request[TURN].identify(session=new_response_id(), tenant=tenant, turn=req.turn)
    return await _route(request, req, forwardable=False)


async def _continue(request: web.Request, req: ResponsesRequest, tenant: str) -> None:
    """A local Responses request's conversation: its previous response's (this tenant's), then its
    input; a previous response not stored here is OpenAI's 404 (clients such as Codex start over on it)."""
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        previous = await _responses(request).get(tenant, req.previous_response_id)
        if previous is None:
            raise APIError(
                404,
                f"Previous response with id '{req.previous_response_id}' not found.",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        history = previous.conversation
    req.continue_from(history)


async def count_input_tokens(request: web.Request) -> web.StreamResponse:
    """POST /v1/responses/input_tokens: for a local model, the prompt tokens a turn of this request
    would have (its conversation, instructions and tools rendered as the turn renders them: the
    `usage.input_tokens` that turn reports); for any other model, the upstream's answer."""
    req = parse_responses(await _read(request))
    tenant = tenant_of(request.headers)
    _session(request, req, lambda: "")  # the session field never goes upstream; counting needs none
    backend = await _backend(request, req)
    route = choose_route(request.app[SETTINGS], req, backend)
    if route.kind == "local" and backend is not None:
        await _continue(request, req, tenant)
        body = {"object": "response.input_tokens", "input_tokens": await backend.count_prompt_tokens(req)}
        return web.Response(body=orjson.dumps(body), content_type="application/json")
    if route.kind == "upstream":
        return await forward_upstream(request, body=req.upstream_bytes(), turn=None)
    raise _unservable(route)


async def get_response(request: web.Request) -> web.StreamResponse:
    """A stored response (this tenant's); one the upstream made is the upstream's to answer."""
    response_id = request.match_info["response_id"]
    stored = await _responses(request).get(tenant_of(request.headers), response_id)
    if stored is not None:
        return web.Response(body=orjson.dumps(stored.response), content_type="application/json")
    if request.app[SETTINGS].llm_endpoint.base_url:
        return await forward_upstream(request, body=None, turn=None)
    raise _not_found(response_id)


def _page_query(query: MultiMapping[str], ids: list[str]) -> tuple[int, bool, str | None]:
    """input_items' query (limit 1-100, default 20; order asc or desc, default desc; after an item of
    the list), validated with OpenAI's 400s; `include` names data local items do not have."""
    raw_limit = query.get("limit", "20")
    if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= 100:
        raise bad_request(
            f"Invalid 'limit': {raw_limit!r}. It must be an integer from 1 to 100.", param="limit"
        )
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid_value("order", order, ("asc", "desc"))
    after = query.get("after")
    if after is not None and after not in ids:
        raise bad_request(f"No item with id '{after}' in this response's input items.", param="after")
    if query.getall("include", None) or query.getall("include[]", None):
        raise bad_request("'include' is not served for a locally stored response.", param="include")
    return int(raw_limit), order == "desc", after


async def list_input_items(request: web.Request) -> web.StreamResponse:
    """GET /v1/responses/{id}/input_items: the items a stored response (this tenant's) was made from,
    its previous responses' inputs and outputs included, a page at a time; one the upstream made is the
    upstream's to answer."""
    response_id = request.match_info["response_id"]
    stored = await _responses(request).get(tenant_of(request.headers), response_id)
    if stored is None:
        if request.app[SETTINGS].llm_endpoint.base_url:
            return await forward_upstream(request, body=None, turn=None)
        raise _not_found(response_id)
    items = input_items(stored.conversation[:-1])  # the last message is the response's own output
    limit, descending, after = _page_query(request.query, [item["id"] for item in items])
    page = item_page(items, limit=limit, descending=descending, after=after)
    return web.Response(body=orjson.dumps(page), content_type="application/json")


async def delete_response(request: web.Request) -> web.StreamResponse:
    """Forget a stored response and its conversation's KV (what its turn stored, in every tier, on every
    replica: the one that served the turn holds its own memory tiers)."""
    response_id = request.match_info["response_id"]
    tenant = tenant_of(request.headers)
    if not await _responses(request).delete(tenant, response_id):
        if request.app[SETTINGS].llm_endpoint.base_url:
            return await forward_upstream(request, body=None, turn=None)
        raise _not_found(response_id)
    await request.app[LOCAL_START].wait()  # its KV is forgotten in the tiers, L2 included
    engine = local_engine(request.app)
    if engine is not None:
        await asyncio.to_thread(engine.forget_session, tenant, response_id)
    await request.app[SESSION_INDEX].forget(tenant, response_id)
    forwarder = request.app.get(FORWARDER)
    if forwarder is not None:
        await forwarder.forget_elsewhere(request, response_id)
    body = {"id": response_id, "object": "response", "deleted": True}
    return web.Response(body=orjson.dumps(body), content_type="application/json")
