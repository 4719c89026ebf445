"""vLLM's KV-cache groups on the connector's side (the hybrid memory allocator, ``SupportsHMA``).

A sliding-window hybrid (Gemma 2/3, gpt-oss) served with the hybrid allocator has one
KV-cache group per attention window: a full-attention group whose pages a request keeps to its
end, and a sliding group whose pages behind the window vLLM frees as the request advances
(they become the null page, :data:`~kvshare.vllm.connector.paged.NULL_PAGE`). All groups draw
pages from one pool, and vLLM hands the connector one page list per group.

The share block format stays the layout's (DESIGN "canonical block format"; every layer of the
block, :class:`kvshare.layout.KVLayout`), so:

- **save**: a share block is stored only while every page it covers, in every group, is a real
  page: the blocks a step computes always are (vLLM frees a sliding group's pages at a later
  step's allocation, never in the step that computes them); blocks of vLLM's own prefix hit
  behind the window are not (:func:`savable_from`). Because vLLM frees those pages at the
  next step whatever the connector does, a hybrid's saves copy their pages before the step
  returns (:class:`CopySignal`), not in the background.
- **load**: the whole block travels and the full-attention group's pages are written; a
  sliding group's pages are written where vLLM allocated real pages (the hit's last window),
  its null pages are skipped.

With one group (MHA, or a hybrid whose allocator vLLM turned off: every layer keeps every page)
nothing here changes the single-list path.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvshare.layout import KVLayout
from kvshare.vllm.connector.paged import NULL_PAGE, PagedRequestKV, PageViews, layer_order

SUPPORTED_SPECS = ("FullAttentionSpec", "SlidingWindowSpec", "MLAAttentionSpec")
"""vLLM KV-cache spec classes whose pages kvshare loads and saves."""


@dataclass(frozen=True)
class EngineGroups:
    """The engine's KV-cache groups: ``layers[g]`` the canonical layers of vLLM group ``g``,
    ``windows[g]`` its sliding window (None: full attention, every page kept)."""

    layers: tuple[tuple[int, ...], ...]
    windows: tuple[int | None, ...]

    @property
    def grouped(self) -> bool:
        """Several groups or a sliding one: loads and saves carry every group's page list
        (null pages skipped), loads run asynchronously and a failed one fails its request
        (``failed_recving``), not pages."""
        return len(self.layers) > 1 or any(w is not None for w in self.windows)

    @classmethod
    def single(cls, num_layers: int) -> EngineGroups:
        return cls((tuple(range(num_layers)),), (None,))

    @classmethod
    def from_vllm(cls, kv_cache_config: Any, layout: KVLayout, model: str) -> EngineGroups:
        """The groups of vLLM's ``KVCacheConfig`` checked against ``layout``: ValueError naming
        the fix for a spec kvshare has no block format for, or windows that differ from the
        namespace layout's."""
        groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
        if not groups:
            return cls.single(layout.num_layers)
        windows = {i: g.window for g in layout.groups for i in g.layers}
        index = {name: i for i, name in enumerate(layer_order(
            [n for g in groups for n in g.layer_names]))}
        out_layers, out_windows = [], []
        for gi, group in enumerate(groups):
            spec = group.kv_cache_spec
            kind = type(spec).__name__
            if kind not in SUPPORTED_SPECS:
                raise ValueError(
                    f"KVShareConnector: {model}'s KV-cache group {gi} is a {kind} (layers "
                    f"{list(group.layer_names)[:4]}...), which kvshare has no block format for "
                    f"(it shares {', '.join(SUPPORTED_SPECS)}): remove the KVShareConnector "
                    "from --kv-transfer-config for this model")
            layers = tuple(sorted(index[n] for n in group.layer_names))
            window = int(spec.sliding_window) if kind == "SlidingWindowSpec" else None
            for i in layers:
                want = windows.get(i)
                if window is not None and want != window:
                    raise ValueError(
                        f"KVShareConnector: vLLM runs layer {i} of {model} with a sliding "
                        f"window of {window} tokens, the namespace layout says {want}: deploy "
                        "the namespace with this model's config.json (`kvshare up --layout`)")
            out_layers.append(layers)
            out_windows.append(window)
        if sorted(i for ls in out_layers for i in ls) != list(range(layout.num_layers)):
            raise ValueError(f"KVShareConnector: vLLM's KV-cache groups hold layers "
                             f"{sorted(i for ls in out_layers for i in ls)}, the layout "
                             f"{layout.num_layers}")
        return cls(tuple(out_layers), tuple(out_windows))


def savable_from(group_pages: Sequence[Sequence[int]], start: int, end: int,
                 pages_per_block: int) -> int:
    """The first block ``b >= start`` such that blocks ``b..end-1`` cover no null page in any
    group (``end`` when block ``end - 1`` does): the share blocks a save may read."""
    first = start
    for pages in group_pages:
        for p in range(min(end * pages_per_block, len(pages)) - 1, start * pages_per_block - 1,
                       -1):
            if pages[p] == NULL_PAGE:
                first = max(first, p // pages_per_block + 1)
                break
    return min(first, end)


class CopySignal:
    """Set once a store has read its pages (or the store ended without reading them)."""

    def __init__(self) -> None:
        self.event = threading.Event()


class GroupedRequestKV:
    """One request's pages across vLLM's KV-cache groups as one BlockIO and SlabIO: each
    group's layers copy through their own :class:`PagedRequestKV` over that group's page
    list (null pages skipped on writes, refused on reads). ``copied`` (when given) is set
    after every read of the pages (a store's copy), so the step can wait for it."""

    def __init__(self, pages: PageViews, layout: KVLayout, groups: EngineGroups,
                 group_pages: Sequence[Sequence[int]], first_block: int = 0,
                 keep_tokens: int = 0, copied: CopySignal | None = None) -> None:
        if len(group_pages) != len(groups.layers):
            raise ValueError(f"{len(group_pages)} page lists for {len(groups.layers)} KV-cache "
                             "groups")
        self.layout = layout
        self.copied = copied
        self.parts = [
            PagedRequestKV(PageViews(tuple(pages.views[i] for i in layers), pages.page_tokens,
                                     pages.kind, pages.head_start),
                           layout, ids, first_block, keep_tokens, layers=layers, null_pages=True)
            for layers, ids in zip(groups.layers, group_pages, strict=True)]

    @property
    def num_tokens(self) -> int:
        return min(p.num_tokens for p in self.parts)

    def check(self, layout: KVLayout, tokens: int) -> None:
        for part in self.parts:
            part.check(layout, tokens)

    def write_blocks(self, first: int, blocks: torch.Tensor) -> None:
        for part in self.parts:
            part.write_blocks(first, blocks)

    def write_block(self, index: int, block: torch.Tensor) -> None:
        self.write_blocks(index, block.unsqueeze(0))

    def read_blocks(self, first: int, out: torch.Tensor) -> None:
        try:
            for part in self.parts:
                part.read_blocks(first, out)
        finally:
            self._copied()

    def read_block(self, index: int, out: torch.Tensor) -> None:
        self.read_blocks(index, out.unsqueeze(0))

    def write_slots(self, blocks: Sequence[int], rows: np.ndarray, slots: Sequence[int]) -> None:
        for part in self.parts:
            part.write_slots(blocks, rows, slots)

    def read_slots(self, blocks: Sequence[int], rows: np.ndarray, slots: Sequence[int]) -> None:
        try:
            for part in self.parts:
                part.read_slots(blocks, rows, slots)
        finally:
            self._copied()

    def _copied(self) -> None:
        if self.copied is not None:
            self.copied.event.set()
