"""IndexFeed: the change stream a router-side replica of the index follows.

Once a replica asks (:meth:`GlobalIndex.feed_since`), every change a shard's tables make is
recorded as a *delta* (:data:`~kvshare.actors.index.table.Delta`: store / remove / drop, locations by
name, hashes packed in one bytes): the effect after generations, sequence numbers and
duplicates were judged, so a replica applies deltas without any of those rules and ends up
with the same ``hash -> holders`` map. Deltas are numbered; the feed keeps the last
``max_deltas`` of them. A reader whose cursor is older than that (or than the feed itself: the
shard restarted, its ``epoch`` changed) gets ``None`` and starts again from
:meth:`GlobalIndex.feed_snapshot`, which returns the whole map as deltas with the cursor they
are current at.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from kvshare.actors.index.table import Delta

MAX_DELTAS = 100_000
"""Deltas a shard keeps for replicas that fall behind (one per applied batch or removal)."""


class FeedReply(NamedTuple):
    """``deltas`` after the reader's cursor (None: too old, take a snapshot), the ``cursor``
    to ask from next, the shard's ``epoch`` and its namespaces' hash sizes."""

    epoch: str
    cursor: int
    deltas: list[Delta] | None
    namespaces: dict[str, int]


class IndexFeed:
    """Numbered deltas: tables append to :attr:`pending`; :meth:`since` numbers and serves."""

    def __init__(self, max_deltas: int = MAX_DELTAS) -> None:
        if max_deltas < 1:
            raise ValueError(f"an index feed keeps >= 1 delta, got {max_deltas}")
        self.pending: list[Delta] = []
        self._log: deque[Delta] = deque(maxlen=max_deltas)
        self._next = 0  # number of the next delta

    def _flush(self) -> None:
        if self.pending:
            self._log.extend(self.pending)
            self._next += len(self.pending)
            self.pending.clear()

    @property
    def cursor(self) -> int:
        """The number of the next delta (what a reader current now asks from)."""
        self._flush()
        return self._next

    def since(self, cursor: int) -> tuple[int, list[Delta] | None]:
        """``(next cursor, deltas numbered cursor..)``; None if they are no longer kept."""
        self._flush()
        oldest = self._next - len(self._log)
        if cursor < oldest or cursor > self._next:
            return self._next, None
        log = self._log
        return self._next, [log[i] for i in range(cursor - oldest, len(log))]
