"""Match results as runs: the compact form the index computes and sends.

A prompt's blocks fall into a few *runs* of consecutive blocks with the same holders (the
shared system prompt on many nodes, then the tail on one or two). The index answers a match
with ``(num_blocks, runs)``, each run ``(((location, tier_code), ...), length)``, covering the
combined prefix; :func:`from_runs` expands that into a :class:`~kvshare.match.MatchResult`
(equal to :func:`kvshare.match.build_match` over the per-block holders). Runs are small to
pickle, so an actor call costs little more than the call itself.
"""

from __future__ import annotations

from typing import cast

from actors.holders import TIERS
from kvshare.match import LocationMatch, MatchResult
from kvshare.types import Location, Tier

NamedItems = tuple[tuple[str, int], ...]
Runs = list[tuple[NamedItems, int]]
Row = tuple[Tier | None, ...]


def from_runs(num_blocks: int, runs: Runs) -> MatchResult:
    """Expand runs into per-location prefixes, tier counts and per-block tiers."""
    if len(runs) == 1:  # every holder holds the whole combined prefix
        items, k = runs[0]
        rows = {code: (TIERS[code],) * k for code in {c for _, c in items}}
        return MatchResult(num_blocks, k, {
            cast(Location, loc): LocationMatch(cast(Location, loc), k, {TIERS[code]: k}, rows[code])
            for loc, code in items
        })
    segs: dict[str, list[tuple[int, int, Tier]]] = {}  # location -> (start, length, tier)
    pos = 0
    for items, ln in runs:
        for loc, code in items:
            seg = segs.get(loc)
            if seg is None:
                segs[loc] = [(pos, ln, TIERS[code])]
            else:
                seg.append((pos, ln, TIERS[code]))
        pos += ln
    out: dict[Location, LocationMatch] = {}
    built: dict[tuple[tuple[int, int, Tier], ...], tuple[int, dict[Tier, int], Row]] = {}
    for loc, seg in segs.items():
        key = tuple(seg)
        done = built.get(key)  # locations with the same runs share one (immutable) row
        if done is None:
            done = built[key] = _row(seg, pos)
        name = cast(Location, loc)
        out[name] = LocationMatch(name, done[0], done[1], done[2])
    return MatchResult(num_blocks, pos, out)


def _row(seg: list[tuple[int, int, Tier]], total: int) -> tuple[int, dict[Tier, int], Row]:
    """Prefix held, tier counts of that prefix, and per-block tiers of one location."""
    row: Row = ()
    held = 0
    counts: dict[Tier, int] = {}
    at = 0
    for start, ln, tier in seg:
        if start > at:
            row += _NONE * (start - at)
        elif held == at:  # still unbroken from block 0
            held = start + ln
            counts[tier] = counts.get(tier, 0) + ln
        row += (tier,) * ln
        at = start + ln
    if at < total:
        row += _NONE * (total - at)
    return held, counts, row


_NONE: tuple[None] = (None,)
