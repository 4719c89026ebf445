"""Per-link bandwidths: a pull from holder X to reader Y is priced at the probed X->Y link, in
the worker's cut (CostCut) and in the router's cost policy (no Ray)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvshare.cost import Bandwidths, CostModel, PrefillModel, Source
from kvshare.cost_cut import CostCut
from kvshare.layout import KVLayout
from kvshare.links import Links
from kvshare.match import build_match
from kvshare.router.core.policy import Candidate, RouteRequest
from kvshare.router.core.registry import make_policy
from kvshare.router.core.sources import Sharing, SourceMap
from kvshare.types import BlockHash, NodeId, Tier, WorkerId, node_location
from kvshare.workers import WorkerInfo, WorkerLoad

BT = 16
NS = "m"
HASHES = [BlockHash(i.to_bytes(32, "big")) for i in range(1, 9)]  # 8 blocks, 128 tokens
FAST, SLOW = 16e9, 16e6 / 100  # 1 us vs 100 ms per 16 kB block (recompute: 16 ms a block)


def test_links_take_the_faster_remote_transport_and_skip_the_node_itself() -> None:
    links = Links.from_probes({
        "b": {"a": {"nixl": 1e8, "objstore": 3e8}, "b": {"shm": 2e10}, "c": {"nixl": 0.0}},
        "a": {"b": {"nixl": 5e9}},
    })
    assert links.get("a", "b") == 3e8 and links.get("b", "a") == 5e9
    assert links.get("b", "b") is None and links.get("c", "b") is None  # self; nothing measured
    assert links.slowest(["a", "c", "b"], "b") == 3e8  # unknown and own links do not count
    assert links.slowest(["c"], "b") is None
    assert links.as_dict() == {"a": {"b": 5e9}, "b": {"a": 3e8}}
    with pytest.raises(ValueError, match="a -> b: bytes/s must be positive"):
        Links((("a", "b", 0.0),))


def test_a_pull_is_priced_at_its_own_link_and_unprobed_links_keep_the_node_figure() -> None:
    bw = Bandwidths(remote=FAST, remote_latency_s=0.0,
                    links=Links((("slow", "r", SLOW), ("fast", "r", FAST))))
    m = CostModel(PrefillModel(1e-3), bw, BT, 1000)
    srcs = [Source.REMOTE_HOST] * 8
    assert m.for_pull({"slow"}, "r").plan(128, srcs).cut == 0  # recompute beats the slow link
    assert m.for_pull({"fast"}, "r").plan(128, srcs).cut == 8
    assert m.for_pull({"other"}, "r") is m  # nobody probed that link: the node's figure
    assert m.for_pull({"slow", "fast"}, "r").bandwidths.remote == SLOW  # the slowest link
    assert m.for_pull({"slow"}, "r") is m.for_pull({"slow"}, "r")  # kept per figure
    # links survive re-measuring the node's figures
    assert Bandwidths.from_measured({"nixl": 1e9}, bw).links == bw.links


def test_the_workers_cut_prices_each_holders_link() -> None:
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=125, dtype="fp32", block_tokens=BT)
    cut = CostCut(layout, [(1000, 0, 1.0), (2000, 0, 2.0)])  # 1 ms/token: 16 ms a block
    cut.set_bandwidths({"nixl": FAST})
    srcs = [Source.REMOTE_HOST] * 8
    assert cut(128, srcs, ["a"] * 8) == 8  # no links known: the node's (fast) figure
    cut.set_peer_bandwidths("me", {"a": SLOW, "b": FAST, "me": 1.0})
    assert cut(128, srcs, ["a"] * 8) == 0  # A's link is slow: recompute
    assert cut(128, srcs, ["b"] * 8) == 8  # B's is fast: load
    assert cut(128, [Source.LOCAL_HOST] * 4 + srcs[:4], ["me"] * 4 + ["a"] * 4) == 4
    assert cut(128, srcs) == 8  # a caller that names no holders gets the node figure
    cut.set_bandwidths({"nixl": FAST / 2})  # a new node figure keeps the links
    assert cut(128, srcs, ["a"] * 8) == 0


def _cand(worker: str, node: str, queued: int = 0) -> Candidate:
    info = WorkerInfo(WorkerId(worker), NodeId(node), (NS,), f"http://{worker}")
    return Candidate(info, WorkerLoad(info.worker_id, queued, 0))


def test_the_router_keeps_a_prompt_on_its_holders_node_when_the_link_is_slow() -> None:
    # the whole prompt in node A's host tier; A's worker has 60 ms queued, B's is idle
    match = build_match([{node_location("A"): Tier.HOST}] * 8)
    req = RouteRequest(NS, HASHES, 128)
    base = Bandwidths(remote=FAST, remote_latency_s=0.0)
    cands = [_cand("wa", "A", queued=60), _cand("wb", "B")]

    def choose(bw: Bandwidths) -> tuple[str, int]:
        d = make_policy("cost", CostModel(PrefillModel(1e-3), bw, BT, 1000),
                        Sharing.GLOBAL).choose(req, match, cands)
        return d.worker, d.remote_blocks

    assert choose(base) == ("wb", 8)  # a fast network: B pulls it rather than wait
    slow = replace(base, links=Links((("A", "B", SLOW),)))
    assert choose(slow) == ("wa", 0)  # A -> B is slow: A serves it
    # only the A -> B link is slow; C pulls from A over a fast one
    cands_c = [_cand("wa", "A", queued=60), _cand("wb", "B"), _cand("wc", "C", queued=1)]
    both = replace(base, links=Links((("A", "B", SLOW), ("A", "C", FAST))))
    d = make_policy("cost", CostModel(PrefillModel(1e-3), both, BT, 1000),
                    Sharing.GLOBAL).rank(req, match, cands_c)
    assert (d.decision.worker, d.decision.remote_blocks) == ("wc", 8)
    est = {e.worker: e for e in d.estimates()}
    assert est[WorkerId("wb")].plan.cut == 0  # B would recompute: its link is the slow one


def test_source_map_names_the_nodes_a_reader_pulls_from() -> None:
    match = build_match([{node_location("A"): Tier.HOST, node_location("B"): Tier.HOST}] * 4
                        + [{node_location("A"): Tier.HOST}] * 4)
    view = SourceMap(match, {})
    assert view.pull_nodes(NodeId("C")) == {"A"}  # the best holder of each segment
    assert view.pull_nodes(NodeId("A")) == {"B"}  # (it holds them itself: a superset)


def test_the_cut_never_plans_a_fetch_that_would_miss_the_load_deadline() -> None:
    """A load still running at its deadline is dropped whole (the prompt is recomputed after
    the wait): on a link where loading beats recompute only without a deadline, the cut loads
    the leading blocks that arrive in time, or none."""
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=125, dtype="fp32", block_tokens=BT)
    srcs = [Source.REMOTE_HOST] * 8

    def cut_at(deadline_s: float | None) -> tuple[int, float]:
        cut = CostCut(layout, [(1000, 0, 1.0), (2000, 0, 2.0)], deadline_s=deadline_s)
        cut.set_bandwidths({"nixl": 1.6e6})  # 10 ms a block, 1 ms latency: beats 16 ms
        k = cut(128, srcs)
        return k, cut.model.plan(128, srcs[:k]).fetch_s if k else 0.0

    assert cut_at(None) == (8, pytest.approx(0.081))  # no deadline: all 8 (81 ms)
    k, fetch = cut_at(0.05)  # 40 ms of it may be planned
    assert k == 3 and fetch <= 0.8 * 0.05 < cut_at(None)[1]
    assert cut_at(0.02)[0] == 1 and cut_at(0.005)[0] == 0  # nothing arrives in 4 ms: recompute
    with pytest.raises(ValueError, match="deadline_s must be positive"):
        CostCut(layout, deadline_s=0)

