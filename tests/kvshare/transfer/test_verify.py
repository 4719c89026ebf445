"""Who checks a NIXL read's bytes: the holding pool while the transfer runs (default), or the
reader once they landed (``end_to_end``). Either way a rotten
slot is a ``corrupt`` miss, the pool drops the block, and nothing stays pinned or pending. In
one process, real NIXL."""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest

from kvshare.layout import KVLayout
from kvshare.tiers.base import block_checksum
from kvshare.tiers.host import HostSlab
from kvshare.transfer.base import CORRUPT, Transport
from kvshare.transfer.holder.local import make_local_source
from kvshare.transfer.holder.server import BlockServer
from kvshare.transfer.reader.control import LocalControl
from kvshare.transfer.reader.nixl import NixlTransport
from kvshare.transfer.verify import PinnedSlot, SlotVerifier
from kvshare.types import BlockHash, Tier

LAYOUT = KVLayout(1, 1, 8, "fp32", 64)  # 4 KiB blocks
B = LAYOUT.bytes_per_block


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(4, "little") + b"v" * 28)


def payload(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 255, B, dtype=np.uint8)


@pytest.fixture(scope="module")
def source() -> Iterator[BlockServer]:
    src = make_local_source(f"uv{os.getpid()}", "uv-a", LAYOUT, 64, nixl=True)
    for i in range(8):
        assert src.pool.put(h(i), payload(i))
    yield src
    src.close()
    src.pool.close()


MODES = {"at_source": False, "end_to_end": True}


@pytest.fixture(scope="module", params=list(MODES))
def reader(request: pytest.FixtureRequest) -> Iterator[Transport]:
    t = NixlTransport(f"uv{os.getpid()}/reader/{request.param}", end_to_end=MODES[request.param])
    t.victim = 100 + list(MODES).index(request.param)  # type: ignore[attr-defined]
    yield t
    t.close()


def rot(src: BlockServer, block: BlockHash) -> None:
    lease = src.pool.pin([block], "test")[0]
    assert lease is not None and lease.tier == Tier.HOST
    src.pool.unpin([lease.lease_id])
    slab = src.pool.store(Tier.HOST)
    assert isinstance(slab, HostSlab)
    slab.array[lease.slot, B - 1] ^= 0x10


def test_rotten_slot_is_a_corrupt_miss_and_dropped(source: BlockServer, reader: Transport) -> None:
    victim = h(reader.victim)  # type: ignore[attr-defined]
    assert source.pool.put(victim, payload(5))
    rot(source, victim)
    dest = np.zeros((3, B), np.uint8)
    res = reader.read(LocalControl(source), [h(0), victim, h(2)], list(dest))
    assert res.misses() == {victim: CORRUPT}
    assert np.array_equal(dest[0], payload(0)) and np.array_equal(dest[2], payload(2))
    assert victim not in source.pool
    st = source.pool.stats()
    assert st["active_leases"] == 0 and st["pinned_blocks"] == 0


def test_intact_reads_leave_no_checksums_pending(source: BlockServer, reader: Transport) -> None:
    dest = np.zeros((8, B), np.uint8)
    for _ in range(3):
        assert reader.read(LocalControl(source), [h(i) for i in range(8)], list(dest)).ok
    assert all(np.array_equal(dest[i], payload(i)) for i in range(8))
    assert source._verifier is not None and not source._verifier._pending


def test_verifier_names_the_failed_lease_and_forgets_abandoned_holders() -> None:
    slab = HostSlab(B, 4, f"kvshare-uvs{os.getpid()}-n-0")
    try:
        for s in range(4):
            slab.array[s] = payload(s)
        sums = [block_checksum(payload(s)) for s in range(4)]
        slab.array[2, 0] ^= 1
        v = SlotVerifier(slab)
        v.start("r1", [PinnedSlot(10 + s, h(s), s, sums[s]) for s in range(4)])
        got = v.verdict("r1", timeout=10.0)
        assert got is not None and {lid: c.ok for lid, c in got.items()} == {
            10: True, 11: True, 12: False, 13: True}
        assert got[12].block_hash == h(2)
        assert v.verdict("r1", timeout=1.0) is None  # taken once
        v.start("r2", [PinnedSlot(20, h(0), 0, sums[0])])
        v.forget("r2")
        assert v.verdict("r2", timeout=1.0) is None
        v.close()
    finally:
        slab.close()


def test_rot_in_one_of_many_blocks_is_the_only_miss(source: BlockServer) -> None:
    """A read of 7 blocks checked by the reader: the one rotten block alone misses."""
    t = NixlTransport(f"uv{os.getpid()}/reader/groups", end_to_end=True)
    try:
        keys = [h(200 + i) for i in range(7)]
        for i, k in enumerate(keys):
            assert source.pool.put(k, payload(20 + i))
        rot(source, keys[3])
        dest = np.zeros((7, B), np.uint8)
        res = t.read(LocalControl(source), keys, list(dest))
        assert res.misses() == {keys[3]: CORRUPT}
        assert all(np.array_equal(dest[i], payload(20 + i)) for i in range(7) if i != 3)
        assert keys[3] not in source.pool and source.pool.stats()["active_leases"] == 0
    finally:
        t.close()


def test_a_read_records_where_its_time_went(source: BlockServer, reader: Transport) -> None:
    """Per-stage timings (benchmarks/nixl_stages.py reads them): every stage of a read that
    moved blocks, each non-negative, together no longer than the read."""
    dest = np.zeros((4, B), np.uint8)
    t = reader.submit_read(LocalControl(source), [h(i) for i in range(4)], list(dest), deadline_s=10.0)
    res = reader.wait(t)
    assert res.ok
    stages = t.state["stages"]
    assert set(stages) == {"control", "prepare", "post", "move", "release", "finish"}
    assert all(v >= 0 for v in stages.values())
    assert sum(stages.values()) <= res.seconds + 0.01
