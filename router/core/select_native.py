"""The cost policy's candidate loop in C (``kvshare._native._select``), where it was built.

:meth:`kvshare.router.core.policy.CostPolicy._select` walks the candidates by queue wait, reads each one's
view of the match (:class:`~kvshare.router.core.sources.SourceMap`) and the blocks earlier decisions are
creating (the ready book), bounds and plans them, and prunes. :class:`NativeSelect` makes the
same walk in one C call, on the same inputs, and returns the same estimates and the runs and
cut-point scan of every plan the Python loop would compute, in its order; the policy builds
the plans and picks as before (``tests/test_router_fastpaths.py`` routes both in lockstep).

It needs the C ready book (:class:`~kvshare.router.core.ready_native.NativeReady`) when the policy has
ready blocks; anything else (no extension, a Python book, inputs outside the plain case:
numbers that are not exact floats, a cost model with sliding-window terms) answers None and
the policy runs its Python loop.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvshare.actors.index.runs import HolderRuns
from kvshare.cost import CostModel
from kvshare.router.core.sources import Match, SourceRuns, holder_runs
from kvshare.types import BlockHash, NodeId, WorkerId, node_location, worker_location

Kernel = Callable[..., tuple[list[float], list[tuple[int, SourceRuns, int, float, float]]]]
kernel: Kernel | None
"""``kvshare._native._select.select`` (None: not built, or switched off to run the Python loop)."""
try:
    from kvshare._native._ready import Book as _ReadyBook
    from kvshare._native._select import select as kernel
except ImportError:  # no compiler at install: the Python loop
    kernel = None
    _ReadyBook = None  # type: ignore[assignment, misc]

Evaluated = list[tuple[int, SourceRuns, int, float, float]]
"""Per plan the loop computed, in its order: the candidate's index, its runs and their scan
(best cut in blocks, its total and fetch seconds: :meth:`CostModel.plan_of_scan`)."""


class NativeSelect:
    """One policy's C loop and what it keeps between calls: the candidates' locations (kept
    while the worker -> node map is the same object, as the policy's eligible list is) and
    every holder location's node (as :func:`kvshare.router.core.sources._node_of`, by node id)."""

    def __init__(self) -> None:
        self._nodes: Mapping[WorkerId, NodeId] | None = None
        self._roster: tuple[list[str], list[str], list[int], list[WorkerId]] = ([], [], [], [])
        self._loc_node: dict[str, int] = {}
        self._node_ids: dict[str, int] = {}
        self.ran = 0
        """Selections made in C."""
        self.declined = 0
        """Selections the C loop could not make (the policy ran its Python loop)."""

    def _node_id(self, node: str) -> int:
        nid = self._node_ids.get(node)
        if nid is None:  # (one per node or unknown worker ever seen holding blocks)
            nid = self._node_ids[node] = len(self._node_ids)
        return nid

    def _node_of(self, loc: str) -> int:
        """A holder location's node id (filled on a miss of the C loop)."""
        kind, _, ident = loc.partition(":")
        nodes = self._nodes
        assert nodes is not None
        node = ident if kind == "node" else nodes.get(WorkerId(ident), f"?{ident}")
        nid = self._loc_node[loc] = self._node_id(node)
        return nid

    def _roster_of(self, cands: Sequence[Any], nodes: Mapping[WorkerId, NodeId]
                   ) -> tuple[list[str], list[str], list[int], list[WorkerId]]:
        if nodes is not self._nodes or len(self._roster[0]) != len(cands):
            self._nodes = nodes
            self._loc_node = {}
            infos = [c.info for c in cands]
            self._roster = ([worker_location(i.worker_id) for i in infos],
                            [node_location(i.node) for i in infos],
                            [self._node_id(i.node) for i in infos],
                            [i.worker_id for i in infos])
        return self._roster

    def run(self, *, match: Match, pending: Match | None, cands: Sequence[Any],
            nodes: Mapping[WorkerId, NodeId], private: frozenset[str], queues: list[float],
            order: list[int], bound: list[float] | None, typical: list[float] | None,
            work: float, ready: object | None, namespace: str, hashes: Sequence[BlockHash],
            now: float, tokens: int, cost: CostModel, tie_s: float, remote: bool,
            ) -> tuple[list[float], Evaluated] | None:
        """Every candidate's estimate (inf where pruned) and the plans' runs and scans, as
        :meth:`CostPolicy._select <kvshare.router.core.policy.CostPolicy._select>` computes them; None where
        the C loop cannot run it (module docstring). Changes nothing the policy reads."""
        if kernel is None or cost.window_fetch_s or (
                ready is not None and not isinstance(ready, _ReadyBook)):
            self.declined += 1
            return None
        pending_runs = () if pending is None else (
            pending.runs if isinstance(pending, HolderRuns) else holder_runs(pending))
        index_runs = match.runs if isinstance(match, HolderRuns) else holder_runs(match)
        pm, bw = cost.prefill, cost.bandwidths
        try:
            got = kernel(index_runs, pending_runs, self._roster_of(cands, nodes),
                          self._loc_node, self._node_of, private, queues, order, bound, typical,
                          work, ready, namespace, hashes, now, tokens, cost.block_fetch_s,
                          pm.a, pm.b, cost.block_tokens, bw.remote_latency_s,
                          bw.local_latency_s, tie_s, remote)
        except (TypeError, ValueError, OverflowError):  # not the plain case: the Python loop
            self.declined += 1
            return None
        self.ran += 1
        return got
