"""The Grafana dashboard queries only what /metrics exports: after one local turn (the real model) and one
upstream turn (the fake upstream), every series a panel's PromQL names is in the proxy's exposition, with
samples wherever such turns produce them (forwarding needs two replicas and Redis: declared, no samples)."""

from __future__ import annotations

import re
from pathlib import Path

import orjson
from prometheus_client.parser import text_string_to_metric_families

from tests.model_fixture import MODEL
from tests.servers import http_request

REPO = Path(__file__).resolve().parent.parent
DASHBOARDS = sorted((REPO / "deploy" / "grafana" / "dashboards").glob("*.json"))
SERIES = re.compile(r"\b(attnstore_[a-z0-9_]+)")
SUFFIXES = ("_total", "_bucket", "_count", "_sum", "_created")
# Counted only where replicas forward turns to each other (tests/test_replicas.py produces them).
WITHOUT_SAMPLES_HERE = {"attnstore_forwarded_turns_total"}


def queried_series() -> dict[str, set[str]]:
    """Series name -> titles of the panels (and variables) whose queries use it."""
    out: dict[str, set[str]] = {}
    for path in DASHBOARDS:
        doc = orjson.loads(path.read_bytes())
        queries = [(p["title"], t["expr"]) for p in doc["panels"] for t in p["targets"]]
        queries += [(v["name"], v["definition"]) for v in doc["templating"]["list"]]
        for title, expr in queries:
            for name in SERIES.findall(expr):
                out.setdefault(name, set()).add(title)
    return out


def exposition(text: str) -> tuple[set[str], set[str]]:
    """(names of the samples present, names of the families declared)."""
    samples: set[str] = set()
    families: set[str] = set()
    for family in text_string_to_metric_families(text):
        families.add(family.name)
        samples |= {s.name for s in family.samples}
    return samples, families


def _family(series: str) -> str:
    for suffix in SUFFIXES:
        if series.endswith(suffix):
            return series.removesuffix(suffix)
    return series


def test_every_dashboard_panel_has_a_query_and_names_attnstore_series():
    assert DASHBOARDS
    series = queried_series()
    for path in DASHBOARDS:
        for panel in orjson.loads(path.read_bytes())["panels"]:
            assert panel["targets"] and all(SERIES.search(t["expr"]) for t in panel["targets"]), panel[
                "title"
            ]
    # What the issue asks to see: hits by tier, reused vs prefilled, TTFT by cache, queue and running
    # jobs, prefetch outcomes, tier bytes, forwarding.
    for name in (
        "attnstore_store_hits_total",
        "attnstore_chat_requests_total",
        "attnstore_reused_tokens_total",
        "attnstore_prefilled_tokens_total",
        "attnstore_ttft_seconds_bucket",
        "attnstore_runner_queued_jobs",
        "attnstore_runner_running_jobs",
        "attnstore_prefetch_chunks_total",
        "attnstore_tier_used_bytes",
        "attnstore_forwarded_turns_total",
    ):
        assert name in series, name


def test_metrics_export_every_series_the_dashboard_queries(local_proxy, fake_upstream):
    proxy = local_proxy()
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0}
    local = http_request("POST", proxy.url + "/v1/chat/completions", {**body, "model": MODEL}, timeout=120)
    assert local.status == 200 and local.headers["x-attentionstore-route"] == "local"
    upstream = http_request("POST", proxy.url + "/v1/chat/completions", {**body, "model": "gpt-fake"})
    assert upstream.status == 200 and upstream.headers["x-attentionstore-route"] == "upstream"
    scraped = http_request("GET", proxy.url + "/metrics")
    assert scraped.status == 200
    samples, families = exposition(scraped.body.decode())
    missing = {
        name: sorted(panels)
        for name, panels in queried_series().items()
        if name not in samples and not (name in WITHOUT_SAMPLES_HERE and _family(name) in families)
    }
    assert not missing, f"queried by the dashboard, not exported: {missing}"
