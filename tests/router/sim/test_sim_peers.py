"""Today's peer routing rules (Dynamo's KV cost, llm-d's precise prefix scorer, Ray 2.60's
PrefixCacheAffinityRouter): each scenario checks the rule's documented arithmetic."""

from __future__ import annotations

import random

import pytest

from kvshare.cost import Bandwidths, CostModel, PrefillModel
from kvshare.match import MatchResult, build_match
from kvshare.router.core.baselines.dynamo import sample_lowest
from kvshare.router.core.policy import Candidate, RouteRequest
from kvshare.router.core.registry import POLICIES, make_policy
from kvshare.router.core.sources import SourceMap
from kvshare.types import BlockHash, Location, NodeId, Tier, WorkerId, node_location
from kvshare.workers import WorkerInfo, WorkerLoad

BT = 16
NS = "m"
HASHES = [BlockHash(i.to_bytes(32, "big")) for i in range(1, 9)]  # 8 blocks, 128 tokens


def _cost() -> CostModel:
    return CostModel(PrefillModel(1e-3, 0.0), Bandwidths(), BT, 1000)


def _cand(i: int, queued: int = 0, running: int = 0, active: int = 0) -> Candidate:
    info = WorkerInfo(WorkerId(f"w{i}"), NodeId(f"n{i}"), (NS,), f"http://w{i}")
    return Candidate(info, WorkerLoad(info.worker_id, queued, running), active)


def _held(layout: dict[Location, tuple[int, Tier]]) -> MatchResult:
    return build_match([{loc: t for loc, (k, t) in layout.items() if i < k} for i in range(8)])


REQ = RouteRequest(NS, HASHES, 128)


def test_peer_rules_are_registered() -> None:
    assert {"dynamo_kv", "llmd_precise", "ray_prefix"} <= set(POLICIES)


def test_dynamo_cost_credits_host_and_disk_at_their_weights() -> None:
    p = make_policy("dynamo_kv", _cost())
    match = _held({node_location("n0"): (8, Tier.HOST), node_location("n1"): (8, Tier.DISK)})
    view = SourceMap(match, {WorkerId("w0"): NodeId("n0"), WorkerId("w1"): NodeId("n1")})
    c0, c1, c2 = _cand(0, queued=96), _cand(1), _cand(2, active=4)
    # raw = (queued + 128) / 16; credit 0.75 x 8 host blocks, 0.25 x 8 disk; decode = active + 8
    assert p.logit(REQ, view, c0) == pytest.approx((96 + 128) / 16 - 6 + 8)
    assert p.logit(REQ, view, c1) == pytest.approx(8 - 2 + 8)
    assert p.logit(REQ, view, c2) == pytest.approx(8 + 4 + 8)
    assert p.choose(REQ, match, [c0, c1, c2]).worker == "w1"


def test_dynamo_temperature_samples_by_normalised_cost() -> None:
    rng = random.Random(1)
    assert sample_lowest([3.0, 1.0, 2.0], 0.0, rng) == 1
    picks = [sample_lowest([0.0, 10.0], 0.5, rng) for _ in range(2000)]
    # p(second) = e^-2 / (1 + e^-2) = 0.119
    assert 0.09 < picks.count(1) / 2000 < 0.15


def test_llmd_scores_the_longest_consecutive_prefix_min_max_normalised() -> None:
    p = make_policy("llmd_precise", _cost())
    # w0 holds 8 blocks in host (0.8 each), w1 holds 2; both hold block 0
    match = _held({node_location("n0"): (8, Tier.HOST), node_location("n1"): (2, Tier.HOST)})
    nodes = {WorkerId(f"w{i}"): NodeId(f"n{i}") for i in range(3)}
    view = SourceMap(match, nodes)
    assert p.prefix_score(view, _cand(0)) == pytest.approx(6.4)
    # equal queues: prefix decides (w0: 2*1 + 1 = 3 > w1: 2*0 + 1)
    assert p.choose(REQ, match, [_cand(0), _cand(1), _cand(2)]).worker == "w0"
    # w0 has the longest waiting queue: 2*1 + 0 = 2 still beats idle w2's 0 + 1 = 1
    busy = [_cand(0, running=6), _cand(1, running=1), _cand(2, running=1)]
    assert p.choose(REQ, match, busy).worker == "w0"


def test_ray_router_follows_its_own_tree_of_routed_prompts() -> None:
    p = make_policy("ray_prefix", _cost())
    cands = [_cand(0), _cand(1), _cand(2)]
    empty = build_match([{} for _ in range(8)])
    first = p.choose(REQ, empty, cands)  # empty tree: smallest tenants, shortest queue
    assert first.reason == "smallest_tenant"
    # the same prompt again: its tree says the first replica has it, whatever the index says
    again = p.choose(REQ, empty, cands)
    assert (again.worker, again.reason) == (first.worker, "prefix_match")
    # a prompt sharing < 10% with anything routed goes to a smallest tenant (not the first)
    other = RouteRequest(NS, [BlockHash(bytes([9]) * 32)] * 1, 16)
    assert p.choose(other, build_match([{}]), cands).worker != first.worker
    # matched replicas: the shortest queue among them wins
    cands2 = [_cand(0, running=3), _cand(1, running=0), _cand(2, running=0)]
    assert p.choose(REQ, empty, cands2).worker == first.worker  # only it holds the prefix


def test_ray_router_evicts_each_replicas_oldest_prompts_past_its_threshold() -> None:
    # 3-block prompts (48 tokens); a tenant above 100 tokens is cut back to 64 (4 blocks)
    p = make_policy("ray_prefix", _cost(), do_eviction=True, eviction_threshold_tokens=100,
                    eviction_target_tokens=64)
    one = [_cand(0)]
    prompts = [RouteRequest(NS, [BlockHash(bytes([k, j]) * 16) for j in range(3)], 48)
               for k in range(3)]
    for req in prompts[:2]:
        p.choose(req, build_match([{} for _ in range(3)]), one)
    assert p.tenant_tokens(WorkerId("w0")) == 96  # under the threshold: nothing evicted
    p.choose(prompts[2], build_match([{} for _ in range(3)]), one)
    # 144 > 100: the two oldest prompts go whole (all blocks of one insert together)
    assert p.tenant_tokens(WorkerId("w0")) == 48
    assert p.prefix_match(prompts[0], {WorkerId("w0")}) == (0, set())
    assert p.prefix_match(prompts[2], {WorkerId("w0")}) == (3, {WorkerId("w0")})
    keep = make_policy("ray_prefix", _cost(), eviction_threshold_tokens=100,
                       eviction_target_tokens=64)
    for req in prompts:
        keep.choose(req, build_match([{} for _ in range(3)]), one)
    assert keep.tenant_tokens(WorkerId("w0")) == 144  # Ray's default, no eviction: the tree only grows
    with pytest.raises(ValueError, match="eviction_target_tokens"):
        make_policy("ray_prefix", _cost(), eviction_threshold_tokens=10, eviction_target_tokens=20)


@pytest.mark.parametrize(("name", "bad"), [
    ("dynamo_kv", {"host_cache_hit_weight": -0.5}),
    ("llmd_precise", {"tier_weights": (1.0, float("nan"), 0.3)}),
    ("ray_prefix", {"match_rate_threshold": 1.5}),
])
def test_a_bad_peer_option_names_the_rule_and_makes_no_policy(name: str, bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=name):
        make_policy(name, _cost(), **bad)
    with pytest.raises(TypeError, match="typo_weight"):
        make_policy(name, _cost(), typo_weight=1.0)


def test_llmd_kv_utilization_lets_idle_pods_tie_a_lone_holder_whose_kv_is_full() -> None:
    """llm-d's guide also weighs the kv-cache-utilization scorer (1.0): a lone holder of the
    prefix whose KV is full and whose queue is deepest scores 2 + 0 + 0, the same as an idle
    pod's 0 + 1 + 1, so the max-score picker spreads them at random; with KV room left the
    holder still wins (2 + 0.5 + 0 > 2)."""
    p = make_policy("llmd_precise", _cost())
    match = _held({node_location("n0"): (8, Tier.HOST)})

    def hot(usage: float) -> list[Candidate]:
        c0 = _cand(0, running=6)
        return [Candidate(c0.info, WorkerLoad(c0.info.worker_id, 0, 6, kv_usage=usage)),
                _cand(1, running=1), _cand(2, running=1)]

    assert {p.choose(REQ, match, hot(0.5)).worker for _ in range(20)} == {"w0"}
    assert {p.choose(REQ, match, hot(1.0)).worker for _ in range(60)} == {"w0", "w1", "w2"}


def test_llmd_spreads_a_shared_prefix_burst_once_the_holders_kv_fills() -> None:
    """A burst of prompts sharing their first block on 4 modelled workers whose KV holds ~16
    prompts: llm-d's rule sends them to the holder until its KV is full, then spreads them
    (it used to send every one to the first worker, whatever the cluster size)."""
    from dataclasses import replace

    from kvshare.router.sim.cluster_model import ClusterConfig
    from kvshare.router.sim.replay import simulate
    from kvshare.router.sim.trace import TraceRequest

    base = ClusterConfig(workers=4)
    prompt = 8 * base.block_tokens
    cfg = replace(base, gpu_bytes=2 * base.params + 16 * prompt * base.layout.bytes_per_token)
    burst = [TraceRequest(i, 0.001 * i, prompt, 1, [0, *range(1 + 7 * i, 8 + 7 * i)])
             for i in range(60)]
    rows = simulate(burst, cfg, ["llmd_precise"], reference=False).rows["llmd_precise"]
    shares = sorted((list(rows["worker"]).count(f"w{i}") for i in range(4)), reverse=True)
    assert sum(shares) == 60
    assert shares[0] < 60 and shares[1] > 0
