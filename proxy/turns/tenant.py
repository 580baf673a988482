"""Who is calling: tenant id = short sha256 of the client's key (or "anonymous"); optional client auth.

A client's key comes as OpenAI's clients send it (`Authorization: Bearer <key>`) or as Anthropic's do
(`x-api-key: <key>`); the same key is the same tenant either way, so one client may use both APIs.

Without `proxy.api_keys` every caller is the tenant "anonymous" and shares its stored KV: a second
client sending the same messages learns (reused tokens, `cached_tokens`) that someone sent them. That is
safe only where one user (or one trusting team) reaches the proxy, as on loopback; a proxy listening
elsewhere needs keys (cli.py refuses to start without them unless told otherwise)."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping, Sequence

from ..errors import APIError

ANONYMOUS = "anonymous"


API_KEY_HEADER = "x-api-key"  # Anthropic's clients send their key here


def client_key(headers: Mapping[str, str]) -> str | None:
    """The caller's key: `Authorization: Bearer <key>`, else `x-api-key: <key>`; None without one."""
    auth = headers.get("Authorization", "")
    scheme, _, key = auth.partition(" ")
    key = key.strip()
    if scheme.lower() == "bearer" and key:
        return key
    return headers.get(API_KEY_HEADER, "").strip() or None


def tenant_of(headers: Mapping[str, str]) -> str:
    """A stable, non-reversible id for the caller's key; the key itself is never stored or logged."""
    key = client_key(headers)
    if key is None:
        return ANONYMOUS
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _matches(key: str, keys: Sequence[str]) -> bool:
    # Compare against every key in constant time so timing reveals nothing about which one almost matched.
    ok = False
    for allowed in keys:
        ok |= hmac.compare_digest(key.encode(), allowed.encode())
    return ok


def check_client_auth(
    headers: Mapping[str, str], api_keys: Sequence[str], admin_keys: Sequence[str] = ()
) -> None:
    """Raise a 401 unless no key is configured or the caller's key is a client or admin key."""
    if not api_keys and not admin_keys:
        return
    key = client_key(headers)
    if key is None:
        raise APIError(
            401, "Missing API key (Authorization: Bearer <key>, or x-api-key: <key>).", code="invalid_api_key"
        )
    if not _matches(key, [*api_keys, *admin_keys]):
        raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")


def is_admin(headers: Mapping[str, str], api_keys: Sequence[str], admin_keys: Sequence[str]) -> bool:
    """Whether the caller sees every tenant: an admin key, or no keys configured at all (one user)."""
    if not api_keys and not admin_keys:
        return True
    key = client_key(headers)
    return key is not None and _matches(key, admin_keys)
