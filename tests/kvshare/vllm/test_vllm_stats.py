"""The connector's transfer counters as vLLM connector stats and Prometheus counters
(:mod:`kvshare.vllm.connector.stats`): deltas per report, summed across workers, on ``/metrics``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest  # noqa: E402

from kvshare.vllm.connector.stats import (  # noqa: E402
    CounterDelta,
    KVSharePromMetrics,
    KVShareStats,
    byte_counters,
)


def prometheus() -> tuple[CollectorRegistry, KVSharePromMetrics]:
    """The connector's metrics on a registry of their own (engine 0 of model "tiny")."""
    registry = CollectorRegistry()

    def counter(**kw: object) -> Counter:
        return Counter(registry=registry, **kw)  # type: ignore[arg-type]

    types = {Counter: counter, Gauge: Gauge, Histogram: Histogram}
    prom = KVSharePromMetrics(SimpleNamespace(kv_transfer_config=None), types,
                              ["model_name", "engine"], {0: ["tiny", "0"]})
    return registry, prom


def test_deltas_report_only_what_moved_since_the_last_report() -> None:
    delta = CounterDelta()
    client = {"lookups": 3, "bytes_shm": 100, "bytes_stored": 50}
    assert delta.take(byte_counters(client)) == {"bytes_shm": 100, "bytes_stored": 50}
    assert delta.take(byte_counters(client)) == {}
    client.update(bytes_shm=160, bytes_nixl=10)
    assert delta.take(byte_counters(client)) == {"bytes_shm": 60, "bytes_nixl": 10}


def test_stats_of_two_workers_sum_and_empty_stats_are_empty() -> None:
    a = KVShareStats(data={"bytes_shm": 10.0})
    b = KVShareStats(data={"bytes_shm": 5.0, "bytes_nixl": 7.0})
    assert a.aggregate(b).reduce() == {"bytes_nixl": 7, "bytes_shm": 15}
    assert KVShareStats().is_empty() and KVShareStats(data={"bytes_shm": 0}).is_empty()
    a.reset()
    assert a.is_empty()


def test_prometheus_counters_per_transport_and_stored() -> None:
    registry, prom = prometheus()
    prom.observe({"bytes_shm": 2048, "bytes_nixl": 1024, "bytes_stored": 4096}, 0)
    prom.observe({"bytes_shm": 2048, "lookups": 9}, 0)
    text = generate_latest(registry).decode()
    assert 'vllm:kvshare_loaded_bytes_total{engine="0",model_name="tiny",transport="shm"} 4096.0' in text
    assert 'transport="nixl"} 1024.0' in text
    assert 'vllm:kvshare_stored_bytes_total{engine="0",model_name="tiny"} 4096.0' in text
    assert "kvshare_lookups_total{" not in text  # a client counter, not a lookup wait


def test_read_after_write_holds_become_their_own_counters() -> None:
    from kvshare.vllm.connector.stats import save_counters

    registry, prom = prometheus()
    sched = {"sync_saves": 6, "sync_save_s": 0.375, "sync_saves_late": 1,
             "sync_saves_unmarked": 2, "save_blocks": 9}
    assert save_counters(sched) == {"sync_saves": 6.0, "sync_save_s": 0.375,
                                    "sync_saves_late": 1.0, "sync_saves_unmarked": 2.0}
    prom.observe(save_counters(sched), 0)
    text = generate_latest(registry).decode()
    assert 'vllm:kvshare_sync_saves_total{engine="0",model_name="tiny"} 6.0' in text
    assert 'vllm:kvshare_sync_save_seconds_total{engine="0",model_name="tiny"} 0.375' in text
    assert 'vllm:kvshare_sync_saves_late_total{engine="0",model_name="tiny"} 1.0' in text
    assert 'vllm:kvshare_sync_saves_unmarked_total{engine="0",model_name="tiny"} 2.0' in text
    assert "save_blocks" not in text


def test_load_waits_become_counters_a_load_report_reads() -> None:
    from kvshare.types import WorkerId
    from kvshare.vllm.connector.stats import wait_counters
    from kvshare.vllm.server.load import MetricsLoad, parse_metrics

    registry, prom = prometheus()
    worker = {"load_reported_seconds": 9.0, "load_reported_seconds_remote": 3.0,
              "loads_remote": 2, "load_reported_seconds_local": 0.5, "loads_local": 5,
              "load_polls": 40, "load_seconds": 1.25, "load_stage_seconds_shm": 0.75,
              "load_stage_seconds_copy": 0.5, "failed_blocks": 3, "load_errors": 1}
    waits = wait_counters(worker)
    assert waits == {"load_reported_seconds_remote": 3.0, "loads_remote": 2.0,
                     "load_reported_seconds_local": 0.5, "loads_local": 5.0,
                     "load_seconds": 1.25, "load_stage_seconds_shm": 0.75,
                     "load_stage_seconds_copy": 0.5, "failed_blocks": 3.0}
    load = MetricsLoad(WorkerId("w"), "http://127.0.0.1:1")
    try:
        load.from_metrics(parse_metrics(generate_latest(registry).decode()), 0.0)
        prom.observe(waits, 0)
        report = load.from_metrics(parse_metrics(generate_latest(registry).decode()), 0.1)
    finally:
        load.close()
    assert report.remote_load_s == 1.5 and report.local_load_s == 0.1
    text = generate_latest(registry).decode()  # the loads' own part of their waits
    assert 'vllm:kvshare_load_transfer_seconds_total{engine="0",model_name="tiny"} 1.25' in text
    # blocks planned that never arrived (vLLM recomputed them)
    assert 'vllm:kvshare_load_failed_blocks_total{engine="0",model_name="tiny"} 3.0' in text
    for stage, value in (("shm", 0.75), ("copy", 0.5)):
        assert (f'vllm:kvshare_load_stage_seconds_total{{engine="0",model_name="tiny",'
                f'stage="{stage}"}} {value}' in text)


def test_lookup_waits_become_their_own_counters() -> None:
    from kvshare.vllm.connector.stats import lookup_counters

    registry, prom = prometheus()
    sched = {"lookups": 4, "lookup_pending": 7, "lookup_wait_seconds": 0.25,
             "lookups_answered": 3, "lookup_seconds": 0.125, "lookups_abandoned": 1,
             "lookups_skipped": 5, "lookups_skipped_router": 2, "lookups_from_router": 6,
             "router_hints_mismatched": 1}
    assert lookup_counters(sched) == {"lookup_wait_seconds": 0.25, "lookups_answered": 3.0,
                                      "lookup_seconds": 0.125, "lookups": 4.0,
                                      "lookups_abandoned": 1.0, "lookups_skipped": 5.0,
                                      "lookups_skipped_router": 2.0, "lookups_from_router": 6.0,
                                      "router_hints_mismatched": 1.0}
    prom.observe(lookup_counters(sched), 0)
    text = generate_latest(registry).decode()
    assert 'vllm:kvshare_lookup_seconds_total{engine="0",model_name="tiny"} 0.25' in text
    assert 'vllm:kvshare_lookups_total{engine="0",model_name="tiny"} 3.0' in text
    assert 'vllm:kvshare_lookup_index_seconds_total{engine="0",model_name="tiny"} 0.125' in text
    assert 'vllm:kvshare_lookups_started_total{engine="0",model_name="tiny"} 4.0' in text
    assert 'vllm:kvshare_lookups_abandoned_total{engine="0",model_name="tiny"} 1.0' in text
    assert ('vllm:kvshare_lookups_skipped_total{engine="0",model_name="tiny",why="own_cache"} 5.0'
            in text)
    assert ('vllm:kvshare_lookups_skipped_total{engine="0",model_name="tiny",why="router"} 2.0'
            in text)
    assert 'vllm:kvshare_lookups_from_router_total{engine="0",model_name="tiny"} 6.0' in text
    assert ('vllm:kvshare_router_hints_ignored_total{engine="0",model_name="tiny",'
            'why="mismatched"} 1.0' in text)
    assert "pending" not in text


def test_the_prefill_backlog_reaches_the_load_report_exactly() -> None:
    """Three cold prompts of 6.4k tokens in all, one not reached by the scheduler yet: the
    report owes the connector's exact count plus the unreached one at the mean, where the
    estimate from vLLM's own counts (without the connector) prices them all at the mean."""
    from kvshare.types import WorkerId
    from kvshare.vllm.connector.backlog import PrefillBacklog
    from kvshare.vllm.connector.stats import backlog_counters
    from kvshare.vllm.server.load import MetricsLoad, parse_metrics

    registry, prom = prometheus()
    backlog, delta = PrefillBacklog(), CounterDelta()
    backlog.seen("a", 3000)
    backlog.seen("b", 2400)
    backlog.step({"a": 512})  # a prefills, b waits (seen), c waits (not reached)
    prom.observe(delta.take(backlog_counters(backlog.counters)), 0)
    finished = {"vllm:request_prefill_kv_computed_tokens_sum": 4000.0,
                "vllm:request_prefill_kv_computed_tokens_count": 4.0,
                "vllm:time_to_first_token_seconds_count": 4.0,
                "vllm:e2e_request_latency_seconds_count": 4.0,
                "vllm:num_requests_running": 1.0, "vllm:num_requests_waiting": 2.0}
    load = MetricsLoad(WorkerId("w"), "http://127.0.0.1:1")
    try:
        exact = load.from_metrics({**finished, **parse_metrics(generate_latest(registry)
                                                                .decode())}, 1.0)
        guessed = load.from_metrics(finished, 1.1)
    finally:
        load.close()
    assert exact.queued_prefill_tokens == (3000 - 512) + 2400 + 1000
    assert guessed.queued_prefill_tokens == 2 * 1000 + 500  # what the estimate made of it
    # the report describes the engine as its last step was scheduled, not as scraped
    assert exact.as_of == backlog.counters["backlog_as_of_seconds"] < exact.ts
    assert guessed.as_of == 0 and guessed.state_ts == guessed.ts
    backlog.step({"a": 5000, "b": 100})
    backlog.gone("b")
    prom.observe(delta.take(backlog_counters(backlog.counters)), 0)
    text = generate_latest(registry).decode()
    assert 'vllm:kvshare_backlog_tokens_added_total{engine="0",model_name="tiny"} 5400.0' in text
    assert 'vllm:kvshare_backlog_tokens_removed_total{engine="0",model_name="tiny"} 5400.0' in text
    assert 'vllm:kvshare_backlog_waiting_removed_total{engine="0",model_name="tiny"} 2.0' in text
