"""With ``recency``, the cost policy cuts each tier's holdings to the leading blocks its shadow
LRU (a replay of the policy's own decisions, in queue order) still holds when the job starts
(router/recency.py)."""

from __future__ import annotations

import random

from kvshare.actors.index.runs import HolderRuns
from kvshare.cost import Bandwidths, CostModel, PrefillModel
from kvshare.match import MatchResult, build_match
from kvshare.router.core.policy import Candidate, CostPolicy, RouteRequest
from kvshare.router.core.recency import RecencyBook, ShadowLru
from kvshare.router.core.registry import make_policy
from kvshare.router.core.sources import Sharing
from kvshare.types import BlockHash, Location, NodeId, Tier, WorkerId, node_location
from kvshare.workers import (
    META_GPU_CACHE_BLOCKS,
    META_GPU_PRIVATE,
    META_POOL_BLOCKS,
    WorkerInfo,
    WorkerLoad,
)

NS = "m"
BT = 16  # tokens per block


def prompt(first: int) -> list[BlockHash]:
    """8 blocks (128 tokens) with ids ``first..first+7``."""
    return [BlockHash(i.to_bytes(32, "big")) for i in range(first, first + 8)]


A, B, C = prompt(1), prompt(101), prompt(201)
N0 = node_location(NodeId("n0"))


def request(hashes: list[BlockHash]) -> RouteRequest:
    return RouteRequest(NS, hashes, 128)


def model() -> CostModel:
    return CostModel(PrefillModel(1e-3, 0.0), Bandwidths(), BT, 1000)  # 1 ms a token


def worker(i: int, queued: int, pool_blocks: int | None = 8) -> Candidate:
    """Worker ``i`` on node ``n<i>`` with ``queued`` prefill tokens (1 ms each), reporting a
    ``pool_blocks`` pool (None: not reported) and a 64-block engine cache."""
    meta = {META_GPU_PRIVATE: "1", META_GPU_CACHE_BLOCKS: "64"}
    if pool_blocks is not None:
        meta[META_POOL_BLOCKS] = str(pool_blocks)
    info = WorkerInfo(WorkerId(f"w{i}"), NodeId(f"n{i}"), (NS,), f"http://w{i}", meta=meta)
    return Candidate(info, WorkerLoad(info.worker_id, queued, 1 if queued else 0))


class Clock:
    """A policy clock that moves a second forward each time it is read."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def held(hashes: list[BlockHash], layout: dict[Location, Tier]) -> MatchResult:
    return build_match([dict(layout) for _ in hashes])


def test_a_shadow_evicts_the_least_recently_used_and_keeps_a_prefix_over_its_tail() -> None:
    """Capacity 12: A (8), then B (8) pushes out A's 4 tail blocks first (used tail first, so
    A's head is the more recent); A again, then C: B is now the oldest and goes whole."""
    lru = ShadowLru(12)
    lru.use(A)
    lru.use(B)
    assert (lru.leading(A), lru.leading(B), len(lru)) == (4, 8, 12)
    lru.use(A)  # a job reads A again: its 8 blocks are the most recent
    lru.use(C[:4])
    assert (lru.leading(A), lru.leading(B), lru.leading(C)) == (8, 0, 4)


def test_trim_cuts_a_location_to_what_its_shadow_holds_and_leaves_the_rest() -> None:
    """n0's pool holds A per the index, but its shadow keeps only A's first 3 blocks; n1 has
    no shadow (no capacity reported) and keeps its whole holding."""
    book = RecencyBook()
    book.add_workers([worker(0, 0, pool_blocks=3).info, worker(1, 0, pool_blocks=None).info])
    book.use(N0, A)
    n1 = node_location(NodeId("n1"))
    got = book.trim(held(A, {N0: Tier.HOST, n1: Tier.HOST}), A)
    assert isinstance(got, HolderRuns)
    assert [(sorted(loc for loc, _ in h), n) for h, n in got.runs] == [([N0, n1], 3), ([n1], 5)]
    # nothing to cut: the same runs
    full = book.trim(held(A[:3], {N0: Tier.HOST}), A)
    assert [(sorted(loc for loc, _ in h), n) for h, n in full.runs] == [([N0], 3)]


def test_a_prompt_the_queue_ahead_pushes_out_of_the_pool_is_not_counted() -> None:
    """w0 computed A into its 8-block pool, then B (both routed by this policy, so w0's
    queue ran A then B): when a repeat of A would start there, the pool holds B alone. The
    index still lists A at n0, so without recency w0 is priced reading it (100.101 s) and
    taken; with it, w0 would recompute (100.228 s) and w1, 0.1 s less behind, wins."""
    empty = held(A, {})
    for recency in (False, True):
        policy = make_policy("cost", model(), Sharing.LOCAL, recency=recency)
        for hashes in (A, B):
            assert policy.choose(request(hashes), empty, [worker(0, 0)]).worker == "w0"
        cands = [worker(0, 100_100), worker(1, 100_000)]
        d = policy.choose(request(A), held(A, {N0: Tier.HOST}), cands)
        if recency:
            assert (d.worker, d.reason, d.cached_blocks) == ("w1", "load", 0)
        else:
            assert (d.worker, d.reason, d.cached_blocks) == ("w0", "cache_local", 8)


def test_a_prompt_used_again_since_survives_where_capacity_alone_would_drop_it() -> None:
    """The same queue (A, B on an 8-block pool) with A read again last: A is the most recent
    and still there, so w0 reads it, where a bound from capacity alone (the queue writes more
    than the pool holds) would count it gone."""
    policy = make_policy("cost", model(), Sharing.LOCAL, recency=True)
    policy.clock = Clock()  # (a second between requests: each job ends before the next)
    for hashes, match in ((A, held(A, {})), (B, held(B, {})), (A, held(A, {N0: Tier.HOST}))):
        assert policy.choose(request(hashes), match, [worker(0, 0)]).worker == "w0"
    cands = [worker(0, 100_100), worker(1, 100_000)]
    d = policy.choose(request(A), held(A, {N0: Tier.HOST}), cands)
    assert (d.worker, d.reason, d.cached_blocks) == ("w0", "cache_local", 8)


def test_a_shadow_reads_a_tier_at_any_time_by_when_each_use_happens() -> None:
    """An 8-block pool: A stored at t=10, B at t=50. At t=30 the pool still holds A (a block
    used later, B, counts as held: whether it exists yet is the index's answer); from t=50
    on it holds B alone, as it does once every use has happened."""
    lru = ShadowLru(8)
    lru.use(A, at=10.0, now=0.0)
    lru.use(B, at=50.0, now=0.0)
    assert (lru.leading(A, at=30.0), lru.leading(B, at=30.0)) == (8, 8)
    assert (lru.leading(A, at=50.0), lru.leading(B, at=50.0)) == (0, 8)
    assert (lru.leading(A), lru.leading(B)) == (0, 8)
    assert len(lru) == 16  # A is still needed for times before 50
    lru.use(C[:1], at=60.0, now=55.0)  # from t=55 on A is gone at every time: dropped
    assert len(lru) == 9


def test_a_remote_pool_is_priced_as_it_will_be_when_the_reader_starts() -> None:
    """n0's 8-block pool holds A; w0's queue will store B there about 100 s from now,
    pushing A out. An idle w1 starting now reads A from n0 (cache_remote, 8 blocks): the
    pool still holds it then. Priced on n0's state once its queue has drained, A would count
    as gone and w1 would recompute it."""
    policy = make_policy("cost", model(), Sharing.GLOBAL, recency=True)
    policy.clock = Clock()
    solo = [worker(0, 0)]
    assert policy.choose(request(A), held(A, {}), solo).worker == "w0"  # A stored at ~1.1 s
    behind = [worker(0, 100_000)]  # 100 s of queue: B stored at ~102.1 s
    assert policy.choose(request(B), held(B, {}), behind).worker == "w0"
    match = held(A, {N0: Tier.HOST})
    d = policy.choose(request(A), match, [worker(0, 200_000), worker(1, 0)])
    assert (d.worker, d.reason, d.cached_blocks) == ("w1", "cache_remote", 8)
    book = policy._recency
    assert book is not None and book.tier(N0) is not None
    assert [n for _, n in book.trim(match, A).runs] == []  # drained: A gone from n0


def test_a_pool_holding_a_prompt_past_a_head_it_never_held_keeps_it() -> None:
    """n1's 7-block pool holds A's blocks 1-7 (it computed them after reading block 0
    elsewhere); n0 holds block 0. Nothing is cut: n1 is not dropped for lacking a block 0 it
    never held. One more block stored at n1 pushes out its least recent, A's last: only that
    block is cut."""
    book = RecencyBook()
    book.add_workers([worker(0, 0, pool_blocks=64).info, worker(1, 0, pool_blocks=7).info])
    n1 = node_location(NodeId("n1"))
    book.use(N0, A[:1])
    book.use(n1, A[1:])
    match = build_match([{N0: Tier.HOST}] + [{n1: Tier.HOST} for _ in A[1:]])
    assert [(sorted(loc for loc, _ in h), n) for h, n in book.trim(match, A).runs] == [
        ([N0], 1), ([n1], 7)]
    book.use(n1, B[:1])
    assert [(sorted(loc for loc, _ in h), n) for h, n in book.trim(match, A).runs] == [
        ([N0], 1), ([n1], 6)]


def bare(i: int, queued: int) -> Candidate:
    """Worker ``i`` reporting no capacity (as a vLLM worker does today)."""
    info = WorkerInfo(WorkerId(f"w{i}"), NodeId(f"n{i}"), (NS,), f"http://w{i}",
                      meta={META_GPU_PRIVATE: "1"})
    return Candidate(info, WorkerLoad(info.worker_id, queued, 1 if queued else 0))


def test_with_no_capacity_reported_recency_decides_as_without_it() -> None:
    """Nothing to shadow: the same decisions and estimates as the plain policy, so turning
    recency on changes nothing for a router until its workers report capacities."""
    rng = random.Random(3)
    plain = make_policy("cost", model(), Sharing.GLOBAL, recency=False)
    timed = make_policy("cost", model(), Sharing.GLOBAL)  # (on by default)
    for _ in range(200):
        hashes = prompt(rng.choice((1, 101, 201)))[: rng.randrange(1, 9)]
        layout = {N0: Tier.HOST} if rng.random() < 0.5 else {}
        cands = [bare(i, rng.randrange(0, 5000)) for i in range(3)]
        got = [p.rank(request(hashes), held(hashes, layout), cands) for p in (plain, timed)]
        assert got[0].decision == got[1].decision
        assert [e.est_ttft_s for e in got[0].estimates()] == [e.est_ttft_s for e in got[1].estimates()]
    assert isinstance(plain, CostPolicy) and isinstance(timed, CostPolicy)
