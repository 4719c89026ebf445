"""Object-store transport: the fallback that always works, on any node, without NIXL.

A batch travels as ONE ``[n, block_bytes]`` numpy uint8 array through the Ray object store
(never pickled torch tensors): for reads the source copies the blocks out in a single call
(pin, copy, unpin inside the pool, so no lease outlives the call) and the reader copies them
into its destination and verifies each block's checksum; for writes the reader ships the
array plus checksums and the pool stores the blocks whose checksum still matches. Replies are
awaited without blocking, so ``poll`` can enforce the deadline.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvshare.tiers.base import ByteArray, block_checksum, copy_block
from kvshare.transfer.base import (
    CORRUPT,
    DEADLINE,
    HOLDER_DEAD,
    Transfer,
    TransferResult,
    Transport,
    call,
)
from kvshare.transfer.wire import PRESENT, BlockBatch, BlockControl, SourceGone
from kvshare.types import BlockHash


class ObjStoreTransport(Transport):
    """Blocks as numpy uint8 batches through the Ray object store (or in-process)."""

    name = "objstore"

    def __init__(self, holder: str = "objstore") -> None:
        self.holder = holder

    def submit_read(
        self, source: BlockControl, hashes: Sequence[BlockHash], dest: Sequence[ByteArray],
        *, deadline_s: float,
    ) -> Transfer:
        t = self.new_transfer("read", hashes, dest, deadline_s, self.holder)
        t.state.update(control=source, bufs=list(dest), reply=source.read_blocks(list(hashes)))
        if not hashes:
            t.finish([], 0)
        return t

    def submit_write(
        self, sink: BlockControl, hashes: Sequence[BlockHash], data: Sequence[ByteArray],
        *, deadline_s: float,
    ) -> Transfer:
        t = self.new_transfer("write", hashes, data, deadline_s, self.holder)
        if not hashes:
            t.finish([], 0)
            return t
        batch = np.stack([np.asarray(d).reshape(-1).view(np.uint8) for d in data])
        sums = [block_checksum(row) for row in batch]
        t.state.update(control=sink, bufs=list(data), reply=sink.write_blocks(list(hashes), batch, sums))
        return t

    def wait(self, transfer: Transfer) -> TransferResult:
        """Block on the reply (no busy polling), then take the result as ``poll`` does."""
        if transfer.result is None and transfer.remaining > 0:
            try:
                transfer.state["reply"].get(transfer.remaining)
            except Exception:  # timeout, dead source, pool error: poll classifies it
                pass
        return super().wait(transfer)

    def poll(self, transfer: Transfer) -> TransferResult | None:
        t = transfer
        if t.result is not None:
            return t.result
        reply = t.state["reply"]
        if not reply.done() and t.remaining > 0:
            return None
        if t.remaining <= 0:  # not there, or later than the caller can use
            return self._end(t, [DEADLINE] * len(t.hashes))
        try:
            value = call(reply, max(t.remaining, 1.0))
        except SourceGone:
            return self._end(t, [HOLDER_DEAD] * len(t.hashes))
        except TimeoutError:
            return self._end(t, [DEADLINE] * len(t.hashes))
        if t.op == "write":
            return self._end(t, ["" if r == PRESENT else r for r in value])
        return self._end(t, self._unpack(t, value))

    def _unpack(self, t: Transfer, batch: BlockBatch) -> list[str]:
        dest: list[ByteArray] = t.state["bufs"]
        if dest and batch.data.shape[1] != dest[0].nbytes:
            raise ValueError(
                f"buffers hold {dest[0].nbytes} bytes but the pool's blocks are "
                f"{batch.data.shape[1]} bytes: check the KV layout of the namespace"
            )
        reasons = list(batch.reasons)
        bad: list[BlockHash] = []
        for i, row in enumerate(batch.rows):
            if row < 0:
                continue
            copy_block(dest[i], batch.data[row])
            if block_checksum(dest[i]) != batch.checksums[i]:
                reasons[i] = CORRUPT
                bad.append(t.hashes[i])
        if bad:
            t.state["control"].report_corrupt(bad)
        return reasons

    def _end(self, t: Transfer, reasons: Sequence[str]) -> TransferResult:
        return t.finish_reasons(reasons, t.state["bufs"])
