"""The cost policy's ready blocks in C (``kvshare._native._ready``): :class:`~kvshare.router.core.ready.ReadyBlocks`
with the same entries, order, drops and answers, at a few microseconds a prompt.

Importing this module raises ImportError where the extension was not built;
:func:`kvshare.router.core.ready.ready_blocks` then gives the Python book.
"""

from __future__ import annotations

from kvshare._native._ready import Book
from kvshare.cost import Source


class NativeReady(Book):
    """:class:`~kvshare.router.core.ready.ReadyBlocks` over the C book (same constructor, same answers)."""

    def __init__(self, max_entries: int = 1_000_000) -> None:
        super().__init__(max_entries, int(Source.LOCAL_GPU), int(Source.REMOTE_HOST))
