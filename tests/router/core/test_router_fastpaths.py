"""The router's fast paths decide exactly as the paths they replaced.

- A random stream of requests (prompts sharing system prompts, tails never seen, finishes,
  new load reports with queues, waits and measured speeds, blocks stored on nodes' pools or
  workers' gpus between decisions) is routed in lockstep by two routers on one fake clock:
  one with the fast paths (the xxh3 chain in C, the index answering inline:
  :meth:`RoutingCore.query_inline`), one with the pure-Python chain and the index awaited
  under its deadline. Every decision and every candidate's estimate must be equal, for sha256
  and xxh3 hashing, under global and local sharing, with and without gpu-private workers and
  busy periods (every worker with requests waiting).
- The inline index answer is the awaited one, for an index that answers, fails, does not know
  the namespace or is not synced; the policy's queue waits, kept between calls and recomputed
  only for the candidates that changed, equal computing them all again.
- ``ReadyBlocks.add`` (its stored entries dropped in one pass, each part of the prompt
  recorded in its own loop) holds and answers exactly as the version before it, kept here as
  the reference, on random sequences over one and two namespaces.
"""

from __future__ import annotations

import asyncio
import random
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvshare import cost, hashing
from kvshare.actors.index.global_index import GlobalIndex
from kvshare.actors.index.replica import NOT_SYNCED, IndexReplica
from kvshare.cost import Bandwidths
from kvshare.events import BlockStored
from kvshare.hashing import HashFn
from kvshare.router.core.embed import CacheAwareRouter, InProcessIndex, Routed, RouterConfig
from kvshare.router.core.pending import PendingBlocks
from kvshare.router.core.policy import Candidate, CostPolicy
from kvshare.router.core.ready import ReadyBlocks
from kvshare.router.core.routing import CostInputs, IndexAnswer, RoutingCore
from kvshare.router.core.sources import Sharing
from kvshare.router.core.workers_view import InFlight, StaticWorkers
from kvshare.types import BlockHash, NodeId, Tier, WorkerId, node_location, worker_location
from kvshare.workers import META_GPU_PRIVATE, WorkerInfo, WorkerLoad

NS = "fast"
BT = 16
WORKERS = 6


@contextmanager
def python_paths() -> Iterator[None]:
    """The C xxh3 chain switched off (the pure-Python loop)."""
    bound = hashing._XXH3_BOUND
    hashing._XXH3_BOUND = False
    try:
        yield
    finally:
        hashing._XXH3_BOUND = bound


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


class AwaitedIndex(InProcessIndex):
    """The same index, not answering inline: the router awaits it under its deadline."""

    inline = False


def make_router(index: GlobalIndex, clock: Clock, fn: HashFn, native: bool,
                sharing: Sharing = Sharing.GLOBAL, private: bool = False) -> CacheAwareRouter:
    """``private``: workers w0 and w3 keep their gpu blocks to themselves."""
    infos = [WorkerInfo(WorkerId(f"w{i}"), NodeId(f"n{i % 3}"), (NS,), f"http://w{i}",
                        meta={META_GPU_PRIVATE: "1"} if private and i % 3 == 0 else {})
             for i in range(WORKERS)]
    cfg = RouterConfig(namespace=NS, model_id="m", block_tokens=BT, hash_fn=fn,
                       prefill_tokens_per_s=4000.0, sharing=sharing, index_timeout_s=5.0)
    adapter = InProcessIndex(index) if native else AwaitedIndex(index)
    router = CacheAwareRouter(adapter, StaticWorkers(infos), cfg)
    if not native:  # the Python loops from the start (the hasher binds its chain when built)
        router.hasher._xxh3 = None
    core = router.core
    core.pending = router.pending = PendingBlocks(cfg.pending_ttl_s, clock=clock)
    core.inflight = router.inflight = InFlight(clock=clock)
    core.policy.clock = clock
    return router


def summary(r: Routed) -> tuple[Any, ...]:
    d = r.decision
    plan = d.plan
    assert plan is not None and r.ranking is not None
    return (r.hashes, d.worker, d.reason, d.est_ttft_s, d.est_ttft_saved_s, d.cached_blocks,
            d.remote_blocks, plan.cut, plan.fetch_s, plan.prefill_s, dict(plan.sources),
            [(e.worker, e.est_ttft_s, e.queue_s, e.reason, e.plan.cut, e.plan.fetch_s)
             for e in r.ranking.estimates()])


async def stream(seed: int, fn: HashFn, n: int = 40, sharing: Sharing = Sharing.GLOBAL,
                 private: bool = False, busy: bool = False) -> list[str]:
    """``busy``: every load report has requests waiting (the policy's busy-period terms)."""
    rng = random.Random(seed)
    clock = Clock()
    index = GlobalIndex()
    index.declare_namespace(NS, hash_size=HashFn(fn).digest_size)
    fast, slow = (make_router(index, clock, fn, native, sharing, private)
                  for native in (True, False))
    systems = [[rng.randrange(50_000) for _ in range(rng.choice((16, 48, 80)))] for _ in range(4)]
    seq = 0
    open_ids: list[str] = []
    reasons: list[str] = []
    for step in range(n):
        clock.now += rng.choice((0.0, 0.001, 0.05, 0.4, 2.0))
        ids = rng.choice(systems) + [rng.randrange(50_000) for _ in range(rng.randrange(1, 90))]
        packed = rng.random() < 0.3
        for w in [WorkerId(f"w{i}") for i in range(WORKERS)] if busy and not step else [
                WorkerId(f"w{rng.randrange(WORKERS)}")] if rng.random() < 0.3 else []:
            load = WorkerLoad(w, rng.choice((0, 800, 5000)), rng.randrange(3),
                              rng.choice((0.0, 3000.0)), clock.now - rng.random(),
                              waiting=rng.choice((1, 3) if busy else (0, 0, 1, 3)))
            for r in (fast, slow):  # a load report (every worker's first, when busy)
                r.report_load(load)
        got = []
        for router, native in ((fast, True), (slow, False)):
            tokens: Any = list(ids)
            if packed:
                import numpy as np

                tokens = np.asarray(ids, dtype=np.uint32)
            if native:
                routed = await router.route(token_ids=tokens)
            else:
                with python_paths():
                    routed = await router.route(token_ids=tokens)
            got.append(summary(routed))
        assert got[0] == got[1]
        reasons.append(got[0][2])
        open_ids.append(routed.request_id)
        if rng.random() < 0.5 and open_ids:  # a request finishes
            rid = open_ids.pop(rng.randrange(len(open_ids)))
            for r in (fast, slow):
                r.finished(rid)
        if rng.random() < 0.4:  # its blocks reach a node's pool, or the worker's gpu, and the index
            loc, tier = (node_location(f"n{rng.randrange(3)}"), Tier.HOST) if rng.random() < 0.5 \
                else (worker_location(got[0][1]), Tier.GPU)
            evs = []
            for h in got[0][0]:
                seq += 1
                evs.append(BlockStored(NS, loc, tier, h, 0, seq))
            index.apply(evs)
    return reasons


@settings(max_examples=8, deadline=None)
@given(st.integers(0, 2**31), st.sampled_from([HashFn.SHA256, HashFn.XXH3_128]))
def test_fast_paths_decide_as_the_python_paths(seed: int, fn: HashFn) -> None:
    asyncio.run(stream(seed, fn))


@settings(max_examples=8, deadline=None)
@given(st.integers(0, 2**31), st.sampled_from(list(Sharing)), st.booleans(), st.booleans())
def test_fast_paths_decide_as_the_python_paths_in_every_setting(
        seed: int, sharing: Sharing, private: bool, busy: bool) -> None:
    asyncio.run(stream(seed, HashFn.XXH3_128, 30, sharing, private, busy))


def test_the_stream_exercises_every_kind_of_plan() -> None:
    reasons = asyncio.run(stream(7, HashFn.SHA256, 120))
    assert {"load", "cache_local", "cache_remote"} <= set(reasons)


class ReadyBefore(ReadyBlocks):
    """``ReadyBlocks.add`` as it was before the one-pass drop (the reference)."""

    def add(self, namespace: str, worker: WorkerId, hashes: Sequence[BlockHash],
            ready_s: float, now: float, stored_from: int = 0) -> None:
        while self._size:
            first, (_, t, _, _) = self._oldest()
            if t > now:
                break
            first.popitem(last=False)
            self._size -= 1
        at = self._at.get(namespace)
        if at is None:
            at = self._at[namespace] = OrderedDict()
        before = len(at)
        self._calls += 1
        value = (worker, ready_s, self._calls, True)
        own = (worker, ready_s, self._calls, False)
        get, refresh = at.get, at.move_to_end
        for i, h in enumerate(hashes):
            if i == stored_from:
                own = value
            old = get(h)
            if old is None:
                at[h] = own
            elif old[1] > ready_s:
                at[h] = own
                refresh(h)
        self._size += len(at) - before
        while self._size > self._max:
            self._oldest()[0].popitem(last=False)
            self._size -= 1


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31), st.sampled_from([1, 2]), st.sampled_from([8, 1_000_000]))
def test_ready_add_holds_as_before(seed: int, namespaces: int, cap: int) -> None:
    rng = random.Random(seed)
    fast, ref = ReadyBlocks(cap), ReadyBefore(cap)
    pool = [bytes([i]) * 4 for i in range(30)]
    now = 0.0
    for _ in range(40):
        now += rng.choice((0.0, 0.1, 0.5, 2.0))
        ns = f"ns{rng.randrange(namespaces)}"
        worker = WorkerId(f"w{rng.randrange(3)}")
        hashes = [rng.choice(pool) for _ in range(rng.randrange(0, 12))]
        ready_s = now + rng.choice((0.0, 0.3, 1.0, 3.0))
        stored_from = rng.choice((0, 1, 3, 20, -1))
        for r in (fast, ref):
            r.add(ns, worker, hashes, ready_s, now, stored_from=stored_from)
        assert len(fast) == len(ref)
        assert {k: list(v.items()) for k, v in fast._at.items()} == {
            k: list(v.items()) for k, v in ref._at.items()}
        probe = [rng.choice(pool) for _ in range(6)]
        assert fast.run_from(ns, probe, 0) == ref.run_from(ns, probe, 0)


class FailingIndex(InProcessIndex):
    def match_runs(self, namespace: str, hashes: Sequence[BlockHash]) -> Any:
        raise RuntimeError("index down")


class AwaitedFailingIndex(FailingIndex):
    inline = False


def same_answer(a: IndexAnswer, b: IndexAnswer) -> bool:
    """Equal but for the time waited."""
    return (a.match, a.fallback, a.timed, a.answered) == (b.match, b.fallback, b.timed, b.answered)


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**31))
def test_the_inline_answer_is_the_awaited_one(seed: int) -> None:
    rng = random.Random(seed)
    index = GlobalIndex()
    index.declare_namespace(NS)
    pool = [bytes([i]) * 32 for i in range(1, 40)]
    seq = 0
    for _ in range(rng.randrange(0, 30)):
        seq += 1
        loc = node_location(f"n{rng.randrange(3)}") if rng.random() < 0.5 else worker_location(
            f"w{rng.randrange(3)}")
        index.apply([BlockStored(NS, loc, rng.choice((Tier.HOST, Tier.GPU)), rng.choice(pool),
                                 0, seq)])
    replica = IndexReplica([object()], start=False)  # never synced: unavailable
    for inline, awaited in ((InProcessIndex(index), AwaitedIndex(index)),
                            (FailingIndex(index), AwaitedFailingIndex(index)),
                            (replica, None)):
        fast = RoutingCore(inline, CostInputs(BT, 1024, Bandwidths(), 4000.0), policy="cost")
        slow = RoutingCore(awaited, CostInputs(BT, 1024, Bandwidths(), 4000.0), policy="cost",
                           index_timeout_s=5.0)
        for ns in (NS, "undeclared"):
            hashes = [rng.choice(pool) for _ in range(rng.randrange(0, 8))]
            got = fast.query_inline(ns, hashes)
            assert got is not None and same_answer(got, asyncio.run(fast.query(ns, hashes)))
            if awaited is not None:
                assert slow.query_inline(ns, hashes) is None or not hashes
                assert same_answer(got, asyncio.run(slow.query(ns, hashes)))
            elif hashes:  # the replica before its first sync
                assert got.fallback == "index_unavailable"
                assert replica.match_runs(ns, hashes).unavailable == NOT_SYNCED


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31))
def test_kept_queue_waits_equal_computing_them_all_again(seed: int) -> None:
    rng = random.Random(seed)
    model = cost.CostModel(cost.PrefillModel.from_tokens_per_s(4000.0), Bandwidths(), BT, 1024)
    policy = CostPolicy(model)
    infos = [WorkerInfo(WorkerId(f"w{i}"), NodeId(f"n{i}"), (NS,), f"http://w{i}")
             for i in range(rng.randrange(1, 9))]

    def candidate(info: WorkerInfo) -> Candidate:
        return Candidate(info, WorkerLoad(info.worker_id, rng.choice((0, 0, 800, 5000, 12_000)),
                                          0, rng.choice((0.0, 2000.0, 8000.0))))

    cands = [candidate(i) for i in infos]
    for _ in range(40):
        cands = list(cands)  # (a new list each call, as the policy's eligible list is)
        for _ in range(rng.choice((0, 0, 1, 2))):
            i = rng.randrange(len(cands))
            cands[i] = candidate(infos[i])
        if rng.random() < 0.1:  # a refitted cost model: every wait again
            policy.cost = cost.CostModel(cost.PrefillModel.from_tokens_per_s(
                rng.choice((2000.0, 4000.0))), Bandwidths(), BT, 1024)
        waits = [policy.queue_s(c.load) for c in cands]
        assert policy.queues(cands) == (waits, sorted(range(len(cands)), key=waits.__getitem__))
