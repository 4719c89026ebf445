"""vLLM load reports from its metrics (kvshare/vllm/load.py): prefill speed that does not
undercount under concurrency, and the prefill work still ahead in a busy engine. Pure
arithmetic on scrapes: no vLLM process."""

from __future__ import annotations

import math

import pytest

from kvshare.types import WorkerId
from kvshare.vllm.server.load import DrainSpeed, InPrefill, MetricsLoad, PrefillSpeed, parse_metrics


def test_concurrent_prefills_are_not_counted_twice() -> None:
    # two 2,000-token prompts prefilled together in 2 s: each request's own span is 2 s, so
    # tokens / summed spans says 1,000 tok/s; the engine did 4,000 tokens in 2 s
    s = PrefillSpeed(window_s=1.0)
    s.update(0.0, 0, 0.0, busy=True)
    s.update(1.0, 0, 0.0, busy=True)
    assert s.update(2.0, 4000, 4.0, busy=True) == pytest.approx(2000)


def test_sequential_prefills_with_idle_gaps_use_the_spans() -> None:
    # one 1,000-token prefill of 0.5 s per second, idle between (sampled busy each time):
    # the spans (0.5 s) are tighter than the busy wall time (1 s)
    s = PrefillSpeed(window_s=1.0)
    s.update(0.0, 0, 0.0, busy=True)
    assert s.update(1.0, 1000, 0.5, busy=True) == pytest.approx(2000)


def test_idle_time_does_not_count_and_windows_smooth() -> None:
    s = PrefillSpeed(window_s=1.0, alpha=0.5)
    s.update(0.0, 0, 0.0, busy=False)
    assert s.update(10.0, 0, 0.0, busy=False) == 0  # idle: no window yet
    s.update(11.0, 0, 0.0, busy=True)  # busy from 10 s to 11 s (counted: busy at one end)
    assert s.update(12.0, 3000, 5.0, busy=False) == pytest.approx(1500)  # 3,000 in 2 busy s
    s.update(13.0, 3000, 5.0, busy=True)
    # 3,000 more in 1 s (the spans): the windows' tokens over their time, the older one's
    # weight decayed by its 2 busy seconds over the horizon (window_s / alpha = 2 s)
    keep = math.exp(-2 / 2)
    assert s.update(14.0, 6000, 6.0, busy=True) == pytest.approx((3000 * keep + 3000)
                                                                 / (2 * keep + 1))


def test_a_restarted_server_restarts_the_window_not_the_estimate() -> None:
    s = PrefillSpeed(window_s=1.0)
    s.update(0.0, 0, 0.0, busy=True)
    assert s.update(1.0, 1000, 1.0, busy=True) == pytest.approx(1000)
    assert s.update(2.0, 0, 0.0, busy=True) == pytest.approx(1000)  # counters went back
    keep = math.exp(-1 / (1 / 0.3))
    assert s.update(3.0, 3000, 1.0, busy=True) == pytest.approx((1000 * keep + 3000) / (keep + 1))


def test_long_prefills_finishing_together_do_not_read_as_a_burst_of_speed() -> None:
    """A loaded engine: three 2,000-token prompts prefilled together over 24 s finish at once
    every 24 s, beside a 250-token turn finishing every 2 s (2 s spans): 375 tokens a second
    in all. Scraped every 0.1 s, the estimate stays within 1.5x of that once the first long
    prefills have finished (counting their tokens in the 1 s window they finished in read
    2,000+ tok/s)."""
    s = PrefillSpeed(window_s=1.0)
    tokens = spans = finished = 0.0
    seen = []
    for i in range(2401):  # 240 s
        t = i / 10
        if i and i % 20 == 0:
            tokens, spans, finished = tokens + 250, spans + 2.0, finished + 1
        if i and i % 240 == 0:
            tokens, spans, finished = tokens + 6000, spans + 72.0, finished + 3
        speed = s.update(t, tokens, spans, busy=True, finished=finished)
        if t > 48:
            seen.append(speed)
    assert 375 / 1.5 <= min(seen) and max(seen) <= 375 * 1.5, (min(seen), max(seen))


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="window_s"):
        PrefillSpeed(window_s=0)
    with pytest.raises(ValueError, match="alpha"):
        PrefillSpeed(alpha=1.5)


def scrape(running: int = 0, waiting: int = 0, first: int = 0, finished: int = 0,
           computed: float = 0.0, spans: float = 0.0) -> dict[str, float]:
    return {"vllm:num_requests_running": running, "vllm:num_requests_waiting": waiting,
            "vllm:time_to_first_token_seconds_count": first,
            "vllm:e2e_request_latency_seconds_count": finished,
            "vllm:request_prefill_kv_computed_tokens_sum": computed,
            "vllm:request_prefill_kv_computed_tokens_count": finished,
            "vllm:request_prefill_time_seconds_sum": spans}


def test_running_requests_before_their_first_token_are_prefill_work() -> None:
    c = InPrefill()
    assert c.count(scrape(running=3, first=1)) == 2  # one decodes, two prefill
    assert c.count(scrape(running=2, waiting=1, first=5, finished=4)) == 2
    assert c.count(scrape(running=1, first=9, finished=4)) == 0  # never negative


def test_an_abort_before_the_first_token_is_forgotten_once_idle() -> None:
    c = InPrefill()
    # 3 requests finished, one of them aborted before its first token: 2 first tokens
    assert c.count(scrape(first=2, finished=3)) == 0  # idle: re-based
    assert c.count(scrape(running=2, first=3, finished=3)) == 1  # 1 decodes, 1 prefills


def test_waiting_requests_are_prefill_work_whatever_the_counts_say() -> None:
    c = InPrefill()
    assert c.count(scrape(running=1, first=1)) == 0  # one decodes
    # first tokens outran the finishes by more than are active (e.g. aborts the counts did
    # not see end, with no idle moment since): the two waiting still have everything to do
    assert c.count(scrape(running=5, waiting=2, first=12, finished=1)) == 2


def test_load_counts_waiting_and_half_done_running_prefills() -> None:
    load = MetricsLoad(WorkerId("w"), "http://127.0.0.1:1")
    try:
        # 4 finished requests computed 4,000 tokens (mean 1,000); now 2 waiting and 2 running
        # before their first token, 1 decoding
        r = load.from_metrics(scrape(running=3, waiting=2, first=5, finished=4,
                                     computed=4000, spans=8.0), 1.0)
    finally:
        load.close()
    assert r.worker_id == "w" and r.running == 5 and r.waiting == 2
    assert r.queued_prefill_tokens == 2 * 1000 + 2 * 500


def test_the_report_carries_what_the_engines_own_cache_served() -> None:
    """vLLM's prompt and own-prefix-cache token counters, as they stand: the index's gpu tier
    value (kvshare.actors.index.engine_value) is made of their differences."""
    text = ('vllm:prompt_tokens_total{engine="0"} 9000.0\n'
            'vllm:prefix_cache_hits_total{engine="0"} 3500.0\n'
            'vllm:external_prefix_cache_hits_total{engine="0"} 1200.0\n')
    load = MetricsLoad(WorkerId("w"), "http://127.0.0.1:1")
    try:
        r = load.from_metrics(parse_metrics(text), 1.0)
    finally:
        load.close()
    assert r.prompt_tokens == 9000 and r.engine_cached_tokens == 3500  # not the connector's


def test_parse_sums_engines_and_skips_nan() -> None:
    text = ('vllm:num_requests_running{engine="0"} 2.0\n'
            'vllm:num_requests_running{engine="1"} 1.0\n'
            'vllm:time_to_first_token_seconds_count{engine="0"} 7.0\n'
            'vllm:kv_cache_usage_perc{engine="0"} NaN\n'
            'vllm:unrelated_total 5.0\n')
    assert parse_metrics(text) == {"vllm:num_requests_running": 3.0,
                                   "vllm:time_to_first_token_seconds_count": 7.0}


def test_load_waits_are_read_per_kind_and_smoothed() -> None:
    text = ('vllm:kvshare_load_seconds_total{engine="0",where="remote"} 3.0\n'
            'vllm:kvshare_loads_total{engine="0",where="remote"} 2.0\n'
            'vllm:kvshare_load_seconds_total{engine="0",where="local"} 0.2\n'
            'vllm:kvshare_loads_total{engine="0",where="local"} 4.0\n')
    m = parse_metrics(text)
    assert m == {"load_seconds:remote": 3.0, "loads:remote": 2.0,
                 "load_seconds:local": 0.2, "loads:local": 4.0}
    load = MetricsLoad(WorkerId("w"), "http://127.0.0.1:1")
    try:
        first = load.from_metrics({**scrape(), "load_seconds:remote": 1.0, "loads:remote": 1.0}, 0.0)
        assert first.remote_load_s == 0 and first.local_load_s == 0  # nothing measured yet
        r = load.from_metrics({**scrape(), "load_seconds:remote": 4.0, "loads:remote": 3.0,
                               "load_seconds:local": 0.1, "loads:local": 2.0}, 0.1)
        assert r.remote_load_s == pytest.approx(1.5) and r.local_load_s == pytest.approx(0.05)
        # no new load: the estimate stays; the next ones move it by 30 %
        assert load.from_metrics({**scrape(), "load_seconds:remote": 4.0, "loads:remote": 3.0},
                                 0.2).remote_load_s == pytest.approx(1.5)
        r = load.from_metrics({**scrape(), "load_seconds:remote": 4.5, "loads:remote": 4.0}, 0.3)
        assert r.remote_load_s == pytest.approx(0.7 * 1.5 + 0.3 * 0.5)
    finally:
        load.close()


def test_the_drain_rate_is_the_recent_steps_tokens_over_their_seconds() -> None:
    d = DrainSpeed(horizon_s=10.0, min_s=1.0)
    assert d.update(0, 0.0) == 0
    assert d.update(300, 0.5) == 0  # half a second of steps: not enough to say
    half = math.exp(-0.05)  # (each half second decays the sums by this)
    assert d.update(600, 1.0) == pytest.approx((300 * half + 300) / (0.5 * half + 0.5))
    # 10 s more at 100 tok/s: the first second decays by e^-1 and weighs in little
    r = d.update(1600, 11.0)
    keep = math.exp(-1.0)
    assert r == pytest.approx(((300 * half + 300) * keep + 1000) / ((0.5 * half + 0.5) * keep + 10))
    assert 100 < r < 600 * 0.25
    assert d.update(1600, 11.0) == pytest.approx(r)  # no step since: the rate stays
    assert d.update(50, 0.25) == pytest.approx(r)  # restarted engine: too little of its own yet
    keep = math.exp(-0.1)
    assert d.update(250, 1.25) == pytest.approx((50 * keep + 200) / (0.25 * keep + 1.0))
    with pytest.raises(ValueError, match="horizon_s"):
        DrainSpeed(horizon_s=0)


def test_the_report_divides_the_backlog_by_the_drain_rate() -> None:
    load = MetricsLoad(WorkerId("w"), "http://127.0.0.1:1")
    backlog = {"vllm:kvshare_backlog_tokens_added_total": 6000.0,
               "vllm:kvshare_backlog_tokens_removed_total": 0.0}
    try:
        # finished requests say 2,000 tok/s; the connector's steps computed 1,200 in 4 s
        first = load.from_metrics({**scrape(running=2, finished=0, computed=0, spans=0.0),
                                   **backlog}, 0.0)
        assert first.prefill_tokens_per_s == 0  # nothing measured yet either way
        r = load.from_metrics({**scrape(running=2, first=1, finished=1, computed=4000, spans=2.0),
                               **backlog, "vllm:kvshare_backlog_tokens_removed_total": 1200.0,
                               "vllm:kvshare_backlog_drained_tokens_total": 1200.0,
                               "vllm:kvshare_backlog_drain_seconds_total": 4.0}, 2.0)
        assert r.prefill_tokens_per_s == pytest.approx(300)
        assert r.queued_prefill_tokens == 4800
    finally:
        load.close()
    # no connector: the estimate from finished requests, as before
    plain = MetricsLoad(WorkerId("v"), "http://127.0.0.1:1")
    try:
        plain.from_metrics(scrape(running=2, finished=0, computed=0, spans=0.0), 0.0)
        r = plain.from_metrics(scrape(running=2, first=1, finished=1, computed=4000, spans=2.0), 2.0)
        assert r.prefill_tokens_per_s == pytest.approx(2000)
    finally:
        plain.close()
