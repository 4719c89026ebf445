"""The router's per-decision metrics are summed in plain Python (DecisionTally) and exported
when scraped; this checks a scrape reads exactly what prometheus_client's own counters and
histograms fed the same decisions would (names, labels, bucket counts, sums)."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from kvshare.router.core.metrics import _LATENCY_BUCKETS, DecisionTally


def lines(registry: CollectorRegistry) -> list[str]:
    return [ln for ln in generate_latest(registry).decode().splitlines() if "_created" not in ln]


def test_a_scrape_reads_what_prometheus_metrics_fed_the_same_decisions_would() -> None:
    rng = random.Random(3)
    ours, ref = CollectorRegistry(), CollectorRegistry()
    tally = DecisionTally()
    ours.register(tally)
    decisions = Counter("kvshare_router_decisions", "Routing decisions", ["policy", "reason"],
                        registry=ref)
    saved = Counter("kvshare_router_est_ttft_saved_seconds",
                    "Estimated TTFT saved by cache reuse (recompute-all minus plan), summed",
                    registry=ref)
    cached = Counter("kvshare_router_cached_tokens",
                     "Prompt tokens the chosen workers are expected to reuse", registry=ref)
    tokens = Counter("kvshare_router_prompt_tokens", "Prompt tokens routed", ["tenant"], registry=ref)
    index = Histogram("kvshare_router_index_latency_seconds", "Index match latency",
                      buckets=_LATENCY_BUCKETS, registry=ref)
    latency = Histogram("kvshare_router_decision_latency_seconds",
                        "Tokenize+hash+match+score latency", buckets=_LATENCY_BUCKETS, registry=ref)
    fallbacks = Counter("kvshare_router_fallbacks",
                        "Load-only decisions because the index was unavailable", ["cause"],
                        registry=ref)
    assert lines(ours) == lines(ref)  # nothing decided yet: the same empty families
    for _ in range(500):
        policy, reason = rng.choice(("cost", "round_robin")), rng.choice(("load", "cache_local"))
        tenant, n, hit = rng.choice("abc"), rng.randrange(1, 9000), rng.randrange(0, 4000)
        s, dt = rng.random(), rng.choice((0.0002, 0.0003, 1e-5, 0.004, 2.0, rng.random() / 100))
        fb = rng.choice(("", "", "", "index_timeout", "index_error"))
        tally.decision(policy, reason, tenant, n, hit, s, dt, fb)
        decisions.labels(policy, reason).inc()
        tokens.labels(tenant).inc(n)
        cached.inc(hit)
        saved.inc(s)
        latency.observe(dt)
        if fb:
            fallbacks.labels(fb).inc()
        if rng.random() < 0.8:
            tally.index_latency(dt / 3)
            index.observe(dt / 3)
        if rng.random() < 0.05:  # a scrape in between changes nothing
            assert lines(ours) == lines(ref)
    assert lines(ours) == lines(ref)
