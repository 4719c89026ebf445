"""NIXL push transport, the reader's side: the holder WRITEs blocks into the reader's memory.

(The pool's side is :meth:`BlockServer.push_read <kvshare.transfer.holder.server.BlockServer.push_read>`
and :meth:`NixlSource.write_slots <kvshare.transfer.nixl_agent.NixlSource.write_slots>`; the
messages, :class:`~kvshare.transfer.wire.PushRequest` and
:class:`~kvshare.transfer.wire.SlotReply`, are the control interface's.)

Same guarantees as the ``nixl`` READ path, other initiator. Over UCX ``cma`` (one host, the
stand-in for RDMA here) the initiator calls ``process_vm_readv``/``process_vm_writev``, which
pin the *peer's* pages on every transfer. A READ pins the pool's host slab (a ``/dev/shm``
tmpfs mapping: 4 KiB pages where shmem huge pages are off); a holder-initiated WRITE pins the
reader's destination instead (private anonymous memory, huge pages when the buffer is
``madvise(MADV_HUGEPAGE)``-d, as numpy does for large arrays) and copies the slab by plain
copy. A WRITE into a huge-page destination runs at about memcpy speed, faster than a READ
from the slab; with 4 KiB destination pages the two are alike, and a destination that is not
page-aligned halves both (see :func:`~kvshare.transfer.reader.nixl.aligned_empty`). The
figures, and push against READ in ``benchmarks/transfer.py``, are on the results page.

Protocol (one control message): the reader registers its buffers, sends its agent metadata
and the destination addresses with ``transfer_push_read``; the pool pins the blocks, posts
ONE WRITE from the slab slots, polls it until done or the deadline (then cancels), ends the
pins and replies per block with the checksum (or a miss reason). The reader verifies every
checksum; corrupt blocks are reported and come back as misses. While it waits, the reader
progresses its own agent (so UCX can accept the pool's connection).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from kvshare.tiers.base import ByteArray, block_checksum
from kvshare.transfer.base import (
    CORRUPT,
    DEADLINE,
    HOLDER_DEAD,
    TRANSFER_ERROR,
    Transfer,
    TransferResult,
    call,
    finish_quietly,
    lease_ttl,
)
from kvshare.transfer.reader.nixl import NixlTransport
from kvshare.transfer.wire import (
    BlockControl,
    PushRequest,
    Reply,
    SlotReply,
    SourceBlock,
    SourceGone,
)
from kvshare.types import BlockHash

log = logging.getLogger(__name__)

CANCEL_GRACE_S = 1.0
"""How long past its deadline a reader waits for the pool's reply (the pool cancels the WRITE
at the deadline it was sent); only then may a late WRITE still land in the reader's buffers."""
WAIT_STEP_S = 0.005  # the reader progresses its agent (accepts connections) this often
SEND_MARGIN_S = 0.002  # the pool's deadline is the reader's remaining time minus this


class NixlPushTransport(NixlTransport):
    """Reads by asking the holding pool to NIXL-WRITE into this agent's registered buffers.

    Writes (into a pool) are the ``nixl`` transport's. Raises :class:`TransportUnavailable`
    (reason ``nixl_unavailable``) if NIXL cannot start.
    """

    name = "nixl_push"

    def submit_read(
        self, source: BlockControl, hashes: Sequence[BlockHash], dest: Sequence[ByteArray],
        *, deadline_s: float,
    ) -> Transfer:
        t = self.new_transfer("read", hashes, dest, deadline_s, self.agent_name)
        t.state.update(control=source, bufs=list(dest), handle=None, outcome={}, reply=None)
        if not hashes:
            t.finish([], 0)
            return t
        keep: set[tuple[int, int]] = set()
        for b in dest:
            self._ensure_registered(b, keep)
        req = PushRequest(
            self.agent_name, self.agent.get_agent_metadata(),
            tuple(int(b.ctypes.data) for b in dest), int(dest[0].nbytes),
            max(t.remaining - SEND_MARGIN_S, 0.0),
        )
        try:
            reply = source.push_read(hashes, t.holder, lease_ttl(deadline_s), req)
        except (ValueError, KeyError):
            raise
        except SourceGone:
            return self._end(t, HOLDER_DEAD)
        except Exception as exc:
            log.warning("nixl push request failed: %s", exc)
            return self._end(t, TRANSFER_ERROR)
        t.state["reply"] = reply
        return t

    def poll(self, transfer: Transfer) -> TransferResult | None:
        t = transfer
        if t.result is not None:
            return t.result
        if t.op != "read":
            return super().poll(t)
        reply: Reply[SlotReply] = t.state["reply"]
        if not reply.done():
            self.agent.get_new_notifs()  # progress: lets UCX accept the pool's connection
            if t.remaining < -CANCEL_GRACE_S:
                return self._end(t, DEADLINE).result
            _wait_briefly(reply, min(WAIT_STEP_S, max(t.remaining + CANCEL_GRACE_S, 0.0)))
            return None
        try:
            pushed = call(reply, 1.0)
        except (TimeoutError, SourceGone):
            return self._end(t, HOLDER_DEAD).result
        return self._verify(t, pushed)

    def _verify(self, t: Transfer, pushed: SlotReply) -> TransferResult:
        outcome: dict[int, str] = t.state["outcome"]
        bufs: list[ByteArray] = t.state["bufs"]
        late = t.remaining < 0
        bad: list[BlockHash] = []
        for i, b in enumerate(pushed.blocks):
            if late:  # the batch did not finish by its deadline: every block misses
                outcome[i] = DEADLINE
            elif not isinstance(b, SourceBlock):
                outcome[i] = b
            elif self.verify and block_checksum(bufs[i]) != b.checksum:
                outcome[i] = CORRUPT
                bad.append(t.hashes[i])
            else:
                outcome[i] = ""
        if bad:
            t.state["control"].report_corrupt(bad)
        return self._result(t)

    def _end(self, t: Transfer, reason: str | None) -> Transfer:
        if t.op != "read":
            return super()._end(t, reason)
        outcome: dict[int, str] = t.state["outcome"]
        for i in range(len(t.hashes)):
            outcome.setdefault(i, reason or TRANSFER_ERROR)
        finish_quietly(t.state["control"], t.holder, [])
        self._result(t)
        return t


def _wait_briefly(reply: Reply[Any], timeout: float) -> None:
    """Block up to ``timeout`` s on a Ray reply, returning when it arrives (instead of
    spinning a core that the pool's copy needs)."""
    ref = getattr(reply, "ref", None)
    if ref is not None:
        import ray

        ray.wait([ref], timeout=timeout)
