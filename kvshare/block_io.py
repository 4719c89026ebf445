"""Engine KV memory that converts to and from canonical blocks itself.

The SDK converts two engine shapes on its own (a contiguous tensor and :class:`PagedKV`,
see :mod:`kvshare.kv_convert`). An engine whose memory looks different (vLLM's CPU
attention pages, a TP rank's head slice, pages the engine already holds and must not be
overwritten) passes a :class:`BlockIO` instead: ``load`` and ``store`` then hand it each
block as a canonical ``[layers, 2, kv_heads, block_tokens, head_dim]`` view and it does the
one copy into (or out of) its own memory. ``write_blocks``/``read_blocks`` take several
consecutive blocks at once (``[n, layers, 2, kv_heads, block_tokens, head_dim]``), so memory
that can move them in a few vectorised copies does (the SDK's loads and stores use these).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

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
