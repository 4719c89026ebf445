"""ClusterCollector turns a status snapshot into Prometheus series and never fails a scrape."""

from __future__ import annotations

from typing import Any

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvshare.actors.metrics import ClusterCollector, cluster_registry


def series(collector: ClusterCollector) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(cluster_registry(collector)).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_unreachable_cluster_is_a_zero_not_an_error() -> None:
    def broken() -> dict[str, Any]:
        raise ConnectionError("no Ray cluster")

    got = series(ClusterCollector(broken))
    assert got[("kvshare_status_up", ())] == 0 and got[("kvshare_index_up", ())] == 0
    assert not [k for k in got if k[0].startswith("kvshare_pool_")]


def test_dead_pool_reports_down_and_no_tier_series() -> None:
    status = {
        "nodes": [
            {"node_id": "n1", "alive": False, "pool_error": "RayActorError: died"},
            {"node_id": "n2", "alive": True, "bandwidth_bytes_per_s": {"shm": 10e9},
             "pool": {"generation": 3, "holders": 1, "published_events": 7,
                      "namespaces": {"m": {"active_leases": 2, "pinned_blocks": 1,
                                           "leases_expired": 4,
                                           "tiers": {"host": {"blocks": 5, "used_bytes": 50,
                                                              "capacity_bytes": 100,
                                                              "hits": 9, "misses": 1}}}}}},
        ],
        "index": [{"namespaces": {"m": {"blocks": 5}}, "locations": ["a", "b"], "applied": 7,
                   "pending_resync": [["m", "a"]]}],
        "workers": [{"worker_id": "w"}],
    }
    got = series(ClusterCollector(lambda: status))
    assert got[("kvshare_pool_up", (("node", "n1"),))] == 0
    assert got[("kvshare_node_alive", (("node", "n1"),))] == 0
    assert not [k for k in got if ("node", "n1") in k[1] and k[0] not in
                ("kvshare_pool_up", "kvshare_node_alive")]
    host = (("namespace", "m"), ("node", "n2"), ("tier", "host"))
    assert got[("kvshare_pool_blocks", host)] == 5 and got[("kvshare_pool_hits_total", host)] == 9
    assert got[("kvshare_pool_leases_expired_total", (("namespace", "m"), ("node", "n2")))] == 4
    assert got[("kvshare_pool_published_events_total", (("node", "n2"),))] == 7
    assert got[("kvshare_transfer_bandwidth_bytes_per_second", (("node", "n2"), ("transport", "shm")))] == 10e9
    assert got[("kvshare_index_blocks", (("namespace", "m"), ("shard", "0")))] == 5
    assert got[("kvshare_index_locations", (("shard", "0"),))] == 2
    assert got[("kvshare_index_pending_resyncs", (("shard", "0"),))] == 1
    assert got[("kvshare_index_applied_total", (("shard", "0"),))] == 7
    assert got[("kvshare_workers", ())] == 1
