"""Interned holder sets: who holds a block, in which tier, as one small int.

The index maps each block hash to a *state*: an int naming a sorted tuple of
``(location_id, tier_code)`` pairs. Most blocks share a handful of holder sets (a prompt's
blocks sit on the same nodes), so states are few, a hash costs one dict slot, and updates are
cached transitions ``(state, location, tier) -> state``. State 0 is the empty set and is never
stored in a table (a hash whose last holder goes is deleted).
"""

from __future__ import annotations

from kvshare.types import Location, Tier

TIER_CODES: dict[Tier, int] = {Tier.GPU: 0, Tier.HOST: 1, Tier.DISK: 2}
TIERS: tuple[Tier, ...] = (Tier.GPU, Tier.HOST, Tier.DISK)
TIER_BY_NAME: dict[str, int] = {t.value: c for t, c in TIER_CODES.items()}

Items = tuple[tuple[int, int], ...]
EMPTY = 0


class HolderStates:
    """Interning of locations and holder sets, with cached transitions."""

    def __init__(self) -> None:
        self.loc_ids: dict[str, int] = {}
        self.loc_names: list[Location] = []
        self.items: list[Items] = [()]
        self._ids: dict[Items, int] = {(): EMPTY}
        self._add: dict[tuple[int, int, int], int] = {}
        self._rm: dict[tuple[int, int, int], int] = {}
        self._drop: dict[tuple[int, int], int] = {}
        self._maps: list[dict[Location, Tier] | None] = [{}]
        self._named: list[tuple[tuple[str, int], ...] | None] = [()]

    def loc_id(self, location: str) -> int:
        lid = self.loc_ids.get(location)
        if lid is None:
            lid = self.loc_ids[location] = len(self.loc_names)
            self.loc_names.append(Location(location))
        return lid

    def _intern(self, items: Items) -> int:
        sid = self._ids.get(items)
        if sid is None:
            sid = self._ids[items] = len(self.items)
            self.items.append(items)
            self._maps.append(None)
            self._named.append(None)
        return sid

    def add(self, state: int, loc: int, tier: int) -> int:
        """The state after ``loc`` stores the block in ``tier`` (replacing its old tier)."""
        key = (state, loc, tier)
        out = self._add.get(key)
        if out is None:
            kept = tuple(p for p in self.items[state] if p[0] != loc)
            out = self._add[key] = self._intern(tuple(sorted((*kept, (loc, tier)))))
        return out

    def remove(self, state: int, loc: int, tier: int) -> int:
        """The state after ``loc`` removes the block from ``tier`` (no-op if another tier)."""
        key = (state, loc, tier)
        out = self._rm.get(key)
        if out is None:
            items = self.items[state]
            if (loc, tier) in items:
                out = self._intern(tuple(p for p in items if p[0] != loc))
            else:
                out = state
            self._rm[key] = out
        return out

    def drop(self, state: int, loc: int) -> int:
        """The state without ``loc`` in any tier."""
        key = (state, loc)
        out = self._drop.get(key)
        if out is None:
            out = self._drop[key] = self._intern(
                tuple(p for p in self.items[state] if p[0] != loc)
            )
        return out

    def tier_of(self, state: int, loc: int) -> int | None:
        for lid, tier in self.items[state]:
            if lid == loc:
                return tier
        return None

    def as_map(self, state: int) -> dict[Location, Tier]:
        """``{location: tier}`` of a state (cached; do not mutate)."""
        m = self._maps[state]
        if m is None:
            m = self._maps[state] = {
                self.loc_names[lid]: TIERS[tier] for lid, tier in self.items[state]
            }
        return m

    def named(self, state: int) -> tuple[tuple[str, int], ...]:
        """``((location, tier_code), ...)`` of a state (cached)."""
        m = self._named[state]
        if m is None:
            m = self._named[state] = tuple((self.loc_names[lid], t) for lid, t in self.items[state])
        return m

    def __len__(self) -> int:
        return len(self.items)
