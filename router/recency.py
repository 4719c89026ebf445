"""Which of the index's holdings a job queued now will still find: each tier's LRU order.

A tier that evicts its least recently used block (an engine's prefix cache, a node's pool)
holding ``capacity`` blocks still holds a block once the jobs queued in front of a request have
run only if fewer than ``capacity`` other blocks were used there since the block's last use:
its LRU stack distance. :mod:`router.survival` bounds that from the capacity alone, for any
rank; this module keeps the rank. The router sees every job it sends, in each worker's queue
order, so it replays them into a shadow LRU per tier (a key per block, no bytes):

- the chosen worker's engine cache uses every block of the prompt (it keeps what it loads and
  what it computes);
- its node's pool stores the blocks the plan computes (past the cut);
- a block the plan loads from a pool is used there (the pool's LRU touch when it is pinned):
  its own node's pool, else the first other node the index names as holding it.

Blocks are used tail first, so a prefix outlives its tail, as the pools stamp them.

When a job is routed, each shadow already holds the state after every job queued before it,
so the leading blocks of a prompt still in the shadow of location ``L`` are what ``L`` will
hold when the job starts, and :meth:`RecencyBook.trim` cuts the index's (and the pending
blocks') holdings of ``L`` to that prefix before the candidates are priced. That is exact for
a worker's own engine cache (its jobs run in queue order); for a node's pool read by a worker
on another node it is the state when that node's queue has drained, not when the reader starts.
Nothing is tuned: the capacities are the ones the workers report
(:data:`~kvshare.workers.META_GPU_CACHE_BLOCKS`, :data:`~kvshare.workers.META_POOL_BLOCKS`).

A location whose capacity is not reported has no shadow and is never trimmed. A block the
router never saw used at a location with a shadow (stored by another router's jobs, or before
this one started) counts as gone there: one router's book sees only its own traffic.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from actors.index.runs import HolderRuns, Holders
from kvshare.types import BlockHash, node_location, worker_location
from kvshare.workers import META_GPU_CACHE_BLOCKS, META_POOL_BLOCKS, WorkerInfo
from router.sources import Match, holder_runs
from router.survival import capacity


class ShadowLru:
    """The keys of an LRU tier of ``capacity`` blocks, least recently used first."""

    def __init__(self, capacity: int) -> None:
        assert capacity > 0
        self.capacity = capacity
        self._keys: OrderedDict[BlockHash, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def use(self, hashes: Sequence[BlockHash]) -> None:
        """A job uses (stores or reads) these blocks of one prompt: tail first, so the prefix
        ends most recently used; the least recently used go past the capacity."""
        keys = self._keys
        for h in reversed(hashes):
            if h in keys:
                keys.move_to_end(h)
            else:
                keys[h] = None
        while len(keys) > self.capacity:
            keys.popitem(last=False)

    def leading(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of ``hashes`` the tier holds."""
        keys = self._keys
        for i, h in enumerate(hashes):
            if h not in keys:
                return i
        return len(hashes)


class RecencyBook:
    """A shadow LRU per engine cache (``worker:<id>``) and node pool (``node:<id>``) of the
    workers that report its capacity (module docstring)."""

    def __init__(self) -> None:
        self._tiers: dict[str, ShadowLru] = {}

    def add_workers(self, infos: Sequence[WorkerInfo]) -> None:
        """Start a shadow for each tier of these workers not yet kept (a worker reporting
        no capacity for a tier gets none there)."""
        for info in infos:
            for loc, key in ((worker_location(info.worker_id), META_GPU_CACHE_BLOCKS),
                             (node_location(info.node), META_POOL_BLOCKS)):
                cap = capacity(info, key)
                tier = self._tiers.get(loc)
                if cap and (tier is None or tier.capacity < cap):
                    new = self._tiers[loc] = ShadowLru(cap)
                    if tier is not None:  # (a node's workers may report different sizes)
                        new.use(list(tier._keys)[::-1])

    def tier(self, loc: str) -> ShadowLru | None:
        return self._tiers.get(loc)

    def use(self, loc: str, hashes: Sequence[BlockHash]) -> None:
        """A job uses these blocks at ``loc`` (nothing where it has no shadow)."""
        tier = self._tiers.get(loc)
        if tier is not None and hashes:
            tier.use(hashes)

    def trim(self, match: Match, hashes: Sequence[BlockHash]) -> HolderRuns:
        """``match`` in run form with each shadowed location's holding cut to the leading
        blocks its shadow still holds; unchanged where nothing is cut."""
        runs = holder_runs(match)
        limits: dict[str, int] = {}
        ends: dict[str, int] = {}  # where each location's holding ends
        pos = 0
        for holders, n in runs:
            pos += n
            for loc, _ in holders:
                ends[loc] = pos
                if loc not in limits:
                    tier = self._tiers.get(loc)
                    limits[loc] = tier.leading(hashes) if tier is not None else len(hashes)
        cut = any(limits[loc] < e for loc, e in ends.items())
        if not cut:
            return match if isinstance(match, HolderRuns) else HolderRuns(match.num_blocks, runs)
        out: list[tuple[Holders, int]] = []
        pos = 0
        for holders, n in runs:
            end = pos + n
            bounds = sorted({pos, *(k for loc, _ in holders if pos < (k := limits[loc]) < end)})
            for s, e in zip(bounds, [*bounds[1:], end], strict=True):
                kept = tuple((loc, r) for loc, r in holders if limits[loc] > s)
                if kept and out and out[-1][0] == kept:
                    out[-1] = (kept, out[-1][1] + e - s)
                else:
                    out.append((kept, e - s))
            pos = end
        gap = next((j for j, (h, _) in enumerate(out) if not h), len(out))
        del out[gap:]  # (nothing past a gap is reachable: a view stops at the first)
        return HolderRuns(match.num_blocks, tuple(out), getattr(match, "unavailable", ""))
