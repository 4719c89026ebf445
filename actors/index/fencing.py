"""Generations and sequence numbers: which of a publisher's events the index takes.

- **Generations** are issued here (:meth:`Fencing.new_generation`), increase per location (and
  across index restarts: they never go below the wall clock in ms). Events of a generation
  older than the location's current one, or of a generation that was dropped, are stale. A
  newer generation replaces the location's entries (its pool restarted and republishes).
- **Sequence numbers** are tracked per ``(namespace, location, generation)``; events at or
  below the last applied seq are duplicates; a gap marks ``(namespace, location)`` for resync
  (the publisher then sends its whole inventory).

Plain state of one :class:`~kvshare.actors.index.global_index.GlobalIndex` (not thread-safe); it counts
``stale`` and ``gaps`` in the index's counters.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

from kvshare.types import parse_location

Pair = tuple[str, str]  # (namespace, location)


@functools.lru_cache(maxsize=4096)
def check_location(location: str) -> None:
    """:func:`~kvshare.types.parse_location` (ValueError if malformed), remembered for the
    locations that passed."""
    parse_location(location)


class Fencing:
    """``drop_entries(location)``: forget a location's entries (its newer generation came)."""

    def __init__(self, counters: dict[str, int], drop_entries: Callable[[str], int]) -> None:
        self.gen: dict[str, int] = {}
        self.floor: dict[str, int] = {}  # events of generations <= floor are ignored
        self.seq: dict[tuple[str, str, int], int] = {}
        self.resync: set[Pair] = set()
        self._counters = counters
        self._drop_entries = drop_entries

    def new_generation(self, location: str) -> int:
        """A fresh generation for ``location``; its older entries are dropped now."""
        parse_location(location)
        gen = max(self.gen.get(location, 0), self.floor.get(location, 0)) + 1
        gen = max(gen, int(time.time() * 1000))
        self.fence(location, gen)
        return gen

    def fence(self, location: str, generation: int) -> bool:
        """Adopt ``generation`` for ``location`` if it is the newest; False if it is stale."""
        cur = self.gen.get(location)
        if generation <= self.floor.get(location, -1) or (cur is not None and generation < cur):
            return False
        if cur is None or generation > cur:
            if cur is not None:
                self._drop_entries(location)
            self.gen[location] = generation
        return True

    def gap(self, ns: str, loc: str) -> None:
        """Events of ``(ns, loc)`` went missing: it must resync."""
        self.resync.add((ns, loc))
        self._counters["gaps"] += 1

    def admit(self, ns: str, loc: str, gen: int, first: int, last: int, n: int,
              resync: set[Pair]) -> int:
        """Generation and sequence check of a run of ``n`` events with seqs first..last.

        Returns the seq floor (events at or below it are duplicates) or -1 if the run is
        stale. A run that does not start right after the last applied seq is a gap; a pair
        that must resync is added to ``resync`` (the publisher's answer).
        """
        if not self.fence(loc, gen):
            self._counters["stale"] += n
            return -1
        key = (ns, loc, gen)
        prev = self.seq.get(key)
        if first > (1 if prev is None else prev + 1):
            self.gap(ns, loc)
        if (ns, loc) in self.resync:
            resync.add((ns, loc))
        if prev is None or last > prev:
            self.seq[key] = last
        return 0 if prev is None else prev

    def restart(self, ns: str, location: str, generation: int, seq: int) -> None:
        """``(ns, location)`` sent its whole inventory as of ``seq``: later events go on from it."""
        for key in [k for k in self.seq if k[0] == ns and k[1] == location]:
            del self.seq[key]
        self.seq[(ns, location, generation)] = seq
        self.resync.discard((ns, location))

    def newer_than(self, location: str, generation: int | None) -> bool:
        """Whether ``location`` already has a generation above ``generation`` (None: no)."""
        cur = self.gen.get(location)
        return generation is not None and cur is not None and cur > generation

    def forget(self, location: str, up_to_generation: int | None) -> None:
        """``location`` is dropped: later events of its generations up to now are stale."""
        top = max(self.gen.get(location) or 0, up_to_generation or 0)
        self.floor[location] = max(self.floor.get(location, 0), top)
        self.gen.pop(location, None)
        for key in [k for k in self.seq if k[1] == location]:
            del self.seq[key]
        self.resync = {k for k in self.resync if k[1] != location}

    def last_seq(self, ns: str, location: str) -> tuple[int, int]:
        """``(generation, last applied seq)`` of ``(ns, location)`` (0 for unknown)."""
        gen = self.gen.get(location, 0)
        return gen, self.seq.get((ns, location, gen), 0)
