"""Small helpers shared by the pool tests: a tiny layout, deterministic blocks, a fake clock."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np

from kvshare.layout import KVLayout
from kvshare.pool.tiered import TieredBlockPool
from kvshare.pool.types import PoolConfig, TierSpec
from kvshare.tiers.base import TierStore
from kvshare.tiers.disk import DiskStore
from kvshare.tiers.host import HostSlab
from kvshare.types import BlockHash, Location, Tier

LAYOUT = KVLayout(num_layers=1, num_kv_heads=2, head_dim=8, dtype="fp32", block_tokens=16)
BB = LAYOUT.bytes_per_block  # 2048 bytes


def h(i: int) -> BlockHash:
    """The hash of test block ``i``."""
    return BlockHash(hashlib.sha256(f"block-{i}".encode()).digest())


def data(i: int) -> np.ndarray:
    """The payload of test block ``i`` (deterministic in ``i``)."""
    return np.random.default_rng(i).integers(0, 256, BB, dtype=np.uint8)


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_pool(
    tmp_path: Path | None = None,
    host: int = 3,
    disk: int = 0,
    *,
    null: bool = False,
    clock: FakeClock | None = None,
    **config: Any,
) -> TieredBlockPool:
    """A pool of ``host`` host slots and ``disk`` disk slots (disk needs ``tmp_path``)."""
    specs = [TierSpec(Tier.HOST, host * BB)]
    stores: dict[Tier, TierStore] = {Tier.HOST: HostSlab(BB, host)}
    if disk:
        specs.append(TierSpec(Tier.DISK, disk * BB))
        if not null:
            assert tmp_path is not None, "a disk tier needs a directory"
            stores[Tier.DISK] = DiskStore(str(tmp_path / "disk"), BB, disk, LAYOUT.fingerprint())
    cfg = PoolConfig("test", LAYOUT, tuple(specs), location=Location("node:n1"), **config)
    return TieredBlockPool(cfg, None if null else stores, clock=clock or FakeClock())


def snapshot(pool: TieredBlockPool) -> tuple[Any, ...]:
    """What must not change when a call is rejected: contents, slots and leases."""
    stats = pool.stats()
    used = {t: (s["used_slots"], s["blocks"], s["stores"]) for t, s in stats["tiers"].items()}
    return sorted(pool.inventory()), used, stats["active_leases"], stats["pinned_blocks"]
