"""SGLang's HiCache pages as kvshare blocks: their keys and their bytes.

Keys. SGLang names each page of a sequence by a hex SHA-256 chain over the page's token ids,
seeded by the request's ``extra_key``/``cache_salt`` (so tenants already differ); its storage
backends see only those keys, never the token ids. A kvshare block of an SGLang namespace is
one page, and its hash is ``H(root, field(key))`` (:func:`~kvshare.hashing.keyed_block_hash`): the namespace root
keeps models, layouts and TP shards apart, the key carries the whole prefix before it. An
SGLang page and a vLLM block of the same tokens therefore never share a hash: vLLM's blocks
are kvshare's chain over the token ids, which SGLang does not hand its storage tier.

Bytes. SGLang's host pool (``MHATokenToKVPoolHost``, ``layer_first``) holds one tensor
``[2, layers, tokens, kv_heads, head_dim]``; a page is the ``page_size`` tokens from a page
start. kvshare's canonical block is ``[layers, 2, kv_heads, tokens, head_dim]``.
:class:`HostPages` is the SDK's :class:`~kvshare.block_io.BlockIO` over a list of page starts
in that tensor, so the SDK's loads and stores copy straight between the cluster and SGLang's
host pool (the v1 zero-copy interface).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvshare.hashing import DEFAULT_HASH_FN, HashFn, keyed_block_hash
from kvshare.layout import KVLayout, normalize_dtype
from kvshare.types import BlockHash

LAYOUTS = ("layer_first",)
"""Host pool layouts :class:`HostPages` reads and writes (``--hicache-mem-layout``)."""


def page_hashes(root: BlockHash, keys: Sequence[str],
                fn: HashFn = DEFAULT_HASH_FN) -> list[BlockHash]:
    """The kvshare block hash of each SGLang page key under namespace ``root``."""
    for key in keys:
        if not isinstance(key, str) or not key:
            raise ValueError(f"an SGLang page key must be a non-empty string, got {key!r}")
    return [keyed_block_hash(root, key, fn) for key in keys]


def host_layout(kv_buffer: torch.Tensor, page_size: int, layout: str) -> KVLayout:
    """The kvshare layout of one page of a host pool's ``kv_buffer``; ValueError naming the
    fix for a layout kvshare does not read."""
    if layout not in LAYOUTS:
        raise ValueError(f"kvshare reads SGLang host pools in {LAYOUTS} layout, not {layout!r}: "
                         "start SGLang with --hicache-mem-layout layer_first")
    if kv_buffer.dim() != 5 or kv_buffer.shape[0] != 2:
        raise ValueError(f"expected a [2, layers, tokens, kv_heads, head_dim] host buffer, got "
                         f"{tuple(kv_buffer.shape)}")
    _, layers, _, heads, dim = kv_buffer.shape
    dtype = normalize_dtype(str(kv_buffer.dtype))
    return KVLayout(int(layers), int(heads), int(dim), dtype, block_tokens=page_size)


class HostPages:
    """Blocks ``0..n-1`` are the pages starting at ``starts[i]`` of an SGLang host buffer
    (:class:`~kvshare.block_io.BlockIO`). The buffer is written only through the page views,
    so pages not listed are never touched."""

    def __init__(self, kv_buffer: torch.Tensor, page_size: int, starts: Sequence[int]) -> None:
        self.kv_buffer = kv_buffer
        self.page_size = page_size
        self.starts = [int(s) for s in starts]
        tokens = int(kv_buffer.shape[2])
        for s in self.starts:
            if s < 0 or s % page_size or s + page_size > tokens:
                raise ValueError(f"page start {s} is not a page of a {tokens}-token host pool "
                                 f"with {page_size}-token pages")

    @classmethod
    def from_indices(cls, kv_buffer: torch.Tensor, page_size: int,
                     host_indices: torch.Tensor | Sequence[int]) -> HostPages:
        """Pages from SGLang's ``host_indices`` (one token index per token, pages in order)."""
        flat = [int(i) for i in (host_indices.tolist() if isinstance(host_indices, torch.Tensor)
                                 else host_indices)]
        if len(flat) % page_size:
            raise ValueError(f"{len(flat)} host indices are not whole {page_size}-token pages")
        return cls(kv_buffer, page_size, flat[::page_size])

    @property
    def num_tokens(self) -> int:
        return len(self.starts) * self.page_size

    def check(self, layout: KVLayout, tokens: int) -> None:
        got = host_layout(self.kv_buffer, self.page_size, "layer_first")
        if got.fingerprint() != layout.fingerprint():
            raise ValueError(f"the host pool holds {got.to_dict()}, the namespace expects "
                             f"{layout.to_dict()}: deploy the namespace with this model's layout")
        if tokens > self.num_tokens:
            raise ValueError(f"{tokens} tokens do not fit {len(self.starts)} pages")

    def write_block(self, index: int, block: torch.Tensor) -> None:
        self.write_blocks(index, block.unsqueeze(0))

    def read_block(self, index: int, out: torch.Tensor) -> None:
        self.read_blocks(index, out.unsqueeze(0))

    def _runs(self, first: int, n: int) -> list[tuple[int, int, int]]:
        """Blocks ``first..first+n`` as runs of pages adjacent in the buffer: (first block of
        the run, its pages, its first token)."""
        runs: list[tuple[int, int, int]] = []
        for i in range(first, first + n):
            s = self.starts[i]
            if runs and runs[-1][2] + runs[-1][1] * self.page_size == s:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1, runs[-1][2])
            else:
                runs.append((i, 1, s))
        return runs

    def _run_view(self, pages: int, start: int) -> torch.Tensor:
        """``pages`` adjacent pages from token ``start`` as ``[2, L, pages, page, H, D]``."""
        kv, layers, _, heads, dim = self.kv_buffer.shape
        return self.kv_buffer[:, :, start : start + pages * self.page_size].view(
            kv, layers, pages, self.page_size, heads, dim)

    # canonical blocks [n, L, 2, H, T, D] <-> a run [2, L, n, T, H, D]: one permutation, its
    # own inverse; one copy per run of adjacent pages (SGLang allocates them mostly in order)
    _PERM = (2, 1, 0, 4, 3, 5)

    def write_blocks(self, first: int, blocks: torch.Tensor) -> None:
        for i, pages, start in self._runs(first, blocks.shape[0]):
            self._run_view(pages, start).copy_(
                blocks[i - first : i - first + pages].permute(*self._PERM))

    def read_blocks(self, first: int, out: torch.Tensor) -> None:
        for i, pages, start in self._runs(first, out.shape[0]):
            out[i - first : i - first + pages].copy_(
                self._run_view(pages, start).permute(*self._PERM))
