"""Per-worker view of a match: where each leading block would come from.

The index answers "who holds block i, in which tier" (:class:`kvshare.match.MatchResult`). A
worker on node N sees block i as local (its own gpu tier, or N's host/disk pool) or remote
(another node's pool or another worker's gpu). :class:`SourceMap` precomputes, once per
request, the best holder per block and the best holder on a *different* node, so each
worker's view is cheap.

It works on *segments*: runs of consecutive blocks over which no location's tier changes (a
prompt is a shared prefix held by many, then a tail held by few, so a 32-block match is
typically 2-4 segments). Everything is computed per segment, with exactly the per-block
result; :meth:`SourceMap.source_runs` returns a worker's view as runs ``(source, count)``
(hashable, cheap to compare; :meth:`~kvshare.cost.CostModel.plan_runs` takes them) and
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

from kvshare.cost import Source
from kvshare.match import MatchResult
from kvshare.types import Location, NodeId, Tier, WorkerId, node_location, worker_location

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


def _node_of(loc: Location, worker_nodes: Mapping[WorkerId, NodeId]) -> str:
    kind, _, ident = loc.partition(":")
    if kind == "node":
        return ident
    # a worker we do not know (other namespace, dead): its own pseudo-node, i.e. remote
    return worker_nodes.get(WorkerId(ident), f"?{ident}")


def _changes(row: list[int]) -> list[int]:
    """Positions ``i > 0`` where ``row[i] != row[i - 1]`` (C-level loops)."""
    return list(compress(range(1, len(row)), map(ne, row, islice(row, 1, None))))


def expand(runs: SourceRuns) -> list[Source]:
    """Runs back to one :class:`Source` per block."""
    out: list[Source] = []
    for src, n in runs:
        out += [_SRC[src]] * n
    return out


class SourceMap:
    """Block sources for every worker, from one :class:`MatchResult`."""

    def __init__(
        self,
        match: MatchResult,
        worker_nodes: Mapping[WorkerId, NodeId],
        pending: MatchResult | None = None,
    ) -> None:
        """``pending``: blocks the router's recent decisions are about to create; they count
        only for the workers at their locations (they cannot be pulled before they exist)."""
        k = match.combined_prefix
        self.num_blocks = match.num_blocks
        self.combined = combined = max(k, pending.combined_prefix if pending is not None else 0)
        pad = [_NONE] * (combined - k)
        self._ranks: dict[Location, list[int]] = {}
        rows: dict[int, list[int]] = {}  # id(tiers) -> ranks: locations often share one row
        index_rows: dict[tuple[int, str], list[int]] = {}  # (row, node): each pair counts once
        cuts: set[int] = set()
        for loc, m in match.locations.items():
            tiers = m.tiers
            ranks = rows.get(id(tiers))
            if ranks is None:
                ranks = rows[id(tiers)] = list(map(_RANK.__getitem__, tiers[:k]))
                ranks += pad
                cuts.update(_changes(ranks))
            self._ranks[loc] = ranks
            index_rows[(id(tiers), _node_of(loc, worker_nodes))] = ranks
        if pending is not None:
            for loc, m in pending.locations.items():
                row = list(map(_RANK.__getitem__, m.tiers))
                row.extend([_NONE] * (combined - len(row)))
                cuts.update(_changes(row))
                cur = self._ranks.get(loc)
                self._ranks[loc] = row if cur is None else list(map(min, cur, row))
        # segments [starts[j], starts[j + 1]): no row changes inside one
        starts = [0, *sorted(c for c in cuts if c < combined)] if combined else []
        self._starts = starts
        self._lens = [e - s for s, e in zip(starts, [*starts[1:], combined][: len(starts)], strict=True)]
        # per segment: best rank, its node, best rank on any other node (index holders only)
        n = len(starts)
        best1 = [_NONE] * n
        best1_node: list[str | None] = [None] * n
        best2 = [_NONE] * n
        for (_, node), ranks in index_rows.items():
            for j, s0 in enumerate(starts):
                r = ranks[s0]
                if r == _NONE:
                    continue
                if best1_node[j] == node:
                    if r < best1[j]:
                        best1[j] = r
                elif r < best1[j]:
                    best2[j] = best1[j]
                    best1[j], best1_node[j] = r, node
                elif r < best2[j]:
                    best2[j] = r
        self._best1, self._best1_node, self._best2 = best1, best1_node, best2
        self._holder_nodes = {nd for nd in best1_node if nd is not None}
        self._remote_only: SourceRuns | None = None

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
        own_w = self._ranks.get(_worker_loc(worker)) if self._ranks else None
        own_n = self._ranks.get(_node_loc(node)) if self._ranks else None
        remote = sharing is Sharing.GLOBAL
        if own_w is None and own_n is None and (not remote or node not in self._holder_nodes):
            # the common case: this worker holds nothing; every such worker sees the same runs
            if not remote:
                return ()
            if self._remote_only is None:
                self._remote_only = self._runs(None, None, None, True, None)
            return self._remote_only
        return self._runs(own_w, own_n, node, remote, fetch_s)

    def _runs(self, own_w: list[int] | None, own_n: list[int] | None, node: str | None, remote: bool,
              fetch_s: Sequence[float] | None) -> SourceRuns:
        b1, b1n, b2, lens = self._best1, self._best1_node, self._best2, self._lens
        out: list[tuple[int, int]] = []
        for j, s0 in enumerate(self._starts):
            s = _NONE
            if own_w is not None:
                s = own_w[s0]
            if own_n is not None and own_n[s0] < s:
                s = own_n[s0]
            if remote and s > 0:
                r = b1[j] if b1n[j] != node else b2[j]
                if r != _NONE:
                    if s == _NONE:
                        s = r + 3
                    elif fetch_s is not None and fetch_s[r + 3] < fetch_s[s]:
                        s = r + 3
            if s == _NONE:
                break
            if out and out[-1][0] == s:
                out[-1] = (s, out[-1][1] + lens[j])
            else:
                out.append((s, lens[j]))
        return tuple(out)

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
