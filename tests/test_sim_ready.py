"""The cost policy counts blocks its own decisions are creating elsewhere once they will be
stored before a worker starts (router/ready.py)."""

from __future__ import annotations

from kvshare.cost import Bandwidths, CostModel, PrefillModel, Source
from kvshare.match import EMPTY_MATCH
from kvshare.types import BlockHash, NodeId, WorkerId
from kvshare.workers import WorkerInfo, WorkerLoad
from router.policy import Candidate, RouteRequest, make_policy
from router.ready import ReadyBlocks

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


def test_ready_blocks_extend_only_past_the_creators_finish_and_never_for_the_creator() -> None:
    ready = ReadyBlocks()
    ready.add(NS, WorkerId("w0"), HASHES[2:6], ready_s=1.0, now=0.0)
    runs = ((int(Source.LOCAL_HOST), 2),)
    assert ready.extend(runs, NS, HASHES, WorkerId("w1"), 0.0, 0.5) == runs  # not stored yet
    assert ready.extend(runs, NS, HASHES, WorkerId("w0"), 0.0, 2.0) == runs  # its own: pending's job
    assert ready.extend(runs, NS, HASHES, WorkerId("w1"), 0.0, 1.0) == (
        *runs, (int(Source.REMOTE_HOST), 4))
    assert ready.run_from(NS, HASHES, 2) == 4
    assert ready.extend(runs, NS, HASHES, WorkerId("w1"), 1.0, 2.0) == runs  # index's word now
    ready.add(NS, WorkerId("w1"), HASHES[6:], ready_s=3.0, now=1.5)  # w0's are stored: dropped
    assert len(ready) == 2
