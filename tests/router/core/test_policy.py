"""Cost model, block sources, pending blocks and the routing policies (no Ray, no HTTP)."""

from __future__ import annotations

import math

import pytest

from kvshare.cost import Bandwidths, CostModel, PrefillModel, Source
from kvshare.match import EMPTY_MATCH, MatchResult, build_match
from kvshare.router.core.pending import PendingBlocks
from kvshare.router.core.policy import Candidate, NoEligibleWorker, RouteRequest
from kvshare.router.core.registry import ALIASES, POLICIES, make_policy, policy_names
from kvshare.router.core.sources import Sharing, SourceMap
from kvshare.types import (
    BlockHash,
    Location,
    NodeId,
    Tier,
    WorkerId,
    node_location,
    worker_location,
)
from kvshare.workers import WorkerInfo, WorkerLoad

BT = 16  # tokens per block in these scenarios
NS = "m"


def H(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(32, "big"))


HASHES = [H(i) for i in range(1, 9)]  # an 8-block, 128-token prompt


def cost_model(a: float = 1e-3, b: float = 0.0, bpt: int = 1000, **bw: float) -> CostModel:
    return CostModel(PrefillModel(a, b), Bandwidths(**bw), BT, bpt)


def cand(i: int, node: str | None = None, queued: int = 0, running: int = 0, ns: tuple[str, ...] = (NS,),
         **meta: str) -> Candidate:
    info = WorkerInfo(WorkerId(f"w{i}"), NodeId(node or f"n{i}"), ns, f"http://w{i}", meta=meta)
    return Candidate(info, WorkerLoad(info.worker_id, queued, running))


def load(i: int, queued: int, waiting: int) -> Candidate:
    """Worker ``i`` with ``queued`` prefill tokens, ``waiting`` requests queued and one running."""
    c = cand(i)
    return Candidate(c.info, WorkerLoad(c.info.worker_id, queued, waiting + 1, 0.0, 0.0, waiting))


def held(layout: dict[Location, tuple[int, Tier]], n: int = 8) -> MatchResult:
    """A match where each location holds its first k blocks in one tier."""
    return build_match([
        {loc: t for loc, (k, t) in layout.items() if i < k} for i in range(n)
    ])


# ---------------------------------------------------------------- cost model
def test_prefill_fit_recovers_linear_and_attention_terms() -> None:
    truth = PrefillModel(2e-4, 3e-9)
    samples = [(n, c, truth.time(n, c)) for n in (256, 1024, 4096, 16384) for c in (0, 8192)]
    fit = PrefillModel.fit(samples)
    assert fit.a == pytest.approx(2e-4, rel=1e-6)
    assert fit.b == pytest.approx(3e-9, rel=1e-6)
    assert fit.time(1000, 500) == pytest.approx(truth.time(1000, 500))


def test_prefill_fit_rejects_too_few_samples_and_drops_negative_attention() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        PrefillModel.fit([(100, 0, 0.1)])
    noisy = PrefillModel.fit([(100, 0, 0.1), (200, 0, 0.19), (400, 0, 0.37)])
    assert noisy.b == 0.0 and noisy.a > 0


def test_bandwidths_from_measured_takes_best_remote_and_rejects_unknown_keys() -> None:
    bw = Bandwidths.from_measured({"shm": 20e9, "nixl": 8e9, "objstore": 1.5e9})
    assert (bw.host, bw.remote) == (20e9, 8e9)
    with pytest.raises(ValueError, match="unknown bandwidth keys"):
        Bandwidths.from_measured({"infiniband": 1.0})


def test_plan_uses_remote_blocks_only_when_pulling_beats_recomputing() -> None:
    # recompute: 1 ms/token -> 16 ms per block. Remote fetch: 16 kB / bw.
    fast = cost_model(remote=16e9 / 16, remote_latency_s=0.0)  # 1 ms per block: pull
    slow = cost_model(remote=16e6 / 100, remote_latency_s=0.0)  # 100 ms per block: recompute
    srcs = [Source.REMOTE_HOST] * 8
    assert fast.plan(128, srcs).cut == 8
    assert slow.plan(128, srcs).cut == 0
    # local host blocks first, remote after: the cut stops where remote gets too dear
    mixed = [Source.LOCAL_HOST] * 3 + [Source.REMOTE_HOST] * 5
    plan = slow.plan(128, mixed)
    assert plan.cut == 3 and plan.remote_blocks == 0 and plan.sources == {Source.LOCAL_HOST: 3}


def test_plan_full_hit_still_computes_the_last_token() -> None:
    m = cost_model()
    plan = m.plan(128, [Source.LOCAL_GPU] * 8)
    assert plan.cut == 8 and plan.cached_tokens == 127
    assert plan.prefill_s == pytest.approx(1e-3)
    with pytest.raises(ValueError):
        m.plan(0, [])


# ---------------------------------------------------------------- sources
def test_source_map_local_remote_and_sharing_modes() -> None:
    n0, n1 = node_location("n0"), node_location("n1")
    match = held({n0: (3, Tier.HOST), n1: (6, Tier.DISK)})
    view = SourceMap(match, {WorkerId("w0"): NodeId("n0"), WorkerId("w1"): NodeId("n1")})
    fetch = cost_model().block_fetch_s
    w0 = view.sources_for(WorkerId("w0"), NodeId("n0"), Sharing.GLOBAL, fetch)
    assert w0 == [Source.LOCAL_HOST] * 3 + [Source.REMOTE_DISK] * 3
    assert view.sources_for(WorkerId("w0"), NodeId("n0"), Sharing.LOCAL, fetch) == [Source.LOCAL_HOST] * 3
    # w1's own node has them on disk; a remote host copy is cheaper only if the network is
    w1 = view.sources_for(WorkerId("w1"), NodeId("n1"), Sharing.GLOBAL, fetch)
    assert w1[:3] == [Source.REMOTE_HOST] * 3 and w1[3:] == [Source.LOCAL_DISK] * 3
    slow_net = cost_model(remote=1e6).block_fetch_s
    assert view.sources_for(WorkerId("w1"), NodeId("n1"), Sharing.GLOBAL, slow_net) == [Source.LOCAL_DISK] * 6


def test_pending_blocks_count_only_for_their_own_worker_and_expire() -> None:
    now = [0.0]
    pending = PendingBlocks(ttl_s=5, clock=lambda: now[0])
    pending.add(NS, node_location("n1"), HASHES[:4], Tier.HOST)
    pm = pending.match(NS, HASHES)
    assert pm.combined_prefix == 4
    view = SourceMap(EMPTY_MATCH, {WorkerId("w0"): NodeId("n0")}, pm)
    assert view.sources_for(WorkerId("w1"), NodeId("n1"), Sharing.GLOBAL) == [Source.LOCAL_HOST] * 4
    assert view.sources_for(WorkerId("w0"), NodeId("n0"), Sharing.GLOBAL) == []
    assert pending.match("other-ns", HASHES) is EMPTY_MATCH
    now[0] = 6.0
    assert pending.match(NS, HASHES).combined_prefix == 0 and len(pending) == 0


# ---------------------------------------------------------------- policies
def test_registry_has_every_policy_and_rejects_unknown_names() -> None:
    assert set(POLICIES) == {"round_robin", "least_loaded", "cost", "dynamo_kv", "llmd_precise",
                             "ray_prefix"}
    with pytest.raises(KeyError, match="choose one of"):
        make_policy("random", cost_model())


def test_round_robin_cycles_and_least_loaded_picks_the_emptiest_queue() -> None:
    cands = [cand(0, queued=50), cand(1, queued=10), cand(2, queued=30)]
    rr = make_policy("round_robin", cost_model())
    req = RouteRequest(NS, HASHES, 128)
    assert [rr.choose(req, EMPTY_MATCH, cands).worker for _ in range(4)] == ["w0", "w1", "w2", "w0"]
    d = make_policy("least_loaded", cost_model()).choose(req, EMPTY_MATCH, cands)
    assert d.worker == "w1" and d.reason == "least_loaded" and d.cached_blocks == 0


def test_older_peer_names_are_aliases_of_the_peers_rules() -> None:
    # prefix_affinity is Ray Serve's rule (ray_prefix), options and all: imbalanced -> pow2
    pol = make_policy("prefix_affinity", cost_model(), imbalanced_threshold=4)
    assert type(pol) is POLICIES["ray_prefix"]
    skewed = [cand(0, running=0), cand(1, running=1), cand(2, running=9)]
    d = pol.choose(RouteRequest(NS, HASHES, 128), EMPTY_MATCH, skewed)
    assert d.reason == "pow2" and d.policy == "ray_prefix"
    kv = make_policy("kv_overlap", cost_model(), router_temperature=0.5)
    assert type(kv) is POLICIES["dynamo_kv"] and kv.temperature == 0.5
    assert set(ALIASES) <= set(policy_names()) and not set(ALIASES) & set(POLICIES)
    with pytest.raises(TypeError, match="temperature"):  # the old model's option: named
        make_policy("kv_overlap", cost_model(), temperature=5.0)


def test_cost_policy_trades_queue_wait_against_prefill_and_transfer() -> None:
    m = cost_model(a=1e-3)  # 128-token prompt: 128 ms cold
    match = held({node_location("n0"): (8, Tier.HOST)})
    req = RouteRequest(NS, HASHES, 128)
    pol = make_policy("cost", m, Sharing.LOCAL)
    # w0 holds it all, queue 50 tokens = 50 ms < 127 ms saved: go to w0
    d = pol.choose(req, match, [cand(0, queued=50), cand(1)])
    assert (d.worker, d.reason, d.cached_blocks) == ("w0", "cache_local", 8)
    assert d.est_ttft_s == pytest.approx(0.05 + 0.001 + 8 * 16 * 1000 / 25e9, rel=1e-6)
    assert d.est_ttft_saved_s > 0.1
    # queue of 500 ms: recompute on the idle worker is faster
    d = pol.choose(req, match, [cand(0, queued=500), cand(1)])
    assert (d.worker, d.reason) == ("w1", "load")
    # global sharing: the idle worker pulls the blocks remotely
    d = make_policy("cost", m, Sharing.GLOBAL).choose(req, match, [cand(0, queued=500), cand(1)])
    assert (d.worker, d.reason, d.remote_blocks) == ("w1", "cache_remote", 8)


def test_cost_policy_prices_a_plans_work_by_the_requests_waiting() -> None:
    m = cost_model(a=1e-3)  # 128-token prompt: 128 ms cold, ~1 ms from w0's host cache
    match = held({node_location("n0"): (8, Tier.HOST)})
    req = RouteRequest(NS, HASHES, 128)
    pol = make_policy("cost", m, Sharing.LOCAL)

    # nothing waiting: the lowest TTFT, recomputing on idle w1 (128 ms < 200 ms + 1 ms)
    d = pol.choose(req, match, [load(0, 200, 0), load(1, 0, 0)])
    assert (d.worker, d.reason) == ("w1", "load")
    # requests waiting at every worker: the 127 ms a recompute adds would delay the requests
    # arriving behind it too, so the cached plan wins over the shorter queue
    d = pol.choose(req, match, [load(0, 200, 3), load(1, 0, 1)])
    assert (d.worker, d.reason, d.cached_blocks) == ("w0", "cache_local", 8)
    assert d.est_ttft_s == pytest.approx(0.2 + 0.001 + 8 * 16 * 1000 / 25e9, rel=1e-6)  # its TTFT
    # a worker with nothing waiting has slack for the extra work: the lowest TTFT again
    d = pol.choose(req, match, [load(0, 200, 3), load(1, 50, 0)])
    assert (d.worker, d.reason) == ("w1", "load")


def test_cost_policy_prices_work_for_the_whole_busy_period() -> None:
    m = cost_model(a=1e-3)  # 128-token prompt: 128 ms cold, ~1 ms from w0's host cache
    match = held({node_location("n0"): (8, Tier.HOST)})
    req = RouteRequest(NS, HASHES, 128)
    pol = make_policy("cost", m, Sharing.LOCAL)

    behind = [load(0, 1000, 1), load(1, 100, 1)]  # every worker has a request waiting
    # at the start of a busy period the 127 ms a recompute adds delays the few requests
    # arriving during the current wait: the 900 ms shorter queue wins
    d = pol.choose(req, match, behind)
    assert (d.worker, d.reason) == ("w1", "load")
    # the period goes on: every request routed to a worker until it ends waits for the
    # recompute too, so after enough of them the cached plan wins over the shorter queue
    ds = [pol.choose(req, match, behind) for _ in range(30)]
    assert ds[-1].worker == "w0" and ds[-1].reason == "cache_local"
    assert ds[-1].est_ttft_s == pytest.approx(1.0 + 0.001 + 8 * 16 * 1000 / 25e9, rel=1e-6)
    first = next(i for i, x in enumerate(ds) if x.worker == "w0")
    assert all(x.worker == "w0" for x in ds[first:])  # the switch is one way within a period
    # a worker ran dry: the period is over, and the next one starts from the lowest TTFT
    assert pol.choose(req, match, [load(0, 1000, 1), load(1, 100, 0)]).worker == "w1"
    assert pol.choose(req, match, behind).worker == "w1"


def test_cost_policy_keeps_a_long_prompt_off_a_worker_crowded_with_short_ones() -> None:
    m = cost_model(a=1e-3)  # 1 ms a token, nothing cached: a 128-token prompt takes 128 ms
    pol = make_policy("cost", m, Sharing.LOCAL)

    # w0: 200 ms of queue in 10 short requests (20 ms each); w1: 300 ms in one long one.
    # The 9 requests beyond w1's count bound to w0 (45 a second) would each wait 128 ms
    # instead of ~20 ms behind a long prompt there: it goes to w1, though w0 starts sooner
    crowded = [load(0, 200, 10), load(1, 300, 1)]
    d = pol.choose(RouteRequest(NS, HASHES, 128), EMPTY_MATCH, crowded)
    assert d.worker == "w1"
    assert d.est_ttft_s == pytest.approx(0.3 + 0.128, rel=1e-3)  # still its own TTFT
    # a prompt of w0's typical size costs its requests nothing extra: the shorter queue wins
    d = pol.choose(RouteRequest(NS, HASHES[:1], 16), EMPTY_MATCH, crowded)
    assert d.worker == "w0"
    # with a worker idle, later requests can go around it: the lowest TTFT, as before
    d = pol.choose(RouteRequest(NS, HASHES, 128), EMPTY_MATCH, [load(0, 200, 10), load(1, 300, 0)])
    assert d.worker == "w0"


def test_cost_policy_sends_a_request_to_an_idle_worker_rather_than_lengthen_a_convoy() -> None:
    """w0's gpu holds the first half of the prompt and 2 requests wait at w0 for 30 ms of
    work (~67 arrive there a second); idle w1 would pull that half from w0 (41 ms) instead.
    Alone the request is 11 ms sooner at w0, but the ~6 requests expected to join w0 behind
    it before w0 drains would each wait its 64 ms of prefill or go elsewhere at about 11 ms
    more: it goes to w1. With nothing waiting at w0, or no idle worker, it joins w0."""
    m = cost_model(a=1e-3, remote=1.6e6)  # 64 tokens: 64 ms to prefill, 41 ms to pull
    match = held({worker_location("w0"): (4, Tier.GPU)})
    req = RouteRequest(NS, HASHES, 128)

    def pick(cands: list[Candidate]) -> tuple[str, float]:
        pol = make_policy("cost", m)
        pol.clock = lambda: 100.0
        d = pol.choose(req, match, cands)
        return d.worker, d.est_ttft_s

    worker, est = pick([load(0, 30, 2), cand(1)])
    assert worker == "w1" and est == pytest.approx(0.041 + 0.064, abs=2e-3)
    assert pick([load(0, 30, 0), cand(1)])[0] == "w0"  # no one waits there: no convoy
    assert pick([load(0, 30, 2), cand(1, queued=1, running=1)])[0] == "w0"  # no worker idle
    # a request that adds almost no work at w0 (all of it cached there) joins the queue
    match_all = held({worker_location("w0"): (8, Tier.GPU)})
    pol = make_policy("cost", m)
    pol.clock = lambda: 100.0
    assert pol.choose(req, match_all, [load(0, 30, 2), cand(1)]).worker == "w0"


def test_policies_respect_namespace_and_tenant_restrictions() -> None:
    req = RouteRequest(NS, HASHES, 128, tenant="acme")
    cands = [cand(0, ns=("other",)), cand(1, tenants="globex"), cand(2, tenants="acme,initech")]
    for name in POLICIES:
        assert make_policy(name, cost_model()).choose(req, EMPTY_MATCH, cands).worker == "w2"
    with pytest.raises(NoEligibleWorker, match="namespace 'm'"):
        make_policy("cost", cost_model()).choose(req, EMPTY_MATCH, cands[:2])
    with pytest.raises(ValueError, match="at least one token"):
        RouteRequest(NS, [], 0)


def test_cost_policy_spreads_ties_over_idle_workers() -> None:
    """The same prompt 8 times on 4 idle workers: a tie each time, spread over all four. The
    clock stands still: each pick records the prompt as pending at its worker, ready when its
    prefill ends, so with time passing between picks (a stalled test process) that worker
    would rightly win the next pick by the time elapsed, and no tie would be left to spread."""
    pol = make_policy("cost", cost_model())
    pol.clock = lambda: 100.0
    req = RouteRequest(NS, HASHES, 128)
    cands = [cand(i) for i in range(4)]
    picks = [pol.choose(req, EMPTY_MATCH, cands).worker for _ in range(8)]
    assert len(set(picks)) == 4
    assert all(math.isfinite(pol.choose(req, EMPTY_MATCH, cands).est_ttft_s) for _ in range(2))


def test_cost_policy_breaks_a_near_tie_between_reading_and_pulling_for_the_reader() -> None:
    """Within the tie, the worker reading its node's copy beats the one that would pull it,
    every time (the rotation, and the lighter queue, decide only among equal pulls)."""
    from kvshare.router.core.policy import CostPolicy

    pol = CostPolicy(cost_model(a=1e-3), Sharing.GLOBAL, tie_s=0.05)
    pol.clock = lambda: 100.0  # (a stall between picks must not break the tie: see above)
    match = held({node_location("n0"): (8, Tier.HOST)})
    req = RouteRequest(NS, HASHES, 128)
    cands = [cand(0, queued=5), cand(1)]  # w0 5 ms behind: within the tie
    picks = {(d.worker, d.reason) for d in (pol.choose(req, match, cands) for _ in range(6))}
    assert picks == {("w0", "cache_local")}
    fresh = RouteRequest(NS, [H(i) for i in range(100, 108)], 128)  # cached nowhere: rotated
    assert len({pol.choose(fresh, EMPTY_MATCH, [cand(0), cand(1)]).worker for _ in range(4)}) == 2


def test_worker_gpu_tier_is_free_and_prefers_that_worker() -> None:
    m = cost_model(a=1e-3)
    match = held({worker_location("w1"): (8, Tier.GPU), node_location("n0"): (8, Tier.HOST)})
    d = make_policy("cost", m).choose(RouteRequest(NS, HASHES, 128), match, [cand(0), cand(1)])
    assert d.worker == "w1" and d.plan is not None and d.plan.fetch_s == 0.0


def test_an_engines_private_gpu_cache_is_no_source_for_other_workers() -> None:
    m = cost_model(a=1e-3)  # 128 ms cold; w0 is 60 ms behind, w1 idle
    match = held({worker_location("w0"): (8, Tier.GPU)})
    req = RouteRequest(NS, HASHES, 128)
    pol = make_policy("cost", m)
    # a reference worker serves its gpu blocks: the idle w1 pulls them remotely
    d = pol.choose(req, match, [cand(0, queued=60), cand(1)])
    assert (d.worker, d.reason, d.remote_blocks) == ("w1", "cache_remote", 8)
    # vLLM's own prefix cache cannot be read by another worker: w1 would recompute all of it,
    # so waiting 60 ms for the holder wins (another cluster: a fresh policy, which has not
    # just sent the prompt to w1, whose engine would then hold it too)
    d = make_policy("cost", m).choose(req, match, [cand(0, queued=60, gpu_private="1"), cand(1)])
    assert (d.worker, d.reason, d.cached_blocks) == ("w0", "cache_local", 8)
