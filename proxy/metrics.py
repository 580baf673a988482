"""Prometheus metrics: one registry per app (no process-global state, `METRICS`), store gauges read at
scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60)

# The path label of a pass-through: OpenAI's resources under /v1, and their sub-resources that are words
# (never an id: /v1/files/file-abc/content counts as /v1/files), so the label set stays small whatever
# clients send; an unknown resource is "/v1/other".
_RESOURCES: dict[str, frozenset[str]] = {
    name: frozenset(subs)
    for name, subs in {
        "assistants": (),
        "audio": ("speech", "transcriptions", "translations"),
        "batches": (),
        "chat": ("completions",),
        "completions": (),
        "containers": (),
        "conversations": (),
        "embeddings": (),
        "evals": (),
        "files": (),
        "fine_tuning": ("alpha", "checkpoints", "jobs"),
        "images": ("edits", "generations", "variations"),
        "models": (),
        "moderations": (),
        "organization": (),
        "realtime": ("client_secrets", "sessions", "transcription_sessions"),
        "responses": (),
        "threads": (),
        "uploads": (),
        "vector_stores": (),
        "videos": (),
    }.items()
}


def passthrough_path_label(path: str) -> str:
    """`/v1/<resource>[/<sub-resource>]` of a path under /v1 (see `_RESOURCES`), or `/v1/other`."""
    parts = path.split("/", 4)  # "", "v1", resource, sub-resource, rest
    resource = parts[2] if len(parts) > 2 else ""
    subs = _RESOURCES.get(resource)
    if subs is None:
        return "/v1/other"
    if len(parts) > 3 and parts[3] in subs:
        return f"/v1/{resource}/{parts[3]}"
    return f"/v1/{resource}"


def status_class(status: int | None) -> str:
    """`2xx`, `4xx`, ...; `aborted` when no answer went out (the client left first)."""
    return f"{status // 100}xx" if status is not None else "aborted"


class _StoreCollector(Collector):
    """Turns the KV stores' stats dicts into gauges and counters when Prometheus scrapes."""

    def __init__(self, stats: Callable[[], dict[str, dict]]):
        self._stats = stats

    def collect(self) -> Iterable:
        used = GaugeMetricFamily(
            "attnstore_tier_used_bytes", "Bytes held per KV tier", labels=["model", "tier"]
        )
        cap = GaugeMetricFamily(
            "attnstore_tier_capacity_bytes", "Capacity per KV tier", labels=["model", "tier"]
        )
        entries = GaugeMetricFamily("attnstore_tier_entries", "KV chunks per tier", labels=["model", "tier"])
        hits = CounterMetricFamily("attnstore_store_hits", "Chunk hits per tier", labels=["model", "tier"])
        misses = CounterMetricFamily("attnstore_store_misses", "Lookups that found nothing", labels=["model"])
        evictions = CounterMetricFamily("attnstore_store_evictions", "Chunks evicted", labels=["model"])
        loaded = CounterMetricFamily(
            "attnstore_store_loaded_bytes", "Bytes loaded from the store", labels=["model"]
        )
        saved = CounterMetricFamily("attnstore_store_saved_bytes", "Bytes written to L2", labels=["model"])
        pending = GaugeMetricFamily(
            "attnstore_saves_pending", "L2 writes queued or running", labels=["model"]
        )
        skipped = CounterMetricFamily(
            "attnstore_saves_skipped",
            "Chunks not written to L2 because its save queue was full (the disk behind)",
            labels=["model"],
        )
        reused = CounterMetricFamily(
            "attnstore_store_reused_tokens",
            "Matched prompt tokens by the tier their KV came from",
            labels=["model", "tier"],
        )
        prefetch = CounterMetricFamily(
            "attnstore_prefetch_chunks",
            "Look-ahead prefetches: issued, completed, used by a job, wasted (evicted unused)",
            labels=["model", "outcome"],
        )
        retained = GaugeMetricFamily(
            "attnstore_retained_sessions",
            "Sessions the store retains now (an agent waiting on a tool, a retention hint)",
            labels=["model"],
        )
        retained_bytes = GaugeMetricFamily(
            "attnstore_retained_bytes", "Bytes of retained sessions' KV per tier", labels=["model", "tier"]
        )
        retention_evictions = CounterMetricFamily(
            "attnstore_retention_evictions",
            "Retention holds broken by memory pressure (a retained session's KV evicted before its deadline)",
            labels=["model"],
        )
        for model, s in self._stats().items():
            for tier, t in s.get("tiers", {}).items():
                used.add_metric([model, tier], t.get("used_bytes", 0))
                cap.add_metric([model, tier], t.get("capacity_bytes", 0))
                entries.add_metric([model, tier], t.get("entries", 0))
            for tier, n in s.get("hits", {}).items():
                hits.add_metric([model, tier], n)
            misses.add_metric([model], s.get("misses", 0))
            evictions.add_metric([model], s.get("evictions", 0))
            loaded.add_metric([model], s.get("bytes_loaded", 0))
            saved.add_metric([model], s.get("bytes_saved", 0))
            pending.add_metric([model], s.get("saves_pending", 0))
            skipped.add_metric([model], s.get("saves_skipped", 0))
            for tier, n in s.get("reused_tokens", {}).items():
                reused.add_metric([model, tier], n)
            for outcome in ("issued", "completed", "used", "wasted"):
                prefetch.add_metric([model, outcome], s.get(f"prefetch_{outcome}", 0))
            retained.add_metric([model], s.get("retained_sessions", 0))
            for tier, n in s.get("retained_bytes", {}).items():
                retained_bytes.add_metric([model, tier], n)
            retention_evictions.add_metric([model], s.get("retention_evictions", 0))
        yield from (
            used,
            cap,
            entries,
            hits,
            misses,
            evictions,
            loaded,
            saved,
            pending,
            skipped,
            reused,
            prefetch,
            retained,
            retained_bytes,
            retention_evictions,
        )


class Metrics:
    def __init__(self, store_stats: Callable[[], dict[str, dict]] | None = None):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "attnstore_chat_requests",
            "Chat requests by route and cache level",
            ["route", "cache"],
            registry=self.registry,
        )
        self.reused_tokens = Counter(
            "attnstore_reused_tokens", "Prompt tokens whose KV was reused", registry=self.registry
        )
        self.prefilled_tokens = Counter(
            "attnstore_prefilled_tokens", "Prompt tokens computed by prefill", registry=self.registry
        )
        self.forwarded = Counter(
            "attnstore_forwarded_turns",
            "Local turns of a session another replica holds in memory: forwarded there, or served here "
            "after a failed attempt (owner dead, slow, full or failing before its answer)",
            ["outcome"],
            registry=self.registry,
        )
        self.passthrough = Counter(
            "attnstore_passthrough_requests",
            "Requests passed through to the upstream as they came, by API path (ids left out) and the "
            "status class of their answer",
            ["path", "status"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "attnstore_ttft_seconds",
            "Time to first token by cache level",
            ["cache"],
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        if store_stats is not None:
            self.registry.register(_StoreCollector(store_stats))

    def observe_turn(self, *, route: str, cache: str, reused: int, prompt: int, ttft_ms: float) -> None:
        self.requests.labels(route, cache).inc()
        self.ttft.labels(cache).observe(ttft_ms / 1000.0)
        if route == "local":
            self.reused_tokens.inc(reused)
            self.prefilled_tokens.inc(max(0, prompt - reused))

    def count_passthrough(self, path: str, status: int | None) -> None:
        self.passthrough.labels(passthrough_path_label(path), status_class(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EngineCollector(Collector):
    """The local engine's queue as Prometheus sees it, read from `Engine.stats()` at scrape time: jobs
    waiting and running now (the dashboard's load panel), jobs admitted and their summed queue wait (rate
    of one over the other: the mean wait), and jobs cancelled by their client. `stats` returns the
    engine's `EngineStats`, or None when nothing is served locally (then nothing is exported)."""

    def __init__(self, stats: Callable[[], object | None]):
        self._stats = stats

    def collect(self) -> Iterable:
        snapshot = self._stats()
        if snapshot is None:
            return
        gauges = (
            ("attnstore_runner_queued_jobs", "Local jobs waiting in the runner's queue", "queued"),
            ("attnstore_runner_running_jobs", "Local jobs running (prefilling or decoding)", "running"),
        )
        counters = (
            ("attnstore_runner_admitted_jobs", "Local jobs taken from the queue", "admitted"),
            (
                "attnstore_runner_queue_wait_seconds",
                "Queue wait of the admitted jobs, summed",
                "queue_wait_seconds",
            ),
            (
                "attnstore_runner_cancelled_jobs",
                "Local jobs stopped because their client went away",
                "cancelled",
            ),
        )
        for name, doc, attr in gauges:
            value = getattr(snapshot, attr, None)
            if value is not None:
                yield GaugeMetricFamily(name, doc, value=value)
        for name, doc, attr in counters:
            value = getattr(snapshot, attr, None)
            if value is not None:
                yield CounterMetricFamily(name, doc, value=value)


# This app's Prometheus registry and its metrics (no process-global metrics).
METRICS = web.AppKey("metrics", Metrics)
