"""Which of the index's holdings a job queued now will still find: each tier's LRU order.

A tier that evicts its least recently used block (an engine's prefix cache, a node's pool)
holding ``capacity`` blocks still holds a block once the jobs queued in front of a request have
run only if fewer than ``capacity`` other blocks were used there since the block's last use:
its LRU stack distance; this module keeps the rank. The router sees every job it sends, in each worker's queue
order, so it replays them into a shadow LRU per tier (a key per block, no bytes):

- the chosen worker's engine cache uses every block of the prompt at the job's estimated end
  (it keeps what it loads and what it computes);
- its node's pool stores the blocks the plan computes (past the cut), at the job's end;
- a block the plan loads from a pool is used there at the job's estimated start (the pool's
  LRU touch when it is pinned): its own node's pool, else the first other node the index
  names as holding it.

Blocks are used tail first, so a prefix outlives its tail, as the pools stamp them. A job's
start is the later of the router's estimate of its queue wait and its worker's previous
job's replayed end, so a worker's own uses stay in queue order.

Each use keeps its time, so a shadow answers for any moment (:class:`ShadowLru`): a block
used at ``tau`` is held at ``t`` while fewer than ``capacity`` blocks were used there in
``(tau, t]``. A candidate is priced on each tier as it will be at the candidate's own start
(:class:`TimedHoldings` cuts the index's and the pending holdings of each location to the
leading blocks its shadow holds then): for the candidate's own engine cache that is the state
once its queue has run (exact: only its jobs use it); for a node's pool read from another node
it is the pool at the moment the reader starts, with the uses of the pool's own queue that
come later left out (reading it once that queue had drained dropped blocks a reader starting
sooner still finds). A location's later uses are the router's estimates, as its queue waits
are.
Nothing is tuned: the capacities are the ones the workers report
(:data:`~kvshare.workers.META_GPU_CACHE_BLOCKS`, :data:`~kvshare.workers.META_POOL_BLOCKS`).

A location whose capacity is not reported has no shadow and is never trimmed. A block the
router never saw used at a location with a shadow (stored by another router's jobs, or before
this one started) counts as gone there: one router's book sees only its own traffic.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections.abc import Sequence

from kvshare.actors.index.runs import HolderRuns, Holders
from kvshare.router.core.sources import Match, SourceMap, holder_runs
from kvshare.types import BlockHash, node_location, worker_location
from kvshare.workers import META_GPU_CACHE_BLOCKS, META_POOL_BLOCKS, WorkerInfo


def capacity(info: WorkerInfo, key: str) -> int:
    """A capacity the worker reports in its meta (blocks); 0 when it reports none (no limit
    assumed: nothing is ever lost there). ValueError naming the key for a malformed one."""
    raw = info.meta.get(key)
    if not raw:
        return 0
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"worker {info.worker_id}: meta[{key!r}] must be a whole number of "
                         f"blocks, got {raw!r}") from None
    return max(0, value)


class ShadowLru:
    """The keys of an LRU tier of ``capacity`` blocks, each stamped with the (estimated) time
    of its last use, so the tier's content can be read at any time, not only once every use
    replayed so far has happened.

    A block used at ``tau`` is still held at ``t`` while fewer than ``capacity`` other blocks
    were used there in ``(tau, t]``: it leaves at the time of the ``capacity``-th use after its
    own (:meth:`evicted_at`). Uses are ordered by time, then by the order they were replayed
    in (so one job's blocks, used tail first, leave its prefix the most recent). A block whose
    last replayed use is after ``t`` counts as held at ``t`` (its use before that is not
    kept; it was recent enough to be used again). A key leaves the shadow once it is gone at
    every time from ``now`` on.
    """

    def __init__(self, capacity: int) -> None:
        assert capacity > 0
        self.capacity = capacity
        self._at: dict[BlockHash, _Use] = {}  # key -> its last use
        self._order: list[_Use] = []  # every kept key's last use, oldest first
        self._seq = 0

    def __len__(self) -> int:
        return len(self._at)

    def take(self, other: ShadowLru) -> None:
        """Start from ``other``'s uses (same times and order), cut to this capacity."""
        self._at.update(other._at)
        self._order = sorted(self._at.values())
        self._seq = max(self._seq, other._seq)
        self.use((), now=-math.inf)

    def keys(self) -> list[BlockHash]:
        """The kept keys, least recently used first."""
        return [u[2] for u in self._order]

    def use(self, hashes: Sequence[BlockHash], at: float = 0.0, now: float = math.inf) -> None:
        """A job uses (stores or reads) these blocks of one prompt at time ``at``: tail first,
        so the prefix ends most recently used. Keys gone at every time from ``now`` on are
        dropped (the default, ``inf``: the state once every use so far has happened, a plain
        LRU of ``capacity``)."""
        at_, order = self._at, self._order
        for h in reversed(hashes):
            self._seq += 1
            u = (at, self._seq, h)
            old = at_.get(h)
            if old is not None:
                if old > u:
                    continue  # (its later use stands)
                del order[bisect_left(order, old)]
            at_[h] = u
            if not order or order[-1] < u:
                order.append(u)
            else:
                insort(order, u)
        cap = self.capacity
        drop = 0
        while len(order) - drop > cap and order[drop + cap][0] <= now:
            drop += 1
        if drop:
            for u in order[:drop]:
                del at_[u[2]]
            del order[:drop]

    def evicted_at(self, h: BlockHash) -> float:
        """When ``h`` leaves the tier (``inf``: not within the uses replayed; ``-inf``: not
        held)."""
        u = self._at.get(h)
        if u is None:
            return -math.inf
        j = bisect_left(self._order, u) + self.capacity
        return self._order[j][0] if j < len(self._order) else math.inf

    def held_until(self, hashes: Sequence[BlockHash]) -> list[float]:
        """:meth:`evicted_at` of each block of ``hashes``."""
        return [self.evicted_at(h) for h in hashes]

    def leading(self, hashes: Sequence[BlockHash], at: float = math.inf) -> int:
        """How many leading blocks of ``hashes`` the tier holds at time ``at`` (default: once
        every use replayed so far has happened)."""
        return next((i for i, u in enumerate(self.held_until(hashes)) if not _held(u, at)),
                    len(hashes))


_Use = tuple[float, int, BlockHash]  # (time, replay order, key)


def _held(until: float, at: float) -> bool:
    """Whether a block held until ``until`` is held at ``at`` (``inf``: never evicted, held
    even once every use has happened)."""
    return until > at or until == math.inf


def dropped_at(until: dict[int, float], at: float) -> tuple[int, ...]:
    """The positions of a :meth:`RecencyBook.schedule` entry not held at time ``at``."""
    return tuple(i for i, u in until.items() if not _held(u, at))


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
                        new.take(tier)

    def __bool__(self) -> bool:
        """Whether any tier is shadowed (some worker reported a capacity)."""
        return bool(self._tiers)

    def tier(self, loc: str) -> ShadowLru | None:
        return self._tiers.get(loc)

    def use(self, loc: str, hashes: Sequence[BlockHash], at: float = 0.0,
            now: float = math.inf) -> None:
        """A job uses these blocks at ``loc`` at time ``at`` (nothing where it has no
        shadow); :meth:`ShadowLru.use`."""
        tier = self._tiers.get(loc)
        if tier is not None and hashes:
            tier.use(hashes, at, now)

    def schedule(self, match: Match, hashes: Sequence[BlockHash]
                 ) -> dict[str, dict[int, float]]:
        """Per shadowed location ``match`` names, each position it holds there (a location's
        holding need not be one run from the first block) and until when
        (:meth:`ShadowLru.evicted_at`)."""
        out: dict[str, dict[int, float]] = {}
        pos = 0
        for holders, n in holder_runs(match):
            for loc, _ in holders:
                tier = self._tiers.get(loc)
                if tier is not None:
                    got = out.setdefault(loc, {})
                    for i in range(pos, pos + n):
                        got[i] = tier.evicted_at(hashes[i])
            pos += n
        return out

    def trim(self, match: Match, hashes: Sequence[BlockHash], at: float = math.inf
             ) -> HolderRuns:
        """``match`` in run form without the blocks each shadowed location no longer holds
        at time ``at`` (default: once every use replayed so far has happened); unchanged where
        nothing is cut."""
        drops = {loc: d for loc, until in self.schedule(match, hashes).items()
                 if (d := dropped_at(until, at))}
        return cut(match, drops)


def cut(match: Match, drops: dict[str, tuple[int, ...]]) -> HolderRuns:
    """``match`` in run form without each location's holding of the positions ``drops``
    names for it; unchanged where nothing is cut."""
    runs = holder_runs(match)
    if not drops:
        return match if isinstance(match, HolderRuns) else HolderRuns(match.num_blocks, runs)
    gone = {(loc, i) for loc, ps in drops.items() for i in ps}
    out: list[tuple[Holders, int]] = []
    pos = 0
    for holders, n in runs:
        if not any(loc in drops for loc, _ in holders):
            kept_runs: list[tuple[Holders, int]] = [(holders, n)]
        else:
            kept_runs = [(tuple((loc, r) for loc, r in holders if (loc, i) not in gone), 1)
                         for i in range(pos, pos + n)]
        for kept, k in kept_runs:
            if out and out[-1][0] == kept:
                out[-1] = (kept, out[-1][1] + k)
            else:
                out.append((kept, k))
        pos += n
    gap = next((j for j, (h, _) in enumerate(out) if not h), len(out))
    del out[gap:]  # (nothing past a gap is reachable: a view stops at the first)
    return HolderRuns(match.num_blocks, tuple(out), match.unavailable)


class TimedHoldings:
    """One request's index match and pending blocks as the shadowed locations will hold them
    at a given time: each candidate is priced on the holdings at its own start (a node's pool
    read from another node as it will be when the reader starts, not once that node's queue
    has drained). Views are built once per distinct cut."""

    def __init__(self, book: RecencyBook, hashes: Sequence[BlockHash], match: Match,
                 pending: Match | None) -> None:
        self.match, self.pending = match, pending
        until = book.schedule(match, hashes)
        if pending is not None:
            for loc, got in book.schedule(pending, hashes).items():
                until.setdefault(loc, {}).update(got)
        self._until = until
        self._cuts: dict[float, tuple[tuple[str, tuple[int, ...]], ...]] = {}
        self._views: dict[tuple[tuple[str, tuple[int, ...]], ...], SourceMap] = {}

    def limits(self, at: float) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """The locations whose holding is cut at time ``at``, each with the positions it no
        longer holds."""
        got = self._cuts.get(at)
        if got is None:
            got = self._cuts[at] = tuple(
                (loc, d) for loc, until in self._until.items() if (d := dropped_at(until, at)))
        return got

    def match_at(self, at: float) -> Match:
        """The index match as held at time ``at``."""
        lim = self.limits(at)
        return cut(self.match, dict(lim)) if lim else self.match

    def view(self, base: SourceMap, at: float) -> SourceMap:
        """``base`` (the view of the whole match) as held at time ``at``."""
        lim = self.limits(at)
        if not lim:
            return base
        got = self._views.get(lim)
        if got is None:
            cuts = dict(lim)
            pending = cut(self.pending, cuts) if self.pending is not None else None
            got = self._views[lim] = base.with_match(cut(self.match, cuts), pending)
        return got
