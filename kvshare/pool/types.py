"""Configs and result objects of :class:`kvshare.pool.tiered.TieredBlockPool`."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import NamedTuple

from kvshare.layout import KVLayout
from kvshare.types import BlockHash, Location, Tier

_NAMESPACE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def check_namespace(namespace: str) -> str:
    """Namespaces name files and shm segments: letters, digits, '.', '_', '-' (1-64)."""
    if not isinstance(namespace, str) or not _NAMESPACE.match(namespace):
        raise ValueError(
            f"namespace {namespace!r} is invalid: use 1-64 letters, digits, '.', '_' or '-'"
        )
    return namespace


@dataclass(frozen=True)
class TierSpec:
    """One tier of a pool and its hard capacity in bytes."""

    tier: Tier
    capacity_bytes: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "tier", Tier(self.tier))
        if self.capacity_bytes < 0:
            raise ValueError(f"capacity of tier {self.tier.value} must be >= 0 bytes")


@dataclass(frozen=True)
class PoolConfig:
    """What a pool stores and where it reports it.

    ``tiers`` are fastest first; writes land in the first, eviction demotes down the list and
    drops from the last. ``demote_min_hits``: a block is demoted (not dropped) only if it was
    hit at least that often. Watermarks are fractions of the first tier's slots.
    ``sizing_blocks``: blocks the hit-rate-against-capacity estimator tracks at most
    (:mod:`kvshare.pool.sizing`, ~280 bytes each; 0: no estimate, as the simulator runs).
    ``value_window_s``: the sliding window of the tier value ledger (:mod:`kvshare.pool.value`).
    """

    namespace: str
    layout: KVLayout
    tiers: tuple[TierSpec, ...]
    location: Location = Location("node:local")
    generation: int = 0
    lease_ttl_s: float = 30.0
    demote_min_hits: int = 0
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    hash_size: int = 32
    sizing_blocks: int = 0
    value_window_s: float = 300.0
    extra: dict[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        check_namespace(self.namespace)
        if self.sizing_blocks < 0:
            raise ValueError(f"sizing_blocks must be >= 0 (0: off), got {self.sizing_blocks}")
        if not self.tiers:
            raise ValueError("a pool needs at least one tier")
        order = [t.tier.rank for t in self.tiers]
        if order != sorted(set(order)):
            raise ValueError(
                f"pool tiers must be distinct and fastest first, got {[t.tier.value for t in self.tiers]}"
            )
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise ValueError("watermarks must satisfy 0 < low <= high <= 1")
        if self.lease_ttl_s <= 0:
            raise ValueError("lease_ttl_s must be positive")

    def slots(self, tier: Tier) -> int:
        for spec in self.tiers:
            if spec.tier == tier:
                return spec.capacity_bytes // self.layout.bytes_per_block
        return 0


class Reserved(NamedTuple):
    """A write slot is held for ``block_hash`` until commit/abort or ``lease_id`` expires."""

    block_hash: BlockHash
    lease_id: int
    tier: Tier
    slot: int
    epoch: int


class AlreadyPresent(NamedTuple):
    block_hash: BlockHash


class InFlightWrite(NamedTuple):
    """Another writer holds a reservation for this hash."""

    block_hash: BlockHash


class NoSpace(NamedTuple):
    """Every slot of the write tier is leased; nothing could be evicted."""

    block_hash: BlockHash


ReserveResult = Reserved | AlreadyPresent | InFlightWrite | NoSpace


class ReadLease(NamedTuple):
    """A pinned committed block. Its slot is safe to read while the lease lives."""

    block_hash: BlockHash
    lease_id: int
    tier: Tier
    slot: int
    epoch: int
    checksum: int


class ReadResult(NamedTuple):
    """Outcome of reading one block: ``ok`` or a miss with a ``reason``."""

    block_hash: BlockHash
    ok: bool
    reason: str = ""
