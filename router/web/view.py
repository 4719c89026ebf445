"""What the live page shows, as one JSON object built from data kvshare already exposes.

:func:`cluster_view` reshapes an :func:`kvshare.actors.deploy.status` snapshot (the one ``kvshare status
--json`` prints and the Prometheus collector reads): per node its state, tiers (used/capacity,
blocks, hit rate, evictions, demotions), what each tier is worth
(:func:`kvshare.actors.tier_value.value_rows`) and probed bandwidths per transport and peer; the
index shards; the registered workers. :func:`router_view` adds a router's side (gateway only):
decisions by reason and estimated TTFT saved from its Prometheus registry, the recent
decisions, worker load reports, and for admins the per-tenant usage. Pure functions of their
inputs: no Ray, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvshare.actors.tier_value import value_rows
from kvshare.cost import GB
from kvshare.workers import WorkerInfo, WorkerLoad

NODE_UP, NODE_DOWN, POOL_SILENT, NO_POOL = "up", "down", "pool not answering", "no pool"
TIER_FIELDS = ("blocks", "used_bytes", "capacity_bytes", "hits", "misses", "evictions",
               "demotions", "promotions", "corrupt")


def node_state(node: Mapping[str, Any]) -> str:
    """``down`` (Ray says the node is dead), ``pool not answering``, ``no pool`` or ``up``."""
    if not node.get("alive"):
        return NODE_DOWN
    if node.get("pool") is None:
        return POOL_SILENT if "pool_error" in node else NO_POOL
    return NODE_UP


def _tiers(pool: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per namespace and tier. A pool counts a miss once (on its first tier), so a
    tier's ``hit_rate`` is its hits over all the namespace's lookups on that node; the
    tiers' rates add up to the node's hit rate for the namespace."""
    out = []
    for ns, info in sorted(pool.get("namespaces", {}).items()):
        rows = []
        for tier, t in info.get("tiers", {}).items():
            row: dict[str, Any] = {"namespace": ns, "tier": tier}
            row.update({k: float(t.get(k, 0)) for k in TIER_FIELDS})
            rows.append(row)
        misses = sum(r["misses"] for r in rows)
        hits = sum(r["hits"] for r in rows)
        for row in rows:
            row["hit_rate"] = row["hits"] / (hits + misses) if hits + misses else None
        out.extend(rows)
    return out


def _sizing(pool: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per namespace and tier, the hit rate it would have at 0.5x..4x its size
    (:meth:`kvshare.pool.tiered.TieredBlockPool.sizing`); empty where pools do not estimate."""
    out = []
    for ns, info in sorted(pool.get("namespaces", {}).items()):
        for tier, points in ((info.get("sizing") or {}).get("tiers") or {}).items():
            size = float(info.get("tiers", {}).get(tier, {}).get("capacity_bytes", 0))
            out.append({"namespace": ns, "tier": tier, "points": [
                {"capacity_bytes": int(c), "hit_rate": float(r),
                 "multiple": round(c / size, 2) if size else None} for c, r in points]})
    return out


def _peers(bandwidth: Mapping[str, Any]) -> list[dict[str, Any]]:
    per_node = bandwidth.get("per_node") or {}
    rows: list[dict[str, Any]] = []
    for peer, figures in sorted(per_node.items()):
        if isinstance(figures, Mapping):
            rows.extend({"peer": str(peer), "transport": str(t), "gbps": float(v) / GB}
                        for t, v in sorted(figures.items()) if isinstance(v, int | float))
    return rows


def cluster_view(status: Mapping[str, Any]) -> dict[str, Any]:
    """Nodes, index and workers of a status snapshot (see the module docstring)."""
    nodes = []
    values: dict[str, list[dict[str, Any]]] = {}
    for row in value_rows(status):
        values.setdefault(row["node"], []).append(row)
    for node in status.get("nodes", []):
        pool = node.get("pool") or {}
        nid = str(node["node_id"])
        nodes.append({
            "node_id": nid, "address": node.get("address", ""), "state": node_state(node),
            "error": node.get("pool_error", ""), "generation": pool.get("generation"),
            "tiers": _tiers(pool), "sizing": _sizing(pool), "value": values.get(nid, []),
            "bandwidth_gbps": {str(k): float(v) / GB for k, v in
                               sorted((node.get("bandwidth_bytes_per_s") or {}).items())},
            "peers": _peers(node.get("bandwidth") or {}),
            "measured_at": float((node.get("bandwidth") or {}).get("measured_at", 0.0)),
        })
    shards = []
    for i, shard in enumerate(status.get("index", [])):
        shards.append({
            "shard": i, "epoch": shard.get("epoch", 0),
            "blocks": {ns: int(v.get("blocks", 0)) for ns, v in
                       sorted(shard.get("namespaces", {}).items())},
            "locations": len(shard.get("locations", [])), "workers": shard.get("workers", 0),
            "applied": shard.get("applied", 0), "gaps": shard.get("gaps", 0),
            "resyncs": shard.get("replaced", 0),
            "pending_resyncs": len(shard.get("pending_resync", [])),
        })
    down = {n["node_id"] for n in nodes if n["state"] == NODE_DOWN}
    workers = [{"worker_id": str(w["worker_id"]), "node": str(w["node"]),
                "endpoint": str(w.get("endpoint", "")),
                "namespaces": list(w.get("namespaces", [])),
                "state": NODE_DOWN if str(w["node"]) in down else NODE_UP}
               for w in status.get("workers", [])]
    return {"available": True, "nodes": nodes, "index": shards, "workers": workers,
            "index_error": status.get("index_error", "")}


def merge_workers(workers: list[dict[str, Any]], infos: Sequence[WorkerInfo],
                  loads: Mapping[Any, WorkerLoad], now: float) -> list[dict[str, Any]]:
    """``workers`` (from the status) plus the router's own worker list and load reports."""
    by_id = {w["worker_id"]: w for w in workers}
    for info in infos:
        by_id.setdefault(str(info.worker_id), {
            "worker_id": str(info.worker_id), "node": str(info.node), "endpoint": info.endpoint,
            "namespaces": list(info.namespaces), "state": NODE_UP})
    for wid, w in by_id.items():
        load = loads.get(wid)
        if load is not None:
            w.update(queued_prefill_tokens=load.queued_prefill_tokens, running=load.running,
                     prefill_tokens_per_s=load.prefill_tokens_per_s,
                     report_age_s=max(0.0, now - load.ts) if load.ts else None)
    return sorted(by_id.values(), key=lambda w: (w["node"], w["worker_id"]))


def metric_totals(registry: Any) -> dict[str, dict[str, float]]:
    """``{metric sample name: {label value: value}}`` of a Prometheus registry's counters
    (one label at most is kept: the last one, e.g. ``reason`` or ``tenant``)."""
    out: dict[str, dict[str, float]] = {}
    for family in registry.collect():
        for s in family.samples:
            if not s.name.endswith("_total"):
                continue
            key = list(s.labels.values())[-1] if s.labels else ""
            by = out.setdefault(s.name, {})
            by[key] = by.get(key, 0.0) + float(s.value)
    return out


def router_view(router: Any, tenant: str | None) -> dict[str, Any]:
    """The router's figures; ``tenant``: only that tenant's recent decisions (None = all)."""
    totals = metric_totals(router.metrics.registry)
    return {
        "policy": router.policy.name, "decisions": router.decisions,
        "fallbacks": router.fallbacks,
        "by_reason": totals.get("kvshare_router_decisions_total", {}),
        "est_ttft_saved_s": sum(totals.get("kvshare_router_est_ttft_saved_seconds_total",
                                           {}).values()),
        "cached_tokens": sum(totals.get("kvshare_router_cached_tokens_total", {}).values()),
        "recent": router.recent.snapshot(tenant),
    }


def tenants_view(router: Any) -> list[dict[str, Any]]:
    """Per-tenant usage since the router started (admin view)."""
    return [{"tenant": name, **figures} for name, figures in sorted(router.recent.tenants.items())]
