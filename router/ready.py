"""When the blocks the router's own decisions create can be pulled by other workers.

A worker stores the blocks it computes in its node's pool when its prefill ends (kvshare
workers save what they compute; the index learns of them then). Until then
:class:`~router.pending.PendingBlocks` counts them only for the worker creating them. But a
worker whose queue outlasts that prefill starts after the blocks exist: it will pull them
from the creator's node (a remote host copy) instead of recomputing them. :class:`ReadyBlocks`
remembers, per block, the worker creating it and the estimated end of that job (the
decision's TTFT estimate), so the cost policy prices that worker's plan as it will run.
Only blocks a job computes are recorded (the ones it loads are already held elsewhere).
Not thread-safe: one instance per policy.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvshare.cost import Source
from kvshare.types import BlockHash, WorkerId
from router.sources import SourceRuns

_REMOTE_HOST = int(Source.REMOTE_HOST)


class ReadyBlocks:
    """``(namespace, hash) -> (creating worker, time it is stored)``; an entry goes once that
    time has passed (the index holds the block then) or past ``max_entries``.

    Stored per namespace (one ordered map keyed by the hash bytes: recording a decision
    allocates no key tuple per block, which would live until the block is stored and trigger
    the garbage collector every few decisions); the entries keep one order across namespaces
    (the order they were recorded in), by which they are dropped."""

    def __init__(self, max_entries: int = 1_000_000) -> None:
        self._max = max_entries
        # per namespace: hash -> (worker, ready_s, the number of the add call that recorded it)
        self._at: dict[str, OrderedDict[BlockHash, tuple[WorkerId, float, int]]] = {}
        self._size = 0
        self._calls = 0

    def __len__(self) -> int:
        return self._size

    def add(self, namespace: str, worker: WorkerId, hashes: Sequence[BlockHash],
            ready_s: float, now: float) -> None:
        """``worker`` stores ``hashes`` at ``ready_s`` (an earlier creator's time is kept)."""
        maps = self._at
        if len(maps) == 1:  # (one namespace: its map's order is the order)
            (only,) = maps.values()
            before = len(only)
            while only and next(iter(only.values()))[1] <= now:
                only.popitem(last=False)
            self._size -= before - len(only)
        while self._size:  # roughly in time order: drop the stored ones from the front
            first, (_, t, _) = self._oldest()
            if t > now:
                break
            first.popitem(last=False)
            self._size -= 1
        at = self._at.get(namespace)
        if at is None:
            at = self._at[namespace] = OrderedDict()
        before = len(at)
        self._calls += 1
        value = (worker, ready_s, self._calls)
        get, refresh = at.get, at.move_to_end
        for h in hashes:
            old = get(h)
            if old is None:
                at[h] = value
            elif old[1] > ready_s:
                at[h] = value
                refresh(h)
        self._size += len(at) - before
        while self._size > self._max:
            self._oldest()[0].popitem(last=False)
            self._size -= 1

    def _oldest(self) -> tuple[OrderedDict[BlockHash, tuple[WorkerId, float, int]],
                               tuple[WorkerId, float, int]]:
        """The namespace map whose first entry was recorded first (there is one), and that entry."""
        best: tuple[OrderedDict[BlockHash, tuple[WorkerId, float, int]],
                    tuple[WorkerId, float, int]] | None = None
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
               worker: WorkerId, now: float, start_s: float) -> SourceRuns:
        """``worker``'s runs (its view of the index and pending blocks) followed by the blocks
        other workers will store after ``now`` and by ``start_s``, when it starts: remote host
        copies (once their time has passed the index is the truth: a block it does not show
        was not stored)."""
        at = self._at.get(namespace) if self._size else None
        if not at:
            return runs
        covered = sum(n for _, n in runs)
        k = covered
        while k < len(hashes):
            entry = at.get(hashes[k])
            if entry is None or entry[0] == worker or not now < entry[1] <= start_s:
                break
            k += 1
        if k == covered:
            return runs
        if runs and runs[-1][0] == _REMOTE_HOST:
            return (*runs[:-1], (_REMOTE_HOST, runs[-1][1] + k - covered))
        return (*runs, (_REMOTE_HOST, k - covered))
