"""Conversion between engine KV memory and the canonical block format.

Canonical block payload (flat uint8 on the wire and in every tier)::

    [layer][k|v][kv_head][token][head_dim]      in the layout's dtype

Engine side, two shapes are supported:

- *contiguous*: one tensor ``[layers, 2, kv_heads, tokens, head_dim]`` (``kv[l, 0]`` is layer
  ``l``'s keys as ``[kv_heads, tokens, head_dim]``, exactly the per-sequence slice of a
  transformers ``DynamicCache`` layer ``[batch, kv_heads, tokens, head_dim]``);
- *paged*: per layer ``[2, num_pages, page_tokens, kv_heads, head_dim]`` (vLLM's flash-attention
  layout) plus a page table; ``block_tokens`` must be a multiple of ``page_tokens``.

Views are zero-copy (``torch.from_numpy(...).view(dtype)``); each conversion does exactly one
copy, straight into its destination.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvshare.block_io import BlockIO, PagedKV
from kvshare.layout import KVLayout

TORCH_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def torch_dtype(layout: KVLayout) -> torch.dtype:
    return TORCH_DTYPES[layout.dtype]


def as_u8_tensor(data: Any) -> torch.Tensor:
    """A flat uint8 CPU tensor over ``data`` (numpy array, tensor, bytes) without copying."""
    if isinstance(data, torch.Tensor):
        return data.reshape(-1).view(torch.uint8)
    arr = data if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
    with warnings.catch_warnings():  # read-only object-store buffers: we only read them
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr.reshape(-1).view(np.uint8))


def block_view(data: Any, layout: KVLayout) -> torch.Tensor:
    """A block payload viewed as ``[layers, 2, kv_heads, block_tokens, head_dim]``."""
    u8 = as_u8_tensor(data)
    if u8.numel() != layout.bytes_per_block:
        raise ValueError(
            f"block payload is {u8.numel()} bytes but the layout's blocks are "
            f"{layout.bytes_per_block} bytes: check dtype, block_tokens and kv heads"
        )
    return u8.view(torch_dtype(layout)).view(layout.block_shape)


def blocks_view(rows: Any, layout: KVLayout) -> torch.Tensor:
    """``n`` block payloads in one buffer (``[n, bytes_per_block]``, contiguous) viewed as
    ``[n, layers, 2, kv_heads, block_tokens, head_dim]``."""
    u8 = as_u8_tensor(rows)
    if u8.numel() % layout.bytes_per_block:
        raise ValueError(f"{u8.numel()} bytes is not a whole number of {layout.bytes_per_block}"
                         "-byte blocks: check dtype, block_tokens and kv heads")
    return u8.view(torch_dtype(layout)).view(-1, *layout.block_shape)


def new_contiguous(layout: KVLayout, tokens: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """An empty contiguous KV buffer for ``tokens`` tokens."""
    L, _, H, _, D = layout.block_shape
    return torch.empty((L, 2, H, tokens, D), dtype=torch_dtype(layout), device=device)


def check_contiguous(kv: torch.Tensor, layout: KVLayout, min_tokens: int) -> None:
    """ValueError naming the fix if ``kv`` is not a contiguous KV buffer for this layout."""
    L, _, H, _, D = layout.block_shape
    if kv.dim() != 5 or kv.shape[0] != L or kv.shape[1] != 2 or kv.shape[2] != H or kv.shape[4] != D:
        raise ValueError(
            f"contiguous KV must be [layers={L}, 2, kv_heads={H}, tokens, head_dim={D}], "
            f"got {list(kv.shape)}"
        )
    if kv.dtype != torch_dtype(layout):
        raise ValueError(f"contiguous KV dtype is {kv.dtype}, the layout needs {torch_dtype(layout)}")
    if kv.shape[3] < min_tokens:
        raise ValueError(f"contiguous KV holds {kv.shape[3]} tokens, {min_tokens} are needed")


def block_into_contiguous(block: Any, kv: torch.Tensor, index: int, layout: KVLayout) -> None:
    """Copy one block into tokens ``[index*B, (index+1)*B)`` of a contiguous buffer."""
    B = layout.block_tokens
    kv[:, :, :, index * B : (index + 1) * B, :].copy_(block_view(block, layout))


def contiguous_into_block(kv: torch.Tensor, index: int, out: Any, layout: KVLayout) -> None:
    """Copy tokens ``[index*B, (index+1)*B)`` of a contiguous buffer into a block payload."""
    B = layout.block_tokens
    block_view(out, layout).copy_(kv[:, :, :, index * B : (index + 1) * B, :])


def layers_into_block(
    layers: Sequence[tuple[torch.Tensor, torch.Tensor]], index: int, out: Any, layout: KVLayout
) -> None:
    """Copy block ``index`` of per-layer ``(keys, values)`` ``[1, H, T, D]`` into ``out``."""
    if len(layers) != layout.num_layers:
        raise ValueError(f"got KV for {len(layers)} layers, the layout has {layout.num_layers}")
    B = layout.block_tokens
    dest = block_view(out, layout)
    s, e = index * B, (index + 1) * B
    for layer, (k, v) in enumerate(layers):
        dest[layer, 0].copy_(k[0, :, s:e, :])
        dest[layer, 1].copy_(v[0, :, s:e, :])


def block_into_pages(
    block: Any, pages: Sequence[torch.Tensor], page_ids: Sequence[int], layout: KVLayout
) -> None:
    """Copy one block into an engine's paged KV (per layer ``[2, P, page_tokens, H, D]``).

    ``page_ids`` are the engine pages that hold this block's tokens, in order
    (``block_tokens // page_tokens`` of them).
    """
    src = block_view(block, layout)
    if len(pages) != layout.num_layers:
        raise ValueError(f"got paged KV for {len(pages)} layers, the layout has {layout.num_layers}")
    page_tokens = int(pages[0].shape[2])
    per_block = layout.block_tokens // page_tokens
    if layout.block_tokens % page_tokens or len(page_ids) != per_block:
        raise ValueError(
            f"a {layout.block_tokens}-token block needs {per_block} pages of {page_tokens} "
            f"tokens (block_tokens must be a multiple of the page size), got {len(page_ids)}"
        )
    for layer, paged in enumerate(pages):
        for j, pid in enumerate(page_ids):
            chunk = src[layer, :, :, j * page_tokens : (j + 1) * page_tokens, :]  # [2, H, t, D]
            paged[:, pid].copy_(chunk.transpose(1, 2))


def pages_into_block(
    pages: Sequence[torch.Tensor], page_ids: Sequence[int], out: Any, layout: KVLayout
) -> None:
    """Inverse of :func:`block_into_pages`."""
    dest = block_view(out, layout)
    page_tokens = int(pages[0].shape[2])
    for layer, paged in enumerate(pages):
        for j, pid in enumerate(page_ids):
            dest[layer, :, :, j * page_tokens : (j + 1) * page_tokens, :].copy_(
                paged[:, pid].transpose(1, 2)
            )


def block_into_target(block: Any, target: Any, index: int, layout: KVLayout) -> None:
    """Copy block ``index`` into a load target (contiguous tensor or :class:`PagedKV`)."""
    if isinstance(target, BlockIO):
        target.write_block(index, block_view(block, layout))
    elif isinstance(target, PagedKV):
        block_into_pages(block, target.pages, target.block_pages(index, layout.block_tokens), layout)
    elif isinstance(target, torch.Tensor):
        check_contiguous(target, layout, (index + 1) * layout.block_tokens)
        block_into_contiguous(block, target, index, layout)
    else:
        raise TypeError(
            f"load target must be a [layers, 2, kv_heads, tokens, head_dim] tensor or PagedKV, "
            f"got {type(target).__name__}"
        )


def blocks_into_target(rows: Any, target: Any, first: int, layout: KVLayout) -> None:
    """Copy ``len(rows)`` consecutive blocks (one buffer) into a load target from block
    ``first``: one call for a :class:`BlockIO` (it vectorises), else block by block."""
    if isinstance(target, BlockIO):
        target.write_blocks(first, blocks_view(rows, layout))
        return
    for i in range(len(rows)):
        block_into_target(rows[i], target, first + i, layout)


def blocks_from_source(source: Any, first: int, rows: Any, layout: KVLayout) -> None:
    """Copy blocks ``first..first+len(rows)`` of a store source into ``rows`` (one buffer)."""
    if isinstance(source, BlockIO):
        source.read_blocks(first, blocks_view(rows, layout))
        return
    for j in range(len(rows)):
        block_from_source(source, first + j, rows[j], layout)


def source_tokens(source: Any) -> int:
    """How many tokens a store source holds."""
    if isinstance(source, BlockIO):
        return source.num_tokens
    if isinstance(source, PagedKV):
        return len(source.page_table) * int(source.pages[0].shape[2])
    if isinstance(source, torch.Tensor):
        return int(source.shape[3])
    return int(source[0][0].shape[-2])


def block_from_source(source: Any, index: int, out: Any, layout: KVLayout) -> None:
    """Copy block ``index`` of a store source (contiguous, paged, or per-layer) into ``out``."""
    if isinstance(source, BlockIO):
        source.read_block(index, block_view(out, layout))
    elif isinstance(source, PagedKV):
        pages_into_block(source.pages, source.block_pages(index, layout.block_tokens), out, layout)
    elif isinstance(source, torch.Tensor):
        contiguous_into_block(source, index, out, layout)
    elif isinstance(source, Sequence):
        layers_into_block(source, index, out, layout)
    else:
        raise TypeError(f"cannot store KV from {type(source).__name__}")


def check_source(source: Any, layout: KVLayout) -> None:
    """ValueError naming the fix if ``source`` cannot be stored under ``layout``."""
    L, _, H, _, D = layout.block_shape
    dtype = torch_dtype(layout)
    if isinstance(source, BlockIO):
        source.check(layout, 0)
        return
    if isinstance(source, torch.Tensor):
        check_contiguous(source, layout, 0)
        return
    if isinstance(source, PagedKV):
        tensors = list(source.pages)
        want = "[2, pages, page_tokens, kv_heads, head_dim]"
        ok = all(t.dim() == 5 and t.shape[0] == 2 and t.shape[3] == H and t.shape[4] == D
                 for t in tensors)
        if ok and tensors and layout.block_tokens % int(tensors[0].shape[2]):
            raise ValueError(
                f"block_tokens {layout.block_tokens} is not a multiple of the page size "
                f"{int(tensors[0].shape[2])}"
            )
    elif isinstance(source, Sequence):
        tensors = [t for pair in source for t in pair]
        want = "(keys, values) of [1, kv_heads, tokens, head_dim]"
        ok = all(len(pair) == 2 for pair in source) and all(
            t.dim() == 4 and t.shape[0] == 1 and t.shape[1] == H and t.shape[3] == D
            for t in tensors
        )
    else:
        raise TypeError(f"cannot store KV from {type(source).__name__}")
    n_layers = len(source.pages) if isinstance(source, PagedKV) else len(source)
    if n_layers != L or not ok:
        raise ValueError(
            f"KV to store must be {L} layers of {want} with kv_heads={H}, head_dim={D}; got "
            f"{n_layers} layers of shapes {sorted({tuple(t.shape) for t in tensors})[:3]}"
        )
    if any(t.dtype != dtype for t in tensors):
        raise ValueError(f"KV to store must be {dtype} (the namespace's layout dtype)")


def check_target(target: Any, layout: KVLayout, tokens: int) -> None:
    """ValueError naming the fix if ``target`` cannot receive ``tokens`` tokens of ``layout``."""
    if isinstance(target, BlockIO):
        target.check(layout, tokens)
        return
    if isinstance(target, torch.Tensor):
        check_contiguous(target, layout, tokens)
        return
    if not isinstance(target, PagedKV):
        raise TypeError(
            f"load target must be a [layers, 2, kv_heads, tokens, head_dim] tensor or PagedKV, "
            f"got {type(target).__name__}"
        )
    check_source(target, layout)
    room = len(target.page_table) * int(target.pages[0].shape[2])
    if room < tokens:
        raise ValueError(f"the page table covers {room} tokens, the plan loads {tokens}")


def blocks_to_contiguous(blocks: Sequence[Any], layout: KVLayout) -> torch.Tensor:
    """A contiguous KV tensor holding ``blocks`` (canonical payloads) in order: one copy each."""
    kv = new_contiguous(layout, len(blocks) * layout.block_tokens)
    for i, block in enumerate(blocks):
        block_into_contiguous(block, kv, i, layout)
    return kv
