"""The live page's data, from a status snapshot and a router's decisions (no Ray, no HTTP)."""

from __future__ import annotations

from typing import Any

from kvshare.router.core.policy import Decision
from kvshare.router.core.recent import RecentDecisions
from kvshare.router.web.view import cluster_view
from kvshare.types import WorkerId


def tier(hits: int, misses: int, used: int = 0) -> dict[str, Any]:
    return {"hits": hits, "misses": misses, "blocks": used // 2, "used_bytes": used,
            "capacity_bytes": 100}


def status() -> dict[str, Any]:
    pool = {"generation": 2, "namespaces": {"chat": {"tiers": {
        "host": tier(6, 2, used=40), "disk": tier(2, 0, used=10)}}}}
    return {"nodes": [
        {"node_id": "a" * 56, "alive": True, "pool": pool,
         "bandwidth_bytes_per_s": {"shm": 16e9, "nixl": 5e9},
         "bandwidth": {"per_node": {"b" * 56: {"nixl": 5e9, "objstore": 1.2e9}}, "measured_at": 9.0}},
        {"node_id": "b" * 56, "alive": True, "pool_error": "GetTimeoutError: ..."},
        {"node_id": "c" * 56, "alive": False},
    ], "index": [{"epoch": 3, "namespaces": {"chat": {"blocks": 25}}, "locations": ["node:a"],
                  "workers": 2, "replaced": 1, "gaps": 1, "pending_resync": ["node:b"]}],
        "workers": [{"worker_id": "w0", "node": "a" * 56, "namespaces": ["chat"], "endpoint": "x"},
                    {"worker_id": "w2", "node": "c" * 56, "namespaces": ["chat"], "endpoint": "y"}]}


def test_tier_hit_rates_share_one_denominator() -> None:
    """A pool counts a miss once (first tier): 6 host + 2 disk hits, 2 misses = 60% + 20%."""
    node = cluster_view(status())["nodes"][0]
    rates = {t["tier"]: t["hit_rate"] for t in node["tiers"]}
    assert rates == {"host": 0.6, "disk": 0.2}
    assert node["peers"] == [{"peer": "b" * 56, "transport": "nixl", "gbps": 5.0},
                             {"peer": "b" * 56, "transport": "objstore", "gbps": 1.2}]


def test_node_states_and_workers_on_dead_nodes() -> None:
    view = cluster_view(status())
    assert [n["state"] for n in view["nodes"]] == ["up", "pool not answering", "down"]
    assert {w["worker_id"]: w["state"] for w in view["workers"]} == {"w0": "up", "w2": "down"}
    shard = view["index"][0]
    assert (shard["blocks"], shard["resyncs"], shard["pending_resyncs"]) == ({"chat": 25}, 1, 1)


def test_no_lookups_is_no_rate_not_zero() -> None:
    st = status()
    st["nodes"][0]["pool"]["namespaces"]["chat"]["tiers"] = {"host": tier(0, 0)}
    assert cluster_view(st)["nodes"][0]["tiers"][0]["hit_rate"] is None


def decision(saved: float) -> Decision:
    return Decision(WorkerId("w0"), "http://w0", "cost", "cache_hit", 0.05, saved, 3, 1)


def test_recent_decisions_ring_tenants_and_worker_figures() -> None:
    recent = RecentDecisions(size=2)
    recent.add("r1", decision(0.1), "acme", 100)
    recent.add("r2", decision(0.2), "globex", 50)
    recent.add("r3", decision(0.3), "acme", 70)
    recent.finish("r3", {"reused_tokens": 48, "prefill_s": 0.02, "ttft_s": "x",
                         "ttft_breakdown": {"index_s": 0.001, "fetch_s": 0.004, "bad": None}})
    recent.finish("r1", {"reused_tokens": 1})  # fell out of the ring: ignored
    assert [d["request_id"] for d in recent.snapshot()] == ["r3", "r2"]
    assert [d["request_id"] for d in recent.snapshot("acme")] == ["r3"]
    newest = recent.snapshot()[0]
    assert newest["worker_stats"] == {"reused_tokens": 48.0, "prefill_s": 0.02}
    assert newest["breakdown"] == {"index_s": 0.001, "fetch_s": 0.004}
    recent.finish_stream("r2", b'data: {"choices": []}\n\ndata: {"kvshare": {"ttft_s": 0.5}}\n\n'
                                b"data: [DONE]\n\n")
    recent.finish_stream("r2", b"data: {not json")  # ignored
    assert recent.snapshot()[1]["worker_stats"] == {"ttft_s": 0.5}
    acme = recent.tenants["acme"]  # totals cover every decision, not just the ring
    assert acme["requests"] == 2 and acme["prompt_tokens"] == 170
    assert abs(acme["est_ttft_saved_s"] - 0.4) < 1e-9
