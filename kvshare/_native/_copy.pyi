"""Type stub of the optional C extension ``kvshare._native._copy`` (source: ``_copy.c``)."""

from typing_extensions import Buffer

NON_TEMPORAL: int
"""1 where ``stream_copy`` uses streaming (non-temporal) stores (x86-64), else 0 (memcpy)."""

def stream_copy(dst: Buffer, src: Buffer) -> None:
    """Copy ``src`` into ``dst`` (C-contiguous, same length, ``dst`` writable) with streaming
    stores and a closing ``sfence``; overlapping buffers are memmoved; GIL released >= 64 KiB."""

def copy_chunks(dst: Buffer, dst_offsets: Buffer, src: Buffer, src_offsets: Buffer,
                chunk: int) -> None:
    """For each i copy ``chunk`` bytes from ``src[src_offsets[i]:]`` to ``dst[dst_offsets[i]:]``
    (int64 offsets, same count; every range bounds-checked first: ValueError, nothing copied);
    GIL released."""
