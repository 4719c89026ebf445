"""Counters that do not lie: each pool counter family the README and ``/metrics`` name
(``kvshare_pool_*``: hits, misses, bytes in/out, stores, evictions, demotions, promotions)
against what the test really did to a real pool (host slab in shared memory + disk files).

One scenario per family, each starting from a fresh pool, so a counter that stays 0 or counts
the wrong tier fails its own test.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pool_helpers import BB, LAYOUT, data, h, make_pool

from kvshare.types import Tier


def tiers(pool: Any) -> dict[str, dict[str, int]]:
    return pool.stats()["tiers"]


def test_host_hits_misses_and_bytes(tmp_path: Path) -> None:
    pool = make_pool(tmp_path, host=4, disk=4)
    for i in range(3):
        pool.put(h(i), data(i))
    assert np.array_equal(pool.get(h(1)), data(1))
    assert np.array_equal(pool.get(h(2)), data(2))
    assert pool.get(h(99)) is None
    host, disk = tiers(pool)["host"], tiers(pool)["disk"]
    assert (host["stores"], host["bytes_in"]) == (3, 3 * BB)
    assert (host["hits"], host["misses"], host["bytes_out"]) == (2, 1, 2 * BB)
    assert (disk["hits"], disk["bytes_in"], disk["bytes_out"]) == (0, 0, 0)


def test_demotions_move_bytes_into_the_disk_tier(tmp_path: Path) -> None:
    pool = make_pool(tmp_path, host=2, disk=4)
    for i in range(4):  # 2 host slots: the two oldest go to disk
        pool.put(h(i), data(i))
    host, disk = tiers(pool)["host"], tiers(pool)["disk"]
    assert host["demotions"] == 2 and host["evictions"] == 0
    assert host["bytes_out"] == 2 * BB and disk["bytes_in"] == 2 * BB
    assert disk["blocks"] == 2 and host["blocks"] == 2


def test_disk_hits_count_reads_served_from_disk_also_when_promoted(tmp_path: Path) -> None:
    pool = make_pool(tmp_path, host=2, disk=4)
    for i in range(4):
        pool.put(h(i), data(i))  # blocks 0, 1 on disk
    assert np.array_equal(pool.get(h(0)), data(0))  # read from disk in place
    before = tiers(pool)
    (lease,) = pool.pin([h(1)], "reader", promote=True)  # copied up to host, then read
    assert lease is not None and lease.tier == Tier.HOST
    out = np.empty(BB, dtype=np.uint8)
    assert pool.read_into(lease, out).ok and np.array_equal(out, data(1))
    pool.unpin([lease.lease_id])
    after = tiers(pool)
    assert before["disk"]["hits"] == 1 and before["disk"]["bytes_out"] == BB
    assert after["disk"]["hits"] == 2, "a read served by the disk tier is a disk hit"
    assert after["disk"]["bytes_out"] == 2 * BB  # the promotion read it from disk
    assert after["host"]["promotions"] == 1
    assert after["host"]["hits"] == before["host"]["hits"]  # host did not have it


def test_evictions_count_blocks_dropped_from_the_last_tier(tmp_path: Path) -> None:
    pool = make_pool(tmp_path, host=2, disk=2)
    for i in range(6):  # 4 fit (2 host + 2 disk); 2 are dropped from disk
        pool.put(h(i), data(i))
    host, disk = tiers(pool)["host"], tiers(pool)["disk"]
    assert disk["evictions"] == 2 and host["evictions"] == 0
    assert host["demotions"] == 4
    assert sum(pool.get(h(i)) is not None for i in range(6)) == 4
    assert host["blocks"] + disk["blocks"] == 4


def test_host_only_pool_evicts_and_counts(tmp_path: Path) -> None:
    pool = make_pool(host=2)
    for i in range(5):
        pool.put(h(i), data(i))
    host = tiers(pool)["host"]
    assert (host["stores"], host["evictions"], host["demotions"]) == (5, 3, 0)
    assert sum(pool.get(h(i)) is None for i in range(5)) == 3
    assert tiers(pool)["host"]["misses"] == 3 and tiers(pool)["host"]["hits"] == 2


@pytest.mark.parametrize("name", ["shm", "nixl", "objstore"])
def test_bytes_out_and_bytes_per_transport_match_the_blocks_read(name: str) -> None:
    """Every way out of the host slab counts: shm readers and NIXL READs copy slots themselves
    (the pool learns it at ``finish``), the object store copies through the pool."""
    import os

    from kvshare.transfer.holder.local import make_local_source
    from kvshare.transfer.reader.control import LocalControl
    from kvshare.transfer.reader.nixl import NixlTransport
    from kvshare.transfer.reader.objstore import ObjStoreTransport
    from kvshare.transfer.reader.shm import ShmTransport

    node = f"cnt-{name}"
    src = make_local_source(f"cnt{os.getpid()}{name}", node, LAYOUT, 16, nixl=name == "nixl")
    make = {"shm": lambda: ShmTransport(node, verify=True),
            "nixl": lambda: NixlTransport(f"cnt{os.getpid()}/reader/0"),
            "objstore": ObjStoreTransport}
    transport = make[name]()
    try:
        for i in range(12):
            assert src.pool.put(h(i), data(i))
        dest = np.zeros((8, BB), np.uint8)
        res = transport.read(LocalControl(src), [h(i) for i in range(8)], list(dest))
        assert res.ok and res.nbytes == 8 * BB
        host = tiers(src.pool)["host"]
        assert host["bytes_out"] == 8 * BB, (name, host)
        assert host["hits"] == 8 and host["bytes_in"] == 12 * BB
    finally:
        transport.close()
        src.close()
        src.pool.close()
