"""The books of a :class:`~kvshare.pool.tiered.TieredBlockPool`: which block sits in which tier and slot.

Per tier: the free slots and each slot's epoch (bumped whenever the slot goes to another
block), the LRU of committed blocks, the byte store (None: books only, as the trace simulator
runs it) and the counters. Across tiers: eviction (LRU, unpinned blocks only), demotion of
blocks hit at least ``demote_min_hits`` times to the next tier, moves between tiers, and the
:mod:`kvshare.events` the index learns them from. Recovery takes back what the stores still
hold after a restart. Not locked: the pool calls it under its own lock; leases are the pool's.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from kvshare.events import AllCleared, BlockRemoved, BlockStored, Event
from kvshare.pool.types import PoolConfig
from kvshare.pool.value import ValueLedger
from kvshare.tiers.base import CorruptBlock, TierStore
from kvshare.types import TIER_CODES, BlockHash, Tier

COUNTERS = (
    "hits", "misses", "bytes_in", "bytes_out", "evictions", "demotions", "promotions",
    "corrupt", "stores",
)
"""Per-tier counters (:meth:`TierState.stats`)."""


@dataclass
class Entry:
    """One block's place: tier, slot, checksum; ``pins`` leases read it now."""

    block_hash: BlockHash
    tier: Tier
    slot: int
    checksum: int
    committed: bool
    hits: int = 0
    pins: int = 0


class TierState:
    """One tier's slots (free list, epochs), its LRU of committed blocks, its store, counters."""

    def __init__(self, tier: Tier, num_slots: int, store: TierStore | None) -> None:
        self.tier = tier
        self.num_slots = num_slots
        self.store = store
        self.free: list[int] = list(range(num_slots - 1, -1, -1))
        self.epochs = np.zeros(num_slots, dtype=np.int64)
        self.lru: OrderedDict[BlockHash, None] = OrderedDict()  # committed blocks, oldest first
        self.counters = dict.fromkeys(COUNTERS, 0)

    @property
    def used(self) -> int:
        return self.num_slots - len(self.free)

    def stats(self, block_bytes: int) -> dict[str, int]:
        """Blocks, used/capacity slots and bytes, and the counters."""
        return {
            "blocks": len(self.lru),
            "used_slots": self.used,
            "capacity_slots": self.num_slots,
            "used_bytes": self.used * block_bytes,
            "capacity_bytes": self.num_slots * block_bytes,
            **self.counters,
        }


class PoolBooks:
    """Tiers, entries and events of one pool (``stores=None``: no bytes, the same books)."""

    def __init__(self, config: PoolConfig, stores: Mapping[Tier, TierStore] | None,
                 value: ValueLedger | None = None) -> None:
        self.config = config
        self.value = value  # a move is charged to the lower of its two tiers
        self.block_bytes = config.layout.bytes_per_block
        self.tiers: dict[Tier, TierState] = {}
        for spec in config.tiers:
            store = stores.get(spec.tier) if stores is not None else None
            n = config.slots(spec.tier)
            if stores is not None and store is None:
                raise ValueError(f"no store given for tier {spec.tier.value}")
            if store is not None:
                if store.slot_bytes != self.block_bytes:
                    raise ValueError(
                        f"{spec.tier.value} store has {store.slot_bytes}-byte slots but the "
                        f"layout's blocks are {self.block_bytes} bytes"
                    )
                n = min(n, store.num_slots)
            self.tiers[spec.tier] = TierState(spec.tier, n, store)
        self.order = [spec.tier for spec in config.tiers]
        self.entries: dict[BlockHash, Entry] = {}
        self.events: list[Event] = []
        self.seq = 0

    def take_events(self) -> list[Event]:
        events, self.events = self.events, []
        return events

    def emit_cleared(self) -> None:
        self.seq += 1
        c = self.config
        self.events.append(AllCleared(c.namespace, c.location, c.generation, self.seq))

    def alloc(self, tier: Tier) -> int | None:
        st = self.tiers[tier]
        if not st.free and not self.evict_one(tier):
            return None
        slot = st.free.pop()
        st.epochs[slot] += 1
        return slot

    def free_slot(self, tier: Tier, slot: int) -> None:
        st = self.tiers[tier]
        st.epochs[slot] += 1
        if st.store is not None:
            st.store.discard(slot)
        st.free.append(slot)

    def evict_one(self, tier: Tier) -> bool:
        """Free one slot of ``tier`` by demoting or dropping its LRU unpinned block."""
        st = self.tiers[tier]
        victim = next((h for h in st.lru if self.entries[h].pins == 0), None)
        if victim is None:
            return False
        e = self.entries[victim]
        idx = self.order.index(tier)
        if idx + 1 < len(self.order) and e.hits >= self.config.demote_min_hits:
            e.pins += 1  # not evictable while we make room below
            try:
                ok = self.move(e, self.order[idx + 1])
            finally:
                e.pins -= 1
            if ok:
                st.counters["demotions"] += 1
                return True
        st.counters["evictions"] += 1
        self.drop(e)
        return True

    def move(self, e: Entry, dest: Tier) -> bool:
        """Copy a committed block into ``dest`` and free its old slot; False if no room."""
        src = self.tiers[e.tier]
        dst = self.tiers[dest]
        if dst.num_slots == 0:
            return False
        slot = self.alloc(dest)
        if slot is None:
            return False
        t0 = time.perf_counter()
        if src.store is not None and dst.store is not None:
            buf = np.empty(self.block_bytes, dtype=np.uint8)
            try:
                src.store.read_into(e.slot, buf, e.block_hash, e.checksum)
            except CorruptBlock:
                self.free_slot(dest, slot)
                raise
            dst.store.write(slot, buf, e.block_hash, e.checksum)
        if self.value is not None:  # demotion: writing into dest; promotion: reading src
            down = TIER_CODES[dest] > TIER_CODES[e.tier]
            self.value.moved(dest if down else e.tier, self.block_bytes,
                             time.perf_counter() - t0, into=down)
        src.counters["bytes_out"] += self.block_bytes  # the same books without byte stores
        dst.counters["bytes_in"] += self.block_bytes
        old_tier, old_slot = e.tier, e.slot
        del src.lru[e.block_hash]
        self.free_slot(old_tier, old_slot)
        e.tier, e.slot = dest, slot
        dst.lru[e.block_hash] = None
        self.emit_stored(e.block_hash, dest)
        self.emit(BlockRemoved, e.block_hash, old_tier)
        return True

    def drop(self, e: Entry, emit: bool = True) -> None:
        st = self.tiers[e.tier]
        st.lru.pop(e.block_hash, None)
        del self.entries[e.block_hash]
        self.free_slot(e.tier, e.slot)
        if emit:
            self.emit(BlockRemoved, e.block_hash, e.tier)

    def emit_stored(self, h: BlockHash, tier: Tier) -> None:
        self.emit(BlockStored, h, tier)

    def emit(self, cls: type[BlockStored] | type[BlockRemoved], h: BlockHash, tier: Tier) -> None:
        self.seq += 1
        c = self.config
        self.events.append(cls(c.namespace, c.location, tier, h, c.generation, self.seq))

    def recover(self) -> int:
        """Take back the blocks the stores still hold (a restart); returns how many."""
        recovered = 0
        for tier in self.order:
            st = self.tiers[tier]
            if st.store is None:
                continue
            taken: set[int] = set()
            for slot, h, checksum in st.store.recover():
                if slot >= st.num_slots or h in self.entries or len(h) != self.config.hash_size:
                    st.store.discard(slot)
                    continue
                taken.add(slot)
                st.epochs[slot] += 1
                self.entries[h] = Entry(h, tier, slot, checksum, committed=True)
                st.lru[h] = None
                recovered += 1
                self.emit_stored(h, tier)
            if taken:
                st.free = [slot for slot in st.free if slot not in taken]
            # torn and corrupt files the store deleted while recovering
            st.counters["corrupt"] += int(getattr(st.store, "discarded", 0))
        return recovered
