"""vLLM's paged KV caches as vLLM allocates them, and plain-torch reference copies.

The reference moves the bytes of canonical blocks ``[layer][k|v][kv_head][token][head_dim]``
into and out of pages with one indexing assignment per (block, page, layer, k|v), on the
CPU, on uint8 views (so every dtype, fp8 included, is compared byte for byte). It shares no
code with :mod:`kvshare.vllm.connector.paged`, which the GPU check (:mod:`kvshare.testing.gpu_check`)
holds against it.

Layouts (``kind``), per layer, as vLLM's attention backends shape them::

    flash_nhd  [2, pages, page_tokens, heads, head_dim]   FLASH_ATTN, default stride order
    flash_hnd  the same shape, memory ordered [2, pages, heads, page_tokens, head_dim]
               (vLLM's "HND" KV-cache layout: a permuted view, not contiguous)
    cpu        [pages, heads, page_tokens, 2 * head_dim]  CPU_ATTN, read by the backend as
               [pages, heads, 2 * page_tokens, head_dim]: per page and head, keys then values
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvshare.kv_convert import torch_dtype
from kvshare.layout import KVLayout

KINDS = ("flash_nhd", "flash_hnd", "cpu")


@dataclass(frozen=True)
class Pages:
    """One rank's paged KV geometry: ``local_heads`` heads from ``head_start`` of the layout."""

    kind: str
    layout: KVLayout
    num_pages: int
    page_tokens: int
    local_heads: int
    head_start: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"paged kind {self.kind!r}: use one of {KINDS}")
        if self.layout.block_tokens % self.page_tokens:
            raise ValueError("block_tokens must be a multiple of page_tokens")

    @property
    def per_block(self) -> int:
        return self.layout.block_tokens // self.page_tokens

    @property
    def shape(self) -> tuple[int, ...]:
        P, t, H, D = self.num_pages, self.page_tokens, self.local_heads, self.layout.head_dim
        return (P, H, t, 2 * D) if self.kind == "cpu" else (2, P, t, H, D)


def layer_names(num_layers: int) -> list[str]:
    """vLLM's attention layer names, in the scrambled order a dict may hand them over."""
    order = list(range(num_layers))[::2] + list(range(num_layers))[1::2]
    return [f"model.layers.{i}.self_attn.attn" for i in order]


def random_bytes(shape: Sequence[int], seed: int) -> torch.Tensor:
    """A CPU uint8 tensor of random bytes (the same for the same seed)."""
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, tuple(shape),
                                                                 dtype=np.uint8))


def allocate(pages: Pages, device: torch.device | str, seed: int,
             raw: bool = True) -> dict[str, torch.Tensor]:
    """One cache tensor per layer, filled with random bytes (so a page written by mistake
    shows). ``raw``: as vLLM's model runner does, a flat int8 buffer per layer viewed as
    vLLM's cache dtype (fp8 caches are ``torch.uint8`` there: ``STR_DTYPE_TO_TORCH_DTYPE``),
    then as the backend's shape (through its stride order for ``flash_hnd``); else a plain
    ``torch.empty`` of the shape in the layout's own dtype."""
    dtype = torch_dtype(pages.layout)
    if raw and pages.layout.dtype.startswith("fp8"):
        dtype = torch.uint8
    shape = pages.shape
    physical = shape if pages.kind != "flash_hnd" else (shape[0], shape[1], shape[3], shape[2],
                                                        shape[4])
    elems = int(np.prod(physical))
    out = {}
    for i, name in enumerate(layer_names(pages.layout.num_layers)):
        fill = random_bytes((elems * pages.layout.dtype_bytes,), seed + i).to(device)
        if raw:
            t = torch.empty(elems * pages.layout.dtype_bytes, dtype=torch.int8, device=device)
            t.view(torch.uint8).copy_(fill)
            cache = t.view(dtype).view(physical)
        else:
            cache = torch.empty(physical, dtype=dtype, device=device)
            cache.view(-1).view(torch.uint8).copy_(fill)
        out[name] = cache.permute(0, 1, 3, 2, 4) if pages.kind == "flash_hnd" else cache
    return out


def host_bytes(caches: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU copies of ``caches`` (never views of them, also on the CPU) as uint8, the last axis
    in bytes, in the same logical order."""
    return {n: c.detach().to("cpu", copy=True).contiguous().view(torch.uint8)
            for n, c in caches.items()}


def _canon(rows: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """``[n, bytes]`` uint8 rows as ``[n, layers, 2, heads, block_tokens, head_dim_bytes]``."""
    L, _, H, B, D = layout.block_shape
    return rows.reshape(-1, L, 2, H, B, D * layout.dtype_bytes)


def _page_slot(cache: torch.Tensor, pages: Pages, page: int, kv: int) -> torch.Tensor:
    """The ``[local_heads, page_tokens, head_dim_bytes]`` view of one page's keys (kv=0) or
    values (kv=1) in a uint8 cache of :func:`host_bytes`."""
    t = pages.page_tokens
    if pages.kind == "cpu":
        return cache.view(pages.num_pages, pages.local_heads, 2 * t, -1)[page, :, kv * t:(kv + 1) * t]
    return cache[kv, page].transpose(0, 1)


def _pairs(pages: Pages, page_ids: Sequence[int], first_block: int, blocks: Sequence[int],
           keep_tokens: int, writing: bool) -> list[tuple[int, int, int]]:
    """``(j, page within block, vLLM page id)`` of the pages block ``blocks[j]`` covers."""
    out = []
    for j, b in enumerate(blocks):
        for k in range(pages.per_block):
            p = (first_block + b) * pages.per_block + k
            if p >= len(page_ids) or (writing and p * pages.page_tokens < keep_tokens):
                continue
            out.append((j, k, page_ids[p]))
    return out


def load(ref: dict[str, torch.Tensor], pages: Pages, rows: torch.Tensor,
         page_ids: Sequence[int], blocks: Sequence[int], first_block: int = 0,
         keep_tokens: int = 0) -> None:
    """Write canonical ``rows[j]`` (CPU uint8) as block ``blocks[j]`` of a request whose
    pages are ``page_ids`` into ``ref`` (from :func:`host_bytes`), pages holding tokens below
    ``keep_tokens`` untouched: what a load into vLLM's pages must do."""
    canon = _canon(rows, pages.layout)
    h0, nh, t = pages.head_start, pages.local_heads, pages.page_tokens
    for j, k, pid in _pairs(pages, page_ids, first_block, blocks, keep_tokens, writing=True):
        for layer, name in enumerate(layer_names_sorted(ref)):
            for kv in (0, 1):
                _page_slot(ref[name], pages, pid, kv)[:] = canon[j, layer, kv, h0:h0 + nh,
                                                                 k * t:(k + 1) * t]


def store(ref: dict[str, torch.Tensor], pages: Pages, page_ids: Sequence[int],
          blocks: Sequence[int], first_block: int = 0) -> torch.Tensor:
    """Canonical rows ``[len(blocks), bytes]`` of blocks ``blocks`` read from the pages (all
    heads must be local): what a store out of vLLM's pages must produce."""
    if pages.local_heads != pages.layout.num_kv_heads:
        raise ValueError("a store reads every head: give the pages of all kv heads")
    out = torch.zeros((len(blocks), pages.layout.bytes_per_block), dtype=torch.uint8)
    canon = _canon(out, pages.layout)
    t = pages.page_tokens
    pairs = _pairs(pages, page_ids, first_block, blocks, 0, writing=False)
    if len(pairs) != len(blocks) * pages.per_block:
        raise ValueError("the blocks are not fully in the request's pages")
    for j, k, pid in pairs:
        for layer, name in enumerate(layer_names_sorted(ref)):
            for kv in (0, 1):
                canon[j, layer, kv, :, k * t:(k + 1) * t] = _page_slot(ref[name], pages, pid, kv)
    return out


def layer_names_sorted(caches: dict[str, torch.Tensor]) -> list[str]:
    """The names of ``caches`` by layer index (``model.layers.<i>.``)."""
    return sorted(caches, key=lambda n: int(n.split("layers.")[1].split(".")[0]))
