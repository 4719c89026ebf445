"""With ``survival``, the cost policy counts a held block only where its holder will still hold
it when the job starts: a tier whose queued writes by then reach its reported capacity has
turned over (router/survival.py). Recency is off here: these are survival's own answers."""

from __future__ import annotations

from kvshare.cost import Bandwidths, CostModel, PrefillModel, Source
from kvshare.match import MatchResult, build_match
from kvshare.router.core.pending import PendingBlocks
from kvshare.router.core.policy import Candidate, RouteRequest
from kvshare.router.core.ready import ReadyBlocks
from kvshare.router.core.registry import make_policy
from kvshare.router.core.sources import Sharing
from kvshare.router.core.survival import Capacities, Turnover
from kvshare.types import (
    BlockHash,
    Location,
    NodeId,
    Tier,
    WorkerId,
    node_location,
    worker_location,
)
from kvshare.workers import (
    META_GPU_CACHE_BLOCKS,
    META_GPU_PRIVATE,
    META_POOL_BLOCKS,
    WorkerInfo,
    WorkerLoad,
)

NS = "m"
BT = 16  # tokens per block
HASHES = [BlockHash(i.to_bytes(32, "big")) for i in range(1, 9)]  # 8 blocks, 128 tokens
REQ = RouteRequest(NS, HASHES, 128)


def model() -> CostModel:
    return CostModel(PrefillModel(1e-3, 0.0), Bandwidths(), BT, 1000)  # 1 ms a token


def worker(i: int, queued: int, pool_blocks: int | None = 64, gpu_blocks: int | None = None,
           ) -> Candidate:
    """Worker ``i`` on node ``n<i>`` with ``queued`` prefill tokens (1 ms each) and the
    capacities it reports (None: not reported)."""
    meta = {META_GPU_PRIVATE: "1"}  # engines' own caches, as vLLM's
    if pool_blocks is not None:
        meta[META_POOL_BLOCKS] = str(pool_blocks)
    if gpu_blocks is not None:
        meta[META_GPU_CACHE_BLOCKS] = str(gpu_blocks)
    info = WorkerInfo(WorkerId(f"w{i}"), NodeId(f"n{i}"), (NS,), f"http://w{i}", meta=meta)
    return Candidate(info, WorkerLoad(info.worker_id, queued, 1 if queued else 0))


def held(layout: dict[Location, Tier]) -> MatchResult:
    return build_match([dict(layout) for _ in HASHES])


def test_a_pool_the_queue_turns_over_before_the_job_starts_is_not_counted() -> None:
    """w0's node pool holds the whole prompt, but w0's 100.1 s of queue computes 6,256 blocks
    into that 64-block pool first: the prompt is gone when the job starts, and w0 would
    recompute it (100.228 s), so w1, 0.1 s less behind, wins (100.128 s). Without survival
    (before), w0 is priced reading its pool (100.101 s) and taken."""
    match = held({node_location("n0"): Tier.HOST})
    cands = [worker(0, 100_100), worker(1, 100_000)]
    assert make_policy("cost", model(), Sharing.LOCAL, recency=False).choose(REQ, match, cands).worker == "w0"
    d = make_policy("cost", model(), Sharing.LOCAL, survival=True, recency=False).choose(REQ, match, cands)
    assert (d.worker, d.reason, d.cached_blocks) == ("w1", "load", 0)
    # a pool larger than the queue's writes keeps them: read there, as before
    roomy = [worker(0, 100_100, pool_blocks=20_000), worker(1, 100_000, pool_blocks=20_000)]
    d = make_policy("cost", model(), Sharing.LOCAL, survival=True, recency=False).choose(REQ, match, roomy)
    assert (d.worker, d.reason, d.cached_blocks) == ("w0", "cache_local", 8)
    # no capacity reported: nothing is assumed lost
    blind = [worker(0, 100_100, None), worker(1, 100_000, None)]
    assert make_policy("cost", model(), Sharing.LOCAL, survival=True, recency=False).choose(REQ, match, blind).worker == "w0"


def test_the_queue_estimate_counts_the_recompute() -> None:
    """The decision's plan (what the worker's queue estimate adds up) recomputes the evicted
    prompt: 100 s behind on both, w0's plan takes the full 128 ms, not ~1 ms."""
    match = held({node_location("n0"): Tier.HOST})
    d = make_policy("cost", model(), Sharing.LOCAL, survival=True, recency=False).choose(
        REQ, match, [worker(0, 100_000), worker(1, 200_000)])
    assert d.worker == "w0" and d.plan is not None
    assert (d.plan.cut, round(d.plan.total_s, 3)) == (0, 0.128)


def test_blocks_a_job_ahead_uses_again_still_count() -> None:
    """Pending blocks at w0 (a job ahead in its queue holds the prompt) outlive the turnover:
    w0 reads them from its engine for free, whatever its pool and cache lose."""
    pending = PendingBlocks(60.0, clock=lambda: 0.0)
    pending.add(NS, worker_location("w0"), HASHES, Tier.GPU)
    match = held({node_location("n0"): Tier.HOST, worker_location("w0"): Tier.GPU})
    cands = [worker(0, 100_100, gpu_blocks=64), worker(1, 100_000, gpu_blocks=64)]
    pol = make_policy("cost", model(), Sharing.LOCAL, survival=True, recency=False)
    d = pol.choose(REQ, match, cands, pending.match(NS, HASHES))
    assert (d.worker, d.reason, d.cached_blocks) == ("w0", "cache_local", 8)
    assert d.plan is not None and d.plan.fetch_s == 0.0


def test_a_remote_pool_counts_only_until_its_own_queue_turns_it_over() -> None:
    """Idle w1 would pull the prompt from n0's pool. n0's worker has 1,000 s of queue writing
    62.5 blocks a second into its 64-block pool: a job starting now still finds the prompt
    there (pull), one starting in 2 s does not (125 blocks written: turned over)."""
    match = held({node_location("n0"): Tier.HOST})
    d = make_policy("cost", model(), survival=True, recency=False).choose(REQ, match, [worker(0, 1_000_000), worker(1, 0)])
    assert (d.worker, d.reason, d.remote_blocks) == ("w1", "cache_remote", 8)
    caps = Capacities([worker(0, 0).info, worker(1, 0).info])
    loads = [worker(0, 1_000_000).load, worker(1, 2_000).load]
    turnover = Turnover(caps, loads, [1_000.0, 2.0], BT)
    assert turnover.lost(0.5) == frozenset()
    assert turnover.lost(2.0) == {node_location("n0"), node_location("n1")}
    d = make_policy("cost", model(), survival=True, recency=False).choose(REQ, match, [worker(0, 1_000_000), worker(1, 2_000)])
    assert (d.worker, d.reason) == ("w1", "load")


def test_a_ready_block_counts_only_while_its_holder_keeps_it() -> None:
    """w0's job ending in 1 s stores the prompt; w0 is 100 s behind (6,250 blocks into a
    64-block engine cache and pool): a job of w0 starting then finds its own copy gone, one
    starting at 1.5 s still has it. Without turnover it counts either way."""
    ready = ReadyBlocks()
    ready.add(NS, WorkerId("w0"), HASHES, ready_s=1.0, now=0.0)
    caps = Capacities([worker(0, 0, gpu_blocks=64).info, worker(1, 0).info])
    turnover = Turnover(caps, [worker(0, 100_000).load, worker(1, 0).load], [100.0, 0.0], BT)
    own = ((int(Source.LOCAL_GPU), 8),)
    assert ready.extend((), NS, HASHES, WorkerId("w0"), 0.0, 100.0) == (own, 100.0)
    assert ready.extend((), NS, HASHES, WorkerId("w0"), 0.0, 100.0, turnover) == ((), 100.0)
    assert ready.extend((), NS, HASHES, WorkerId("w0"), 0.0, 1.5, turnover) == (own, 1.5)
