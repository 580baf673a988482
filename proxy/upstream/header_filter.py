"""The one filter for headers that cross the proxy, for every call it makes on a client's behalf: a chat turn,
`GET /v1/models` or any other request passed through to the upstream, and a turn forwarded to the replica
holding its KV.

What a client's headers lose on the way out:

- always: hop-by-hop headers (and any the client's `Connection` names), `Host`, `Content-Length` (the
  client library sets them for the new connection; a body streamed up verbatim gets its length back,
  see `upstream`), `Expect`;
- to the upstream: `X-Session-Id` (the proxy's own), and the client's key (`Authorization`, or
  Anthropic's `x-api-key`) when the proxy authenticates clients (`proxy.api_keys` or
  `proxy.admin_keys`): that key is for this proxy only, no client credential reaches the upstream. The
  key that `llm_endpoint.api_key_env` names, when set, takes its place: in the header the path's API
  documents (`x-api-key` on Anthropic's paths, `/v1/messages*`; `Authorization: Bearer` elsewhere) and
  in the one the client sent its key in, when that is the other (Anthropic's newer SDKs send
  `Authorization: Bearer`; Claude Code and curl examples `x-api-key`). A proxy that does not authenticate clients and has no
  upstream key passes the client's own key through;
- to another replica: nothing more. The owner authenticates the same key and derives the same tenant;
  the request is marked `X-AttentionStore-Forwarded-By` (one hop at most).

An answer coming back loses its hop-by-hop headers, `Content-Length`, `Date` and `Server`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from multidict import CIMultiDict

from ..anthropic.messages import PATH_PREFIX as ANTHROPIC_PATH_PREFIX
from ..settings import Settings, replica_id
from ..turns.headers import FORWARDED_BY
from ..turns.session import SESSION_HEADER
from ..turns.tenant import API_KEY_HEADER

HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "Proxy-Connection",
        "TE",
        "Trailer",
        "Trailers",
        "Transfer-Encoding",
        "Upgrade",
    )
)
# Expect (100-continue) is answered by this proxy's server, per connection; the call it makes sends its
# body at once, so passing it on would only have an upstream wait for a continue nobody sends.
_DROP_ALWAYS = HOP_BY_HOP | {"host", "content-length", "expect"}
_DROP_TO_UPSTREAM = _DROP_ALWAYS | {SESSION_HEADER.lower()}
_DROP_RESPONSE = HOP_BY_HOP | {"content-length", "date", "server"}

Destination = Literal["upstream", "replica"]
_KEY_HEADERS = frozenset({"authorization", API_KEY_HEADER})


def _connection_tokens(headers: Mapping[str, str]) -> set[str]:
    return {t.strip().lower() for t in headers.get("Connection", "").split(",") if t.strip()}


def authenticates_clients(settings: Settings) -> bool:
    """Whether this proxy checks client keys itself (then a client's key is never passed on upstream)."""
    return bool(settings.proxy.api_keys or settings.proxy.admin_keys)


def _key_headers(client: Mapping[str, str], path: str) -> set[str]:
    """Where the upstream's key goes (lower-case names): the header the path's API documents
    (Anthropic's x-api-key, OpenAI's Authorization) and the ones the client sent its key in."""
    documented = API_KEY_HEADER if path.startswith(ANTHROPIC_PATH_PREFIX) else "authorization"
    return {documented} | ({k.lower() for k in client} & _KEY_HEADERS)


def outbound_headers(
    client: Mapping[str, str], settings: Settings, to: Destination, path: str = ""
) -> CIMultiDict[str]:
    """The client's headers for a call to `to` on its behalf, for the request path `path` (see the
    module's docstring)."""
    drop = (_DROP_TO_UPSTREAM if to == "upstream" else _DROP_ALWAYS) | _connection_tokens(client)
    upstream_key = settings.upstream_api_key if to == "upstream" else None
    if to == "upstream" and (upstream_key or authenticates_clients(settings)):
        drop = drop | _KEY_HEADERS
    out: CIMultiDict[str] = CIMultiDict((k, v) for k, v in client.items() if k.lower() not in drop)
    if to == "replica":
        out[FORWARDED_BY] = replica_id(settings)
        return out
    if upstream_key:
        for header in sorted(_key_headers(client, path)):
            if header == API_KEY_HEADER:
                out[API_KEY_HEADER] = upstream_key
            else:
                out["Authorization"] = f"Bearer {upstream_key}"
    return out


def inbound_headers(answer: Mapping[str, str]) -> CIMultiDict[str]:
    """An upstream's or an owner replica's answer headers, for the client."""
    drop = _DROP_RESPONSE | _connection_tokens(answer)
    return CIMultiDict((k, v) for k, v in answer.items() if k.lower() not in drop)
