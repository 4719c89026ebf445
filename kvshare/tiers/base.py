"""The storage-tier boundary: fixed-size slots that hold block payloads.

A ``TierStore`` moves bytes and nothing else; which hash lives in which slot, eviction and
leases belong to ``TieredBlockPool``. Contract shared by every implementation (and checked by
one conformance suite, ``tests/test_tiers.py``):

- slots are numbered ``0 .. num_slots-1`` and each holds exactly ``slot_bytes`` bytes;
- ``write`` replaces the slot's content; after it returns, ``read_into`` yields those bytes;
- ``read_into`` raises :class:`CorruptBlock` when the slot does not hold an intact block
  written for ``block_hash`` (stores that keep headers check them; the host slab relies on
  the pool's slot epochs instead);
- ``recover`` lists the intact blocks that survived a restart (persistent tiers only);
- a store never raises for a valid slot number except for I/O faults and corruption.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
import numpy.typing as npt
import xxhash

from kvshare.types import BlockHash, Tier

try:  # optional C accelerator, built by `pip install -e .` where a compiler exists (setup.py)
    from kvshare._native import _copy
except ImportError:  # pragma: no cover - depends on the build
    _copy = None  # type: ignore[assignment]

ByteArray = npt.NDArray[np.uint8]

STREAM_MIN_BYTES = 64 * 1024
"""Copies at least this long use streaming stores (where built); below it numpy's copy."""

STREAMING_COPY: bool = _copy is not None and bool(_copy.NON_TEMPORAL)
"""Whether :func:`copy_block` can bypass the cache (``kvshare._native._copy`` built on x86-64)."""


def copy_block(dst: ByteArray, src: ByteArray, stream: bool = True) -> None:
    """Copy ``src`` into ``dst`` (C-contiguous uint8 of the same length).

    With ``stream`` (and :data:`STREAMING_COPY`), copies of :data:`STREAM_MIN_BYTES` or more
    use non-temporal stores: a block written into a pool slot (or read out of one) is not
    re-read by this core soon, and bypassing the cache saves the read-for-ownership of every
    destination line (measured: 2 MiB blocks ~17 GB/s vs ~10 GB/s for numpy's cached copy).
    The stores are fenced before returning, so other processes see the bytes afterwards.
    """
    if (
        stream
        and STREAMING_COPY
        and src.nbytes >= STREAM_MIN_BYTES
        and dst.flags.c_contiguous
        and src.flags.c_contiguous
    ):
        _copy.stream_copy(dst.data, src.data)
    else:
        np.copyto(dst, src, casting="no")


def block_checksum(data: ByteArray | bytes | memoryview) -> int:
    """xxh3-64 of a block payload: the checksum stored with every block."""
    buf = data.data if isinstance(data, np.ndarray) else data
    return int(xxhash.xxh3_64_intdigest(buf))


def check_geometry(store: str, slot_bytes: int, num_slots: int) -> None:
    """ValueError naming the store unless it has positive ``slot_bytes`` and ``num_slots``."""
    if slot_bytes <= 0 or num_slots <= 0:
        raise ValueError(
            f"{store} needs positive slot_bytes and num_slots, got {slot_bytes}, {num_slots}"
        )


class CorruptBlock(Exception):
    """A slot's bytes failed verification (checksum, header or length)."""


class TierStore(ABC):
    """Fixed-size slots of one tier."""

    tier: Tier
    slot_bytes: int
    num_slots: int

    @abstractmethod
    def write(self, slot: int, data: ByteArray, block_hash: BlockHash, checksum: int) -> None:
        """Store ``data`` (exactly ``slot_bytes`` uint8) in ``slot``."""

    @abstractmethod
    def read_into(self, slot: int, out: ByteArray, block_hash: BlockHash, checksum: int) -> None:
        """Copy the slot's bytes into ``out``; :class:`CorruptBlock` if they fail verification."""

    @abstractmethod
    def discard(self, slot: int) -> None:
        """Forget the slot's content (persistent tiers delete it, so it is not recovered)."""

    def recover(self) -> list[tuple[int, BlockHash, int]]:
        """``(slot, hash, checksum)`` of intact blocks found at start; volatile tiers: none."""
        return []

    def write_checksummed(self, slot: int, data: ByteArray, block_hash: BlockHash) -> int:
        """:meth:`write` that also returns ``block_checksum(data)``.

        Stores that can hash while they copy (the host slab) override this to save a pass
        over memory; the result must equal ``block_checksum(data)``.
        """
        checksum = block_checksum(data)
        self.write(slot, data, block_hash, checksum)
        return checksum

    def checksum(self, slot: int) -> int:
        """Checksum of the slot's current bytes (used at commit when the writer gave none)."""
        out = np.empty(self.slot_bytes, dtype=np.uint8)
        self.read_into(slot, out, BlockHash(b""), -1)
        return block_checksum(out)

    def close(self) -> None:
        """Release resources (unmap, close files). The store is unusable afterwards."""

    def _check(self, slot: int, data: ByteArray | None = None) -> None:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.num_slots})")
        if data is not None and data.nbytes != self.slot_bytes:
            raise ValueError(
                f"block payload is {data.nbytes} bytes but this pool's blocks are "
                f"{self.slot_bytes} bytes: check the KV layout (dtype, block_tokens, heads)"
            )


def as_u8(data: object) -> ByteArray:
    """View bytes-like data (numpy array, bytes, memoryview, CPU torch tensor) as flat uint8."""
    if isinstance(data, np.ndarray):
        arr = data
    elif hasattr(data, "numpy") and hasattr(data, "is_contiguous"):  # torch.Tensor on CPU
        t = data.contiguous()  # type: ignore[attr-defined]
        arr = t.view(-1).view(__import__("torch").uint8).numpy()
    else:
        arr = np.frombuffer(data, dtype=np.uint8)  # type: ignore[call-overload]
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    return arr.reshape(-1).view(np.uint8)


def as_u8_out(out: object) -> ByteArray:
    """:func:`as_u8` for a destination: a writable view of ``out``'s own memory, never a copy.

    A strided array or tensor would otherwise be copied first, and a read would fill the copy
    and leave ``out`` as it was; such destinations raise ValueError instead.
    """
    if isinstance(out, np.ndarray):
        shared = bool(out.flags.c_contiguous)
    elif hasattr(out, "numpy") and hasattr(out, "is_contiguous"):  # torch.Tensor on CPU
        shared = bool(out.is_contiguous())
    else:
        shared = True  # bytes-like objects are viewed, not copied
    arr = as_u8(out)
    if not shared or not arr.flags.writeable:
        raise ValueError(
            "read destination must be a writable, C-contiguous array or tensor (it would be "
            "copied, not filled): pass np.ascontiguousarray / .contiguous() storage instead"
        )
    return arr
