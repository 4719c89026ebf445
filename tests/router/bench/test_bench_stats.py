"""``kvshare bench``'s numbers: percentiles, hit rate per tier from vLLM's counters, ratios."""

from __future__ import annotations

import pytest

from kvshare.router.bench.report import percentiles, ratios
from kvshare.router.bench.tiers import hit_rates, parse_tier_counters

METRICS = """\
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
vllm:prompt_tokens_total{engine="0",model_name="m"} 1000.0
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="device"} 300.0
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="host"} 200.0
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="p2p"} 100.0
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="disk"} 0.0
vllm:prompt_tokens_cached_by_source_total{engine="1",model_name="m",source="device"} 50.0
vllm:prompt_tokens_cached_total{engine="0",model_name="m"} 600.0
"""


def test_vllm_counters_are_read_per_tier_and_summed_over_engines() -> None:
    got = parse_tier_counters(METRICS)
    assert got == {"prompt": 1000.0, "engine": 350.0, "local_pool": 200.0, "remote_pool": 100.0,
                   "disk": 0.0, "external": 0.0}


def test_hit_rate_per_tier_is_the_share_of_prompt_tokens_between_two_scrapes() -> None:
    before = parse_tier_counters(METRICS)
    after = {**before, "prompt": 1400.0, "engine": 450.0, "remote_pool": 200.0}
    rates = hit_rates(before, after)
    assert rates == pytest.approx({"engine": 0.25, "local_pool": 0.0, "remote_pool": 0.25,
                                   "disk": 0.0, "external": 0.0, "computed": 0.5})
    assert set(hit_rates(before, before).values()) == {0.0}  # nothing admitted: no rate


def test_percentiles_and_ratios() -> None:
    assert percentiles([]) is None
    p = percentiles([float(x) for x in range(1, 101)])
    assert p == pytest.approx({"p50": 50.5, "p90": 90.1, "p99": 99.01, "mean": 50.5})
    a = {"ttft_s": {"p50": 0.2, "p90": 0.4, "p99": 1.0}, "itl_s": None, "tpot_s": {"p50": 0.02},
         "requests_per_s": 2.0, "output_tokens_per_s": 100.0, "hit_rate": 0.0}
    b = {"ttft_s": {"p50": 0.1, "p90": 0.1, "p99": 0.5}, "itl_s": {"p50": 0.01}, "tpot_s": {"p50": 0.01},
         "requests_per_s": 3.0, "output_tokens_per_s": 150.0, "hit_rate": 0.5}
    assert ratios(a, b) == {"ttft_p50": 0.5, "ttft_p90": 0.25, "ttft_p99": 0.5, "itl_p50": None,
                            "tpot_p50": 0.5, "requests_per_s": 1.5, "output_tokens_per_s": 1.5, "hit_rate": None}


def test_a_gateway_is_told_by_its_health_and_its_workers_read_for_tiers() -> None:
    import asyncio

    import httpx

    from kvshare.router.bench.tiers import Target, discover

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.host == "gw":
            return httpx.Response(200, json={"status": "ok", "policy": "cost",
                                             "endpoints": ["http://w1:1", "http://w2:2"]})
        return httpx.Response(200, json={})  # vLLM's /health has no body of note

    async def both() -> list[Target]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as http:
            return [await discover(http, "http://gw:8000"), await discover(http, "http://v:8000"),
                    await discover(http, "http://gw:8000", ["http://w3:3"])]

    gw, vllm, given = asyncio.run(both())
    assert (gw.kind, gw.metrics_urls) == ("gateway", ("http://w1:1", "http://w2:2"))
    assert (vllm.kind, vllm.metrics_urls) == ("vllm", ("http://v:8000",))
    assert given.metrics_urls == ("http://w3:3",)


def test_a_kvshare_workers_usage_objects_give_the_hit_rate_per_tier() -> None:
    from kvshare.router.bench.tiers import hit_rates, usage_counters, usage_series

    answers = [(100, {"host": 64}), (100, {"p2p": 32, "disk": 16}), (50, {})]
    got = hit_rates(usage_counters([]), usage_counters(answers))
    assert got["local_pool"] == pytest.approx(64 / 250) and got["remote_pool"] == pytest.approx(32 / 250)
    assert got["disk"] == pytest.approx(16 / 250) and got["computed"] == pytest.approx(138 / 250)
    series = usage_series([(0.2, *answers[0]), (0.9, *answers[2]), (2.5, *answers[1])], 1.0)
    assert [t for t, _ in series] == [1.0, 3.0]
    assert series[0][1]["local_pool"] == pytest.approx(64 / 150) and series[1][1]["disk"] == 0.16


def test_a_reused_prefix_is_told_by_source_in_vllms_names() -> None:
    from kvshare.client.types import hit_source
    from kvshare.engines.worker import _by_source

    assert [hit_source(t, tier) for t, tier in [("gpu", "gpu"), ("nixl", "disk"),
            ("objstore", "host"), ("shm", "disk"), ("shm", "host"), ("local", "host")]] == [
        "device", "p2p", "p2p", "disk", "host", "host"]
    # the engine reused 40 of the 48 tokens loaded: the last block counts only its first 8
    assert _by_source(["host", "host", "p2p"], 16, 40) == {"host": 32, "p2p": 8}
    assert _by_source(["disk"], 16, 0) == {}
