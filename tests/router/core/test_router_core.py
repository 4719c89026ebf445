"""One routing core behind both front ends: the same request stream routed through the
asyncio gateway's CacheAwareRouter and through Ray Serve's KVShareRequestRouter (real Serve
router class, its replicas described as Serve describes them) makes the same decisions, with
the same full ranking; the core's own rules (pending at the worker's gpu tier, fallbacks)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from typing import Any

import pytest
from ray.serve._private.common import (
    DeploymentHandleSource,
    DeploymentID,
    ReplicaID,
    RequestMetadata,
)
from ray.serve._private.request_router.common import PendingRequest
from vllm_helpers import wait_for

from kvshare.actors.index.global_index import GlobalIndex
from kvshare.cost import Bandwidths
from kvshare.engines.runtime import LoadReporter, LoadTracker
from kvshare.events import BlockStored
from kvshare.hasher import Hasher
from kvshare.match import EMPTY_MATCH as EMPTY
from kvshare.match import MatchResult
from kvshare.router.core.embed import CacheAwareRouter, InProcessIndex, RouterConfig
from kvshare.router.core.index import QueryIndex
from kvshare.router.core.policy import RouteRequest
from kvshare.router.core.routing import CostInputs, IndexAnswer, RoutingCore
from kvshare.router.core.workers_view import IndexWorkers, InFlight
from kvshare.router.gateway.forward import vllm_hint
from kvshare.router.serve.request import (
    FRONTS_WORKER,
    META_BLOCK_TOKENS,
    META_BYTES_PER_TOKEN,
    META_ROOT,
    META_TOKENIZER,
    replica_worker_id,
)
from kvshare.router.serve.request_router import KVShareRequestRouter
from kvshare.types import NodeId, Tier, WorkerId, node_location, worker_location
from kvshare.workers import META_GPU_PRIVATE, WorkerInfo, WorkerLoad

NS = "llm"
BT = 16
BPT = 4096
TPS = 2000.0
DEPLOYMENT = DeploymentID(name="llm", app_name="app")
HASHER = Hasher("m", "fp", BT)


class Replica:
    """What Serve's RequestRouter reads of a replica (its RunningReplica would look up the
    replica's actor on construction; routing never calls the replica)."""

    def __init__(self, i: int) -> None:
        self.replica_id = ReplicaID(f"r{i}", DEPLOYMENT)
        self.node_id = f"n{i % 3}"
        self.availability_zone = None
        self.multiplexed_model_ids: set[str] = set()
        self.max_ongoing_requests = 8


def replicas(n: int) -> list[Any]:
    return [Replica(i) for i in range(n)]


def cluster(reps: list[Any]) -> GlobalIndex:
    """An index that knows the replicas as workers (registered as a Serve replica does) and
    holds some prefixes on nodes n0 and n2."""
    index = GlobalIndex()
    index.declare_namespace(NS, 32)
    meta = {META_ROOT: HASHER.root.hex(), META_BLOCK_TOKENS: str(BT),
            META_BYTES_PER_TOKEN: str(BPT), META_TOKENIZER: json.dumps({"kind": "bytes"})}
    for i, r in enumerate(reps):
        wid = replica_worker_id(r.replica_id)
        index.register_worker(WorkerInfo(wid, NodeId(r.node_id), (NS,), meta=meta))
        index.report_load(WorkerLoad(wid, 300 * i, i % 2, TPS, time.time() - 60))
    for node, prefix in (("n0", SYSTEMS[0]), ("n2", SYSTEMS[1])):
        hashes = HASHER.hashes(prefix)
        index.apply([BlockStored(NS, node_location(node), Tier.HOST, h, 0, j + 1)
                     for j, h in enumerate(hashes)])
    return index


RNG = random.Random(7)
SYSTEMS = [[RNG.randrange(256) for _ in range(BT * n)] for n in (24, 12, 40)]
STREAM = [SYSTEMS[RNG.randrange(3)] + [RNG.randrange(256) for _ in range(RNG.randrange(1, 80))]
          for _ in range(40)]


def pending_request(i: int, ids: list[int]) -> PendingRequest:
    meta = RequestMetadata(request_id=f"q{i}", internal_request_id=f"q{i}")
    return PendingRequest(args=[{"kvshare": {"token_ids": ids, "namespace": NS}}], kwargs={},
                          metadata=meta)


def test_embed_and_serve_adapters_make_identical_decisions() -> None:
    reps = replicas(6)
    by_id = {replica_worker_id(r.replica_id): r for r in reps}

    async def stream() -> tuple[list[Any], list[Any]]:
        index = InProcessIndex(cluster(reps))
        embed = CacheAwareRouter(index, IndexWorkers(index, refresh_s=0.0), RouterConfig(
            namespace=NS, model_id="m", layout_fingerprint="fp", block_tokens=BT,
            bytes_per_token=BPT, prefill_tokens_per_s=TPS))
        serve = KVShareRequestRouter(deployment_id=DEPLOYMENT,
                                     handle_source=DeploymentHandleSource.UNKNOWN)
        serve.initialize_state(namespace=NS, prefill_tokens_per_s=TPS, workers_refresh_s=0.0,
                               hint_kwarg="held")
        serve.use_index(index)
        serve.update_replicas(reps)
        got_e, got_s, hints = [], [], []
        for i, ids in enumerate(STREAM):
            routed = await embed.route(token_ids=ids, request_id=f"q{i}")
            ranking = routed.ranking
            assert ranking is not None
            est = {e.worker: e.est_ttft_s for e in ranking.estimates()}
            best = est[routed.decision.worker]
            # Serve's first pass offers the ranking cut at spill_ratio (default 0.5)
            offered = [w for w in ranking.order()
                       if w == routed.decision.worker or est[w] <= best * 1.5 + 0.005]
            got_e.append((routed.decision.worker, routed.decision.reason, offered))
            pr = pending_request(i, ids)
            shortlist = await serve.choose_replicas(reps, pr)
            chosen = shortlist[0][0]
            got_s.append((replica_worker_id(chosen.replica_id),
                          [replica_worker_id(s[0].replica_id) for s in shortlist]))
            hints.append((vllm_hint(routed.ranking, routed.block_tokens), pr.kwargs["held"]))  # the router hint, both ways
            serve.on_request_routed(pr, chosen.replica_id, None)
            if i % 5 == 4:  # some finish, on both
                embed.finished(f"q{i - 2}")
                serve.on_request_completed(by_id[got_s[i - 2][0]].replica_id, f"q{i - 2}")
        serve_reasons = {k.removeprefix("decision_"): n for k, n in serve.counters.items()
                         if k.startswith("decision_")}
        return got_e, got_s, serve_reasons, hints

    got_e, got_s, serve_reasons, hints = asyncio.run(stream())
    assert len(got_s) == len(STREAM)
    assert all(e == s for e, s in hints)
    assert {0, 24 * BT} <= {e["kvshare"]["held_tokens"] for e, _ in hints}
    assert [(w, order) for w, _, order in got_e] == got_s
    assert Counter(r for _, r, _ in got_e) == serve_reasons
    # the stream is not trivial: it used the index's blocks, pending ones, load, several workers
    assert {"cache_local", "cache_remote", "load"} <= set(serve_reasons), serve_reasons
    assert len({w for w, _ in got_s}) >= 3
    assert any(len(order) > 1 for _, order in got_s)


def test_serve_ranks_a_replica_by_the_worker_its_routing_stats_name() -> None:
    """Replicas in front of engines that registered themselves (``router/serve_vllm.py``):
    the router reads the worker id from each replica's routing stats, so the replica in front
    of the worker whose own cache holds the prompt is chosen, and its work counts there."""
    reps = replicas(2)
    for r, wid in zip(reps, ("vllm-b", "vllm-a"), strict=True):
        r.routing_stats = {FRONTS_WORKER: wid}
    index = GlobalIndex()
    index.declare_namespace(NS, 32)
    meta = {META_ROOT: HASHER.root.hex(), META_BLOCK_TOKENS: str(BT),
            META_BYTES_PER_TOKEN: str(BPT), META_TOKENIZER: json.dumps({"kind": "bytes"}),
            META_GPU_PRIVATE: "1"}
    gen = {wid: index.register_worker(WorkerInfo(WorkerId(wid), NodeId(node), (NS,), meta=meta))
           for wid, node in (("vllm-a", "n0"), ("vllm-b", "n1"))}
    for wid in gen:
        index.report_load(WorkerLoad(WorkerId(wid), 0, 0, TPS, time.time()))
    ids = SYSTEMS[0]
    index.apply([BlockStored(NS, worker_location("vllm-a"), Tier.GPU, h, gen["vllm-a"], j + 1)
                 for j, h in enumerate(HASHER.hashes(ids))])

    async def route() -> tuple[Any, Any]:
        serve = KVShareRequestRouter(deployment_id=DEPLOYMENT,
                                     handle_source=DeploymentHandleSource.UNKNOWN)
        serve.initialize_state(namespace=NS, prefill_tokens_per_s=TPS, workers_refresh_s=0.0)
        serve.use_index(InProcessIndex(index))
        serve.update_replicas(reps)
        pr = pending_request(0, ids)
        shortlist = await serve.choose_replicas(reps, pr)
        serve.on_request_routed(pr, shortlist[0][0].replica_id, None)
        return shortlist, serve

    shortlist, serve = asyncio.run(route())
    assert shortlist[0][0] is reps[1]  # it fronts vllm-a, the holder
    assert serve.counters.get("decision_cache_local") == 1
    assert serve.core.inflight.loads(
        [WorkerInfo(WorkerId("vllm-a"), NodeId("n0"), (NS,))], {})[0][0].running == 1


def test_serve_counts_a_ranked_request_before_serve_places_it() -> None:
    """Serve places a request some time after the router ranked it; requests ranked meanwhile
    (a burst of new conversations) see it queued at its first choice, so two short prompts
    ranked after a long one are not put behind it, and once placed it counts where it went."""
    reps = replicas(2)
    index = cluster(reps)
    long_ids = [RNG.randrange(256) for _ in range(BT * 40)]
    short = [[RNG.randrange(256) for _ in range(BT * 2)] for _ in range(2)]

    infos = [WorkerInfo(replica_worker_id(r.replica_id), NodeId(r.node_id), (NS,)) for r in reps]

    async def burst() -> tuple[list[Any], list[dict[WorkerId, int]]]:
        serve = KVShareRequestRouter(deployment_id=DEPLOYMENT,
                                     handle_source=DeploymentHandleSource.UNKNOWN)
        serve.initialize_state(namespace=NS, prefill_tokens_per_s=TPS, workers_refresh_s=0.0)
        serve.use_index(InProcessIndex(index))
        serve.update_replicas(reps)
        prs = [pending_request(i, ids) for i, ids in enumerate([long_ids, *short])]
        chosen = [(await serve.choose_replicas(reps, pr))[0][0] for pr in prs]  # none placed
        queued = [{ld.worker_id: ld.queued_prefill_tokens
                   for ld, _ in serve.core.inflight.loads(infos, {})}]
        # Serve placed the long one on the other replica after all: it counts there, once
        serve.on_request_routed(prs[0], chosen[1].replica_id, None)
        queued.append({ld.worker_id: ld.queued_prefill_tokens
                       for ld, _ in serve.core.inflight.loads(infos, {})})
        return chosen, queued

    chosen, queued = asyncio.run(burst())
    assert chosen[1] is not chosen[0] and chosen[2] is not chosen[0], chosen
    first, other = (replica_worker_id(chosen[i].replica_id) for i in (0, 1))
    assert queued[0][first] == len(long_ids)
    assert queued[1][first] == 0
    assert queued[1][other] == len(long_ids) + 2 * BT * 2


@pytest.mark.parametrize("front", ["serve", "embed"])
@pytest.mark.parametrize("remote_load_s", [0.0, 1.0])
def test_both_front_ends_price_a_remote_load_at_what_the_workers_measured(
        remote_load_s: float, front: str) -> None:
    """A prompt held in node n0's pool, n0's worker busy: the idle worker on n1 pulls it from
    n0 while a load is cheap; when the workers report that a load from another node takes
    1 s (vLLM's connector measures it), recomputing 400 tokens there is cheaper. The Serve
    router and the gateway's CacheAwareRouter read the reports alike (the core does), and
    both price prefill at the workers' reported speed, not their configured one."""
    index = GlobalIndex()
    index.declare_namespace(NS, 32)
    meta = {META_ROOT: HASHER.root.hex(), META_BLOCK_TOKENS: str(BT),
            META_BYTES_PER_TOKEN: str(BPT), META_TOKENIZER: json.dumps({"kind": "bytes"})}
    reps = replicas(2)
    for r, queued in zip(reps, (50_000, 0), strict=True):
        wid = replica_worker_id(r.replica_id)
        index.register_worker(WorkerInfo(wid, NodeId(r.node_id), (NS,), meta=meta))
        index.report_load(WorkerLoad(wid, queued, 0, TPS, time.time(), remote_load_s=remote_load_s))
    ids = SYSTEMS[0] + [1, 2, 3]
    index.apply([BlockStored(NS, node_location("n0"), Tier.HOST, h, 0, j + 1)
                 for j, h in enumerate(HASHER.hashes(SYSTEMS[0]))])

    async def route() -> Any:
        if front == "embed":
            idx = InProcessIndex(index)
            embed = CacheAwareRouter(idx, IndexWorkers(idx, refresh_s=0.0), RouterConfig(
                namespace=NS, model_id="m", layout_fingerprint="fp", block_tokens=BT,
                bytes_per_token=BPT, prefill_tokens_per_s=TPS / 4))
            routed = await embed.route(token_ids=ids)
            return routed.decision.worker, routed.decision, embed.core.cost
        serve = KVShareRequestRouter(deployment_id=DEPLOYMENT,
                                     handle_source=DeploymentHandleSource.UNKNOWN)
        serve.initialize_state(namespace=NS, prefill_tokens_per_s=TPS / 4, workers_refresh_s=0.0)
        serve.use_index(InProcessIndex(index))
        serve.update_replicas(reps)
        shortlist = await serve.choose_replicas(reps, pending_request(0, ids))
        return (replica_worker_id(shortlist[0][0].replica_id), serve._last["q0"].ranking.decision,
                serve.core.cost)

    chosen, decision, cost = asyncio.run(route())
    assert chosen == replica_worker_id(reps[1].replica_id)
    assert cost.bandwidths.remote_latency_s == (remote_load_s or Bandwidths().remote_latency_s)
    assert cost.prefill.tokens_per_s == TPS
    assert (decision.remote_blocks == 0) == (remote_load_s > 0), decision


class CountingLoads(InProcessIndex):
    """An in-process index counting its load-report reads."""

    def __init__(self, index: Any) -> None:
        super().__init__(index)
        self.reads = 0

    async def loads_async(self) -> dict[WorkerId, WorkerLoad]:
        self.reads += 1
        return await super().loads_async()


@pytest.mark.parametrize("loads_refresh_s", [0.0, 60.0])
def test_serve_reads_load_reports_per_request_or_in_the_background(loads_refresh_s: float) -> None:
    """By default every decision reads the workers' load reports; with ``loads_refresh_s``
    only the first waits for them and later decisions use the latest read (the reads go on in
    the background every that many seconds), so a decision makes no call for them."""
    reps = replicas(2)
    index = CountingLoads(cluster(reps))

    async def stream() -> list[Any]:
        serve = KVShareRequestRouter(deployment_id=DEPLOYMENT,
                                     handle_source=DeploymentHandleSource.UNKNOWN)
        serve.initialize_state(namespace=NS, prefill_tokens_per_s=TPS, workers_refresh_s=0.0,
                               loads_refresh_s=loads_refresh_s)
        serve.use_index(index)
        serve.update_replicas(reps)
        return [(await serve.choose_replicas(reps, pending_request(i, ids)))[0][0]
                for i, ids in enumerate(STREAM[:5])]

    chosen = asyncio.run(stream())
    assert len(chosen) == 5
    assert index.reads == (5 if loads_refresh_s == 0 else 1)


def test_serve_keeps_load_reports_fresh_between_far_apart_decisions() -> None:
    """With ``loads_refresh_s`` the reports are read on that period whether or not decisions
    come (before: a read started only when a decision found them old, so the first decision
    after a quiet spell was ranked on reports as old as the spell)."""
    reps = replicas(2)
    index = CountingLoads(cluster(reps))

    async def quiet_spell() -> float:
        serve = KVShareRequestRouter(deployment_id=DEPLOYMENT,
                                     handle_source=DeploymentHandleSource.UNKNOWN)
        serve.initialize_state(namespace=NS, prefill_tokens_per_s=TPS, workers_refresh_s=0.0,
                               loads_refresh_s=0.05)
        serve.use_index(index)
        serve.update_replicas(reps)
        await serve.choose_replicas(reps, pending_request(0, STREAM[0]))
        await asyncio.sleep(1.0)  # no decisions
        age = time.monotonic() - serve._loads_at
        await serve.choose_replicas(reps, pending_request(1, STREAM[1]))
        return age

    age = asyncio.run(quiet_spell())
    assert index.reads >= 5, index.reads  # ~20 periods in the spell; slack for a slow machine
    assert age < 0.5, age


# ------------------------------------------------------------------ the core's own rules
class SlowIndex:
    """Answers after the deadline (a real coroutine), or says it is unavailable."""

    def __init__(self, unavailable: str = "") -> None:
        self.unavailable = unavailable

    def match(self, namespace: str, hashes: Any) -> MatchResult:
        raise AssertionError("the core must not call the blocking match")

    async def match_async(self, namespace: str, hashes: Any) -> MatchResult:
        if not self.unavailable:
            await asyncio.sleep(1.0)
        return MatchResult(len(hashes), 0, {}, self.unavailable)


def core(index: Any = None) -> RoutingCore:
    return RoutingCore(index, CostInputs(BT, BPT, Bandwidths(), TPS), policy="cost",
                       index_timeout_s=0.05)


WORKERS = [WorkerInfo(WorkerId(f"w{i}"), NodeId("n0" if i < 2 else "n1"), (NS,)) for i in range(3)]


def request(ids: list[int]) -> RouteRequest:
    return RouteRequest(NS, HASHER.hashes(ids), len(ids))


def test_pending_blocks_are_the_chosen_workers_gpu_blocks_and_help_only_it() -> None:
    c = core()
    loads = {w.worker_id: WorkerLoad(w.worker_id, 0, 0, TPS, 0.0) for w in WORKERS}
    req = request(SYSTEMS[0])
    first = c.rank(req, IndexAnswer(EMPTY), c.candidates(WORKERS, loads))
    assert first.decision.reason == "load"
    c.routed("a", first)
    holders = c.pending.match(NS, req.hashes).locations
    assert list(holders) == [worker_location(first.decision.worker)]
    assert set(holders[worker_location(first.decision.worker)].tier_counts) == {Tier.GPU}
    c.prefilled("a")  # its prefill no longer queues there; the index has not heard of it yet
    again = c.rank(request(SYSTEMS[0] + [1] * BT), IndexAnswer(EMPTY), c.candidates(WORKERS, loads))
    assert again.decision.worker == first.decision.worker
    assert again.decision.reason == "cache_local"
    neighbour = next(w.worker_id for w in WORKERS
                     if w.node == WORKERS[0].node and w.worker_id != first.decision.worker)
    assert again.plan_of(neighbour) is not None and again.plan_of(neighbour).cut == 0  # type: ignore[union-attr]
    # the full ranking: every candidate, the chosen first, then by estimate
    est = again.estimates()
    assert [e.worker for e in est][0] == first.decision.worker and len(est) == 3
    assert [e.est_ttft_s for e in est[1:]] == sorted(e.est_ttft_s for e in est[1:])


def test_a_worker_whose_cache_was_emptied_loses_the_blocks_it_was_about_to_hold() -> None:
    c = core()
    loads = {w.worker_id: WorkerLoad(w.worker_id, 0, 0, TPS, 0.0) for w in WORKERS}
    req = request(SYSTEMS[0])
    first = c.rank(req, IndexAnswer(EMPTY), c.candidates(WORKERS, loads))
    c.routed("a", first)
    c.prefilled("a")
    chosen = first.decision.worker
    other = next(w.worker_id for w in WORKERS if w.worker_id != chosen)
    c.routed("b", c.rank(request(SYSTEMS[1]), IndexAnswer(EMPTY), c.candidates(WORKERS, loads)),
             other)
    c.prefilled("b")
    again = request(SYSTEMS[0] + [1] * BT)
    assert c.rank(again, IndexAnswer(EMPTY), c.candidates(WORKERS, loads)).decision.reason == \
        "cache_local"
    # the chosen worker's engine restarted (or reset its prefix cache): its report says so
    loads = {**loads, chosen: WorkerLoad(chosen, 0, 0, TPS, 1.0, cache_epoch=1)}
    after = c.rank(again, IndexAnswer(EMPTY), c.candidates(WORKERS, loads))
    assert after.decision.reason == "load"  # nothing pending anywhere for this prompt now
    assert not c.pending.match(NS, req.hashes).locations
    # another worker's pending blocks stay; a report with the same epoch forgets nothing
    assert list(c.pending.match(NS, request(SYSTEMS[1]).hashes).locations) == [
        worker_location(other)]
    c.routed("c", after)
    loads = {**loads, chosen: WorkerLoad(chosen, 0, 0, TPS, 2.0, cache_epoch=1)}
    c.candidates(WORKERS, loads)
    assert list(c.pending.match(NS, again.hashes).locations) == [
        worker_location(after.decision.worker)]


def reference_worker(index: GlobalIndex, info: WorkerInfo) -> LoadReporter:
    """One start of a reference worker's load reports (its runtime's tracker and thread)."""
    reporter = LoadReporter(index, info, LoadTracker(), interval_s=0.02)
    reporter.start()
    return reporter


def test_a_restarted_reference_worker_reports_another_epoch_and_routers_forget_its_blocks() -> None:
    """A reference worker's restart shows in its load reports (``cache_epoch``: a base per
    start), and a router then forgets what it expected the earlier incarnation to hold."""
    index = GlobalIndex()
    index.declare_namespace(NS)
    reporters = [reference_worker(index, info) for info in WORKERS]
    try:
        wait_for(lambda: len(index.loads()) == len(WORKERS))
        first = index.loads()
        time.sleep(0.1)  # reports keep coming: the epoch of one start does not move
        assert {w: r.cache_epoch for w, r in index.loads().items()} == {
            w: r.cache_epoch for w, r in first.items()}

        c = core()
        loads = {w: WorkerLoad(w, 0, 0, TPS, 0.0, cache_epoch=r.cache_epoch)
                 for w, r in first.items()}
        req = request(SYSTEMS[0])
        chosen = c.rank(req, IndexAnswer(EMPTY), c.candidates(WORKERS, loads))
        c.routed("a", chosen)
        c.prefilled("a")
        w = chosen.decision.worker
        assert list(c.pending.match(NS, req.hashes).locations) == [worker_location(w)]

        # the chosen worker's process dies and starts again under the same id
        i = next(k for k, info in enumerate(WORKERS) if info.worker_id == w)
        reporters[i].stop()
        time.sleep(0.002)  # (a restart takes far longer than the epoch's 1 ms grain)
        reporters[i] = reference_worker(index, WORKERS[i])
        wait_for(lambda: index.loads()[w].cache_epoch != first[w].cache_epoch)
        again = index.loads()[w]
        assert again.cache_epoch > first[w].cache_epoch  # a later start, a later base
        c.candidates(WORKERS, {**loads, w: WorkerLoad(w, 0, 0, TPS, 1.0,
                                                      cache_epoch=again.cache_epoch)})
        assert not c.pending.match(NS, req.hashes).locations  # nothing pending there now
    finally:
        for r in reporters:
            r.stop()


@pytest.mark.parametrize("index, cause", [(QueryIndex(SlowIndex()), "index_timeout"),
                                           (QueryIndex(SlowIndex("index_down")), "index_unavailable")])
def test_a_slow_or_unavailable_index_falls_back_to_pending_then_to_load(index: Any, cause: str) -> None:
    c = core(index)
    loads = {w.worker_id: WorkerLoad(w.worker_id, 4000 * (w.worker_id == "w2"), 0, TPS, 0.0)
             for w in WORKERS}
    known = request(SYSTEMS[1])

    async def go(req: RouteRequest) -> Any:
        answer = await c.query(NS, req.hashes)
        return answer, c.rank(req, answer, c.candidates(WORKERS, loads))

    answer, cold = asyncio.run(go(known))
    assert answer.fallback == cause
    assert cold.decision.reason == f"fallback_{cause}" and cold.decision.worker != "w2"
    c.routed("a", cold)
    c.prefilled("a")
    _, warm = asyncio.run(go(request(SYSTEMS[1] + [3] * BT)))
    assert warm.decision.reason == f"fallback_{cause}_pending"
    assert warm.decision.worker == cold.decision.worker and warm.decision.cached_blocks > 0


def test_a_ranking_says_how_much_the_cluster_held_only_when_the_index_answered() -> None:
    """``held_blocks`` (the hint a vLLM engine gets): the longest prefix held anywhere in the
    index's answer or the router's own pending blocks; None when the index did not answer."""
    c = core(InProcessIndex(cluster(replicas(3))))
    loads = {w.worker_id: WorkerLoad(w.worker_id, 0, 0, TPS, 0.0) for w in WORKERS}

    def held(ids: list[int], slow: Any = None) -> int | None:
        async def go() -> Any:
            req = request(ids)
            ranking = c.rank(req, await c.query(NS, req.hashes), c.candidates(WORKERS, loads))
            c.routed(f"q{len(ids)}", ranking)
            return ranking.held_blocks
        return asyncio.run(go())

    assert held(SYSTEMS[0] + [1] * 40) == 24  # n0's pool holds SYSTEMS[0]
    assert held(SYSTEMS[2]) == 0  # new to the cluster (now pending where it was sent)
    assert held(SYSTEMS[2] + [2] * BT) == 40  # the router's own pending blocks
    c.index = QueryIndex(SlowIndex("index_down"))
    assert held(SYSTEMS[0]) is None


def test_in_flight_work_adds_to_a_report_and_drained_work_comes_off_a_stale_one() -> None:
    now = [100.0]
    inflight = InFlight(clock=lambda: now[0])
    w = WORKERS[0]
    # counts the request routed at 99; the engine says 3 requests wait (the cost policy
    # prices work by them), which the router's view keeps
    report = WorkerLoad(w.worker_id, 1000, 1, TPS, 99.5, waiting=3, kv_usage=0.5,
                        local_load_s=0.02, remote_load_s=0.3)
    now[0] = 99.0
    inflight.add("old", w.worker_id, 1000, 4)
    now[0] = 100.0
    inflight.add("new", w.worker_id, 300, 2)  # after the report: on top of it
    [(load, blocks)] = inflight.loads([w], {w.worker_id: report})
    assert (load.queued_prefill_tokens, load.running, blocks) == (1300, 2, 6)
    assert (load.waiting, load.kv_usage) == (3, 0.5)
    assert (load.local_load_s, load.remote_load_s) == (0.02, 0.3)  # every other field kept
    now[0] = 100.5
    inflight.done("old")  # drained after the report: the report still counts it
    [(load, blocks)] = inflight.loads([w], {w.worker_id: report})
    assert (load.queued_prefill_tokens, blocks, load.waiting) == (300, 2, 3)
    assert inflight.load(w.worker_id, report)[0].waiting == 3
    assert inflight.load(w.worker_id, report)[0].remote_load_s == 0.3
    now[0] = 103.0  # past drain_window_s: a fresher report is due, the old one stands again
    [(load, _)] = inflight.loads([w], {w.worker_id: report})
    assert load.queued_prefill_tokens == 1300


def test_requests_sent_after_the_engine_state_a_report_describes_count_on_top() -> None:
    """A vLLM report scraped at 100.5 describes the engine as its last step was scheduled, at
    98 (``as_of``): a request sent at 99 is not in it (it reached the engine during that
    step), so the router still counts it; one sent before 98 is in the report."""
    now = [97.0]
    inflight = InFlight(clock=lambda: now[0])
    w = WORKERS[0]
    inflight.add("before", w.worker_id, 700, 2)
    now[0] = 99.0
    inflight.add("during", w.worker_id, 2000, 3)
    now[0] = 100.6
    report = WorkerLoad(w.worker_id, 700, 1, TPS, 100.5, as_of=98.0)
    [(load, blocks)] = inflight.loads([w], {w.worker_id: report})
    assert (load.queued_prefill_tokens, load.running, blocks) == (2700, 2, 5)
    assert load.as_of == 98.0  # (kept with the router's view)
    plain = WorkerLoad(w.worker_id, 2700, 2, TPS, 100.5)  # the same, scraped with no as_of
    assert inflight.loads([w], {w.worker_id: plain})[0][0].queued_prefill_tokens == 2700


def test_drained_work_off_a_report_matches_summing_every_drain() -> None:
    """Thousands of drains (a busy router): what comes off each report is the plain sum of
    the drains after it and inside the window, however old the report is."""
    rng = random.Random(7)
    now = [0.0]
    inflight = InFlight(clock=lambda: now[0], drain_window_s=2.0)
    w = WORKERS[0]
    drains: list[tuple[float, int]] = []
    for i in range(3000):
        now[0] += rng.random() * 0.004
        tokens = rng.randrange(1, 500)
        inflight.add(f"r{i}", w.worker_id, tokens, 1)
        inflight.done(f"r{i}")
        drains.append((now[0], tokens))
        if i % 97 == 0:
            ts = now[0] - rng.random() * 3.0
            report = WorkerLoad(w.worker_id, 10**7, 0, TPS, ts)
            [(load, _)] = inflight.loads([w], {w.worker_id: report})
            want = sum(n for at, n in drains if at > ts and now[0] - at < 2.0)
            assert load.queued_prefill_tokens == 10**7 - want


def test_a_cached_request_drains_the_whole_prompt_its_worker_reported() -> None:
    """A worker queues a request's whole prompt until its first token, cache hit or not; the
    router expects only the uncached suffix to load it. When the request ends, a report taken
    before that must lose the whole prompt, not just the suffix (else the holder of a prefix
    looks busy with a full recompute and the next turn goes elsewhere)."""
    now = [100.0]
    inflight = InFlight(clock=lambda: now[0])
    w = WORKERS[0]
    inflight.add("hit", w.worker_id, 64, 40, counted_tokens=10_240)  # 40 blocks, 64 to prefill
    report = WorkerLoad(w.worker_id, 10_240, 1, TPS, 100.2)  # the worker counts all 10,240
    now[0] = 100.4
    inflight.done("hit")
    [(load, blocks)] = inflight.loads([w], {w.worker_id: report})
    assert (load.queued_prefill_tokens, blocks) == (0, 0)
    inflight.add("later", w.worker_id, 500, 2)  # no counted_tokens: the suffix is what counts
    now[0] = 100.6
    inflight.prefilled("later")
    inflight.done("later")  # already drained at its first token: not drained twice
    [(load, _)] = inflight.loads([w], {w.worker_id: WorkerLoad(w.worker_id, 900, 1, TPS, 100.5)})
    assert load.queued_prefill_tokens == 400
