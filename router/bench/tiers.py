"""Hit rate per cache tier, from the counters vLLM exports on ``/metrics``.

vLLM counts every admitted prompt's cached tokens by the tier that supplied them,
``vllm:prompt_tokens_cached_by_source_total{source}`` (``device``: its own prefix cache;
``host``, ``disk``, ``p2p``: what a KV connector loaded, which kvshare's connector reports as
this node's pool (``host``), disk, or another node's (``p2p``): ``kvshare.vllm.connector.
kv_connector._SOURCES``), next to ``vllm:prompt_tokens_total``. The rest was computed.
Scraped before, during (for the chart) and after a run on every server the run reaches: the
URL itself for a vLLM server, the workers a kvshare gateway's ``/health`` lists for a gateway.
The counters are the servers' whole traffic: other clients' requests during the run count too.

Workers without those counters (kvshare's reference workers) say in each answer's ``kvshare``
usage object where its reused tokens came from (``tokens_by_source``, the same source names);
:func:`usage_counters` sums those over a run's own answers, so only the run's requests count.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

PROMPT = "vllm:prompt_tokens_total"
BY_SOURCE = "vllm:prompt_tokens_cached_by_source_total"
TIERS = {"device": "engine", "host": "local_pool", "p2p": "remote_pool", "disk": "disk",
         "external_unspecified": "external"}
"""vLLM's source label -> the tier's name in the report."""
COMPUTED = "computed"


def parse_tier_counters(text: str) -> dict[str, float]:
    """``prompt`` and the cached tokens of each :data:`TIERS` name, summed over engines
    (prometheus_client's parser, as the demo reads the same counters)."""
    out = {"prompt": 0.0, **{t: 0.0 for t in TIERS.values()}}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if math.isnan(sample.value):
                continue
            if sample.name == PROMPT:
                out["prompt"] += sample.value
            elif sample.name == BY_SOURCE and sample.labels.get("source") in TIERS:
                out[TIERS[sample.labels["source"]]] += sample.value
    return out


def hit_rates(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """The share of prompt tokens each tier supplied between two scrapes, and ``computed``
    (all zero when no prompt token was admitted)."""
    prompt = after["prompt"] - before["prompt"]
    if prompt <= 0:
        return {**{t: 0.0 for t in TIERS.values()}, COMPUTED: 0.0}
    rates = {t: max(0.0, after[t] - before[t]) / prompt for t in TIERS.values()}
    rates[COMPUTED] = max(0.0, 1.0 - sum(rates.values()))
    return rates


def usage_counters(answers: Sequence[tuple[int, Mapping[str, int]]]) -> dict[str, float]:
    """:func:`parse_tier_counters`'s counters summed over answers ``(prompt_tokens,
    tokens_by_source)`` (each answer's ``kvshare.tokens_by_source``)."""
    out = {"prompt": 0.0, **{t: 0.0 for t in TIERS.values()}}
    for prompt, by_source in answers:
        out["prompt"] += prompt
        for source, n in by_source.items():
            if source in TIERS:
                out[TIERS[source]] += n
    return out


def usage_series(answers: Sequence[tuple[float, int, Mapping[str, int]]], interval_s: float
                 ) -> list[tuple[float, dict[str, float]]]:
    """Hit rate per tier of the answers ``(done_s, prompt_tokens, tokens_by_source)`` that
    completed in each ``interval_s`` window (the end of the window, its rates)."""
    buckets: dict[int, list[tuple[int, Mapping[str, int]]]] = {}
    for done_s, prompt, by_source in answers:
        buckets.setdefault(int(done_s // interval_s), []).append((prompt, by_source))
    zero = usage_counters([])
    return [((k + 1) * interval_s, hit_rates(zero, usage_counters(buckets[k])))
            for k in sorted(buckets)]


@dataclass(frozen=True)
class Target:
    """Where a run's tier counters come from: ``kind`` ``vllm`` or ``gateway``."""

    kind: str
    metrics_urls: tuple[str, ...]


async def discover(http: httpx.AsyncClient, url: str, workers: Sequence[str] = ()) -> Target:
    """A kvshare gateway (its ``/health`` names a ``policy``; its workers are listed under
    ``endpoints``, or given as ``workers``) or a server with vLLM's counters itself."""
    kind = "vllm"
    found: list[str] = list(workers)
    try:
        r = await http.get(f"{url}/health")
        health = r.json() if r.headers.get("content-type", "").startswith("application/json") else None
    except (httpx.HTTPError, ValueError):
        health = None
    if isinstance(health, dict) and "policy" in health:
        kind = "gateway"
        if not found:
            found = [str(e) for e in health.get("endpoints") or () if e]
    elif not found:
        found = [url]
    return Target(kind, tuple(found))


@dataclass
class TierSampler:
    """Scrapes ``urls`` every ``interval_s``; ``samples``: (seconds since start, counters)."""

    urls: Sequence[str]
    interval_s: float = 1.0
    samples: list[tuple[float, dict[str, float]]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    async def scrape(self, http: httpx.AsyncClient, t0: float) -> None:
        total: dict[str, float] = {}
        for u in self.urls:
            try:
                r = await http.get(f"{u}/metrics")
                r.raise_for_status()
            except httpx.HTTPError as e:
                self.errors.append(f"{u}/metrics: {e}")
                return
            if PROMPT not in r.text:
                self.errors.append(f"{u}/metrics has no {PROMPT}: not a vLLM server?")
                return
            for k, v in parse_tier_counters(r.text).items():
                total[k] = total.get(k, 0.0) + v
        self.samples.append((time.perf_counter() - t0, total))

    async def run(self, http: httpx.AsyncClient, t0: float, stop: asyncio.Event) -> None:
        """Scrape every ``interval_s`` until ``stop`` is set, then once more. The first sample
        is the run's baseline: take it with :meth:`scrape` before the first request is sent
        (``run`` takes one at once only when there is none), else a request admitted while the
        servers are being scraped counts in the baseline, not in the run."""
        if not self.urls:
            return
        if not self.samples:
            await self.scrape(http, t0)
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.interval_s)
            except TimeoutError:
                await self.scrape(http, t0)
        await self.scrape(http, t0)

    def total(self) -> dict[str, float] | None:
        """Hit rate per tier over the whole run (None without two scrapes)."""
        if len(self.samples) < 2:
            return None
        return hit_rates(self.samples[0][1], self.samples[-1][1])

    def series(self) -> list[tuple[float, dict[str, float]]]:
        """Hit rate per tier in each interval that admitted prompt tokens."""
        out = []
        for (_, a), (t, b) in zip(self.samples, self.samples[1:], strict=False):
            if b["prompt"] > a["prompt"]:
                out.append((t, hit_rates(a, b)))
        return out

    @property
    def prompt_tokens(self) -> float:
        return self.samples[-1][1]["prompt"] - self.samples[0][1]["prompt"] if len(self.samples) > 1 else 0.0
