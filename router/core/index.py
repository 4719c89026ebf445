"""The index as the routing core asks it: :class:`RouterIndex`, and :class:`QueryIndex` over
any :class:`~kvshare.workers.IndexQuery`.

Implemented by the cluster's index client (:class:`~kvshare.actors.index.client.IndexClient`,
awaited), a router's copy of the index (:class:`~kvshare.actors.index.replica.IndexReplica`,
inline) and an in-process index (:class:`~kvshare.router.core.embed.InProcessIndex`, inline).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvshare.match import MatchResult
from kvshare.router.core.sources import Match
from kvshare.types import BlockHash
from kvshare.workers import IndexQuery


class RouterIndex(Protocol):
    """What :class:`~kvshare.router.core.routing.RoutingCore` calls on an index: one match
    per decision, in run form where the index has it (:class:`~kvshare.actors.index.runs.HolderRuns`)
    or as a :class:`~kvshare.match.MatchResult`.

    Both matches return the holdings of the prefix ``hashes``; an index that cannot answer
    returns an empty match whose ``unavailable`` says why, and ``KeyError`` means the
    namespace is not declared (nothing is cached anywhere). Any other exception counts as
    an index failure (load-only routing).
    """

    @property
    def inline(self) -> bool:
        """Whether the index answers in this process without I/O (microseconds): the core
        then calls :meth:`match_runs` directly, with no deadline and no coroutine; otherwise
        it awaits :meth:`match_runs_async` under its ``index_timeout_s``."""
        ...

    def match_runs(self, namespace: str, hashes: Sequence[BlockHash]) -> Match:
        """The match now (blocking while an index that is not :attr:`inline` answers)."""
        ...

    async def match_runs_async(self, namespace: str, hashes: Sequence[BlockHash]) -> Match:
        """The match, without blocking the event loop."""
        ...


class QueryIndex:
    """A :class:`RouterIndex` over any :class:`~kvshare.workers.IndexQuery` (an index that
    offers only ``match``/``match_async``): awaited under the core's deadline."""

    inline = False

    def __init__(self, query: IndexQuery) -> None:
        self.query = query

    def match_runs(self, namespace: str, hashes: Sequence[BlockHash]) -> MatchResult:
        return self.query.match(namespace, hashes)

    async def match_runs_async(self, namespace: str, hashes: Sequence[BlockHash]) -> MatchResult:
        return await self.query.match_async(namespace, hashes)
