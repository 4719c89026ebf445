"""The optional streaming-copy extension (``kvshare._native._copy``) and the host slab that uses it.

The C module is checked against numpy's copy on awkward sizes and alignments; the slab is
checked to store, checksum and return the same bytes with streaming copies on and off. Where the
extension was not built (no compiler at install time, or not x86-64) the C-module tests skip and
say so; the slab tests then exercise the numpy path.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvshare.tiers.base import STREAM_MIN_BYTES, STREAMING_COPY, block_checksum, copy_block
from kvshare.tiers.host import HostSlab
from kvshare.types import BlockHash

try:
    from kvshare._native import _copy
except ImportError:
    _copy = None  # type: ignore[assignment]

native = pytest.mark.skipif(
    _copy is None, reason="kvshare._native._copy not built (no C compiler when installed): numpy copies"
)


def rand(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@native
@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 63, 64, 129, 4096 + 3, 65536 + 7, 2**20 + 33])
@pytest.mark.parametrize("src_off,dst_off", [(0, 0), (1, 0), (0, 5), (3, 7)])
def test_stream_copy_matches_numpy(n: int, src_off: int, dst_off: int) -> None:
    src = rand(n + src_off, n)[src_off:]
    guard = rand(n + dst_off + 64, 1)
    dst_all = guard.copy()
    dst = dst_all[dst_off : dst_off + n]
    _copy.stream_copy(dst.data, src.data)
    assert np.array_equal(dst, src)
    # nothing outside the destination was touched
    assert np.array_equal(dst_all[:dst_off], guard[:dst_off])
    assert np.array_equal(dst_all[dst_off + n :], guard[dst_off + n :])


@native
def test_stream_copy_overlap_and_bad_input() -> None:
    a = np.arange(200_000, dtype=np.uint32).view(np.uint8)
    before = a.copy()
    _copy.stream_copy(a[10:].data, a[:-10].data)  # overlapping: behaves like memmove
    assert np.array_equal(a[10:], before[:-10])
    with pytest.raises(ValueError, match="same length"):
        _copy.stream_copy(np.zeros(3, np.uint8).data, np.zeros(4, np.uint8).data)
    with pytest.raises(TypeError, match="read-write"):
        _copy.stream_copy(b"abc", b"abc")


def test_copy_block_falls_back_for_small_or_strided() -> None:
    src = rand(STREAM_MIN_BYTES * 2, 3)
    dst = np.zeros_like(src)
    copy_block(dst[::2], src[::2])  # not contiguous: numpy's copy
    assert np.array_equal(dst[::2], src[::2]) and not dst[1::2].any()
    small = rand(100, 4)
    out = np.zeros(100, np.uint8)
    copy_block(out, small)
    assert np.array_equal(out, small)


@pytest.mark.parametrize("stream", [True, False])
def test_slab_round_trip_with_and_without_streaming(stream: bool) -> None:
    size = 3 * 512 * 1024 + 4096 + 5  # several copy-and-hash chunks and a ragged tail
    slab = HostSlab(size, 3, stream_copies=stream)
    try:
        data = rand(size, 9)
        assert slab.write_checksummed(1, data, BlockHash(b"\x01" * 32)) == block_checksum(data)
        assert np.array_equal(slab.view(1), data) and not slab.view(0).any()
        other = rand(size, 10)
        slab.write(2, other, BlockHash(b"\x02" * 32), block_checksum(other))
        out = np.empty(size, np.uint8)
        slab.read_into(2, out, BlockHash(b"\x02" * 32), 0)
        assert np.array_equal(out, other) and slab.checksum(1) == block_checksum(data)
    finally:
        slab.close()


def test_streaming_is_on_where_built() -> None:
    if _copy is None:
        pytest.skip("kvshare._native._copy not built: the slab copies with numpy")
    assert STREAMING_COPY == bool(_copy.NON_TEMPORAL)


def test_read_into_a_strided_or_read_only_destination_is_refused() -> None:
    import torch

    from kvshare.layout import KVLayout
    from kvshare.pool.tiered import TieredBlockPool
    from kvshare.pool.types import PoolConfig, TierSpec
    from kvshare.types import Tier

    layout = KVLayout(num_layers=1, num_kv_heads=4, head_dim=64, dtype="fp32", block_tokens=128)
    size = layout.bytes_per_block  # 256 KiB: the streaming path where it is built
    pool = TieredBlockPool(PoolConfig("t", layout, (TierSpec(Tier.HOST, 2 * size),)),
                           {Tier.HOST: HostSlab(size, 2)})
    try:
        block, key = rand(size, 11), BlockHash(b"\x07" * 32)
        assert pool.put(key, block)
        (lease,) = pool.pin([key], "r")
        assert lease is not None
        strided = np.zeros((size, 2), np.uint8)[:, 0]
        for bad in (strided, torch.zeros(size, 2, dtype=torch.uint8)[:, 0], bytes(size)):
            with pytest.raises(ValueError, match="C-contiguous"):
                pool.read_into(lease, bad)
        out = torch.zeros(size, dtype=torch.uint8)
        assert pool.read_into(lease, out).ok and np.array_equal(out.numpy(), block)
        pool.unpin([lease.lease_id])
        assert pool.stats()["active_leases"] == 0
    finally:
        pool.close()
