"""Who is calling: tenant id = short sha256 of the bearer key (or "anonymous"); optional client auth."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping, Sequence

from .errors import APIError

ANONYMOUS = "anonymous"


def bearer_key(headers: Mapping[str, str]) -> str | None:
    auth = headers.get("Authorization", "")
    scheme, _, key = auth.partition(" ")
    key = key.strip()
    return key if scheme.lower() == "bearer" and key else None


def tenant_of(headers: Mapping[str, str]) -> str:
    """A stable, non-reversible id for the caller's key; the key itself is never stored or logged."""
    key = bearer_key(headers)
    if key is None:
        return ANONYMOUS
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def check_client_auth(headers: Mapping[str, str], api_keys: Sequence[str]) -> None:
    """Raise a 401 OpenAI error unless `api_keys` is empty or the bearer key is one of them."""
    if not api_keys:
        return
    key = bearer_key(headers)
    if key is None:
        raise APIError(401, "Missing bearer API key (Authorization: Bearer <key>).", code="invalid_api_key")
    # Compare against every key in constant time so timing reveals nothing about which one almost matched.
    ok = False
    for allowed in api_keys:
        ok |= hmac.compare_digest(key.encode(), allowed.encode())
    if not ok:
        raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")
