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

from kvshare.match import EMPTY_MATCH, LocationMatch, MatchResult, location_match
from kvshare.types import BlockHash, Location, Tier


class PendingBlocks:
    """``(namespace, hash) -> {location: (tier, expiry)}`` with a TTL."""

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
        self._entries: OrderedDict[tuple[str, BlockHash], dict[Location, tuple[Tier, float]]] = (
            OrderedDict()
        )

    def __len__(self) -> int:
        return len(self._entries)

    def add(
        self, namespace: str, location: Location, hashes: Sequence[BlockHash], tier: Tier = Tier.GPU
    ) -> None:
        """Record that ``location`` will hold ``hashes`` (in ``tier``) within ``ttl_s``."""
        now = self._clock()
        self._expire(now)
        expiry = now + self.ttl_s
        for h in hashes:
            key = (namespace, h)
            holders = self._entries.get(key)
            if holders is None:
                holders = self._entries[key] = {}
            else:
                self._entries.move_to_end(key)
            holders[location] = (tier, expiry)
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)

    def match(self, namespace: str, hashes: Sequence[BlockHash]) -> MatchResult:
        """Pending holders of ``hashes`` as a match result (only pending, never the index's).

        Pending blocks do not exist yet: they help only the worker that will create them, so
        routers pass this to :class:`~router.sources.SourceMap` separately from the index's
        match, never as a remote source for other workers.
        """
        if not self._entries:
            return EMPTY_MATCH
        now = self._clock()
        self._expire(now)
        entries = self._entries
        rows: dict[Location, list[Tier | None]] = {}
        k = 0
        for i, h in enumerate(hashes):
            pending = entries.get((namespace, h))
            if not pending:
                break
            live = False
            for loc, (tier, expiry) in pending.items():
                if expiry <= now:
                    continue
                live = True
                row = rows.get(loc)
                if row is None:
                    row = rows[loc] = [None] * i
                elif len(row) < i:
                    row.extend([None] * (i - len(row)))
                row.append(tier)
            if not live:
                break
            k = i + 1
        if not k:
            return EMPTY_MATCH
        out: dict[Location, LocationMatch] = {}
        for loc, row in rows.items():
            row.extend([None] * (k - len(row)))
            out[loc] = location_match(loc, row)
        return MatchResult(len(hashes), k, out)

    def _expire(self, now: float) -> None:
        # Entries are refreshed by move_to_end, so the oldest expiry is first in order only
        # approximately; drop expired holders from the front until a live one is found.
        while self._entries:
            key, holders = next(iter(self._entries.items()))
            live = {loc: v for loc, v in holders.items() if v[1] > now}
            if live:
                if len(live) != len(holders):
                    self._entries[key] = live
                return
            del self._entries[key]
