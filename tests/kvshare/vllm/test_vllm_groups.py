"""vLLM's KV-cache groups on the connector's side, without an engine: vLLM's own spec classes,
CPU_ATTN page tensors shared by a sliding and a full layer as vLLM-CPU allocates them."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")
from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)

from kvshare.attention import KVGroup  # noqa: E402
from kvshare.layout import KVLayout  # noqa: E402
from kvshare.vllm.connector.groups import EngineGroups, GroupedRequestKV, savable_from  # noqa: E402
from kvshare.vllm.connector.paged import PageViews  # noqa: E402

PAGE, HEADS, DIM = 32, 2, 16
LAYOUT = KVLayout(4, HEADS, DIM, "fp32", 64, "sliding",
                  groups=(KVGroup((1, 3)), KVGroup((0, 2), 128)))


def names(*layers: int) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in layers]


def config(window: int = 128, extra: object = None) -> SimpleNamespace:
    kw = {"block_size": PAGE, "num_kv_heads": HEADS, "head_size": DIM, "dtype": torch.float32}
    groups = [KVCacheGroupSpec(names(0, 2), SlidingWindowSpec(sliding_window=window, **kw)),
              KVCacheGroupSpec(names(1, 3), FullAttentionSpec(**kw))]
    if extra is not None:
        groups.append(KVCacheGroupSpec(names(4), extra))  # type: ignore[arg-type]
    return SimpleNamespace(kv_cache_groups=groups)


def test_groups_are_read_from_vllms_config_and_checked() -> None:
    g = EngineGroups.from_vllm(config(), LAYOUT, "m")
    assert g.layers == ((0, 2), (1, 3)) and g.windows == (128, None) and g.grouped
    assert not EngineGroups.single(4).grouped
    with pytest.raises(ValueError, match="sliding window of 256 tokens, the namespace layout "
                                         "says 128.*kvshare up --layout"):
        EngineGroups.from_vllm(config(window=256), LAYOUT, "m")
    chunked = ChunkedLocalAttentionSpec(block_size=PAGE, num_kv_heads=HEADS, head_size=DIM,
                                        dtype=torch.float32, attention_chunk_size=64)
    with pytest.raises(ValueError, match="ChunkedLocalAttentionSpec.*no block format.*remove "
                                         "the KVShareConnector"):
        EngineGroups.from_vllm(config(extra=chunked), LAYOUT, "m")


def test_saves_start_after_the_last_block_with_a_null_page() -> None:
    sliding = [0, 0, 0, 0, 7, 8, 9, 10]  # 4 blocks of 2 pages: blocks 0-1 behind the window
    full = [11, 12, 13, 14, 15, 16, 17, 18]
    assert savable_from([sliding, full], 0, 4, 2) == 2
    assert savable_from([sliding, full], 3, 4, 2) == 3
    assert savable_from([[0, 0, 0, 0], full[:4]], 0, 2, 2) == 2  # nothing to save
    assert savable_from([full], 0, 4, 2) == 0


def caches(pages: int = 8) -> dict[str, torch.Tensor]:
    """Layers 0/1 and 2/3 share a tensor, as vLLM-CPU allocates a hybrid's pages."""
    a, b = torch.zeros(pages, HEADS, PAGE, 2 * DIM), torch.zeros(pages, HEADS, PAGE, 2 * DIM)
    return dict(zip(names(0, 1, 2, 3), (a, a, b, b), strict=True))


def test_a_load_skips_null_pages_and_a_save_reads_each_groups_pages() -> None:
    groups = EngineGroups.from_vllm(config(), LAYOUT, "m")
    kv = caches()
    views = PageViews.from_vllm(kv, local_heads=HEADS, head_dim=DIM, page_tokens=PAGE)
    sliding, full = [0, 0, 3, 4], [1, 2, 5, 6]  # block 0's sliding pages: the null page
    blocks = torch.randn(2, *LAYOUT.block_shape)
    GroupedRequestKV(views, LAYOUT, groups, [sliding, full]).write_blocks(0, blocks)
    assert not kv[names(0)[0]][0].any()  # the null page is never written
    out = torch.zeros(1, *LAYOUT.block_shape)
    src = GroupedRequestKV(views, LAYOUT, groups, [sliding, full])
    src.read_blocks(1, out)
    assert torch.equal(out[0], blocks[1])  # every layer of block 1, from its group's pages
    with pytest.raises(ValueError, match="not fully in the request's pages"):
        src.read_blocks(0, out)  # block 0's sliding pages are gone: not savable
    rows = np.zeros((1, LAYOUT.bytes_per_block), dtype=np.uint8)
    src.read_slots([1], rows, [0])  # the straight copy (pages -> slab rows)
    assert np.array_equal(rows[0], blocks[1].numpy().reshape(-1).view(np.uint8))
