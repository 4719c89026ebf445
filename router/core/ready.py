"""When the blocks the router's own decisions create can be pulled by other workers.

A worker stores the blocks it computes in its node's pool when its prefill ends (kvshare
workers save what they compute; the index learns of them then). Until then
:class:`~kvshare.router.core.pending.PendingBlocks` counts them only for the worker creating them. But a
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
from kvshare.router.core.sources import SourceRuns
from kvshare.types import BlockHash, WorkerId

_REMOTE_HOST = int(Source.REMOTE_HOST)
_LOCAL_GPU = int(Source.LOCAL_GPU)
_Entry = tuple[WorkerId, float, int, bool]


class ReadyBlocks:
    """``(namespace, hash) -> (creating worker, time it is stored, whether others can pull
    it)``; an entry goes once that time has passed (the index holds the block then) or past
    ``max_entries``.

    Stored per namespace (one ordered map keyed by the hash bytes: recording a decision
    allocates no key tuple per block, which would live until the block is stored and trigger
    the garbage collector every few decisions); the entries keep one order across namespaces
    (the order they were recorded in), by which they are dropped."""

    def __init__(self, max_entries: int = 1_000_000) -> None:
        self._max = max_entries
        # per namespace: hash -> (worker, ready_s, the number of the add call that recorded it,
        # whether it goes to the worker's node pool)
        self._at: dict[str, OrderedDict[BlockHash, _Entry]] = {}
        self._size = 0
        self._calls = 0

    def __len__(self) -> int:
        return self._size

    def add(self, namespace: str, worker: WorkerId, hashes: Sequence[BlockHash],
            ready_s: float, now: float, stored_from: int = 0) -> None:
        """``worker`` holds ``hashes`` at ``ready_s`` (an earlier creator's time is kept):
        ``hashes[stored_from:]`` (the ones it computes) in its node's pool, the rest (the ones
        it loads) in its engine's own cache only."""
        if self._size:
            self._drop_stored(now)
        at = self._at.get(namespace)
        if at is None:
            at = self._at[namespace] = OrderedDict()
        before = len(at)
        self._calls += 1
        value = (worker, ready_s, self._calls, True)
        own = (worker, ready_s, self._calls, False)
        get, refresh = at.get, at.move_to_end
        cut = stored_from if stored_from >= 0 else len(hashes)  # (negative: none stored)
        for v, part in ((own, hashes[:cut]), (value, hashes[cut:])):
            for h in part:
                old = get(h)
                if old is None:
                    at[h] = v
                elif old[1] > ready_s:
                    at[h] = v
                    refresh(h)
        self._size += len(at) - before
        while self._size > self._max:
            self._oldest()[0].popitem(last=False)
            self._size -= 1

    def forget(self, worker: WorkerId) -> None:
        """Drop every block ``worker`` was creating: its engine restarted or its cache was
        emptied, so its queued jobs' blocks will not be there (the others' stay, in order)."""
        for at in self._at.values():
            gone = [h for h, entry in at.items() if entry[0] == worker]
            for h in gone:
                del at[h]
            self._size -= len(gone)

    def _drop_stored(self, now: float) -> None:
        """Drop the entries stored by ``now`` from the front (roughly in time order)."""
        if len(self._at) == 1:  # (one namespace: count them in order, then pop them)
            (only,) = self._at.values()
            n = 0
            for entry in only.values():
                if entry[1] > now:
                    break
                n += 1
            pop = only.popitem
            for _ in range(n):
                pop(last=False)
            self._size -= n
            return
        while self._size:
            first, (_, t, _, _) = self._oldest()
            if t > now:
                break
            first.popitem(last=False)
            self._size -= 1

    def _oldest(self) -> tuple[OrderedDict[BlockHash, _Entry],
                               _Entry]:
        """The namespace map whose first entry was recorded first (there is one), and that entry."""
        if len(self._at) == 1:  # (one namespace: its map's order is the order)
            (only,) = self._at.values()
            return only, next(iter(only.values()))
        best: tuple[OrderedDict[BlockHash, _Entry],
                    _Entry] | None = None
        for at in self._at.values():
            if at:
                entry = next(iter(at.values()))
                if best is None or entry[2] < best[1][2]:
                    best = (at, entry)
        assert best is not None
        return best

    def run_from(self, namespace: str, hashes: Sequence[BlockHash], start: int) -> int:
        """Blocks from ``start`` on that some decision is creating (an upper bound of any
        :meth:`extend`'s reach past ``start``)."""
        at, k = self._at.get(namespace), start
        if at is None:
            return 0
        while k < len(hashes) and hashes[k] in at:
            k += 1
        return k - start

    def extend(self, runs: SourceRuns, namespace: str, hashes: Sequence[BlockHash],
               worker: WorkerId, now: float, start_s: float) -> tuple[SourceRuns, float]:
        """``worker``'s runs (its view of the index and pending blocks) followed by the blocks
        decisions are creating that it will hold or reach when it starts, at ``start_s``, and
        the time it can start at the earliest for that view (``start_s`` or later):

        - its own (an earlier job of its queue computes or loads them; its engine keeps them), as
          local gpu blocks, starting no earlier than the latest of those jobs' ends (a FIFO
          worker starts after its earlier jobs, however long its queue; pending blocks say
          so only for their TTL, which an overloaded queue outlasts, and a load report that
          does not count the job yet must not make them look free now);
        - other workers' stored after ``now`` and by ``start_s``, as remote host copies.

        An entry whose time has passed is the index's word (a block it does not show was not
        stored)."""
        at = self._at.get(namespace) if self._size else None
        if not at:
            return runs, start_s
        covered = 0
        for _, n in runs:
            covered += n
        k = covered
        out = list(runs)
        begin = start_s
        while k < len(hashes):
            entry = at.get(hashes[k])
            if entry is None or not now < entry[1]:
                break
            if entry[0] == worker:
                src = _LOCAL_GPU
                if entry[1] > begin:
                    begin = entry[1]
            elif entry[3] and entry[1] <= start_s:
                src = _REMOTE_HOST
            else:
                break
            if out and out[-1][0] == src:
                out[-1] = (src, out[-1][1] + 1)
            else:
                out.append((src, 1))
            k += 1
        return (runs, start_s) if k == covered else (tuple(out), begin)
