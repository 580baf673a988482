"""The client's side of a vLLM turn: vLLM's completion events as OpenAI Chat Completions, streamed
(SSE chunks, the usage chunk when asked for, [DONE]) or as one response, and vLLM's refusals as errors."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
from aiohttp import web

from .. import openai_format as fmt
from ..chat_request import ChatRequest
from ..errors import APIError, error_body
from ..turn import Turn
from .stream import Delta, Event, Finish, Usage


async def answer(
    request: web.Request,
    chat: ChatRequest,
    turn: Turn,
    system_fingerprint: str,
    events: AsyncIterator[Event],
    record: Callable[[Usage], Awaitable[None]],
) -> web.StreamResponse:
    """The client's answer from vLLM's events (the turn's first token is reported already): streamed as
    they come, or collected into one response; `record` runs before the client sees the end."""
    ids = fmt.CompletionIds(model=chat.model, system_fingerprint=system_fingerprint)
    headers = turn.headers()
    stream: web.StreamResponse | None = None
    if chat.stream:
        stream = web.StreamResponse(headers={**headers, "Cache-Control": "no-cache"})
        stream.content_type = "text/event-stream"
        await stream.prepare(request)
        first = {"role": "assistant", "content": "", "refusal": None}
        await stream.write(fmt.chunk(ids, first, include_usage=chat.include_usage))
    parts: list[str] = []
    reason, usage = "stop", Usage(0, 0)
    async for event in events:
        if isinstance(event, Delta):
            parts.append(event.text)
            if stream is not None:
                await stream.write(fmt.chunk(ids, {"content": event.text}, include_usage=chat.include_usage))
        elif isinstance(event, Finish):
            reason = event.reason
        elif isinstance(event, Usage):
            usage = event
        elif stream is not None:  # headers are out: report in-band, as OpenAI does mid-stream
            await stream.write(b"data: " + error_body(event.message, "server_error") + b"\n\n")
            await stream.write_eof()
            return stream
        else:
            raise APIError(502, f"vLLM: {event.message}", type_="server_error")
    await record(usage)
    usage_body = fmt.usage(usage.prompt_tokens, usage.completion_tokens, turn.reused)
    if stream is None:
        body = fmt.completion(ids, "".join(parts), reason, usage_body)
        return web.json_response(body, headers=headers, dumps=lambda o: fmt.orjson.dumps(o).decode())
    await stream.write(fmt.chunk(ids, {}, reason, include_usage=chat.include_usage))
    if chat.include_usage:
        await stream.write(fmt.chunk(ids, None, include_usage=True, usage_=usage_body))
    await stream.write(fmt.DONE)
    await stream.write_eof()
    return stream


async def chain(first: Event | None, rest: AsyncIterator[Event]) -> AsyncIterator[Event]:
    if first is not None:
        yield first
    async for event in rest:
        yield event


async def vllm_error(resp: aiohttp.ClientResponse) -> APIError:
    """vLLM refused the request: its 4xx is the client's (its message passed on), anything else a 502."""
    try:
        body = await resp.json(content_type=None)
        message = str(body.get("error", {}).get("message") or body)
    except (ValueError, aiohttp.ClientError, AttributeError):
        message = (await resp.text())[:500]
    if 400 <= resp.status < 500:
        return APIError(400, f"vLLM: {message}", code="invalid_request")
    return APIError(502, f"vLLM answered {resp.status}: {message}", type_="server_error")
