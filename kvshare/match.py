"""Match results: which locations hold which blocks of a request's prefix.

The index answers per block "who holds it, in which tier"; :func:`build_match` turns that into
what routers and workers need. Engines load a contiguous prefix, so everything is cut at the
first block that nobody holds (``combined_prefix``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvshare.types import Location, Tier


@dataclass(frozen=True)
class LocationMatch:
    """What one location holds of a request's combined prefix.

    ``prefix_blocks``: the longest run from block 0 held here. ``tier_counts``: how many of
    those prefix blocks sit in each tier. ``tiers[i]``: this location's tier for block ``i``
    (None if it does not hold it), for ``i < combined_prefix``.
    """

    location: Location
    prefix_blocks: int
    tier_counts: Mapping[Tier, int]
    tiers: tuple[Tier | None, ...]


@dataclass(frozen=True)
class MatchResult:
    """The index's answer for one request's block hashes.

    ``unavailable``: why the index could not answer (``""``: it answered). An unavailable
    answer is empty: a miss for a worker, load-only routing for a router.
    """

    num_blocks: int
    combined_prefix: int
    locations: Mapping[Location, LocationMatch] = field(default_factory=dict)
    unavailable: str = ""

    @property
    def available(self) -> bool:
        """Whether the index answered (an empty answer is then a real miss)."""
        return not self.unavailable

    def prefix_for(self, location: Location) -> int:
        """Longest prefix held by ``location`` alone."""
        m = self.locations.get(location)
        return m.prefix_blocks if m is not None else 0

    def usable_prefix(self, locations: Iterable[Location]) -> int:
        """Longest prefix covered by the union of ``locations``."""
        held = [m for loc in locations if (m := self.locations.get(loc)) is not None]
        n = 0
        while n < self.combined_prefix and any(m.tiers[n] is not None for m in held):
            n += 1
        return n

    def holders(self, i: int) -> dict[Location, Tier]:
        """Who holds block ``i`` (``i < combined_prefix``) and in which tier."""
        return {
            loc: t for loc, m in self.locations.items() if i < len(m.tiers) and (t := m.tiers[i])
        }


EMPTY_MATCH = MatchResult(0, 0, {})


def build_match(per_block: Sequence[Mapping[Location, Tier]]) -> MatchResult:
    """Assemble a :class:`MatchResult` from per-block holder maps (index order)."""
    combined = 0
    for holders in per_block:
        if not holders:
            break
        combined += 1
    tiers: dict[Location, list[Tier | None]] = {}
    for i in range(combined):
        for loc, tier in per_block[i].items():
            row = tiers.get(loc)
            if row is None:
                row = tiers[loc] = [None] * combined
            row[i] = tier
    out = {loc: location_match(loc, row) for loc, row in tiers.items()}
    return MatchResult(len(per_block), combined, out)


def location_match(location: Location, row: Sequence[Tier | None]) -> LocationMatch:
    """One location's :class:`LocationMatch` from its per-block tiers (None = not held)."""
    prefix = 0
    counts: dict[Tier, int] = {}
    for t in row:
        if t is None:
            break
        prefix += 1
        counts[t] = counts.get(t, 0) + 1
    return LocationMatch(location, prefix, counts, tuple(row))
