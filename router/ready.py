"""When the blocks the router's own decisions create can be pulled by other workers.

A worker stores the blocks it computes in its node's pool when its prefill ends (kvshare
workers save what they compute; the index learns of them then). Until then
:class:`~router.pending.PendingBlocks` counts them only for the worker creating them. But a
worker whose queue outlasts that prefill starts after the blocks exist: it will pull them
from the creator's node (a remote host copy) instead of recomputing them. :class:`ReadyBlocks`
remembers, per block, the worker creating it and the estimated end of that job (the
decision's TTFT estimate), so the cost policy prices that worker's plan as it will run.
A job's loaded blocks are recorded for its own worker only (its engine keeps every block it
computes or loads, but only computed ones go to its node's pool for others to pull).
Not thread-safe: one instance per policy.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvshare.cost import Source
from kvshare.types import BlockHash, WorkerId
from router.sources import SourceRuns

_REMOTE_HOST = int(Source.REMOTE_HOST)
_LOCAL_GPU = int(Source.LOCAL_GPU)


class ReadyBlocks:
    """``(namespace, hash) -> (creating worker, time it is stored, whether others can pull
    it)``; an entry goes once that time has passed (the index holds the block then) or past
    ``max_entries``."""

    def __init__(self, max_entries: int = 1_000_000) -> None:
        self._max = max_entries
        self._at: OrderedDict[tuple[str, BlockHash], tuple[WorkerId, float, bool]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._at)

    def add(self, namespace: str, worker: WorkerId, hashes: Sequence[BlockHash],
            ready_s: float, now: float, stored_from: int = 0) -> None:
        """``worker`` holds ``hashes`` at ``ready_s`` (an earlier creator's time is kept):
        ``hashes[stored_from:]`` (the ones it computes) in its node's pool, the rest (the ones
        it loads) in its engine's own cache only."""
        at = self._at
        while at:  # roughly in time order: drop the stored ones from the front
            _, (_, t, _) = next(iter(at.items()))
            if t > now:
                break
            at.popitem(last=False)
        own, value = (worker, ready_s, False), (worker, ready_s, True)
        for i, h in enumerate(hashes):
            key = (namespace, h)
            old = at.get(key)
            if old is None or old[1] > ready_s:
                at[key] = value if i >= stored_from else own
                at.move_to_end(key)
        while len(at) > self._max:
            at.popitem(last=False)

    def run_from(self, namespace: str, hashes: Sequence[BlockHash], start: int) -> int:
        """Blocks from ``start`` on that some decision is creating (an upper bound of any
        :meth:`extend`'s reach past ``start``)."""
        at, k = self._at, start
        while k < len(hashes) and (namespace, hashes[k]) in at:
            k += 1
        return k - start

    def extend(self, runs: SourceRuns, namespace: str, hashes: Sequence[BlockHash],
               worker: WorkerId, now: float, start_s: float) -> tuple[SourceRuns, float]:
        """``worker``'s runs (its view of the index and pending blocks) followed by the blocks
        decisions are creating that it will hold or reach when it starts, at ``start_s``, and
        the time it can start at the earliest for that view (``start_s`` or later):

        - its own (an earlier job of its queue computes them; its engine keeps them), as
          local gpu blocks, starting no earlier than the latest of those jobs' ends (a FIFO
          worker starts after its earlier jobs, however long its queue; pending blocks say
          so only for their TTL, which an overloaded queue outlasts, and a load report that
          does not count the job yet must not make them look free now);
        - other workers' stored after ``now`` and by ``start_s``, as remote host copies.

        An entry whose time has passed is the index's word (a block it does not show was not
        stored)."""
        if not self._at:
            return runs, start_s
        covered = sum(n for _, n in runs)
        at, k = self._at, covered
        out = list(runs)
        begin = start_s
        while k < len(hashes):
            entry = at.get((namespace, hashes[k]))
            if entry is None or not now < entry[1]:
                break
            if entry[0] == worker:
                src = _LOCAL_GPU
                if entry[1] > begin:
                    begin = entry[1]
            elif entry[2] and entry[1] <= start_s:
                src = _REMOTE_HOST
            else:
                break
            if out and out[-1][0] == src:
                out[-1] = (src, out[-1][1] + 1)
            else:
                out.append((src, 1))
            k += 1
        return (runs, start_s) if k == covered else (tuple(out), begin)
