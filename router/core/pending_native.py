"""The router's pending blocks in C (``kvshare._native._pending``): :class:`~kvshare.router.core.pending.PendingBlocks`
with the same holders, order, expiry, eviction and answers, at a few microseconds a prompt.

Importing this module raises ImportError where the extension was not built;
:func:`kvshare.router.core.pending.pending_blocks` then gives the Python book.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from kvshare._native._pending import Book
from kvshare.actors.index.runs import HolderRuns
from kvshare.match import MatchResult
from kvshare.router.core.pending import match_of_runs
from kvshare.types import TIERS, BlockHash


class NativePending(Book):
    """:class:`~kvshare.router.core.pending.PendingBlocks` over the C book (same constructor, same answers)."""

    def __init__(self, ttl_s: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 max_entries: int = 1_000_000) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        super().__init__(ttl_s, max_entries, clock, HolderRuns, TIERS)

    def match(self, namespace: str, hashes: Sequence[BlockHash]) -> MatchResult:
        """:meth:`PendingBlocks.match <kvshare.router.core.pending.PendingBlocks.match>` (only pending)."""
        runs: HolderRuns = self.match_runs(namespace, hashes)
        live, pos = [], 0
        for holders, n in runs.runs:
            live.append((pos, pos + n, tuple((loc, TIERS[code]) for loc, code in holders)))
            pos += n
        return match_of_runs(len(hashes), pos, live)
