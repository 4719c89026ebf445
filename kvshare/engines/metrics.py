"""Prometheus exposition of a worker's counters (``GET /metrics`` of the worker server).

The worker (:class:`~kvshare.engines.worker.ReferenceWorker`) and its SDK client keep flat
counter dicts whose keys carry a dimension in a suffix (``bytes_loaded_nixl``,
``miss_slot reused``). :class:`WorkerCollector` turns each key family into one Prometheus
counter with a label (``kvshare_worker_bytes_loaded_total{transport="nixl"}``), so dashboards
can sum and rate them; keys without a known prefix become ``kvshare_{source}_{key}_total``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector

Counters = Callable[[], dict[str, float]]

#: (key prefix, metric name, label, help); the first matching prefix wins, so longer first.
WORKER_FAMILIES = (
    ("bytes_loaded_tier_", "kvshare_worker_bytes_loaded_by_tier", "tier",
     "Bytes of reused KV by the tier they were read from"),
    ("bytes_loaded_", "kvshare_worker_bytes_loaded", "transport",
     "Bytes of reused KV by transport"),
    ("miss_", "kvshare_worker_load_misses", "reason", "Planned blocks that were not loaded"),
)
CLIENT_FAMILIES = (
    ("transfer_seconds_", "kvshare_client_transfer_seconds", "transport",
     "Seconds from submitting a batch read to its completion, summed"),
    ("transfers_", "kvshare_client_transfers", "transport", "Batch reads completed"),
    ("bytes_", "kvshare_client_transfer_bytes", "transport", "Bytes pulled by transport"),
    ("blocks_", "kvshare_client_loaded_blocks_by_tier", "tier",
     "Blocks loaded by the tier they were read from"),
    ("store_miss_", "kvshare_client_store_misses", "reason", "Blocks not stored, by reason"),
    ("miss_", "kvshare_client_load_misses", "reason", "Planned blocks not loaded, by reason"),
)
STAGE_PREFIX = "ttft_stage_s_"
"""Counters summing one TTFT stage's seconds (exported as one summary per stage)."""
#: Counters that are not a family but a plain total, although they share a family's prefix.
PLAIN = {"bytes_stored"}
_NAME = re.compile(r"[^a-zA-Z0-9_]")


def _families(source: str, counters: dict[str, float], worker: str,
              rules: tuple[tuple[str, str, str, str], ...]) -> Iterator[Metric]:
    # Every family is declared, with no sample until its first event (a dashboard over
    # misses by reason finds the metric before the first miss).
    fams = {name: CounterMetricFamily(name, doc, labels=["worker", label])
            for _, name, label, doc in rules}
    plain: list[CounterMetricFamily] = []
    for key, value in sorted(counters.items()):
        rule = None if key in PLAIN else next((r for r in rules if key.startswith(r[0])), None)
        if rule is None:
            fam = CounterMetricFamily(f"kvshare_{source}_{_NAME.sub('_', key)}",
                                      f"{source} counter {key}", labels=["worker"])
            fam.add_metric([worker], float(value))
            plain.append(fam)
            continue
        prefix, name = rule[0], rule[1]
        fams[name].add_metric([worker, key[len(prefix):]], float(value))
    yield from plain
    yield from fams.values()


class WorkerCollector(Collector):
    """The worker's and its client's counters, read at scrape time."""

    def __init__(self, worker_id: str, worker_counters: Counters, client_counters: Counters) -> None:
        self.worker_id = worker_id
        self._worker = worker_counters
        self._client = client_counters

    def collect(self) -> Iterator[Metric]:
        w = dict(self._worker())
        ttft_sum = w.pop("ttft_s_sum", 0.0)
        ttft = SummaryMetricFamily("kvshare_worker_ttft_seconds",
                                   "Time to first token of served requests", labels=["worker"])
        ttft.add_metric([self.worker_id], count_value=int(w.get("requests", 0)), sum_value=ttft_sum)
        yield ttft
        stages = SummaryMetricFamily(
            "kvshare_worker_ttft_stage_seconds",
            "Where served requests' time to first token went, by stage (kvshare.breakdown)",
            labels=["worker", "stage"])
        for key in [k for k in w if k.startswith(STAGE_PREFIX)]:
            stages.add_metric([self.worker_id, key[len(STAGE_PREFIX):]],
                              count_value=int(w.get("requests", 0)), sum_value=w.pop(key))
        yield stages
        yield from _families("worker", w, self.worker_id, WORKER_FAMILIES)
        yield from _families("client", self._client(), self.worker_id, CLIENT_FAMILIES)


def worker_registry(collector: WorkerCollector) -> CollectorRegistry:
    """A registry holding only ``collector`` (never the process-global one); render it with
    ``prometheus_client.generate_latest``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry
