"""Type stub of the optional C extension ``kvshare._native._hashq`` (source: ``_hashq.c``)."""

from typing_extensions import Buffer

def bind(path: str) -> bool:
    """Use ``XXH3_64bits`` from the loaded library at ``path``; False if it is not exported."""

def digest(buffer: Buffer) -> int:
    """The bound xxh3-64 of ``buffer``."""

class HashQueue:
    """One native thread that xxh3-64s pushed buffers in order, without the GIL."""

    def __init__(self, capacity: int) -> None: ...
    def push(self, addr: int, nbytes: int) -> int:
        """Queue ``nbytes`` at ``addr`` (kept alive by the caller); returns its position."""
    def wait(self, timeout_s: float) -> list[int] | None:
        """Digests of every pushed buffer in push order, or None when ``timeout_s`` passed."""
    def close(self) -> None:
        """Stop after the current buffer and join the thread."""
