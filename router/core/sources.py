"""Per-worker view of a match: where each leading block would come from.

The index answers "who holds block i, in which tier" (:class:`kvshare.match.MatchResult`). A
worker on node N sees block i as local (its own gpu tier, or N's host/disk pool) or remote
(another node's pool or another worker's gpu). :class:`SourceMap` precomputes, once per
request, the best holder and the best holder on a *different* node, so each worker's view is
cheap.

It works on *segments*: runs of consecutive blocks over which no holder changes (a prompt is a
shared prefix held by many, then a tail held by few, so a 32-block match is typically 2-4
segments), with exactly the per-block result. Its input is a :class:`MatchResult` or, cheaper,
the same match in run form (:class:`~kvshare.actors.index.runs.HolderRuns`, what the index computes anyway);
:meth:`SourceMap.source_runs` returns a worker's view as runs ``(source, count)`` (hashable,
cheap to compare; :meth:`~kvshare.cost.CostModel.plan_runs` takes them) and
:meth:`SourceMap.sources_for` the same expanded per block.

``Sharing.LOCAL`` (Mooncake's "local cache" case) hides remote holders: a worker reuses only
what its own node holds. ``Sharing.GLOBAL`` (kvshare) lets it pull from any node.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from enum import StrEnum
from itertools import compress, islice
from operator import ne

from kvshare.actors.index.runs import HolderRuns, Holders
from kvshare.cost import REMOTE_OFFSET, Source
from kvshare.match import MatchResult
from kvshare.types import NodeId, Tier, WorkerId, node_location, worker_location

_NONE = 9  # "nobody holds it" rank sentinel
_SRC = tuple(Source)
_RANK: dict[Tier | None, int] = {None: _NONE, **{t: t.rank for t in Tier}}

SourceRuns = tuple[tuple[int, int], ...]
"""A worker's view as runs ``(source, count)`` of equal consecutive :class:`Source` values."""

_worker_loc = functools.lru_cache(maxsize=4096)(worker_location)
_node_loc = functools.lru_cache(maxsize=4096)(node_location)


class Sharing(StrEnum):
    LOCAL = "local"
    GLOBAL = "global"


Match = MatchResult | HolderRuns


def _node_of(loc: str, worker_nodes: Mapping[WorkerId, NodeId]) -> str:
    kind, _, ident = loc.partition(":")
    if kind == "node":
        return ident
    # a worker we do not know (other namespace, dead): its own pseudo-node, i.e. remote
    return worker_nodes.get(WorkerId(ident), f"?{ident}")


def _changes(row: list[int]) -> list[int]:
    """Positions ``i > 0`` where ``row[i] != row[i - 1]`` (C-level loops)."""
    return list(compress(range(1, len(row)), map(ne, row, islice(row, 1, None))))


def holder_runs(match: Match) -> Sequence[tuple[Holders, int]]:
    """The runs of a match (a :class:`MatchResult` is cut where any location's tier changes)."""
    if isinstance(match, HolderRuns):
        return match.runs
    k = match.combined_prefix
    if not k:
        return ()
    rows: dict[int, list[int]] = {}  # id(tiers) -> ranks: locations often share one row
    locs = []
    cuts: set[int] = set()
    for loc, m in match.locations.items():
        ranks = rows.get(id(m.tiers))
        if ranks is None:
            ranks = rows[id(m.tiers)] = list(map(_RANK.__getitem__, m.tiers[:k]))
            ranks += [_NONE] * (k - len(ranks))
            cuts.update(_changes(ranks))
        locs.append((loc, ranks))
    starts = [0, *sorted(cuts)]
    return [
        ([(loc, r[s]) for loc, r in locs if r[s] != _NONE], e - s)
        for s, e in zip(starts, [*starts[1:], k], strict=True)
    ]


def _per_segment(runs: Sequence[tuple[Holders, int]], starts: list[int]) -> list[Holders]:
    """The holders of the run covering each segment start (none past the runs)."""
    out: list[Holders] = []
    it = iter(runs)
    cur: Holders = ()
    end = 0
    for s in starts:
        while s >= end:
            nxt = next(it, None)
            if nxt is None:
                cur, end = (), 1 << 62
                break
            cur, n = nxt
            end += n
        out.append(cur)
    return out


_Bests = tuple[dict[str, int], int, "str | None", int, "str | None"]
_BESTS: dict[int, tuple[Holders, Mapping[WorkerId, NodeId], frozenset[str], _Bests]] = {}
_BESTS_MAX = 4096


def _bests(holders: Holders, worker_nodes: Mapping[WorkerId, NodeId],
           private: frozenset[str]) -> _Bests:
    """One segment's index holders as ``{location: rank}`` (the last one named wins) and the
    best holder's rank, its node and the best rank on any other node (private locations are
    nobody's source). Kept per holders object while ``worker_nodes`` and ``private`` are the
    same objects: the index answers with one cached tuple per holder set (its interned
    states), so a prompt sharing a system prompt with earlier ones reuses their work."""
    hit = _BESTS.get(id(holders))
    if (hit is not None and hit[0] is holders and hit[1] is worker_nodes
            and hit[2] is private):
        return hit[3]
    ranks: dict[str, int] = {}
    best1, best1_node, best2, best2_node = _NONE, None, _NONE, None
    nodes: dict[str, str] = {}
    for loc, r in holders:
        ranks[loc] = r
        if r == _NONE or loc in private:
            continue
        node = nodes.get(loc)
        if node is None:
            node = nodes[loc] = _node_of(loc, worker_nodes)
        if best1_node == node:
            if r < best1:
                best1 = r
        elif r < best1:
            best2, best2_node = best1, best1_node
            best1, best1_node = r, node
        elif r < best2:
            best2, best2_node = r, node
    got = (ranks, best1, best1_node, best2, best2_node)
    if isinstance(holders, tuple):  # (a list is built per answer: never seen again)
        if len(_BESTS) >= _BESTS_MAX:
            _BESTS.clear()
        _BESTS[id(holders)] = (holders, worker_nodes, private, got)
    return got


def expand(runs: SourceRuns) -> list[Source]:
    """Runs back to one :class:`Source` per block."""
    out: list[Source] = []
    for src, n in runs:
        out += [_SRC[src]] * n
    return out


class SourceMap:
    """Block sources for every worker, from one match (and the router's pending blocks)."""

    def __init__(
        self,
        match: Match,
        worker_nodes: Mapping[WorkerId, NodeId],
        pending: Match | None = None,
        private: frozenset[str] = frozenset(),
    ) -> None:
        """``pending``: blocks the router's recent decisions are about to create; they count
        only for the workers at their locations (they cannot be pulled before they exist).
        ``private``: locations (``worker:<id>``) whose blocks only their own worker can use
        (:data:`~kvshare.workers.META_GPU_PRIVATE`); never a remote source for another.
        ``worker_nodes`` and ``private`` must not change in place once passed (per index
        holders object the bests are kept while they are the same objects: pass a new
        mapping when workers change, as the policies do)."""
        self.num_blocks = match.num_blocks
        self._worker_nodes, self._private = worker_nodes, private
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
        # per segment: the index's holders as {location: rank} and the best index holder's
        # rank, its node, and the best rank on any other node (kept per holders object:
        # _bests); the pending blocks' own ranks per location and segment
        index_ranks: list[dict[str, int]] = []
        best1 = [_NONE] * n_seg
        best1_node: list[str | None] = [None] * n_seg
        best2 = [_NONE] * n_seg
        best2_node: list[str | None] = [None] * n_seg
        for j, holders in enumerate(_per_segment(index, starts)):
            got = _bests(holders, worker_nodes, private)
            index_ranks.append(got[0])
            best1[j], best1_node[j], best2[j], best2_node[j] = got[1], got[2], got[3], got[4]
        ranks: dict[str, list[int]] = {}
        for j, holders in enumerate(_per_segment(mine, starts)):
            for loc, r in holders:
                row = ranks.get(loc)
                if row is None:
                    row = ranks[loc] = [_NONE] * n_seg
                if r < row[j]:
                    row[j] = r
        self._index_ranks = index_ranks
        self._index_locs: set[str] = set().union(*index_ranks)  # every location holding any
        self._pending_ranks = ranks
        self._best1, self._best1_node, self._best2 = best1, best1_node, best2
        self._best2_node = best2_node
        self._holder_nodes = {nd for nd in best1_node if nd is not None}
        self._remote_only: SourceRuns | None = None

    def with_match(self, match: Match, pending: Match | None = None) -> SourceMap:
        """A view of another match (and pending blocks) for the same workers."""
        return SourceMap(match, self._worker_nodes, pending, self._private)

    def _own(self, loc: str) -> list[int] | None:
        """``loc``'s own rank per segment (its index holding, else _NONE, lowered by its
        pending blocks); None if it holds nothing in either."""
        mine = self._pending_ranks.get(loc) if self._pending_ranks else None
        if loc not in self._index_locs:
            return mine
        row = [d.get(loc, _NONE) for d in self._index_ranks]
        if mine is not None:
            row = [min(a, b) for a, b in zip(row, mine, strict=True)]
        return row

    def source_runs(
        self,
        worker: WorkerId,
        node: NodeId,
        sharing: Sharing,
        fetch_s: Sequence[float] | None = None,
    ) -> SourceRuns:
        """Cheapest source of each leading block for ``worker``, as runs; stops at the first gap.

        ``fetch_s[source]`` (seconds per block, :attr:`CostModel.block_fetch_s`) decides
        between a local and a remote copy; without it the faster tier wins, local first.
        Equal views give equal (canonical) runs.
        """
        w_loc, n_loc = _worker_loc(worker), _node_loc(node)
        held, mine = self._index_locs, self._pending_ranks
        remote = sharing is Sharing.GLOBAL
        if (w_loc not in held and w_loc not in mine and n_loc not in held and n_loc not in mine
                and (not remote or node not in self._holder_nodes)):
            # the common case: this worker holds nothing (_own: None for both locations);
            # every such worker sees the same runs
            if not remote:
                return ()
            if self._remote_only is None:
                self._remote_only = self._runs(None, None, None, True, None)
            return self._remote_only
        return self._runs(self._own(w_loc), self._own(n_loc), node, remote, fetch_s)

    def _runs(self, own_w: list[int] | None, own_n: list[int] | None, node: str | None,
              remote: bool, fetch_s: Sequence[float] | None) -> SourceRuns:
        b1, b1n, b2 = self._best1, self._best1_node, self._best2
        lens = self._lens
        far = REMOTE_OFFSET  # tier code -> its remote Source
        out: list[tuple[int, int]] = []
        for j in range(len(lens)):
            s = _NONE
            if own_w is not None:
                s = own_w[j]
            if own_n is not None and own_n[j] < s:
                s = own_n[j]
            if remote and s > 0:
                r = b1[j] if b1n[j] != node else b2[j]
                if r != _NONE:
                    if s == _NONE:
                        s = r + far
                    elif fetch_s is not None and fetch_s[r + far] < fetch_s[s]:
                        s = r + far
            if s == _NONE:
                break
            if out and out[-1][0] == s:
                out[-1] = (s, out[-1][1] + lens[j])
            else:
                out.append((s, lens[j]))
        return tuple(out)

    def pull_nodes(self, node: NodeId) -> frozenset[str]:
        """The nodes a reader on ``node`` would pull the match's blocks from: per segment the
        best holder on another node (a superset where the reader holds a segment itself;
        :meth:`kvshare.cost.CostModel.for_pull` prices its remote blocks at their slowest
        link)."""
        b1n, b2n = self._best1_node, self._best2_node
        return frozenset(x for j in range(len(b1n))
                         if (x := b1n[j] if b1n[j] != node else b2n[j]) is not None)

    def sources_for(
        self,
        worker: WorkerId,
        node: NodeId,
        sharing: Sharing,
        fetch_s: Sequence[float] | None = None,
    ) -> list[Source]:
        """:meth:`source_runs` expanded: the cheapest :class:`Source` of each leading block."""
        return expand(self.source_runs(worker, node, sharing, fetch_s))

    def local_prefix(self, worker: WorkerId, node: NodeId) -> int:
        """Leading blocks the worker holds itself or on its node."""
        return sum(n for _, n in self.source_runs(worker, node, Sharing.LOCAL))
