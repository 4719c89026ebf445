"""The leases of a :class:`~kvshare.pool.tiered.TieredBlockPool`: who holds which block until when.

A lease is a read pin or a write reservation of one block for a ``holder``, with a deadline.
Deadlines sit in a heap, so finding the expired leases costs only what expired; an ended
lease leaves its deadline in the heap until it passes, and the heap is rebuilt from the live
leases when too many such leftovers pile up. Not locked: the pool calls it under its lock.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence, ValuesView
from dataclasses import dataclass

from kvshare.types import BlockHash

_HEAP_SLACK = 1024  # dead lease deadlines kept before the deadline heap is rebuilt


def check_lease_request(hashes: Sequence[BlockHash], hash_size: int, ttl_s: float | None) -> None:
    """ValueError unless every hash is ``hash_size`` bytes and ``ttl_s`` is None or > 0."""
    for h in hashes:
        if not isinstance(h, bytes) or len(h) != hash_size:
            raise ValueError(
                f"block hashes must be {hash_size}-byte bytes, got "
                f"{type(h).__name__} of length {len(h) if hasattr(h, '__len__') else '?'}"
            )
    if ttl_s is not None and not ttl_s > 0:
        raise ValueError(f"lease ttl_s must be positive seconds (or None for the default), got {ttl_s}")


@dataclass
class Lease:
    lease_id: int
    holder: str
    block_hash: BlockHash
    deadline: float
    write: bool


class LeaseTable:
    """Live leases by id; ``default_ttl_s`` for a lease taken without a ttl."""

    def __init__(self, clock: Callable[[], float], default_ttl_s: float) -> None:
        self.clock = clock
        self.default_ttl_s = default_ttl_s
        self._leases: dict[int, Lease] = {}
        self._deadlines: list[tuple[float, int]] = []
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, lease_id: object) -> bool:
        return lease_id in self._leases

    def get(self, lease_id: int) -> Lease | None:
        return self._leases.get(lease_id)

    def values(self) -> ValuesView[Lease]:
        return self._leases.values()

    def end(self, lease_id: int) -> None:
        del self._leases[lease_id]

    def new(self, holder: str, h: BlockHash, ttl_s: float | None, write: bool) -> int:
        """A new lease of ``h`` for ``holder``; returns its id."""
        lid = next(self._ids)
        deadline = self.clock() + (ttl_s if ttl_s is not None else self.default_ttl_s)
        self._leases[lid] = Lease(lid, holder, h, deadline, write)
        if len(self._deadlines) > 2 * len(self._leases) + _HEAP_SLACK:
            # Ended leases leave their deadline behind until it passes: with long TTLs the
            # heap would grow with every lease ever taken. Rebuild it from the live ones.
            self._deadlines = [(x.deadline, x.lease_id) for x in self._leases.values()]
            heapq.heapify(self._deadlines)
        else:
            heapq.heappush(self._deadlines, (deadline, lid))
        return lid

    def held(self, lease_id: int, write: bool) -> Lease:
        """The live lease (a reservation if ``write``, else a read pin); KeyError otherwise."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.write != write:
            kind = "write reservation" if write else "read lease"
            raise KeyError(f"{kind} {lease_id} is unknown or expired: reserve the block again")
        return lease

    def due(self) -> Iterator[Lease]:
        """The live leases past their deadline, oldest deadline first (the caller ends each)."""
        now = self.clock()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, lid = heapq.heappop(self._deadlines)
            lease = self._leases.get(lid)
            if lease is not None and lease.deadline <= now:
                yield lease
