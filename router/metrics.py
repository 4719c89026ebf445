"""Prometheus metrics of a router (decorates the router; the policy code knows nothing of them).

Each :class:`RouterMetrics` owns its own ``CollectorRegistry`` so several routers (tests,
several gateways in one process) never collide in the global registry.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

_LATENCY_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)


class RouterMetrics:
    """Decisions by policy and reason, TTFT saved (estimated), index latency, fallbacks."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.decisions = Counter(
            "kvshare_router_decisions", "Routing decisions", ["policy", "reason"], registry=r
        )
        self.ttft_saved = Counter(
            "kvshare_router_est_ttft_saved_seconds",
            "Estimated TTFT saved by cache reuse (recompute-all minus plan), summed", registry=r,
        )
        self.cached_tokens = Counter(
            "kvshare_router_cached_tokens", "Prompt tokens the chosen workers are expected to reuse",
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvshare_router_prompt_tokens", "Prompt tokens routed", ["tenant"], registry=r
        )
        self.index_latency = Histogram(
            "kvshare_router_index_latency_seconds", "Index match latency", buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.decision_latency = Histogram(
            "kvshare_router_decision_latency_seconds", "Tokenize+hash+match+score latency",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.fallbacks = Counter(
            "kvshare_router_fallbacks", "Load-only decisions because the index was unavailable",
            ["cause"], registry=r,
        )
        self.ttft_stages = Histogram(
            "kvshare_gateway_ttft_stage_seconds",
            "Where requests' time to first token went, by stage (kvshare.breakdown)", ["stage"],
            buckets=_LATENCY_BUCKETS + (2.5, 5.0, 10.0), registry=r,
        )
        self.errors = Counter(
            "kvshare_gateway_errors", "Requests answered with an error", ["code"], registry=r
        )
        self.upstream = Counter(
            "kvshare_gateway_upstream_requests", "Requests forwarded to workers", ["worker", "status"],
            registry=r,
        )

    def render(self) -> bytes:
        """The Prometheus text exposition of this registry."""
        return generate_latest(self.registry)
