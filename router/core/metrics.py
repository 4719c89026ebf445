"""Prometheus metrics of a router (decorates the router; the policy code knows nothing of them).

Each :class:`RouterMetrics` owns its own ``CollectorRegistry`` so several routers (tests,
several gateways in one process) never collide in the global registry. The per-decision ones
are a :class:`DecisionTally`: plain sums under one lock, turned into metric families when the
registry is collected, so a decision costs a few additions instead of seven locked metric
updates (one router decides thousands of times a second) and every scrape sees every decision.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

_le: Callable[[float], str] = floatToGoString  # (untyped upstream) a bucket bound as Prometheus writes it

_LATENCY_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)


class _Buckets:
    """One histogram's observations: a count per bucket (non-cumulative) and their sum."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = list(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound (+Inf)
        self.total = 0.0

    def add(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # first bound >= value
        self.total += value

    def family(self, name: str, doc: str) -> HistogramMetricFamily:
        cum, pairs = 0, []
        for le, n in zip([*self.bounds, float("inf")], self.counts, strict=True):
            cum += n
            pairs.append((_le(le), float(cum)))
        return HistogramMetricFamily(name, doc, buckets=pairs, sum_value=self.total)


class DecisionTally:
    """The per-decision metrics (decisions by policy and reason, prompt tokens by tenant,
    cached tokens, estimated TTFT saved, fallbacks by cause, decision and index latency),
    summed in plain Python and exported as Prometheus families when collected (register it
    in a registry). Thread-safe: decisions come from the event loop, scrapes may not."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._created = time.time()
        self._decisions: dict[tuple[str, str], int] = {}
        self._prompt_tokens: dict[str, int] = {}
        self._fallbacks: dict[str, int] = {}
        self._cached = 0
        self._saved = 0.0
        self._latency = _Buckets(_LATENCY_BUCKETS)
        self._index = _Buckets(_LATENCY_BUCKETS)

    def decision(self, policy: str, reason: str, tenant: str, tokens: int, cached: int,
                 saved_s: float, latency_s: float, fallback: str = "") -> None:
        """One routing decision (``fallback``: its cause, "" for none)."""
        with self._lock:
            key = (policy, reason)
            self._decisions[key] = self._decisions.get(key, 0) + 1
            self._prompt_tokens[tenant] = self._prompt_tokens.get(tenant, 0) + tokens
            self._cached += cached
            self._saved += saved_s
            self._latency.add(latency_s)
            if fallback:
                self._fallbacks[fallback] = self._fallbacks.get(fallback, 0) + 1

    def index_latency(self, seconds: float) -> None:
        """One index answer's latency."""
        with self._lock:
            self._index.add(seconds)

    def describe(self) -> list[Metric]:
        return []  # (no fixed sample set: collected on each scrape)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            yield self._counter("kvshare_router_decisions", "Routing decisions",
                                ["policy", "reason"], self._decisions.items())
            yield self._counter(
                "kvshare_router_est_ttft_saved_seconds",
                "Estimated TTFT saved by cache reuse (recompute-all minus plan), summed",
                [], [((), self._saved)])
            yield self._counter("kvshare_router_cached_tokens",
                                "Prompt tokens the chosen workers are expected to reuse", [],
                                [((), self._cached)])
            yield self._counter("kvshare_router_prompt_tokens", "Prompt tokens routed", ["tenant"],
                                [((t,), n) for t, n in self._prompt_tokens.items()])
            yield self._index.family("kvshare_router_index_latency_seconds", "Index match latency")
            yield self._latency.family("kvshare_router_decision_latency_seconds",
                                       "Tokenize+hash+match+score latency")
            yield self._counter("kvshare_router_fallbacks",
                                "Load-only decisions because the index was unavailable", ["cause"],
                                [((c,), n) for c, n in self._fallbacks.items()])

    def _counter(self, name: str, doc: str, labels: list[str],
                 values: Iterable[tuple[tuple[str, ...], float]]) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=labels)
        for key, value in values:
            family.add_metric(list(key), float(value), created=self._created)
        return family


class RouterMetrics:
    """Decisions by policy and reason, TTFT saved (estimated), index latency, fallbacks
    (:attr:`tally`); gateway stages, errors and upstream requests."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.tally = DecisionTally()
        r.register(self.tally)
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
