"""Storage tiers behind one small ABC. Implementations import lazily (gpu needs CUDA)."""

from kvshare.tiers.base import CorruptBlock, TierStore, as_u8, block_checksum

__all__ = ["CorruptBlock", "TierStore", "as_u8", "block_checksum"]
