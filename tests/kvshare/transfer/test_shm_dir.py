"""``KVSHARE_SHM_DIR`` moves a node's host slabs and their epochs out of /dev/shm (to a
hugetlbfs mount, say): the pool creates them there, a same-node reader maps them from there,
and a directory that cannot hold them is refused by name. Real files in a temporary
directory; a shm read through a real pool."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvshare.layout import KVLayout
from kvshare.tiers.host import SHM_DIR, SHM_DIR_ENV, HostSlab, file_bytes, shm_dir
from kvshare.transfer.holder.local import make_local_source
from kvshare.transfer.reader.control import LocalControl
from kvshare.transfer.reader.shm import ShmTransport
from kvshare.types import BlockHash

LAYOUT = KVLayout(1, 1, 8, "fp32", 64)  # 4 KiB blocks
B = LAYOUT.bytes_per_block


def assert_reads_back(src: Any, reader: ShmTransport, tag: bytes, seed: int) -> None:
    """A block put in ``src``'s pool reads back over ``reader``'s shm, byte for byte."""
    block = BlockHash(tag * 32)
    data = np.random.default_rng(seed).integers(0, 255, B, dtype=np.uint8)
    assert src.pool.put(block, data)
    dest = np.zeros((1, B), np.uint8)
    res = reader.read(LocalControl(src), [block], list(dest))
    assert res.ok and np.array_equal(dest[0], data)


def test_slab_and_epochs_live_in_the_configured_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SHM_DIR_ENV, str(tmp_path))
    assert shm_dir() == str(tmp_path)
    ns, node = f"sd{os.getpid()}", "sd-a"
    src = make_local_source(ns, node, LAYOUT, 8, nixl=False)
    reader = ShmTransport(node, verify=True)
    try:
        info = src.slab_info()
        assert info is not None
        assert sorted(os.listdir(tmp_path)) == sorted([info.name, info.epochs])
        assert not os.path.exists(os.path.join(SHM_DIR, info.name))
        assert_reads_back(src, reader, b"d", seed=3)
    finally:
        reader.close()
        src.close()
        src.pool.close()
    assert os.listdir(tmp_path) == []  # the owner unlinks both


def test_a_reader_maps_the_pools_directory_whatever_its_own_environment_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker started without the pool's ``KVSHARE_SHM_DIR`` (a vLLM server launched apart
    from ``kvshare up``) still reads over shm: the pool's slab info names the directory."""
    monkeypatch.setenv(SHM_DIR_ENV, str(tmp_path))
    ns, node = f"se{os.getpid()}", "se-a"
    src = make_local_source(ns, node, LAYOUT, 8, nixl=False)
    monkeypatch.delenv(SHM_DIR_ENV)  # the reader's environment: /dev/shm
    reader = ShmTransport(node, verify=True)
    try:
        info = src.slab_info()
        assert info is not None and info.directory == str(tmp_path)
        assert_reads_back(src, reader, b"e", seed=4)
    finally:
        reader.close()
        src.close()
        src.pool.close()
    assert os.listdir(tmp_path) == []

@pytest.mark.parametrize("bad", ["missing", "a-file"])
def test_a_directory_that_cannot_hold_slabs_is_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bad: str
) -> None:
    path = tmp_path / bad
    if bad == "a-file":
        path.write_bytes(b"")
    monkeypatch.setenv(SHM_DIR_ENV, str(path))
    with pytest.raises(ValueError, match=f"{SHM_DIR_ENV}=.*{bad}.*not a writable directory"):
        HostSlab(B, 2, f"kvshare-sd{os.getpid()}-n-1")
    with pytest.raises(ValueError, match=SHM_DIR_ENV):
        make_local_source(f"sd{os.getpid()}", "sd-b", LAYOUT, 2, nixl=False)


def test_unset_or_empty_means_dev_shm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SHM_DIR_ENV, raising=False)
    assert shm_dir() == SHM_DIR
    monkeypatch.setenv(SHM_DIR_ENV, "")
    assert shm_dir() == SHM_DIR


def test_files_are_whole_blocks_of_their_file_system(tmp_path: Path) -> None:
    """hugetlbfs files must be whole huge pages (its block size): sizes round up to it."""
    block = os.statvfs(tmp_path).f_bsize
    assert file_bytes(str(tmp_path), 1) == block
    assert file_bytes(str(tmp_path), block) == block
    assert file_bytes(str(tmp_path), block + 1) == 2 * block
    slab = HostSlab(B, 3, f"kvshare-sdround{os.getpid()}-n-1")
    try:
        assert slab.array.shape == (3, B)
        assert slab.path is not None and os.path.getsize(slab.path) == file_bytes(SHM_DIR, 3 * B)
    finally:
        slab.close()
