"""Type stub of the optional C extension ``kvshare._native._chain`` (source: ``_chain.c``)."""

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

def xxh3_bind(path: str) -> bool:
    """Use ``XXH3_128bits`` of the already loaded library at ``path`` (the ``xxhash`` package's
    extension) for :func:`xxh3_chain`; False where it is not loaded or lacks it."""

def xxh3_chain(parent: bytes, data: Buffer, block_bytes: int, tail: bytes) -> list[bytes]:
    """``h_i = xxh3_128(h_{i-1} || data block i || tail)`` (canonical 16-byte digests) for every
    full ``block_bytes`` block of ``data``, ``h_{-1} = parent`` (16 bytes); RuntimeError before
    :func:`xxh3_bind` succeeded."""

class ChainMemo:
    """``sha256_chain_u32`` with a verified memo of up to ``capacity_blocks`` recent blocks: a
    block whose parent digest and packed ids equal a kept block's (compared byte for byte) takes
    its digest; every id is still read and checked. ``fingerprint_bits`` < 64 weakens the set
    index on purpose (tests)."""

    def __init__(self, block_tokens: int, capacity_blocks: int, tail: bytes,
                 fingerprint_bits: int = 64) -> None: ...
    def chain(self, parent: bytes, ids: list[int] | tuple[int, ...]) -> list[bytes]: ...
    def chain_packed(self, parent: bytes, data: Buffer) -> list[bytes]:
        """``chain`` of ids already packed as little-endian u32 (``4 * n`` bytes, any
        contiguous buffer); ValueError if its length is not a multiple of 4."""
    def clear(self) -> None: ...
    def stats(self) -> dict[str, int]:
        """``hits``, ``misses`` (blocks), ``blocks`` kept now, ``capacity``."""
