"""Per-worker view of a match: where each leading block would come from.

The index answers "who holds block i, in which tier" (:class:`kvshare.match.MatchResult`). A
worker on node N sees block i as local (its own gpu tier, or N's host/disk pool) or remote
(another node's pool or another worker's gpu). :class:`SourceMap` precomputes, once per
request, the best holder per block and the best holder on a *different* node, so each
worker's view costs O(blocks).

``Sharing.LOCAL`` (Mooncake's "local cache" case) hides remote holders: a worker reuses only
what its own node holds. ``Sharing.GLOBAL`` (kvshare) lets it pull from any node.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from enum import StrEnum

from kvshare.cost import Source
from kvshare.match import MatchResult
from kvshare.types import Location, NodeId, Tier, WorkerId, node_location, worker_location

_NONE = 9  # "nobody holds it" rank sentinel
_SRC = tuple(Source)
_RANK: dict[Tier | None, int] = {None: _NONE, **{t: t.rank for t in Tier}}


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
        self.combined = max(k, pending.combined_prefix if pending is not None else 0)
        self._ranks: dict[Location, list[int]] = {}
        best1 = [_NONE] * k
        best1_node: list[str | None] = [None] * k
        best2 = [_NONE] * k
        for loc, m in match.locations.items():
            ranks = list(map(_RANK.__getitem__, m.tiers[:k]))
            self._ranks[loc] = ranks
            node = _node_of(loc, worker_nodes)
            for i, r in enumerate(ranks):
                if r == _NONE:
                    continue
                if best1_node[i] == node:
                    if r < best1[i]:
                        best1[i] = r
                elif r < best1[i]:
                    best2[i] = best1[i]
                    best1[i], best1_node[i] = r, node
                elif r < best2[i]:
                    best2[i] = r
        pad = [_NONE] * (self.combined - k)
        self._best1, self._best1_node, self._best2 = best1 + pad, best1_node + [None] * len(pad), best2 + pad
        self._holder_nodes = {n for n in best1_node if n is not None}
        self._remote_only: list[Source] | None = None
        for ranks in self._ranks.values():
            ranks.extend(pad)
        if pending is not None:
            for loc, m in pending.locations.items():
                row = list(map(_RANK.__getitem__, m.tiers))
                row.extend([_NONE] * (self.combined - len(row)))
                cur = self._ranks.get(loc)
                self._ranks[loc] = row if cur is None else [min(a, b) for a, b in zip(cur, row, strict=True)]

    def sources_for(
        self,
        worker: WorkerId,
        node: NodeId,
        sharing: Sharing,
        fetch_s: Sequence[float] | None = None,
    ) -> list[Source]:
        """Cheapest source of each leading block for ``worker``; stops at the first gap.

        ``fetch_s[source]`` (seconds per block, :attr:`CostModel.block_fetch_s`) decides
        between a local and a remote copy; without it the faster tier wins, local first.
        """
        own_w = self._ranks.get(_worker_loc(worker)) if self._ranks else None
        own_n = self._ranks.get(_node_loc(node)) if self._ranks else None
        remote = sharing is Sharing.GLOBAL
        if own_w is None and own_n is None and (not remote or node not in self._holder_nodes):
            # the common case: this worker holds nothing; every such worker sees the same list
            if not remote:
                return []
            if self._remote_only is None:
                out_r: list[Source] = []
                for r in self._best1:
                    if r == _NONE:
                        break
                    out_r.append(_SRC[r + 3])
                self._remote_only = out_r
            return self._remote_only
        b1, b1n, b2 = self._best1, self._best1_node, self._best2
        out: list[Source] = []
        for i in range(self.combined):
            s = _NONE
            if own_w is not None:
                s = own_w[i]
            if own_n is not None and own_n[i] < s:
                s = own_n[i]
            if remote and s > 0:
                r = b1[i] if b1n[i] != node else b2[i]
                if r != _NONE:
                    if s == _NONE:
                        s = r + 3
                    elif fetch_s is not None and fetch_s[r + 3] < fetch_s[s]:
                        s = r + 3
            if s == _NONE:
                break
            out.append(_SRC[s])
        return out

    def local_prefix(self, worker: WorkerId, node: NodeId) -> int:
        """Leading blocks the worker holds itself or on its node."""
        return len(self.sources_for(worker, node, Sharing.LOCAL))
