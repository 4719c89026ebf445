"""One conformance suite for every TierStore (host anonymous, host shm, disk, gpu),
then what only some tiers promise: shared-memory attach from another process, disk headers."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from kvshare.testing.tier_conformance import CHECKS, bh, payload
from kvshare.tiers.base import CorruptBlock, TierStore, block_checksum
from kvshare.tiers.disk import HEADER_BYTES, DiskStore
from kvshare.tiers.host import SHM_DIR, HostSlab, remove_stale_segments, segment_name

SLOT = 64 * 1024 + 8  # deliberately not a power of two
SLOTS = 4
FP = "0123456789abcdef"
KINDS = ["host", "host_shm", "disk", "gpu"]


def shm_name(tag: str) -> str:
    return segment_name(f"test{os.getpid()}", tag, 0)


def make_store(kind: str, tmp_path: Path) -> TierStore:
    if kind == "host":
        return HostSlab(SLOT, SLOTS)
    if kind == "host_shm":
        return HostSlab(SLOT, SLOTS, shm_name("conf"))
    if kind == "disk":
        return DiskStore(str(tmp_path / "disk"), SLOT, SLOTS, FP)
    import torch

    if not torch.cuda.is_available():
        pytest.skip("gpu tier: no CUDA device on this machine, so its conformance run is skipped")
    from kvshare.tiers.gpu import GpuStore

    return GpuStore(SLOT, SLOTS)


@pytest.fixture(params=KINDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TierStore]:
    if request.param == "gpu":
        request.applymarker(pytest.mark.gpu)
    s = make_store(request.param, tmp_path)
    try:
        yield s
    finally:
        s.close()


def read(s: TierStore, slot: int, i: int, checksum: int = -1) -> np.ndarray:
    out = np.empty(s.slot_bytes, dtype=np.uint8)
    s.read_into(slot, out, bh(i), checksum)
    return out


# ---------------------------------------------------------------- conformance (every tier)
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
def test_conformance(store: TierStore, check: Callable[[TierStore], None]) -> None:
    """One check of the TierStore contract (kvshare.testing.tier_conformance; the GPU check
    runs the same functions on the device)."""
    assert (store.slot_bytes, store.num_slots) == (SLOT, SLOTS)
    check(store)


# ---------------------------------------------------------------- host shared memory
ATTACH_CHILD = """
import sys
import numpy as np
from kvshare.tiers.base import block_checksum
from kvshare.tiers.host import HostSlab
name, slot_bytes, num_slots = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
slab = HostSlab.attach(name, slot_bytes, num_slots)
print(block_checksum(slab.view(0)))
slab.view(1)[:] = np.arange(slot_bytes, dtype=np.uint64).astype(np.uint8)
slab.close()
"""


def test_shm_slab_is_shared_with_another_process() -> None:
    name = shm_name("attach")
    slab = HostSlab(SLOT, SLOTS, name)
    try:
        data = payload(7, SLOT)
        slab.write(0, data, bh(7), block_checksum(data))
        proc = subprocess.run(
            [sys.executable, "-c", ATTACH_CHILD, name, str(SLOT), str(SLOTS)],
            capture_output=True, text=True, timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        assert int(proc.stdout.split()[0]) == block_checksum(data)  # child saw our bytes
        expected = np.arange(SLOT, dtype=np.uint64).astype(np.uint8)
        assert np.array_equal(slab.view(1), expected)  # we see the child's bytes
        assert os.path.exists(os.path.join(SHM_DIR, name))  # a detaching child unlinks nothing
        with pytest.raises(ValueError, match="another size"):
            HostSlab.attach(name, SLOT, SLOTS + 1)
    finally:
        slab.close()
    assert not os.path.exists(os.path.join(SHM_DIR, name))  # the owner unlinks on close


def test_shm_names_and_stale_segments() -> None:
    with pytest.raises(ValueError, match="namespace"):
        segment_name("bad/ns", "node", 0)
    ns = f"stale{os.getpid()}"
    old = HostSlab(SLOT, 1, segment_name(ns, "n1", 1))
    current = HostSlab(SLOT, 1, segment_name(ns, "n1", 2))
    other_node = HostSlab(SLOT, 1, segment_name(ns, "n2", 1))
    try:
        assert remove_stale_segments(ns, "n1", keep=segment_name(ns, "n1", 2)) == [
            segment_name(ns, "n1", 1)]
        assert os.path.exists(os.path.join(SHM_DIR, segment_name(ns, "n1", 2)))
        assert os.path.exists(os.path.join(SHM_DIR, segment_name(ns, "n2", 1)))
    finally:
        for s in (old, current, other_node):
            s.close()
    with pytest.raises(FileExistsError):  # generations are never reused while alive
        a = HostSlab(SLOT, 1, shm_name("dup"))
        try:
            HostSlab(SLOT, 1, shm_name("dup"))
        finally:
            a.close()


# ---------------------------------------------------------------- disk headers and recovery
@pytest.fixture
def disk(tmp_path: Path) -> DiskStore:
    return DiskStore(str(tmp_path / "disk"), SLOT, SLOTS, FP)


def test_disk_verifies_hash_checksum_and_layout(disk: DiskStore, tmp_path: Path) -> None:
    data = payload(8, SLOT)
    ck = block_checksum(data)
    disk.write(0, data, bh(8), ck)
    with pytest.raises(CorruptBlock, match="another block"):
        read(disk, 0, 9)
    with pytest.raises(CorruptBlock, match="checksum"):
        read(disk, 0, 8, ck ^ 1)
    with pytest.raises(CorruptBlock, match="missing"):
        read(disk, 1, 8)
    other = DiskStore(str(tmp_path / "disk"), SLOT, SLOTS, "fedcba9876543210")
    with pytest.raises(CorruptBlock, match="another layout"):
        read(other, 0, 8)
    path = tmp_path / "disk" / "slot-00000000.blk"
    assert path.stat().st_size == HEADER_BYTES + SLOT
    raw = bytearray(path.read_bytes())
    raw[HEADER_BYTES + 100] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptBlock, match="payload checksum"):
        read(disk, 0, 8)
    raw[5] ^= 0xFF  # and now the header too
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptBlock, match="header"):
        read(disk, 0, 8)


def test_disk_recover_keeps_intact_and_removes_the_rest(disk: DiskStore, tmp_path: Path) -> None:
    blocks = {slot: payload(20 + slot, SLOT) for slot in range(SLOTS)}
    for slot, data in blocks.items():
        disk.write(slot, data, bh(slot), block_checksum(data))
    d = tmp_path / "disk"
    (d / "slot-00000001.blk").write_bytes((d / "slot-00000001.blk").read_bytes()[:-10])  # short
    raw = bytearray((d / "slot-00000002.blk").read_bytes())
    raw[-1] ^= 1
    (d / "slot-00000002.blk").write_bytes(bytes(raw))  # flipped bit
    (d / "slot-00000003.blk.tmp").write_bytes(b"torn write")
    (d / "slot-00000099.blk").write_bytes(b"beyond num_slots")
    (d / "README").write_text("not ours")
    again = DiskStore(str(d), SLOT, SLOTS, FP)
    found = again.recover()
    assert found == [(0, bh(0), block_checksum(blocks[0])), (3, bh(3), block_checksum(blocks[3]))]
    assert again.discarded == 4
    assert sorted(os.listdir(d)) == ["README", "slot-00000000.blk", "slot-00000003.blk"]
    assert np.array_equal(read(again, 3, 3, block_checksum(blocks[3])), blocks[3])


def test_disk_rejects_bad_sizes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="positive"):
        DiskStore(str(tmp_path), 0, 1, FP)
    with pytest.raises(ValueError, match="positive"):
        HostSlab(SLOT, 0)


def test_host_copy_and_hash_across_chunk_boundaries() -> None:
    size = 3 * 512 * 1024 + 5  # several copy-and-hash chunks and a ragged tail
    slab = HostSlab(size, 2)
    try:
        data = payload(50, size)
        assert slab.write_checksummed(1, data, bh(1)) == block_checksum(data)
        assert np.array_equal(slab.view(1), data)
    finally:
        slab.close()
