"""The cost policy counts blocks its own decisions are creating elsewhere once they will be
stored before a worker starts (router/ready.py)."""

from __future__ import annotations

from kvshare.cost import Bandwidths, CostModel, PrefillModel, Source
from kvshare.match import EMPTY_MATCH
from kvshare.router.core.policy import Candidate, RouteRequest
from kvshare.router.core.ready import ReadyBlocks
from kvshare.router.core.registry import make_policy
from kvshare.types import BlockHash, NodeId, WorkerId
from kvshare.workers import WorkerInfo, WorkerLoad

NS = "m"
HASHES = [BlockHash(i.to_bytes(32, "big")) for i in range(1, 9)]  # 8 blocks of 16 tokens


def cands(*queued: int) -> list[Candidate]:
    out = []
    for i, q in enumerate(queued):
        info = WorkerInfo(WorkerId(f"w{i}"), NodeId(f"n{i}"), (NS,), f"http://w{i}")
        out.append(Candidate(info, WorkerLoad(info.worker_id, q, 1 if q else 0)))
    return out


def route_twice(sharing: str) -> tuple[str, str]:
    """A new prompt goes to idle w0 at t=0 (prefill 0.128 s); at t=0.1 the same prompt finds
    w0 5 s behind, w1 0.05 s behind (it starts after w0 has stored the blocks) and w2 idle."""
    now = [0.0]
    policy = make_policy("cost", CostModel(PrefillModel(1e-3, 0.0), Bandwidths(), 16, 1000), sharing)
    policy.clock = lambda: now[0]
    req = RouteRequest(NS, HASHES, 128)
    first = policy.choose(req, EMPTY_MATCH, cands(0, 100, 200))
    assert first.worker == "w0"
    now[0] = 0.1
    second = policy.choose(req, EMPTY_MATCH, cands(5000, 50, 0))
    return second.worker, second.reason


def test_a_worker_starting_after_the_creator_stores_the_blocks_is_priced_pulling_them() -> None:
    # before: w1 was priced recomputing the prompt, so the idle w2 recomputed it (0.128 s)
    assert route_twice("global") == ("w1", "cache_remote")


def test_without_global_sharing_nobody_pulls_another_nodes_blocks() -> None:
    assert route_twice("local")[0] == "w2"


def test_ready_blocks_extend_past_the_creators_finish_and_for_the_creator_its_own() -> None:
    ready = ReadyBlocks()
    ready.add(NS, WorkerId("w0"), HASHES[2:6], ready_s=1.0, now=0.0)
    runs = ((int(Source.LOCAL_HOST), 2),)
    assert ready.extend(runs, NS, HASHES, WorkerId("w1"), 0.0, 0.5) == (runs, 0.5)  # not yet
    # the creator starts after its own earlier job: it holds them (its engine keeps them),
    # and not before that job ends, whatever its load report says
    own = (*runs, (int(Source.LOCAL_GPU), 4))
    assert ready.extend(runs, NS, HASHES, WorkerId("w0"), 0.0, 2.0) == (own, 2.0)
    assert ready.extend(runs, NS, HASHES, WorkerId("w0"), 0.0, 0.2) == (own, 1.0)
    assert ready.extend(runs, NS, HASHES, WorkerId("w1"), 0.0, 1.0) == (
        (*runs, (int(Source.REMOTE_HOST), 4)), 1.0)
    assert ready.run_from(NS, HASHES, 2) == 4
    assert ready.extend(runs, NS, HASHES, WorkerId("w1"), 1.0, 2.0) == (runs, 2.0)  # index's
    assert ready.extend(runs, NS, HASHES, WorkerId("w0"), 1.0, 2.0) == (runs, 2.0)
    ready.add(NS, WorkerId("w1"), HASHES[6:], ready_s=3.0, now=1.5)  # w0's are stored: dropped
    assert len(ready) == 2


def test_a_queue_longer_than_the_pending_ttl_still_counts_its_own_jobs_blocks() -> None:
    """Overload: w0 (100 s behind) takes a new prompt; its job ends at ~100.1 s, past any
    pending blocks' TTL (the caller passes none). At t=0.5 a repeat finds w0 101 s behind and
    w1 100.95 s behind (it would start after w0 stored the blocks and pull all 8 remotely,
    0.1 s). It goes behind its creator, which will hold every block then (101.001 s against
    101.054 s); before, w0 was priced recomputing the prompt (101.128 s) and w1 pulled it."""
    now = [0.0]
    policy = make_policy("cost", CostModel(PrefillModel(1e-3, 0.0), Bandwidths(), 16, 10**7),
                         "global")
    policy.clock = lambda: now[0]
    req = RouteRequest(NS, HASHES, 128)
    assert policy.choose(req, EMPTY_MATCH, cands(100_000, 200_000)).worker == "w0"
    now[0] = 0.5
    second = policy.choose(req, EMPTY_MATCH, cands(101_000, 100_950))
    assert (second.worker, second.reason, second.cached_blocks) == ("w0", "cache_local", 8)
    assert second.remote_blocks == 0


def test_blocks_a_job_loads_count_for_its_own_worker_only() -> None:
    """A job that loads blocks 0-3 and computes 4-7: its engine keeps all 8 (its worker's
    next request reuses them), but only 4-7 reach its node's pool for another worker."""
    ready = ReadyBlocks()
    ready.add(NS, WorkerId("w0"), HASHES, ready_s=1.0, now=0.0, stored_from=4)
    assert ready.extend((), NS, HASHES, WorkerId("w0"), 0.0, 2.0) == (
        ((int(Source.LOCAL_GPU), 8),), 2.0)
    assert ready.extend((), NS, HASHES, WorkerId("w1"), 0.0, 2.0) == ((), 2.0)
    held = ((int(Source.REMOTE_HOST), 4),)  # blocks 0-3 held elsewhere, in the index
    assert ready.extend(held, NS, HASHES, WorkerId("w1"), 0.0, 2.0) == (
        ((int(Source.REMOTE_HOST), 8),), 2.0)
