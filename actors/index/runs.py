"""Match results as runs: the compact form the index computes and sends.

A prompt's blocks fall into a few *runs* of consecutive blocks with the same holders (the
shared system prompt on many nodes, then the tail on one or two). The index answers a match
with ``(num_blocks, runs)``, each run ``(((location, tier_code), ...), length)``, covering the
combined prefix; :func:`from_runs` expands that into a :class:`~kvshare.match.MatchResult`
(equal to :func:`kvshare.match.build_match` over the per-block holders). Runs are small to
pickle, so an actor call costs little more than the call itself. :class:`HolderRuns` is that
answer as one typed value (routers score it without expanding it).
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import itemgetter
from typing import NamedTuple

from kvshare.actors.index.holders import TIERS
from kvshare.match import LocationMatch, MatchResult
from kvshare.types import Location, Tier

NamedItems = tuple[tuple[str, int], ...]
Runs = list[tuple[NamedItems, int]]
Holders = Sequence[tuple[str, int]]
"""``((location, tier code), ...)``: who holds a block, in which tier (codes of
:data:`~kvshare.actors.index.holders.TIER_CODES`, equal to ``Tier.rank``)."""
_COUNT = itemgetter(1)  # a run's block count


class HolderRuns(NamedTuple):
    """A match in run form: ``runs[j] = (holders, count)`` for consecutive blocks from block 0
    with the same holders, up to the combined prefix (what
    :meth:`kvshare.actors.index.global_index.GlobalIndex.match_runs` computes). ``unavailable``: why
    the index could not answer (``""``: it answered), as in :class:`~kvshare.match.MatchResult`."""

    num_blocks: int
    runs: Sequence[tuple[Holders, int]]
    unavailable: str = ""

    @property
    def combined_prefix(self) -> int:
        return sum(map(_COUNT, self.runs))  # (C-level: read on every routing decision)

    @property
    def available(self) -> bool:
        return not self.unavailable


Row = tuple[Tier | None, ...]
Segs = tuple[tuple[int, int, int], ...]


def from_runs(num_blocks: int, runs: Sequence[tuple[Holders, int]],
              unavailable: str = "") -> MatchResult:
    """Expand runs into per-location prefixes, tier counts and per-block tiers (``from_runs(*r)``
    of a :class:`HolderRuns` ``r`` keeps its ``unavailable``)."""
    segs: dict[str, Segs] = {}  # location -> ((start, length, tier code), ...)
    pos = 0
    empty: Segs = ()
    for items, ln in runs:
        for loc, code in items:
            segs[loc] = segs.get(loc, empty) + ((pos, ln, code),)
        pos += ln
    built: dict[Segs, tuple[int, dict[Tier, int], Row]] = {}
    out: dict[Location, LocationMatch] = {}
    for loc, seg in segs.items():
        done = built.get(seg)  # locations with the same runs share one (immutable) row
        if done is None:
            done = built[seg] = _row(seg, pos)
        out[loc] = LocationMatch(loc, *done)  # type: ignore[index, arg-type]
    return MatchResult(num_blocks, pos, out, unavailable)


def _row(seg: Segs, total: int) -> tuple[int, dict[Tier, int], Row]:
    """Prefix held, tier counts of that prefix, and per-block tiers of one location."""
    row: Row = ()
    held = 0
    counts: dict[Tier, int] = {}
    at = 0
    for start, ln, code in seg:
        tier = TIERS[code]
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
