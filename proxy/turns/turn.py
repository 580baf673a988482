"""The outcome of one turn: the one object every route and every error answer of the turn endpoints
(`POST /v1/chat/completions`, `/v1/completions`, `/v1/responses`) finishes through.

The error middleware opens a `Turn` when a request for one of those endpoints arrives and finishes it
when the answer has been handed over (or the client went away). In between, whoever serves the request
reports what it learns: who is asking and the session (`identify`), the route (`serve_locally`,
`serve_upstream`, `forwarded`), and when the first token was ready with what it reused (`local_first_token`,
`upstream_first_byte`). From those facts alone the turn produces what the project's contract promises
(docs/api.md):

- the X-AttentionStore-* headers (`headers()`, for the answer's headers before they go out, or
  `tag(response)` for an error answer),
- the one log line `[AttentionStore] session=<id> turn=<n> <cache> reused=<n> prompt=<n> ttft_ms=<x>`,
- the metrics observation (`attnstore_chat_requests` always; the TTFT histogram and token counters only for
  a turn that produced a first token).

`finish()` writes the log line and the observation once; calling it again does nothing, so a route may
finish early (a local turn does, before the client sees the end of its answer, so the next turn finds it
indexed) and the middleware finishes whatever is left (errors, clients gone mid-answer). A forwarded turn
is logged and counted by the replica that served it, not a second time here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

from aiohttp import web

from ..metrics import Metrics
from .headers import (
    CACHE,
    POSITION_SHIFT,
    REPLICA,
    REUSED,
    ROUTE,
    SESSION,
    SKIPPED,
    TIERS_HEADER,
    TTFT,
    CacheLevel,
    RouteName,
    cache_label,
    tiers_value,
)
from .session import SESSION_HEADER, is_valid_session_id
from .tenant import ANONYMOUS

log = logging.getLogger("attnstore")


@dataclass(slots=True)
class Turn:
    received_at: float  # time.monotonic() when the request arrived: TTFT is measured from here
    replica: str  # this replica's id (X-AttentionStore-Replica)
    metrics: Metrics
    session: str = ""  # resolved session id; before that, a valid X-Session-Id header, else ""
    tenant: str = ANONYMOUS  # short hash of the bearer key, or "anonymous"
    turn: int = 0  # user messages before the last one
    route: RouteName = "upstream"
    cache: CacheLevel = "bypass"
    reused: int = 0  # prompt tokens whose KV was reused
    prompt: int = 0  # prompt tokens, where known
    tiers: Mapping[str, int] | None = None  # local turns: reused tokens per tier
    position_shift: int | None = None  # local turns: positions the reused KV moved after a truncation
    skipped: int | None = None  # local turns: stored tokens recomputed (loading them measured slower)
    first_token_at: float | None = None  # time.monotonic() when the first token (or byte) was ready
    owner_serves: bool = False  # forwarded: the owner logs and counts this turn
    finished: bool = False

    @classmethod
    def open(cls, request: web.Request, *, replica: str, metrics: Metrics) -> Turn:
        """A turn for a request that just arrived (nothing parsed yet: the session is the header's, when
        it is a valid session id, so even an answer refused before parsing names it)."""
        header = request.headers.get(SESSION_HEADER, "")
        return cls(
            received_at=time.monotonic(),
            replica=replica,
            metrics=metrics,
            session=header if is_valid_session_id(header) else "",
        )

    # -- what serving the request reports --------------------------------------------------------------

    def identify(self, *, session: str, tenant: str, turn: int) -> None:
        self.session, self.tenant, self.turn = session, tenant, turn

    def serve_locally(self) -> None:
        """Routed to the local runner: until a first token says otherwise, a turn that reused nothing."""
        self.route, self.cache = "local", "miss"

    def serve_upstream(self) -> None:
        """Sent to `llm_endpoint` (also a local turn that the full local queue sent there)."""
        self.route, self.cache = "upstream", "bypass"
        self.reused, self.tiers, self.position_shift, self.skipped = 0, None, None, None

    def local_first_token(
        self,
        *,
        cache: CacheLevel,
        reused: int,
        prompt: int,
        tiers: Mapping[str, int],
        position_shift: int,
        at: float,
        skipped: int = 0,
    ) -> None:
        """The runner processed the prompt at `at` (time.monotonic()), reusing `reused` tokens' KV."""
        self.cache, self.reused, self.prompt = cache, reused, prompt
        self.tiers, self.position_shift, self.skipped = tiers, position_shift, skipped
        self.first_token_at = at

    def upstream_first_byte(self) -> None:
        self.first_token_at = time.monotonic()

    def forwarded(self, owner_headers: MutableMapping[str, str], sent_at: float) -> None:
        """The replica holding the session's KV answers: its X-AttentionStore-* headers go to the client,
        its TTFT plus the time the turn spent here before it left (`sent_at`)."""
        if TTFT in owner_headers:
            try:
                owner_ttft = float(owner_headers[TTFT])
            except ValueError:
                pass
            else:
                owner_headers[TTFT] = f"{owner_ttft + (sent_at - self.received_at) * 1000.0:.2f}"
        self.owner_serves = True

    # -- what the turn produces ------------------------------------------------------------------------

    @property
    def ttft_ms(self) -> float:
        """Request received -> first token ready; for an answer without one, -> now (the error's time)."""
        end = self.first_token_at if self.first_token_at is not None else time.monotonic()
        return (end - self.received_at) * 1000.0

    def headers(self) -> dict[str, str]:
        """The X-AttentionStore-* headers for this turn as it stands, ready for `web.Response(headers=...)`;
        a local turn's also name its reused tokens per tier, its position shift and its skipped tokens."""
        headers = {
            CACHE: cache_label(self.cache),
            ROUTE: self.route,
            REUSED: str(int(self.reused)),
            SESSION: self.session,
            TTFT: f"{self.ttft_ms:.2f}",
            REPLICA: self.replica,
        }
        if self.tiers is not None:
            headers[TIERS_HEADER] = tiers_value(self.tiers)
        if self.position_shift is not None:
            headers[POSITION_SHIFT] = str(int(self.position_shift))
        if self.skipped is not None:
            headers[SKIPPED] = str(int(self.skipped))
        return headers

    def tag(self, response: web.StreamResponse) -> None:
        """Add the headers to an answer built elsewhere (an error), keeping any it already carries."""
        for name, value in self.headers().items():
            response.headers.setdefault(name, value)

    def finish(self, *, prompt: int | None = None, reused: int | None = None) -> None:
        """The one log line and the one metrics observation of this request (the first call only)."""
        if self.finished:
            return
        self.finished = True
        if self.owner_serves:
            return
        if prompt is not None:
            self.prompt = prompt
        if reused is not None:
            self.reused = reused
        label = cache_label(self.cache)
        ttft_ms = self.ttft_ms
        shift = self.position_shift or 0
        skipped = self.skipped or 0
        if log.isEnabledFor(logging.INFO):
            log.info(
                "[AttentionStore] session=%s turn=%d %s reused=%d prompt=%d ttft_ms=%.2f%s%s",
                self.session,
                self.turn,
                label,
                self.reused,
                self.prompt,
                ttft_ms,
                # Appended after a truncation, or when stored KV was recomputed as the faster way (the
                # seed's format stays a prefix of every line).
                f" shift={shift}" if shift > 0 else "",
                f" skipped={skipped}" if skipped > 0 else "",
            )
        if self.first_token_at is None:  # no first token: counted, but not a TTFT sample
            self.metrics.requests.labels(self.route, label).inc()
            return
        self.metrics.observe_turn(
            route=self.route, cache=label, reused=self.reused, prompt=self.prompt, ttft_ms=ttft_ms
        )


TURN = web.RequestKey("attnstore_turn", Turn)
