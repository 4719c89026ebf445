"""TieredBlockPool scenarios: two-phase writes, LRU, leases, demotion, events, null mode, bad input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pool_helpers import BB, LAYOUT, FakeClock, data, h, make_pool, snapshot

from kvshare.events import AllCleared, BlockRemoved, BlockStored, events_from_arrow, events_to_arrow
from kvshare.pool.tiered import TieredBlockPool
from kvshare.pool.types import (
    AlreadyPresent,
    InFlightWrite,
    NoSpace,
    PoolConfig,
    ReadLease,
    Reserved,
    TierSpec,
)
from kvshare.tiers.host import HostSlab
from kvshare.types import Location, Tier

HOST, DISK = Tier.HOST, Tier.DISK


def put_all(pool: TieredBlockPool, *ids: int) -> None:
    for i in ids:
        assert pool.put(h(i), data(i)), i


def read(pool: TieredBlockPool, lease: ReadLease | None) -> np.ndarray:
    assert lease is not None
    out = np.empty(BB, dtype=np.uint8)
    res = pool.read_into(lease, out)
    assert res.ok, res.reason
    return out


def kinds(events: list) -> list[tuple[str, int | None, str | None]]:
    """Events as (kind, block id, tier) for blocks 0..99."""
    ids = {h(i): i for i in range(100)}
    return [(type(e).__name__, ids.get(getattr(e, "block_hash", b"")),
             getattr(e, "tier", None)) for e in events]


# ---------------------------------------------------------------- scenarios
def test_store_three_touch_one_store_a_fourth_evicts_the_lru() -> None:
    pool = make_pool(host=3)
    put_all(pool, 0, 1, 2)
    assert len(pool) == 3
    assert np.array_equal(pool.get(h(0)), data(0))  # touch 0: 1 is now least recent
    put_all(pool, 3)
    assert [i for i in range(4) if h(i) in pool] == [0, 2, 3]
    assert pool.stats()["tiers"]["host"]["evictions"] == 1
    assert pool.prefix_len([h(0), h(1), h(2)]) == 1
    assert kinds(pool.take_events())[-2:] == [("BlockRemoved", 1, HOST), ("BlockStored", 3, HOST)]


def test_a_chain_is_stamped_tail_first_so_the_prefix_outlives_its_tail() -> None:
    pool = make_pool(host=3)
    res = pool.reserve([h(0), h(1), h(2)], "w")
    for r, i in zip(res, range(3), strict=True):
        assert isinstance(r, Reserved)
        pool.write(r.lease_id, data(i))
    assert pool.commit([r.lease_id for r in res if isinstance(r, Reserved)]) == [h(0), h(1), h(2)]
    put_all(pool, 3)
    assert h(2) not in pool and h(0) in pool and h(1) in pool


def test_two_phase_write() -> None:
    pool = make_pool(host=3)
    (r,) = pool.reserve([h(0)], "w")
    assert isinstance(r, Reserved) and r.tier == HOST and 0 <= r.slot < 3
    assert h(0) not in pool and pool.pin([h(0)], "r") == [None]  # invisible until commit
    assert pool.reserve([h(0)], "other") == [InFlightWrite(h(0))]
    pool.write(r.lease_id, data(0))
    assert pool.take_events() == []
    assert pool.commit([r.lease_id]) == [h(0)]
    assert pool.reserve([h(0)], "other") == [AlreadyPresent(h(0))]
    assert np.array_equal(pool.get(h(0)), data(0))
    (ev,) = pool.take_events()
    assert isinstance(ev, BlockStored) and ev.block_hash == h(0)


def test_abort_gives_the_slot_back() -> None:
    pool = make_pool(host=1)
    (r,) = pool.reserve([h(0)], "w")
    assert isinstance(r, Reserved)
    pool.write(r.lease_id, data(0))
    pool.abort([r.lease_id, 12345])  # unknown ids are ignored
    assert h(0) not in pool and pool.stats()["tiers"]["host"]["used_slots"] == 0
    assert isinstance(pool.reserve([h(1)], "w")[0], Reserved)
    assert pool.take_events() == []


def test_writer_filled_slot_commits_with_or_without_its_checksum() -> None:
    """The shared-memory path: the writer copies into the slab itself, then commits."""
    pool = make_pool(host=3)
    slab = pool.store(HOST)
    assert isinstance(slab, HostSlab)
    r0, r1 = pool.reserve([h(0), h(1)], "shm-writer")
    assert isinstance(r0, Reserved) and isinstance(r1, Reserved)
    slab.view(r0.slot)[:] = data(0)
    slab.view(r1.slot)[:] = data(1)
    from kvshare.tiers.base import block_checksum

    pool.commit([r0.lease_id], checksums=[block_checksum(data(0))])
    pool.commit([r1.lease_id])  # the pool computes it from the slot
    for i in (0, 1):
        assert np.array_equal(pool.get(h(i)), data(i))
        assert pool.verify(h(i))


def test_no_space_when_every_slot_is_leased() -> None:
    pool = make_pool(host=2)
    res = pool.reserve([h(0), h(1), h(2)], "w")
    assert [type(r) for r in res] == [Reserved, Reserved, NoSpace]
    pool.abort([r.lease_id for r in res if isinstance(r, Reserved)])
    put_all(pool, 0, 1)
    leases = pool.pin([h(0), h(1)], "reader")
    assert pool.reserve([h(2)], "w") == [NoSpace(h(2))]
    assert not pool.put(h(2), data(2))
    pool.unpin([lease.lease_id for lease in leases if lease is not None])
    assert pool.put(h(2), data(2))


def test_pinned_blocks_are_never_evicted() -> None:
    pool = make_pool(host=2)
    put_all(pool, 0, 1)
    (lease,) = pool.pin([h(0)], "reader")
    put_all(pool, 2, 3, 4)  # 0 is the oldest but pinned: 1, 2, 3 go instead
    assert h(0) in pool and [i for i in range(1, 5) if h(i) in pool] == [4]
    assert np.array_equal(read(pool, lease), data(0))
    assert pool.remove([h(0)]) == 0  # not even on request
    assert pool.stats()["pinned_blocks"] == 1
    assert lease is not None
    pool.unpin([lease.lease_id])
    put_all(pool, 5, 6)
    assert h(0) not in pool


def test_leases_expire_on_the_clock() -> None:
    clock = FakeClock()
    pool = make_pool(host=2, clock=clock, lease_ttl_s=10.0)
    (r,) = pool.reserve([h(0)], "slow-writer", ttl_s=5.0)
    assert isinstance(r, Reserved)
    pool.write(r.lease_id, data(0))
    clock.advance(4.9)
    assert pool.expire_leases() == 0
    clock.advance(0.2)
    assert pool.expire_leases() == 1
    with pytest.raises(KeyError, match="unknown or expired"):
        pool.commit([r.lease_id])
    assert h(0) not in pool and pool.stats()["tiers"]["host"]["used_slots"] == 0

    put_all(pool, 1, 2)
    (lease,) = pool.pin([h(1)], "reader")  # default ttl 10 s
    clock.advance(9.0)
    put_all(pool, 3)
    assert h(1) in pool  # still pinned
    clock.advance(2.0)
    put_all(pool, 4)  # the pin has expired: 1 is the LRU and goes
    assert h(1) not in pool
    assert pool.read_into(lease, np.empty(BB, np.uint8)) == (h(1), False, "lease expired")  # type: ignore[arg-type]
    assert pool.stats()["leases_expired"] == 2


def test_ended_leases_cost_no_memory_and_live_ones_still_expire() -> None:
    """A long-running user (the simulator, a pool with long TTLs) pins and unpins millions of
    times: the books must not grow with leases ever taken, and expiry must keep working."""
    import tracemalloc

    clock = FakeClock()
    pool = make_pool(host=2, clock=clock, lease_ttl_s=1e9)
    put_all(pool, 0)
    (short,) = pool.pin([h(0)], "short", ttl_s=5.0)
    assert short is not None

    def cycle(n: int) -> None:
        for _ in range(n):
            (lease,) = pool.pin([h(0)], "loop")
            assert lease is not None
            pool.unpin([lease.lease_id])

    cycle(5_000)  # warm up (heap at its working size)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    cycle(20_000)
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert grown < 200_000, grown  # ~2.4 MB when every ended lease stayed in the heap
    clock.advance(5.1)
    assert pool.expire_leases() == 1 and pool.stats()["active_leases"] == 0


def test_release_holder_ends_only_that_holders_leases() -> None:
    pool = make_pool(host=4)
    put_all(pool, 0, 1)
    pool.pin([h(0), h(1)], "worker-1")
    (other,) = pool.pin([h(1)], "worker-2")
    (r,) = pool.reserve([h(2)], "worker-1")
    assert pool.release_holder("worker-1") == 3
    assert pool.release_holder("worker-1") == 0
    assert h(2) not in pool and pool.reserve([h(2)], "w")[0].__class__ is Reserved
    assert pool.stats()["pinned_blocks"] == 1  # worker-2 still reads 1
    assert np.array_equal(read(pool, other), data(1))


def test_epochs_change_when_a_slot_is_reused() -> None:
    pool = make_pool(host=1)
    (r0,) = pool.reserve([h(0)], "w")
    assert isinstance(r0, Reserved)
    pool.write(r0.lease_id, data(0))
    pool.commit([r0.lease_id])
    (old,) = pool.pin([h(0)], "r")
    assert old is not None and (old.slot, old.epoch) == (r0.slot, r0.epoch)
    pool.unpin([old.lease_id])
    put_all(pool, 1)  # evicts 0; the one slot is reused
    (new,) = pool.pin([h(1)], "r")
    assert new is not None and new.slot == old.slot and new.epoch > old.epoch
    # a reader still holding the old (slot, epoch) is told the block is gone
    stale = new._replace(epoch=old.epoch)
    assert pool.read_into(stale, np.empty(BB, np.uint8)).reason == "slot reused"


def test_demotion_to_disk_under_the_admission_rule(tmp_path: Path) -> None:
    pool = make_pool(tmp_path, host=2, disk=2, demote_min_hits=1)
    put_all(pool, 0, 1)
    assert pool.get(h(0)) is not None  # 0 hit once, 1 never
    put_all(pool, 2)  # evicts 1: no hits -> dropped, not demoted
    assert h(1) not in pool
    put_all(pool, 3)  # evicts 0: hit once -> demoted
    assert pool.tier_of(h(0)) == DISK
    host = pool.stats()["tiers"]["host"]
    assert (host["evictions"], host["demotions"]) == (1, 1)
    assert np.array_equal(pool.get(h(0)), data(0))  # read back from the disk file
    events = kinds(pool.take_events())
    assert events[-3:] == [("BlockStored", 0, DISK), ("BlockRemoved", 0, HOST),
                           ("BlockStored", 3, HOST)]
    assert sorted(pool.inventory()) == sorted([(h(0), DISK), (h(2), HOST), (h(3), HOST)])
    # promote on read: back into host (evicting the LRU host block, 2, which was never hit)
    (lease,) = pool.pin([h(0)], "shm-reader", promote=True)
    assert lease is not None and lease.tier == HOST
    assert np.array_equal(read(pool, lease), data(0))
    assert pool.stats()["tiers"]["host"]["promotions"] == 1


def test_the_last_tier_drops(tmp_path: Path) -> None:
    pool = make_pool(tmp_path, host=1, disk=1)
    put_all(pool, 0, 1, 2)  # 0 -> disk, then 1 -> disk pushes 0 out of the last tier
    assert [pool.tier_of(h(i)) for i in range(3)] == [None, DISK, HOST]
    assert pool.stats()["tiers"]["disk"]["evictions"] == 1
    assert len(list((tmp_path / "disk").iterdir())) == 1  # the dropped block's file is gone


def test_maintain_demotes_down_to_the_low_watermark(tmp_path: Path) -> None:
    pool = make_pool(tmp_path, host=10, disk=10, high_watermark=0.8, low_watermark=0.5)
    put_all(pool, *range(8))
    assert pool.maintain() == 0  # 8 <= 0.8 * 10
    put_all(pool, 8)
    assert pool.maintain() == 4  # 9 -> 5
    assert [pool.tier_of(h(i)) for i in range(9)] == [DISK] * 4 + [HOST] * 5


def test_events_are_emitted_in_order_and_drained() -> None:
    pool = make_pool(host=2)
    put_all(pool, 0, 1, 2)
    events = pool.take_events()
    assert [e.seq for e in events] == [1, 2, 3, 4]
    assert kinds(events) == [("BlockStored", 0, HOST), ("BlockStored", 1, HOST),
                             ("BlockRemoved", 0, HOST), ("BlockStored", 2, HOST)]
    assert all(e.namespace == "test" and e.location == "node:n1" and e.generation == 0
               for e in events)
    assert pool.take_events() == []
    assert events_from_arrow(events_to_arrow(events)) == events
    pool.remove([h(1)])
    (removed,) = pool.take_events()
    assert isinstance(removed, BlockRemoved) and removed.seq == 5
    assert pool.clear() == 1
    assert pool.take_events() == [AllCleared("test", Location("node:n1"), 0, 6)]
    assert len(pool) == 0


def test_clear_keeps_pinned_blocks_and_reports_each_removal() -> None:
    pool = make_pool(host=3)
    put_all(pool, 0, 1)
    pool.take_events()
    pool.pin([h(0)], "r")
    assert pool.clear() == 1
    assert kinds(pool.take_events()) == [("BlockRemoved", 1, HOST)]
    assert h(0) in pool


def test_stats_count_per_tier() -> None:
    pool = make_pool(host=2)
    put_all(pool, 0, 1)
    pool.get(h(0))
    pool.get(h(9))
    s = pool.stats()
    host = s["tiers"]["host"]
    assert (host["hits"], host["misses"], host["stores"]) == (1, 1, 2)
    assert (host["bytes_in"], host["bytes_out"]) == (2 * BB, BB)
    assert (host["capacity_slots"], host["capacity_bytes"], host["used_bytes"]) == (2, 2 * BB, 2 * BB)
    assert s["block_bytes"] == BB and s["namespace"] == "test"


# ---------------------------------------------------------------- null mode
def drive(pool: TieredBlockPool) -> list:
    put_all(pool, 0, 1, 2)
    pool.pin([h(0)], "r")
    put_all(pool, 3, 4)
    (r,) = pool.reserve([h(5)], "w")
    assert isinstance(r, Reserved)
    pool.write(r.lease_id, data(5))
    pool.commit([r.lease_id])
    pool.get(h(1))
    return pool.take_events()


def test_null_mode_keeps_the_same_books(tmp_path: Path) -> None:
    real = make_pool(tmp_path, host=2, disk=2)
    null = make_pool(host=2, disk=2, null=True)
    assert null.null and not real.null and null.store(HOST) is None
    assert drive(null) == drive(real)
    assert sorted(null.inventory()) == sorted(real.inventory())
    assert null.stats()["tiers"] == real.stats()["tiers"]
    (lease,) = null.pin([h(5)], "r")
    assert lease is not None
    assert null.read_into(lease, np.empty(BB, np.uint8)).reason == "no byte store"
    assert null.get(h(5)) is None
    assert null.verify(h(5))


def test_null_mode_needs_no_payload() -> None:
    pool = make_pool(host=2, null=True)
    (r,) = pool.reserve([h(0)], "sim")
    assert isinstance(r, Reserved)
    pool.commit([r.lease_id])  # the simulator never writes bytes
    assert h(0) in pool


# ---------------------------------------------------------------- bad input
def test_wrong_payload_size_leaves_the_pool_unchanged() -> None:
    pool = make_pool(host=2)
    put_all(pool, 0)
    (r,) = pool.reserve([h(1)], "w")
    assert isinstance(r, Reserved)
    pool.take_events()
    before = snapshot(pool)
    with pytest.raises(ValueError, match=f"{BB - 1} bytes but this pool's blocks are {BB}"):
        pool.write(r.lease_id, data(1)[:-1])
    with pytest.raises(ValueError, match="check the KV layout"):
        pool.put(h(2), np.zeros(BB * 2, np.uint8))
    assert snapshot(pool) == before and pool.take_events() == []
    assert pool.reserve([h(2)], "w")[0].__class__ is Reserved  # the failed put released its slot
    pool.write(r.lease_id, data(1))  # the reservation still works
    pool.commit([r.lease_id])
    assert np.array_equal(pool.get(h(1)), data(1))


def test_commit_without_reserve_commits_nothing() -> None:
    pool = make_pool(host=3)
    (r,) = pool.reserve([h(0)], "w")
    assert isinstance(r, Reserved)
    pool.write(r.lease_id, data(0))
    before = snapshot(pool)
    with pytest.raises(KeyError, match="write reservation 999 is unknown or expired"):
        pool.commit([999])
    with pytest.raises(KeyError):
        pool.commit([r.lease_id, 999])  # all or nothing
    with pytest.raises(ValueError, match="same lease twice"):
        pool.commit([r.lease_id, r.lease_id])
    with pytest.raises(ValueError, match="number of checksums"):
        pool.commit([r.lease_id], checksums=[1, 2])
    with pytest.raises(KeyError, match="unknown or expired"):
        pool.write(999, data(0))
    assert snapshot(pool) == before and pool.take_events() == []
    assert h(0) not in pool
    pool.commit([r.lease_id])
    assert h(0) in pool


def test_read_lease_is_not_a_write_reservation() -> None:
    pool = make_pool(host=2)
    put_all(pool, 0)
    (lease,) = pool.pin([h(0)], "r")
    assert lease is not None
    with pytest.raises(KeyError, match="write reservation"):
        pool.write(lease.lease_id, data(1))
    with pytest.raises(KeyError):
        pool.commit([lease.lease_id])
    pool.abort([lease.lease_id])  # ignored: it is a read lease
    assert np.array_equal(read(pool, lease), data(0))


def test_unknown_hashes_are_misses_and_change_nothing() -> None:
    pool = make_pool(host=2)
    put_all(pool, 0)
    pool.take_events()
    before = snapshot(pool)
    assert pool.pin([h(7)], "r") == [None]
    assert pool.get(h(7)) is None
    assert pool.remove([h(7)]) == 0
    assert not pool.verify(h(7))
    assert pool.tier_of(h(7)) is None and h(7) not in pool
    assert pool.prefix_len([h(7), h(0)]) == 0
    assert snapshot(pool) == before and pool.take_events() == []
    assert pool.stats()["tiers"]["host"]["misses"] == 2


@pytest.mark.parametrize("bad", [b"short", bytes(33), "a" * 32, 5, None])
def test_malformed_hashes_are_rejected(bad: object) -> None:
    pool = make_pool(host=2)
    put_all(pool, 0)
    before = snapshot(pool)
    with pytest.raises(ValueError, match="32-byte bytes"):
        pool.reserve([h(1), bad], "w")  # type: ignore[list-item]
    with pytest.raises(ValueError, match="32-byte bytes"):
        pool.pin([h(0), bad], "r")  # type: ignore[list-item]
    with pytest.raises(ValueError, match="32-byte bytes"):
        pool.put(bad, data(1))  # type: ignore[arg-type]
    assert snapshot(pool) == before


@pytest.mark.parametrize("ttl", [0.0, -1.0, float("nan")])
def test_non_positive_ttl_is_rejected(ttl: float) -> None:
    pool = make_pool(host=2)
    put_all(pool, 0)
    before = snapshot(pool)
    with pytest.raises(ValueError, match="ttl_s must be positive"):
        pool.reserve([h(1)], "w", ttl_s=ttl)
    with pytest.raises(ValueError, match="ttl_s must be positive"):
        pool.pin([h(0)], "r", ttl_s=ttl)
    assert snapshot(pool) == before


def test_config_and_store_mismatches() -> None:
    host = TierSpec(HOST, 2 * BB)
    with pytest.raises(ValueError, match="namespace"):
        PoolConfig("bad/ns", LAYOUT, (host,))
    with pytest.raises(ValueError, match="fastest first"):
        PoolConfig("t", LAYOUT, (TierSpec(DISK, BB), host))
    with pytest.raises(ValueError, match="at least one tier"):
        PoolConfig("t", LAYOUT, ())
    with pytest.raises(ValueError, match="watermarks"):
        PoolConfig("t", LAYOUT, (host,), low_watermark=0.9, high_watermark=0.5)
    with pytest.raises(ValueError, match=">= 0 bytes"):
        TierSpec(HOST, -1)
    cfg = PoolConfig("t", LAYOUT, (host,))
    with pytest.raises(ValueError, match="1024-byte slots but the layout's blocks are 2048"):
        TieredBlockPool(cfg, {HOST: HostSlab(BB // 2, 2)})
    with pytest.raises(ValueError, match="no store given for tier host"):
        TieredBlockPool(cfg, {})
    assert TieredBlockPool(cfg, {HOST: HostSlab(BB, 1)}).stats()["tiers"]["host"][
        "capacity_slots"] == 1  # the smaller of capacity and store


# ---------------------------------------------------------------- corruption
def test_corrupt_blocks_are_misses_never_wrong_data(tmp_path: Path) -> None:
    pool = make_pool(tmp_path, host=1, disk=2)
    put_all(pool, 0, 1)  # 0 is demoted to disk
    assert pool.tier_of(h(0)) == DISK
    (path,) = (tmp_path / "disk").iterdir()
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    (lease,) = pool.pin([h(0)], "r")
    assert lease is not None
    res = pool.read_into(lease, np.empty(BB, np.uint8))
    assert not res.ok and res.reason.startswith("corrupt")
    assert h(0) not in pool and pool.stats()["tiers"]["disk"]["corrupt"] == 1
    slab = pool.store(HOST)
    assert isinstance(slab, HostSlab)
    slab.view(0)[0] ^= 0xFF  # a stray write into shared memory
    assert not pool.verify(h(1)) and h(1) not in pool
    assert pool.stats()["tiers"]["host"]["corrupt"] == 1


def test_promotion_of_a_corrupt_disk_block_is_a_miss(tmp_path: Path) -> None:
    pool = make_pool(tmp_path, host=1, disk=2)
    put_all(pool, 0, 1)
    (path,) = (tmp_path / "disk").iterdir()
    path.write_bytes(path.read_bytes()[:100])
    assert pool.pin([h(0)], "r", promote=True) == [None]
    assert h(0) not in pool and h(1) in pool
