"""What each tier is worth where operators read it (``kvshare status``, Prometheus), and the
gpu tier from the engines' load reports; from status snapshots, no Ray."""

from __future__ import annotations

from typing import Any

from pool_helpers import FakeClock
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvshare.actors.index.engine_value import EngineCacheLedger
from kvshare.actors.index.registry import WorkerRegistry
from kvshare.actors.metrics import ClusterCollector, cluster_registry
from kvshare.actors.tier_value import value_lines, value_rows
from kvshare.pool.value import FIELDS
from kvshare.types import NodeId, WorkerId
from kvshare.workers import WorkerInfo, WorkerLoad

MIB = 1 << 20


def span(**kw: float) -> dict[str, float]:
    return {f: float(kw.get(f, 0.0)) for f in FIELDS}


def ledger(**tiers: dict[str, float]) -> dict[str, Any]:
    return {"window_s": 300.0, "since_s": 900.0,
            "tiers": {t: {"window": v, "total": v} for t, v in tiers.items()}}


def snapshot(engine: dict[str, Any] | None = None) -> dict[str, Any]:
    """Node n1: 1,000 blocks of 16 tokens looked up; host served 600, disk 4 (0.4%) after
    31 s of writes; nothing pulled remotely. Prefill priced at 2,000 tokens/s."""
    value = ledger(host=span(lookups=1000, hits=600, bytes_in=64 * MIB, write_s=0.5),
                   disk=span(hits=4, bytes_in=900 * MIB, write_s=31.0, bytes_out=MIB,
                             read_s=0.01),
                   remote=span())
    return {"nodes": [{"node_id": "n1", "alive": True, "pool": {"namespaces": {
                "m": {"tiers": {}, "block_tokens": 16, "value": value}}}},
                      {"node_id": "n2", "alive": False, "pool_error": "died"}],
            "index": [{"engine_value": engine or {}}], "workers": [],
            "prefill_tokens_per_s": {"m": 2000.0}}


def test_status_prints_each_tier_and_flags_the_disk_tier_with_its_fix() -> None:
    rows = {r["tier"]: r for r in value_rows(snapshot())}
    assert set(rows) == {"host", "disk"}  # remote pulls: none since start, left out
    assert rows["host"]["window"]["saved_s"] == 600 * 16 / 2000 and rows["host"]["verdict"] == ""
    disk = rows["disk"]["window"]
    assert disk["tokens"] == 64 and disk["hit_share"] == 0.004
    assert disk["net_s"] == round(64 / 2000 - 31.01, 6)
    lines = value_lines(snapshot())
    assert lines[0].startswith("value n1 m/host (at 2,000 tok/s): last 300 s 9,600 tok "
                               "(60.0% of lookups), 4.8 s saved, 0.5 s spent")
    assert lines[-1] == ("  ! disk: 0.4% of lookups hit, 0.032 s saved, 31 s spent writing, "
                         "0.01 s spent reading: consider --disk-gb 0 or a larger host tier "
                         "(--host-gb)")


def test_no_prefill_speed_yet_prices_nothing_and_flags_nothing() -> None:
    st = {**snapshot(), "prefill_tokens_per_s": {}}
    rows = value_rows(st)
    assert all(r["window"]["saved_s"] is None and r["verdict"] == "" for r in rows)
    assert "no prefill speed reported yet" in value_lines(st)[0]


def test_prometheus_exports_each_figure_per_span_and_the_flag() -> None:
    text = generate_latest(cluster_registry(ClusterCollector(snapshot))).decode()
    samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples]
    flagged = {s.labels["tier"]: s.value for s in samples
               if s.name == "kvshare_tier_value_flagged"}
    assert flagged == {"host": 0.0, "disk": 1.0}
    net = {(s.labels["tier"], s.labels["span"]): s.value for s in samples
           if s.name == "kvshare_tier_value_net_seconds"}
    assert net[("disk", "window")] < 0 < net[("host", "total")]
    speed = [s.value for s in samples if s.name == "kvshare_prefill_tokens_per_second"]
    assert speed == [2000.0]


def test_engine_reports_become_the_gpu_tier_counting_restarts() -> None:
    clock = FakeClock()
    reg = WorkerRegistry(ttl_s=3.0, clock=clock)
    reg.register(WorkerInfo(WorkerId("w"), NodeId("n1"), ("m",)))
    for prompt, cached in ((1000, 400), (3000, 1400), (500, 100)):  # the last: a restart
        assert reg.report(WorkerLoad(WorkerId("w"), prompt_tokens=prompt,
                                     engine_cached_tokens=cached))
    figures = reg.engine_value.figures()
    gpu = figures["n1"]["m"]["tiers"]["gpu"]["total"]  # type: ignore[index]
    assert gpu["lookups"] == 3000 + 500 and gpu["hits"] == 1400 + 100
    rows = value_rows(snapshot(engine=figures))
    row = next(r for r in rows if r["tier"] == "gpu")
    assert row["total"]["tokens"] == 1500 and row["total"]["hit_share"] == round(1500 / 3500, 6)
    assert row["total"]["saved_s"] == 1500 / 2000 and row["total"]["net_s"] == 0.75
    assert row["verdict"] == ""  # nothing spent: the engine's own cache always pays


def test_a_worker_that_reports_no_cache_counts_adds_no_gpu_tier() -> None:
    ledger_ = EngineCacheLedger()
    ledger_.report(WorkerInfo(WorkerId("w"), NodeId("n1"), ("m",)), WorkerLoad(WorkerId("w")))
    assert ledger_.figures() == {}
