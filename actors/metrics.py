"""Prometheus view of a kvshare deployment: node pools per namespace and tier, index shards.

:class:`ClusterCollector` is a ``prometheus_client`` collector. Each scrape takes one
:func:`kvshare.actors.deploy.status` snapshot (one round of actor calls, each bounded by a timeout) and
turns it into metric families, so the figures are exactly what ``kvshare status`` prints.
A pool or shard that does not answer is reported with ``kvshare_pool_up 0`` /
``kvshare_index_up 0`` and no other series; a scrape never raises.

Counters the pools and shards keep since they started (a restarted actor starts again from
zero, which Prometheus ``rate()`` handles as a counter reset) are exposed as counters; current
sizes as gauges. ``kvshare metrics --port N`` serves this over HTTP (see ``actors/cli.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvshare.actors.tier_value import value_rows

log = logging.getLogger(__name__)

#: Per-tier pool counters (``TieredBlockPool`` ``_COUNTERS``) and their help text.
TIER_COUNTERS = {
    "hits": "Lookups (pin/read) that found the block in this tier",
    "misses": "Lookups that found the block in no tier (counted on the first tier)",
    "bytes_in": "Bytes written into this tier (stores and moves from another tier)",
    "bytes_out": "Bytes read out of this tier (copies, moves to another tier, slots handed to shm/NIXL readers)",
    "stores": "Blocks committed into this tier",
    "evictions": "Blocks that left this tier to make room",
    "demotions": "Blocks moved from this tier to the next one down",
    "promotions": "Blocks moved up into the first tier",
    "corrupt": "Blocks dropped because their checksum did not match",
}
#: Node pool actor counters (``NodePool.counters``).
POOL_COUNTERS = {
    "published_events": "Block events published to the index",
    "batches": "Event batches published to the index",
    "publish_errors": "Event batches the index did not accept (retried later)",
    "republishes": "Full inventories sent to the index (resyncs asked by the index)",
    "stale_acks": "Batches the index acknowledged as stale (older generation)",
    "holders_released": "Leases released because their holder died",
}
#: Index shard counters (``GlobalIndex.counters``).
INDEX_COUNTERS = {
    "applied": "Block events applied",
    "stale": "Events dropped as coming from an older pool generation",
    "duplicate": "Events already applied (redelivery)",
    "gaps": "Sequence gaps seen in a pool's event stream (each triggers a resync)",
    "replaced": "Inventories replaced by a resync",
    "dropped_locations": "Locations dropped (dead node or pool)",
}

StatusFn = Callable[[], dict[str, Any]]


class ClusterCollector(Collector):
    """Metric families from a status snapshot; ``status_fn`` defaults to
    :func:`kvshare.actors.deploy.status` in ``ray_namespace`` (Ray must be initialised)."""

    def __init__(self, status_fn: StatusFn | None = None, *, ray_namespace: str | None = None,
                 timeout_s: float = 5.0) -> None:
        if status_fn is None:
            from kvshare.actors.config import RAY_NAMESPACE
            from kvshare.actors.deploy import status

            ns = ray_namespace or RAY_NAMESPACE
            self._status: StatusFn = lambda: status(ns, timeout_s=timeout_s)
        else:
            self._status = status_fn

    def collect(self) -> Iterator[Metric]:
        ok = True
        try:
            st = self._status()
        except Exception as exc:  # no Ray, no cluster: say so in a series, never fail a scrape
            log.warning("kvshare status failed: %s", exc)
            ok, st = False, {"nodes": [], "index": [], "workers": [], "index_error": str(exc)}
        up = GaugeMetricFamily("kvshare_status_up", "1 if the cluster status could be read")
        up.add_metric([], 1.0 if ok else 0.0)
        yield up
        yield from _pool_families(st.get("nodes", []))
        yield from _value_families(st)
        yield from _index_families(st.get("index", []), "index_error" in st)
        workers = GaugeMetricFamily("kvshare_workers", "Workers registered in the index")
        workers.add_metric([], float(len(st.get("workers", []))))
        yield workers


def _pool_families(nodes: Iterable[dict[str, Any]]) -> Iterator[Metric]:
    node_l, ns_l, tier_l = ["node"], ["node", "namespace"], ["node", "namespace", "tier"]
    alive = GaugeMetricFamily("kvshare_node_alive", "1 if Ray reports the node alive", labels=node_l)
    up = GaugeMetricFamily("kvshare_pool_up", "1 if the node's pool actor answered", labels=node_l)
    gen = GaugeMetricFamily("kvshare_pool_generation", "Pool generation (bumps on restart)",
                            labels=node_l)
    holders = GaugeMetricFamily("kvshare_pool_holders", "Distinct lease holders seen", labels=node_l)
    blocks = GaugeMetricFamily("kvshare_pool_blocks", "Blocks held", labels=tier_l)
    used = GaugeMetricFamily("kvshare_pool_used_bytes", "Bytes in use", labels=tier_l)
    cap = GaugeMetricFamily("kvshare_pool_capacity_bytes", "Capacity in bytes", labels=tier_l)
    leases = GaugeMetricFamily("kvshare_pool_active_leases", "Leases (pins and writes) open",
                               labels=ns_l)
    pinned = GaugeMetricFamily("kvshare_pool_pinned_blocks", "Blocks pinned by a reader",
                               labels=ns_l)
    expired = CounterMetricFamily("kvshare_pool_leases_expired", "Leases that hit their deadline",
                                  labels=ns_l)
    sizing = GaugeMetricFamily(
        "kvshare_sizing_hit_rate",
        "Estimated hit rate the tier would have at capacity_bytes (kvshare.pool.sizing)",
        labels=[*tier_l, "capacity_bytes"])
    bw = GaugeMetricFamily("kvshare_transfer_bandwidth_bytes_per_second",
                           "Probed (or configured) pull bandwidth from this node per transport, bytes/s",
                           labels=["node", "transport"])
    tier_c = {k: CounterMetricFamily(f"kvshare_pool_{k}", h, labels=tier_l)
              for k, h in TIER_COUNTERS.items()}
    pool_c = {k: CounterMetricFamily(f"kvshare_pool_{k}", h, labels=node_l)
              for k, h in POOL_COUNTERS.items()}
    for node in nodes:
        nid = str(node["node_id"])
        alive.add_metric([nid], 1.0 if node.get("alive") else 0.0)
        pool = node.get("pool")
        up.add_metric([nid], 0.0 if pool is None else 1.0)
        for transport, rate in sorted((node.get("bandwidth_bytes_per_s") or {}).items()):
            bw.add_metric([nid, transport], float(rate))
        if pool is None:
            continue
        gen.add_metric([nid], float(pool.get("generation", 0)))
        holders.add_metric([nid], float(pool.get("holders", 0)))
        for key, family in pool_c.items():
            family.add_metric([nid], float(pool.get(key, 0)))
        for ns, info in sorted(pool.get("namespaces", {}).items()):
            leases.add_metric([nid, ns], float(info.get("active_leases", 0)))
            pinned.add_metric([nid, ns], float(info.get("pinned_blocks", 0)))
            expired.add_metric([nid, ns], float(info.get("leases_expired", 0)))
            for tier, t in sorted(info.get("tiers", {}).items()):
                labels = [nid, ns, tier]
                blocks.add_metric(labels, float(t.get("blocks", 0)))
                used.add_metric(labels, float(t.get("used_bytes", 0)))
                cap.add_metric(labels, float(t.get("capacity_bytes", 0)))
                for key, family in tier_c.items():
                    family.add_metric(labels, float(t.get(key, 0)))
            for tier, points in sorted((info.get("sizing") or {}).get("tiers", {}).items()):
                for capacity, rate in points:
                    sizing.add_metric([nid, ns, tier, str(int(capacity))], float(rate))
    yield from (alive, up, gen, holders, blocks, used, cap, leases, pinned, expired, bw, sizing)
    yield from tier_c.values()
    yield from pool_c.values()


#: Tier value figures (:func:`kvshare.actors.tier_value.value_rows`), per span.
VALUE_GAUGES = {
    "tokens": ("kvshare_tier_value_tokens", "Prompt tokens the tier served"),
    "saved_s": ("kvshare_tier_value_saved_seconds",
                "Prefill seconds those tokens saved, at the workers' measured prefill speed"),
    "write_s": ("kvshare_tier_value_write_seconds", "Seconds spent writing into the tier"),
    "read_s": ("kvshare_tier_value_read_seconds", "Seconds spent reading out of the tier"),
    "bytes_in": ("kvshare_tier_value_bytes_in", "Bytes written into the tier"),
    "bytes_out": ("kvshare_tier_value_bytes_out", "Bytes read out of the tier"),
    "net_s": ("kvshare_tier_value_net_seconds", "Prefill seconds saved less seconds spent"),
}


def _value_families(st: dict[str, Any]) -> Iterator[Metric]:
    """What each tier is worth, ``span`` = ``window`` (the pools' sliding window) or
    ``total`` (since the pool started); gauges, since a re-measured prefill speed reprices
    past tokens. ``kvshare_tier_value_flagged`` is 1 where the window's net is <= 0."""
    labels = ["node", "namespace", "tier", "span"]
    gauges = {k: GaugeMetricFamily(name, doc, labels=labels)
              for k, (name, doc) in VALUE_GAUGES.items()}
    flagged = GaugeMetricFamily("kvshare_tier_value_flagged",
                                "1 if the tier's net value over the window is <= 0 (see "
                                "kvshare status for the reason and the fix)",
                                labels=["node", "namespace", "tier"])
    speed = GaugeMetricFamily("kvshare_prefill_tokens_per_second",
                              "Workers' median measured prefill speed that prices a token",
                              labels=["namespace"])
    for ns, tps in sorted((st.get("prefill_tokens_per_s") or {}).items()):
        speed.add_metric([ns], float(tps))
    for r in value_rows(st):
        base = [r["node"], r["namespace"], r["tier"]]
        flagged.add_metric(base, 1.0 if r["verdict"] else 0.0)
        for span in ("window", "total"):
            for key, family in gauges.items():
                v = r[span][key]
                if v is not None:
                    family.add_metric([*base, span], float(v))
    yield from gauges.values()
    yield flagged
    yield speed


def _index_families(shards: Iterable[dict[str, Any]], unreachable: bool) -> Iterator[Metric]:
    up = GaugeMetricFamily("kvshare_index_up", "1 if the index shards answered")
    up.add_metric([], 0.0 if unreachable else 1.0)
    yield up
    blocks = GaugeMetricFamily("kvshare_index_blocks", "Distinct block hashes indexed",
                               labels=["shard", "namespace"])
    locations = GaugeMetricFamily("kvshare_index_locations", "Locations (node pools) known",
                                  labels=["shard"])
    holder_states = GaugeMetricFamily("kvshare_index_holder_states",
                                      "Distinct holder sets (index memory)", labels=["shard"])
    resync = GaugeMetricFamily("kvshare_index_pending_resyncs",
                               "Pools asked to resend their inventory", labels=["shard"])
    counters = {k: CounterMetricFamily(f"kvshare_index_{k}", h, labels=["shard"])
                for k, h in INDEX_COUNTERS.items()}
    for i, shard in enumerate(shards):
        sid = str(i)
        for ns, info in sorted(shard.get("namespaces", {}).items()):
            blocks.add_metric([sid, ns], float(info.get("blocks", 0)))
        locations.add_metric([sid], float(len(shard.get("locations", []))))
        holder_states.add_metric([sid], float(shard.get("holder_states", 0)))
        resync.add_metric([sid], float(len(shard.get("pending_resync", []))))
        for key, family in counters.items():
            family.add_metric([sid], float(shard.get(key, 0)))
    yield from (blocks, locations, holder_states, resync)
    yield from counters.values()


def cluster_registry(collector: ClusterCollector | None = None) -> CollectorRegistry:
    """A fresh registry holding only the cluster collector (never the process-global one)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector or ClusterCollector())
    return registry
