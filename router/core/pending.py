"""Blocks the router's own recent decisions are about to create (DESIGN.md, request path 2).

The index learns about a prompt's blocks only after the worker has prefilled and stored them.
Until then, a burst of requests sharing a new prefix would look like misses everywhere and be
scattered. :class:`PendingBlocks` remembers, for ``ttl_s``, which location is about to hold
which hashes; :meth:`match` returns them as a match result for the policy.
Not thread-safe: one instance per router event loop.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from kvshare.actors.index.runs import HolderRuns
from kvshare.match import EMPTY_MATCH, LocationMatch, MatchResult
from kvshare.types import BlockHash, Location, Tier

_RANK = {t: t.rank for t in Tier}
_Holders = dict[Location, tuple[Tier, float]]
"""A block's pending holders and (tier, expiry); shared between blocks, never changed in place."""
_Entry = tuple[_Holders, int, float]
"""What a block's key maps to: its holders, the number of the ``add`` call that last
refreshed it (the order of entries across namespaces) and the earliest of the holders'
expiries (before it, none has expired); shared like the holder map."""


class PendingBlocks:
    """``(namespace, hash) -> {location: (tier, expiry)}`` with a TTL.

    Stored per namespace (one ordered map keyed by the hash bytes, so recording a prompt
    allocates no key tuple per block: such tuples live for the TTL and would trigger the
    garbage collector every few decisions); the entries keep one order across namespaces
    (oldest refreshed first), by which they expire and past ``max_entries`` are evicted.
    """

    def __init__(
        self,
        ttl_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        max_entries: int = 1_000_000,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.ttl_s = ttl_s
        self._clock = clock
        self._max = max_entries
        self._ns: dict[str, OrderedDict[BlockHash, _Entry]] = {}
        self._size = 0
        self._calls = 0

    def __len__(self) -> int:
        return self._size

    def add(
        self, namespace: str, location: Location, hashes: Sequence[BlockHash], tier: Tier = Tier.GPU
    ) -> None:
        """Record that ``location`` will hold ``hashes`` (in ``tier``) within ``ttl_s``."""
        now = self._clock()
        self._expire(now)
        value = (tier, now + self.ttl_s)  # one shared (immutable) value for the whole call
        entries = self._ns.get(namespace)
        if entries is None:
            entries = self._ns[namespace] = OrderedDict()
        before = len(entries)
        self._calls += 1
        call = self._calls
        get, refresh = entries.get, entries.move_to_end
        # Holder maps are shared between keys and never changed in place: the keys of one call
        # that had the same holders get one new map, so a prompt's blocks usually share one
        # object and _live_runs reads it once (compared by identity).
        fresh = ({location: value}, call, value[1])
        grown: dict[int, tuple[_Holders, _Entry]] = {}  # id(old map) -> (old map, new entry)
        for h in hashes:
            old = get(h)
            if old is None:
                entries[h] = fresh
                continue
            refresh(h)
            holders = old[0]
            done = grown.get(id(holders))
            if done is None or done[0] is not holders:  # (the old map is kept alive in grown)
                done = grown[id(holders)] = (
                    holders, ({**holders, location: value}, call, min(old[2], value[1])))
            entries[h] = done[1]
        self._size += len(entries) - before
        while self._size > self._max:
            self._oldest()[1].popitem(last=False)
            self._size -= 1

    def forget(self, location: Location) -> None:
        """``location`` will hold none of the blocks it was about to hold: its own cache was
        emptied (the engine restarted, its prefix cache was reset), so what it was sent before
        is gone. Each block's other holders, their expiries and the order stay; a block no
        other location is about to hold goes."""
        for entries in self._ns.values():
            done: dict[int, tuple[_Holders, _Holders, float]] = {}  # id(old) -> (old, new, first)
            changed: list[tuple[BlockHash, _Entry | None]] = []
            for h, (holders, call, _) in entries.items():
                if location not in holders:
                    continue
                got = done.get(id(holders))
                if got is None or got[0] is not holders:
                    rest = {loc: v for loc, v in holders.items() if loc != location}
                    first = min([v[1] for v in rest.values()]) if rest else 0.0
                    got = done[id(holders)] = (holders, rest, first)
                changed.append((h, (got[1], call, got[2]) if got[1] else None))
            for h, entry in changed:  # (after the walk: an OrderedDict must not change in it)
                if entry is None:
                    del entries[h]
                    self._size -= 1
                else:
                    entries[h] = entry  # an existing key keeps its place

    def match(self, namespace: str, hashes: Sequence[BlockHash]) -> MatchResult:
        """Pending holders of ``hashes`` as a match result (only pending, never the index's).

        Pending blocks do not exist yet: they help only the worker that will create them, so
        routers pass this to :class:`~kvshare.router.core.sources.SourceMap` separately from the index's
        match, never as a remote source for other workers.
        """
        k, runs = self._live_runs(namespace, hashes)
        return match_of_runs(len(hashes), k, runs)

    def match_runs(self, namespace: str, hashes: Sequence[BlockHash]) -> HolderRuns:
        """:meth:`match` in run form (cheaper; :class:`~kvshare.router.core.sources.SourceMap` takes both)."""
        _, runs = self._live_runs(namespace, hashes)
        rank = _RANK
        return HolderRuns(len(hashes), [
            (tuple([(loc, rank[t]) for loc, t in live]), end - start) for start, end, live in runs
        ])

    def _live_runs(self, namespace: str, hashes: Sequence[BlockHash]) -> tuple[int, list[list[Any]]]:
        """Runs ``[start, end, ((location, tier), ...)]`` of consecutive blocks with the same
        live holders, up to the first block nobody is about to hold; and that block's index."""
        if not self._size:
            return 0, []
        now = self._clock()
        self._expire(now)
        entries = self._ns.get(namespace)
        if not entries:
            return 0, []
        # A prompt's blocks were mostly added together, so their holder maps are equal and
        # are read once per run.
        runs: list[list[Any]] = []
        prev: _Holders | None = None
        k = 0
        for entry in map(entries.get, hashes):
            if entry is None:
                break
            pending = entry[0]
            if pending is not prev and pending != prev:
                live = tuple([(loc, t) for loc, (t, expiry) in pending.items() if expiry > now])
                if not live:
                    break
                prev = pending
                if runs and runs[-1][2] == live:
                    runs[-1][1] = k + 1
                else:
                    runs.append([k, k + 1, live])
            else:
                runs[-1][1] = k + 1
            k += 1
        return k, runs

    def _oldest(self) -> tuple[BlockHash, OrderedDict[BlockHash, _Entry], _Entry]:
        """The entry refreshed longest ago (over every namespace; there is one): its hash,
        its namespace's map and its value."""
        if len(self._ns) == 1:  # (one namespace: its map's order is the order)
            (only,) = self._ns.values()
            h, entry = next(iter(only.items()))
            return h, only, entry
        best: tuple[BlockHash, OrderedDict[BlockHash, _Entry], _Entry] | None = None
        for entries in self._ns.values():
            if entries:
                h, entry = next(iter(entries.items()))
                if best is None or entry[1] < best[2][1]:
                    best = (h, entries, entry)
        assert best is not None
        return best

    def _expire(self, now: float) -> None:
        # Entries are refreshed by move_to_end, so the oldest expiry is first in order only
        # approximately; drop expired holders from the front until a live one is found.
        if len(self._ns) == 1:  # (one namespace: walk its map once, then drop the dead ones)
            (only,) = self._ns.values()
            dead = 0
            keep: tuple[BlockHash, _Entry] | None = None
            for h, (holders, call, first) in only.items():
                if now < first:
                    break  # none of its holders has expired: it stays whole
                live = {loc: v for loc, v in holders.items() if v[1] > now}
                if live:
                    keep = (h, (live, call, min([v[1] for v in live.values()])))
                    break
                dead += 1
            pop = only.popitem
            for _ in range(dead):
                pop(last=False)
            self._size -= dead
            if keep is not None:
                only[keep[0]] = keep[1]
            return
        while self._size:
            h, entries, (holders, call, first) = self._oldest()
            if now < first:
                return  # none of its holders has expired: it stays whole
            live = {loc: v for loc, v in holders.items() if v[1] > now}
            if live:
                entries[h] = (live, call, min([v[1] for v in live.values()]))
                return
            del entries[h]
            self._size -= 1


Row = tuple[Tier | None, ...]


def _row(seg: Sequence[tuple[int, int, Tier]], total: int) -> tuple[int, dict[Tier, int], Row]:
    """Prefix held, tier counts of that prefix and per-block tiers of one location, from its
    runs ``(start, end, tier)`` in block order (what :func:`kvshare.match.location_match`
    computes from the per-block row)."""
    row: list[Tier | None] = []
    held = 0
    counts: dict[Tier, int] = {}
    for start, end, tier in seg:
        if start > len(row):
            row += [None] * (start - len(row))
        elif held == start:  # still unbroken from block 0
            held = end
            counts[tier] = counts.get(tier, 0) + end - start
        row += [tier] * (end - start)
    row += [None] * (total - len(row))
    return held, counts, tuple(row)


def match_of_runs(num_blocks: int, k: int, runs: Sequence[Sequence[Any]]) -> MatchResult:
    """:meth:`PendingBlocks.match` from its live runs ``[start, end, ((location, tier), ...)]``
    covering the first ``k`` blocks."""
    if not k:
        return EMPTY_MATCH
    segs: dict[Location, list[tuple[int, int, Tier]]] = {}
    for start, end, live in runs:
        for loc, tier in live:
            segs.setdefault(loc, []).append((start, end, tier))
    built: dict[tuple[tuple[int, int, Tier], ...], tuple[int, dict[Tier, int], Row]] = {}
    out: dict[Location, LocationMatch] = {}
    for loc, seg in segs.items():
        key = tuple(seg)
        done = built.get(key)  # locations with the same runs share one (immutable) row
        if done is None:
            done = built[key] = _row(seg, k)
        out[loc] = LocationMatch(loc, *done)
    return MatchResult(num_blocks, k, out)
