"""The Responses API's stored responses: by tenant and id, in the session index (memory, or Redis so that
a follow-up on another replica finds them), the oldest dropped first past `proxy.max_stored_responses`.

A stored response holds its conversation whole (every earlier input and output, not the instructions:
those are not carried over), so a follow-up needs one lookup however long the chain, and a response
stays usable when its ancestors were dropped or deleted. Another tenant's id is simply not found.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from ..cluster.session_index import SessionIndex


@dataclass(frozen=True)
class StoredResponse:
    model: str
    conversation: list[dict[str, Any]]  # chat messages: the inputs and outputs so far
    response: dict[str, Any]  # the response object, as GET /v1/responses/{id} returns it


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(StoredResponse)


class ResponseStore:
    """Stateless: the index holds the responses; this says how they are written and read."""

    def __init__(self, index: SessionIndex, keep: int) -> None:
        self.index = index
        self.keep = keep

    async def put(self, tenant: str, response_id: str, stored: StoredResponse) -> None:
        await self.index.put_response(tenant, response_id, _encoder.encode(stored), keep=self.keep)

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        raw = await self.index.get_response(tenant, response_id)
        if raw is None:
            return None
        try:
            return _decoder.decode(raw)
        except (msgspec.ValidationError, msgspec.DecodeError):  # another version's, or damaged: not stored
            return None

    async def delete(self, tenant: str, response_id: str) -> bool:
        return await self.index.delete_response(tenant, response_id)
