"""Trace replicas (router/replicas.py): the same requests, arrivals moved within the trace's
timestamp resolution, and the paired comparison that tells a policy gap from replay noise."""

from __future__ import annotations

import math

import numpy as np
import pytest
from paths import TRACES

from kvshare.router.sim.cluster_model import ClusterConfig
from kvshare.router.sim.replay import simulate
from kvshare.router.sim.replicas import beats, gap_beyond_noise, jittered, paired_gap, t95
from kvshare.router.sim.trace import Trace
from kvshare.router.sim.trace_read import read_trace

DYNAMO = TRACES / "dynamo_mooncake_trace_1000.jsonl"
needs_dynamo = pytest.mark.skipif(not DYNAMO.exists(), reason=f"trace {DYNAMO} not present")


def _by_row(requests: object) -> dict[int, tuple[float, int, int, tuple[int, ...], int]]:
    return {r.index: (r.arrival_s, r.input_tokens, r.output_tokens, tuple(r.hash_ids), r.user)
            for r in requests}  # type: ignore[attr-defined]


@needs_dynamo
def test_a_replica_moves_each_arrival_within_the_bound_and_keeps_every_request() -> None:
    trace = read_trace(DYNAMO)
    assert jittered(trace, 0, 5e-4) is trace  # replica 0: the trace as it is
    rep = jittered(trace, 3, 5e-4)
    assert isinstance(rep, Trace) and len(rep) == len(trace)
    assert np.all(np.diff(rep.arrival_s) >= 0)  # in arrival order
    before, after = _by_row(trace), _by_row(rep)
    assert before.keys() == after.keys()
    moved = [after[k][0] - before[k][0] for k in before]
    assert max(abs(m) for m in moved) <= 5e-4 + 1e-12
    assert sum(m != 0 for m in moved) > len(moved) // 2  # it did move them
    assert all(after[k][1:] == before[k][1:] for k in before)  # tokens, output, ids, user kept
    again = jittered(trace, 3, 5e-4)  # a replica is a function of its seed
    assert np.array_equal(again.arrival_s, rep.arrival_s) and np.array_equal(again.rows, rep.rows)
    assert not np.array_equal(jittered(trace, 4, 5e-4).arrival_s, rep.arrival_s)


@needs_dynamo
def test_a_slice_of_requests_is_jittered_too_and_no_arrival_goes_below_zero() -> None:
    part = read_trace(DYNAMO)[:50]
    rep = jittered(part, 1, 5.0)  # (a large offset: arrivals near 0 are clipped at 0)
    assert isinstance(rep, list) and len(rep) == 50
    assert min(r.arrival_s for r in rep) >= 0.0
    assert [r.arrival_s for r in rep] == sorted(r.arrival_s for r in rep)
    assert {k: v[1:] for k, v in _by_row(rep).items()} == {k: v[1:] for k, v in _by_row(part).items()}


@needs_dynamo
@pytest.mark.parametrize(("seed", "within"), [(-1, 1e-3), (1, -1e-3), (1, math.nan), (1, math.inf)])
def test_bad_replica_arguments_are_refused(seed: int, within: float) -> None:
    with pytest.raises(ValueError, match="jittered needs seed >= 0 and a finite within_s >= 0"):
        jittered(read_trace(DYNAMO, limit=5), seed, within)


def test_paired_gap_is_the_mean_difference_and_its_standard_error() -> None:
    gap, se = paired_gap([1.0, 2.0, 4.0], [0.5, 1.0, 2.5])  # differences 0.5, 1.0, 1.5
    assert gap == pytest.approx(1.0) and se == pytest.approx(0.5 / math.sqrt(3))
    one = paired_gap([2.0], [1.0])
    assert one[0] == 1.0 and math.isnan(one[1])  # one replay cannot tell its own noise
    with pytest.raises(ValueError, match="two equal, non-empty lists"):
        paired_gap([1.0], [1.0, 2.0])


@needs_dynamo
def test_replicas_of_one_replay_differ_by_more_than_rounding() -> None:
    """What replicas are for: a replay's outcome moves when arrivals move by less than the
    trace's timestamp resolution (chaos, not a policy's merit), so a single replay's small gap
    between two policies is not evidence."""
    trace = read_trace(DYNAMO, limit=400)
    cfg = ClusterConfig(workers=6, host_tokens=3_000_000, block_tokens=trace.block_tokens)
    means = []
    for seed in range(3):
        rows = simulate(jittered(trace, seed, 5e-4), cfg, ["cost"], "global",
                        reference=False).rows["cost"]
        means.append(float(np.mean(rows["ttft_s"])))
    assert max(means) - min(means) > 1e-3 * min(means)


def test_a_peer_beats_cost_only_beyond_the_paired_noise() -> None:
    assert t95(1) == pytest.approx(12.706) and t95(7) == pytest.approx(2.365)
    assert t95(11) == t95(10) and t95(1000) == pytest.approx(1.96)  # (never more lenient)
    with pytest.raises(ValueError, match="df >= 1"):
        t95(0)
    cost = [1.138, 1.135, 1.135, 1.133, 1.131, 1.133, 1.136, 1.132]  # dynamo 32w, 8 replicas
    peer = [1.132, 1.132, 1.132, 1.133, 1.136, 1.131, 1.136, 1.131]  # dynamo_kv, same replicas
    assert not beats(cost, peer)  # 0.11% lower on average: 1.1 standard errors, noise
    assert beats([1.0 + x for x in peer], peer)  # a steady gap is a loss, however small
    assert gap_beyond_noise([1.0 + x for x in peer], peer) == paired_gap(
        [1.0 + x for x in peer], peer)  # (the gap and its error, for the report)
    assert gap_beyond_noise(cost, peer) is None
    assert not beats([17.68] * 8, [17.68] * 8)  # equal on every replica
    assert not beats([2.0], [1.0])  # one replay tells nothing
