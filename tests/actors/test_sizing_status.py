"""The sizing estimate where operators read it: ``kvshare status --sizing`` and Prometheus."""

from __future__ import annotations

from typing import Any

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvshare.actors.cli import sizing_lines
from kvshare.actors.metrics import ClusterCollector, cluster_registry

GIB = 1 << 30


def snapshot() -> dict[str, Any]:
    tiers = {"host": {"blocks": 5, "used_bytes": 50, "capacity_bytes": 4 * GIB, "hits": 9,
                      "misses": 1}}
    sizing = {"tiers": {"host": [(2 * GIB, 0.42), (4 * GIB, 0.61), (8 * GIB, 0.72),
                                 (16 * GIB, 0.74)]},
              "lookups": 1234, "blocks": 5000, "rate": 0.25, "tracked": 10}
    return {"nodes": [{"node_id": "n1", "alive": True,
                       "pool": {"namespaces": {"m": {"tiers": tiers, "sizing": sizing}}}},
                      {"node_id": "n2", "alive": False, "pool_error": "died"}],
            "index": [], "workers": []}


def test_status_prints_each_namespace_curve() -> None:
    assert sizing_lines(snapshot()) == [
        "sizing n1 m: host 2.00 GiB -> 42%; 4.00 GiB -> 61%; 8.00 GiB -> 72%; 16.00 GiB -> 74% "
        "(1,234 lookups, sampled 25%)"]


def test_prometheus_exports_one_series_per_capacity() -> None:
    text = generate_latest(cluster_registry(ClusterCollector(snapshot))).decode()
    got = {tuple(sorted(s.labels.items())): s.value
           for fam in text_string_to_metric_families(text) for s in fam.samples
           if s.name == "kvshare_sizing_hit_rate"}
    base = (("namespace", "m"), ("node", "n1"), ("tier", "host"))
    assert got == {(("capacity_bytes", str(c * GIB)), *base): r
                   for c, r in ((2, 0.42), (4, 0.61), (8, 0.72), (16, 0.74))}


def test_live_page_view_carries_each_tier_curve() -> None:
    from kvshare.router.web.view import cluster_view

    node = cluster_view(snapshot())["nodes"][0]
    assert node["sizing"] == [{"namespace": "m", "tier": "host", "points": [
        {"capacity_bytes": c * GIB, "hit_rate": r, "multiple": c / 4}
        for c, r in ((2, 0.42), (4, 0.61), (8, 0.72), (16, 0.74))]}]
    assert cluster_view(snapshot())["nodes"][1]["sizing"] == []
