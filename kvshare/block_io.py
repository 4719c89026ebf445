"""Engine KV memory: what a load fills (:data:`KVTarget`) and a store reads (:data:`StorableKV`).

The SDK converts two engine shapes on its own (a contiguous tensor and :class:`PagedKV`,
see :mod:`kvshare.kv_convert`). An engine whose memory looks different (vLLM's CPU
attention pages, a TP rank's head slice, pages the engine already holds and must not be
overwritten) passes a :class:`BlockIO` instead: ``load`` and ``store`` then hand it each
block as a canonical ``[layers, 2, kv_heads, block_tokens, head_dim]`` view and it does the
one copy into (or out of) its own memory. ``write_blocks``/``read_blocks`` take several
consecutive blocks at once (``[n, layers, 2, kv_heads, block_tokens, head_dim]``), so memory
that can move them in a few vectorised copies does (the SDK's loads and stores use these).
Memory that is also a :class:`SlabIO` is copied straight from and into this node's pool slab.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt
import torch

from kvshare.layout import KVLayout


@runtime_checkable
class BlockIO(Protocol):
    """Block ``index`` is the ``index``-th block of a plan (load) or of a store's hashes."""

    @property
    def num_tokens(self) -> int:
        """Tokens this memory covers (full blocks only are read or written)."""
        ...

    def check(self, layout: KVLayout, tokens: int) -> None:
        """ValueError naming the fix if this memory cannot hold ``tokens`` tokens of ``layout``."""
        ...

    def write_block(self, index: int, block: torch.Tensor) -> None:
        """Copy canonical block ``block`` (a read-only view) into this memory."""
        ...

    def read_block(self, index: int, out: torch.Tensor) -> None:
        """Copy this memory's block ``index`` into the canonical view ``out``."""
        ...

    def write_blocks(self, first: int, blocks: torch.Tensor) -> None:
        """Copy ``blocks`` (``[n, *block]``, read-only) into blocks ``first..first+n``."""
        ...

    def read_blocks(self, first: int, out: torch.Tensor) -> None:
        """Copy blocks ``first..first+n`` into ``out`` (``[n, *block]``)."""
        ...


@runtime_checkable
class SlabIO(Protocol):
    """Engine memory that copies straight to and from a pool's shared-memory slab.

    ``rows`` is the slab mapped in this process (``[slots, bytes_per_block]`` uint8); block
    ``blocks[i]`` (numbered as in :class:`BlockIO`) is slot ``slots[i]``. A load from this
    node's pool then makes one copy (slab -> engine) instead of two (slab -> staging ->
    engine), and a store one instead of two.

    A load writes *before* the pool's slot epochs are re-checked, so a block whose check then
    fails (its slot was given to another block meanwhile) may hold that other block's bytes.
    Only memory whose engine recomputes the blocks a load reports failed may implement this
    (vLLM's pages: the connector reports them as invalid block ids); the SDK never writes
    a :class:`BlockIO` or tensor target past its verified prefix.
    """

    def write_slots(self, blocks: Sequence[int], rows: npt.NDArray[np.uint8],
                    slots: Sequence[int]) -> None:
        """Copy slab rows ``slots[i]`` into blocks ``blocks[i]`` of this memory."""
        ...

    def read_slots(self, blocks: Sequence[int], rows: npt.NDArray[np.uint8],
                   slots: Sequence[int]) -> None:
        """Copy blocks ``blocks[i]`` of this memory into slab rows ``slots[i]``."""
        ...


@dataclass(frozen=True)
class PagedKV:
    """An engine's paged KV memory as a load/store destination.

    ``pages[l]`` is layer ``l``'s ``[2, num_pages, page_tokens, kv_heads, head_dim]`` tensor;
    ``page_table`` lists the sequence's pages in token order.
    """

    pages: Sequence[torch.Tensor]
    page_table: Sequence[int]

    def block_pages(self, index: int, block_tokens: int) -> Sequence[int]:
        per = block_tokens // int(self.pages[0].shape[2])
        return self.page_table[index * per : (index + 1) * per]


KVTarget = torch.Tensor | PagedKV | BlockIO
"""Contiguous ``[layers, 2, kv_heads, tokens, head_dim]`` tensor, or paged KV."""

StorableKV = torch.Tensor | PagedKV | BlockIO | Sequence[tuple[torch.Tensor, torch.Tensor]]
"""What ``store`` accepts: a KVTarget, or per-layer ``(keys, values)`` ``[1, H, T, D]``."""
