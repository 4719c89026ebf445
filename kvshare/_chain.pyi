"""Type stub of the optional C extension ``kvshare._chain`` (source: ``_chain.c``)."""

from typing_extensions import Buffer

def sha256_chain(parent: bytes, data: Buffer, block_bytes: int, tail: bytes) -> list[bytes]:
    """``h_i = sha256(h_{i-1} || data block i || tail)`` for every full ``block_bytes`` block of
    ``data`` (any C-contiguous buffer), ``h_{-1} = parent`` (32 bytes); GIL released."""

def pack_u32(ids: list[int] | tuple[int, ...]) -> bytes:
    """``ids`` as little-endian u32 bytes in one pass; OverflowError for an id outside
    [0, 2**32), TypeError for a non-integer."""

def sha256_chain_u32(parent: bytes, ids: list[int] | tuple[int, ...], block_tokens: int,
                     tail: bytes) -> list[bytes]:
    """``sha256_chain(parent, pack_u32(ids), 4 * block_tokens, tail)`` in one pass (GIL held);
    every id is checked, with ``pack_u32``'s refusals."""
