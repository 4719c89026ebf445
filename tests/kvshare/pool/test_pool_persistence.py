"""A disk-tier pool survives a hard kill: intact blocks come back byte-identical, torn and
corrupt files are discarded and counted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from paths import TESTS
from pool_helpers import BB, LAYOUT, data, h

from kvshare.pool.tiered import TieredBlockPool
from kvshare.pool.types import PoolConfig, TierSpec
from kvshare.tiers.disk import HEADER_BYTES, DiskStore
from kvshare.tiers.host import HostSlab
from kvshare.types import Tier

SLOTS = 16
TESTS_DIR = str(TESTS)

# Commits blocks 0-7, says so, then rewrites blocks 8-15 in a loop until it is killed, so the
# SIGKILL lands while files are being written.
WRITER = """
import sys
import kvshare  # first: tests/ holds a folder named kvshare (the tests mirror the package)
sys.path.insert(0, sys.argv[2])
from pool_helpers import BB, LAYOUT, data, h
from kvshare.pool.tiered import TieredBlockPool
from kvshare.pool.types import PoolConfig, TierSpec
from kvshare.tiers.disk import DiskStore
from kvshare.types import Tier
cfg = PoolConfig("persist", LAYOUT, (TierSpec(Tier.DISK, {slots} * BB),))
pool = TieredBlockPool(cfg, {Tier.DISK: DiskStore(sys.argv[1], BB, {slots}, LAYOUT.fingerprint())})
for i in range(8):
    assert pool.put(h(i), data(i))
print("committed", flush=True)
n = 0
while True:
    k = 8 + n % 8
    pool.remove([h(k)])
    pool.put(h(k), data(k))
    n += 1
""".replace("{slots}", str(SLOTS))


def disk_pool(directory: Path, host_slots: int = 0) -> TieredBlockPool:
    specs = [TierSpec(Tier.DISK, SLOTS * BB)]
    stores = {Tier.DISK: DiskStore(str(directory), BB, SLOTS, LAYOUT.fingerprint())}
    if host_slots:
        specs.insert(0, TierSpec(Tier.HOST, host_slots * BB))
        stores[Tier.HOST] = HostSlab(BB, host_slots)  # type: ignore[assignment]
    return TieredBlockPool(PoolConfig("persist", LAYOUT, tuple(specs)), stores)


def file_of(directory: Path, block: int) -> Path:
    (path,) = [p for p in directory.glob("*.blk") if bytes(h(block)) in p.read_bytes()[:HEADER_BYTES]]
    return path


def test_restart_after_sigkill_recovers_survivors_and_counts_the_rest(tmp_path: Path) -> None:
    directory = tmp_path / "disk"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(directory), TESTS_DIR],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "committed", proc.stderr.read() if proc.stderr else line
        time.sleep(0.3)  # let it rewrite blocks 8-15 for a while
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    victim = file_of(directory, 3)
    raw = bytearray(victim.read_bytes())
    raw[HEADER_BYTES + BB // 2] ^= 0x5A  # one payload byte
    victim.write_bytes(bytes(raw))
    torn = directory / "slot-00000015.blk.tmp"
    torn.write_bytes(file_of(directory, 5).read_bytes()[: HEADER_BYTES + 100])  # half a write
    left_tmp = len(list(directory.glob("*.tmp")))

    pool = disk_pool(directory, host_slots=2)
    stats = pool.stats()
    survivors = [i for i in range(16) if h(i) in pool]
    assert [i for i in survivors if i < 8] == [0, 1, 2, 4, 5, 6, 7]
    assert pool.recovered == len(survivors) == len(pool)
    for i in survivors:
        assert pool.tier_of(h(i)) == Tier.DISK
        assert np.array_equal(pool.get(h(i)), data(i)), i  # byte-identical, checksum verified
    assert h(3) not in pool and not victim.exists()
    assert stats["tiers"]["disk"]["corrupt"] == 1 + left_tmp  # the corrupt file and the .tmp
    assert not list(directory.glob("*.tmp"))
    events = pool.take_events()
    assert sorted(e.block_hash for e in events) == sorted(h(i) for i in survivors)  # type: ignore[union-attr]

    # the restarted pool works on: new blocks take the free slots, nothing is overwritten
    free = SLOTS - len(survivors)
    for i in range(100, 100 + free):
        assert pool.put(h(i), data(i))
    pool.maintain()
    assert all(np.array_equal(pool.get(h(i)), data(i)) for i in survivors)
    pool.close()


def test_a_clean_restart_recovers_everything(tmp_path: Path) -> None:
    directory = tmp_path / "disk"
    pool = disk_pool(directory)
    for i in range(5):
        assert pool.put(h(i), data(i))
    pool.close()
    again = disk_pool(directory)
    assert again.recovered == 5 and again.stats()["tiers"]["disk"]["corrupt"] == 0
    assert all(np.array_equal(again.get(h(i)), data(i)) for i in range(5))
    other_layout = DiskStore(str(directory), BB, SLOTS, "0000000000000000")
    assert other_layout.recover() == [] and other_layout.discarded == 5  # never mixed up
