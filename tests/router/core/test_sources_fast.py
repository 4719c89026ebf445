"""SourceMap keeps each index segment's best holders per holders object (the index answers
with one cached tuple per holder set) and reads a worker's own ranks when it is scored; this
checks it against the version before that change (kept here as the reference: a rank row per
location built for every request) on random matches: every worker's runs, and the cost
policy's decision and estimates with either view."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvshare.router.core.policy as policy_module
from kvshare.actors.index.runs import HolderRuns, Holders
from kvshare.cost import Bandwidths, CostModel, PrefillModel
from kvshare.router.core.policy import Candidate, RouteRequest
from kvshare.router.core.registry import make_policy
from kvshare.router.core.sources import (
    _NONE,
    Match,
    Sharing,
    SourceMap,
    SourceRuns,
    _node_loc,
    _node_of,
    _per_segment,
    _worker_loc,
    holder_runs,
)
from kvshare.types import NodeId, WorkerId, worker_location
from kvshare.workers import META_GPU_PRIVATE, WorkerInfo, WorkerLoad

WORKERS = 6
NODES = 3
BT = 16


class Reference(SourceMap):
    """The SourceMap before per-holders memo: every location's rank row built up front."""

    def __init__(self, match: Match, worker_nodes: Mapping[WorkerId, NodeId],
                 pending: Match | None = None, private: frozenset[str] = frozenset()) -> None:
        self.num_blocks = match.num_blocks
        index = holder_runs(match)
        mine = holder_runs(pending) if pending is not None else ()
        bounds = {0}
        for runs in (index, mine):
            pos = 0
            for _, n in runs:
                pos += n
                bounds.add(pos)
        self.combined = combined = max(bounds)
        bounds.discard(combined)
        starts = sorted(bounds) if combined else []
        n_seg = len(starts)
        self._starts = starts
        self._lens = [e - s for s, e in zip(starts, starts[1:] + [combined], strict=False)]
        ranks: dict[str, list[int]] = {}
        best1 = [_NONE] * n_seg
        best1_node: list[str | None] = [None] * n_seg
        best2 = [_NONE] * n_seg
        nodes: dict[str, str] = {}
        prev: Holders | None = None
        for j, holders in enumerate(_per_segment(index, starts)):
            for loc, r in holders:
                row = ranks.get(loc)
                if row is None:
                    row = ranks[loc] = [_NONE] * n_seg
                row[j] = r
            if holders is prev:
                best1[j], best1_node[j], best2[j] = best1[j - 1], best1_node[j - 1], best2[j - 1]
                continue
            prev = holders
            for loc, r in holders:
                if r == _NONE or loc in private:
                    continue
                node = nodes.get(loc)
                if node is None:
                    node = nodes[loc] = _node_of(loc, worker_nodes)
                if best1_node[j] == node:
                    if r < best1[j]:
                        best1[j] = r
                elif r < best1[j]:
                    best2[j] = best1[j]
                    best1[j], best1_node[j] = r, node
                elif r < best2[j]:
                    best2[j] = r
        for j, holders in enumerate(_per_segment(mine, starts)):
            for loc, r in holders:
                row = ranks.get(loc)
                if row is None:
                    row = ranks[loc] = [_NONE] * n_seg
                if r < row[j]:
                    row[j] = r
        self._ranks = ranks
        self._best1, self._best1_node, self._best2 = best1, best1_node, best2
        self._holder_nodes = {nd for nd in best1_node if nd is not None}
        self._remote_only: SourceRuns | None = None

    def source_runs(self, worker: WorkerId, node: NodeId, sharing: Sharing,
                    fetch_s: Sequence[float] | None = None) -> SourceRuns:
        own_w = self._ranks.get(_worker_loc(worker)) if self._ranks else None
        own_n = self._ranks.get(_node_loc(node)) if self._ranks else None
        remote = sharing is Sharing.GLOBAL
        if own_w is None and own_n is None and (not remote or node not in self._holder_nodes):
            if not remote:
                return ()
            if self._remote_only is None:
                self._remote_only = self._runs(None, None, None, True, None)
            return self._remote_only
        return self._runs(own_w, own_n, node, remote, fetch_s)


LOCS = ([f"worker:w{i}" for i in range(WORKERS + 1)]  # w6: a worker nobody registered
        + [f"node:n{i}" for i in range(NODES)])
# a few holder tuples reused across requests, as the index's interned states are
HOLDER_POOL = [tuple((loc, r) for loc, r in zip(LOCS[i::3], (0, 1, 2, 1, 0, 2, 1), strict=False))
               for i in range(3)] + [(("worker:w0", 0), ("worker:w0", 2)), ()]

holders_st = st.one_of(
    st.sampled_from(HOLDER_POOL),
    st.lists(st.tuples(st.sampled_from(LOCS), st.integers(0, 2)), max_size=5).map(tuple),
    st.lists(st.tuples(st.sampled_from(LOCS), st.integers(0, 2)), max_size=5),  # a list
)
runs_st = st.lists(st.tuples(holders_st, st.integers(1, 4)), max_size=4)
pending_st = st.lists(st.tuples(st.lists(st.tuples(st.sampled_from(LOCS[:WORKERS]),
                                                   st.just(0)), max_size=2).map(tuple),
                                st.integers(1, 4)), max_size=3)


def cost() -> CostModel:
    return CostModel(PrefillModel(1e-4, 1e-9), Bandwidths(), BT, 2000)


def cands(private: frozenset[int], loads: Sequence[int]) -> list[Candidate]:
    out = []
    for i in range(WORKERS):
        meta = {META_GPU_PRIVATE: "1"} if i in private else {}
        info = WorkerInfo(WorkerId(f"w{i}"), NodeId(f"n{i % NODES}"), ("ns",), f"http://w{i}",
                          meta=meta)
        out.append(Candidate(info, WorkerLoad(info.worker_id, loads[i], 0, 4000.0, 0.0)))
    return out


@settings(max_examples=300, deadline=None)
@given(runs_st, pending_st, st.frozensets(st.integers(0, WORKERS - 1), max_size=2),
       st.frozensets(st.integers(0, WORKERS - 1), max_size=2))
def test_every_workers_runs_are_the_references(runs: Any, pending: Any, private_a: frozenset[int],
                                               private_b: frozenset[int]) -> None:
    nodes = {WorkerId(f"w{i}"): NodeId(f"n{i % NODES}") for i in range(WORKERS)}
    a, b = (frozenset(worker_location(WorkerId(f"w{i}")) for i in p) for p in (private_a, private_b))
    n = sum(k for _, k in runs) + 2
    match, mine = HolderRuns(n, runs), HolderRuns(n, pending)
    fetch = cost().block_fetch_s
    # again with the kept bests, with other private locations, with another mapping object
    for worker_nodes, private in ((nodes, a), (nodes, a), (nodes, b), (dict(nodes), a)):
        fast = SourceMap(match, worker_nodes, mine, private)
        ref = Reference(match, worker_nodes, mine, private)
        assert fast.combined == ref.combined
        for i in range(WORKERS + 1):
            w, nd = WorkerId(f"w{i}"), NodeId(f"n{i % NODES}")
            for sharing in Sharing:
                for f in (None, fetch):
                    assert fast.source_runs(w, nd, sharing, f) == ref.source_runs(w, nd, sharing, f)
            assert fast.local_prefix(w, nd) == ref.local_prefix(w, nd)


@settings(max_examples=200, deadline=None)
@given(runs_st, pending_st, st.frozensets(st.integers(0, WORKERS - 1), max_size=2),
       st.lists(st.integers(0, 9000), min_size=WORKERS, max_size=WORKERS))
def test_the_cost_policy_decides_and_estimates_as_with_the_reference(
        runs: Any, pending: Any, private_ids: frozenset[int], loads: list[int]) -> None:
    n_blocks = sum(k for _, k in runs) + 1
    request = RouteRequest("ns", [bytes([i]) * 32 for i in range(n_blocks)], n_blocks * BT)
    got = []
    for view in (SourceMap, Reference):
        policy = make_policy("cost", cost())
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(policy_module, "SourceMap", view)
            ranking = policy.rank(request, HolderRuns(n_blocks, runs), cands(private_ids, loads),
                                  HolderRuns(n_blocks, pending))
            got.append((ranking.decision, [(e.worker, e.est_ttft_s, e.plan, e.reason)
                                           for e in ranking.estimates()]))
    assert got[0] == got[1]
