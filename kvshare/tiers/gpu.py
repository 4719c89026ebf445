"""GPU tier: slots in one device buffer (torch, CUDA). Lives only inside a worker process.

Needs CUDA; constructing it without a GPU raises RuntimeError saying so. Payloads come and go
as host uint8 arrays (or device tensors); verification relies on the pool's slot epochs.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvshare.tiers.base import ByteArray, TierStore, block_checksum, check_geometry
from kvshare.types import BlockHash, Tier


class GpuStore(TierStore):
    """``num_slots`` slots of ``slot_bytes`` in one CUDA allocation."""

    tier = Tier.GPU

    def __init__(self, slot_bytes: int, num_slots: int, device: str = "cuda") -> None:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("the gpu tier needs a CUDA device and none is available")
        check_geometry("gpu store", slot_bytes, num_slots)
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.buffer: Any = torch.empty((num_slots, slot_bytes), dtype=torch.uint8, device=device)

    def slot_tensor(self, slot: int) -> Any:
        """The slot as a device uint8 tensor (zero-copy)."""
        self._check(slot)
        return self.buffer[slot]

    def write(self, slot: int, data: ByteArray, block_hash: BlockHash, checksum: int) -> None:
        import torch

        self._check(slot, data)
        src = data if isinstance(data, torch.Tensor) else torch.from_numpy(np.asarray(data))
        self.buffer[slot].copy_(src.reshape(-1), non_blocking=False)

    def read_into(self, slot: int, out: ByteArray, block_hash: BlockHash, checksum: int) -> None:
        import torch

        self._check(slot, out)
        torch.from_numpy(out).copy_(self.buffer[slot])

    def checksum(self, slot: int) -> int:
        return block_checksum(self.buffer[slot].cpu().numpy())

    def discard(self, slot: int) -> None:
        self._check(slot)

    def close(self) -> None:
        self.buffer = None
