"""Type stub of the optional C extension ``kvshare._copy`` (source: ``_copy.c``)."""

from typing_extensions import Buffer

NON_TEMPORAL: int
"""1 where ``stream_copy`` uses streaming (non-temporal) stores (x86-64), else 0 (memcpy)."""

def stream_copy(dst: Buffer, src: Buffer) -> None:
    """Copy ``src`` into ``dst`` (C-contiguous, same length, ``dst`` writable) with streaming
    stores and a closing ``sfence``; overlapping buffers are memmoved; GIL released >= 64 KiB."""
