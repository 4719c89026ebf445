"""Shared-memory transport: same node, straight between the pool's host slab and caller memory.

The process maps the node pool's slab (``HostSlab.attach``, once per pool generation) and
copies slots directly into the destination (reads) or from the source buffers (writes); only
control messages go to the pool: one ``prepare_read`` (pins) and one ``finish`` (which reports
whether every pin was still valid after the copy: the epoch re-check) per batch, or
``prepare_write`` + ``commit_write`` for stores. Reads rely on the slot epoch, not on
checksums (``verify=True`` checks them too, at checksum speed). When the pool keeps its slot
epochs in shared memory (``SlabInfo.epochs``) the reader re-checks them itself and the unpin
is sent without waiting: one round trip per batch instead of two.

Known slots: with shared epochs, the transport remembers ``(slot, epoch)`` of every block it
wrote (once committed) or read (up to ``KNOWN_SLOTS`` blocks). A batch whose blocks are all
known and whose epochs are unchanged is read with no round trip at all: the epochs are checked
before and after the copy (the pool bumps a slot's epoch before anything else may write it,
and when it frees it), and the pool is told afterwards, without waiting, that they were read
(``touch``: hits and LRU). Any block whose epoch moved, or a pool that has died (the epochs
file's lock, :meth:`SharedEpochs.owner_alive`), sends the whole batch the usual way, which also
re-learns its slots. This is what an engine reloading its own evicted blocks from
its node's pool does most.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from kvshare.tiers.base import ByteArray, block_checksum, copy_block
from kvshare.tiers.host import HostSlab
from kvshare.transfer.base import (
    CORRUPT,
    DEADLINE,
    HOLDER_DEAD,
    NOT_SAME_NODE,
    SLOT_REUSED,
    Transfer,
    TransferResult,
    Transport,
    call,
    close_all,
    finish_quietly,
    lease_ttl,
)
from kvshare.transfer.epochs import SharedEpochs
from kvshare.transfer.wire import (
    PRESENT,
    BlockControl,
    Reply,
    SlabInfo,
    SlotReply,
    SourceBlock,
    SourceGone,
)
from kvshare.types import BlockHash

log = logging.getLogger(__name__)

KNOWN_SLOTS = 1 << 16
"""Blocks whose slab slot a transport remembers (about 100 bytes each)."""


class KnownSlots:
    """Where blocks sit in this node's slabs, as this process last saw them: hash -> (slab
    name, slot, epoch), the ``KNOWN_SLOTS`` most recent; thread-safe. Transports of one
    process share one (what the store transport wrote, the load transport reads)."""

    def __init__(self, capacity: int = KNOWN_SLOTS) -> None:
        self.capacity = capacity
        self._map: OrderedDict[BlockHash, tuple[str, int, int]] = OrderedDict()
        self._slabs: dict[str, SlabInfo] = {}  # how to map the slabs named (another transport may not have)
        self._lock = threading.Lock()

    def add(self, info: SlabInfo, blocks: Iterable[tuple[BlockHash, int, int]]) -> None:
        slab = info.name
        with self._lock:
            self._slabs[slab] = info
            known = self._map
            for h, slot, epoch in blocks:
                known[h] = (slab, slot, epoch)
                known.move_to_end(h)
            while len(known) > self.capacity:
                known.popitem(last=False)

    def slab(self, name: str) -> SlabInfo | None:
        with self._lock:
            return self._slabs.get(name)

    def get(self, hashes: Sequence[BlockHash]) -> list[tuple[str, int, int]] | None:
        """Every block's place, or None when any is unknown."""
        with self._lock:
            out = [self._map.get(h) for h in hashes]
        return None if any(k is None for k in out) else out  # type: ignore[return-value]

SlotCopy = Callable[[ByteArray, list[int], list[int]], None]
"""``copy(slab_rows, positions, slots)``: move the batch's blocks ``positions`` between the
slab's rows ``slots`` and the caller's own memory (no staging buffer)."""


class ShmTransport(Transport):
    """Reads and writes through the host slab of a pool on node ``node``."""

    name = "shm"

    def __init__(self, node: str, *, holder: str = "shm", verify: bool = False,
                 known: KnownSlots | None = None, known_slots: bool = True) -> None:
        """``known``: the process's shared :class:`KnownSlots` (default: its own);
        ``known_slots=False``: every read asks the pool (a bandwidth probe measures that
        path, and reads probe blocks whose hashes every pool shares)."""
        self.node = node
        self.holder = holder
        self.verify = verify
        self._slabs: dict[str, HostSlab] = {}  # segment name -> mapping
        self._epochs: dict[str, SharedEpochs] = {}  # segment name -> its slot epochs
        self.known = known if known is not None else KnownSlots()
        self.known_slots = known_slots
        self.fast_reads = 0  # batches read with no round trip (known slots)

    def _slab(self, info: SlabInfo) -> HostSlab:
        slab = self._slabs.get(info.name)
        if slab is None:
            prefix = info.name.rsplit("-", 1)[0] + "-"
            for old in [n for n in self._slabs if n.startswith(prefix)]:  # older generation
                self._slabs.pop(old).close()
                ep = self._epochs.pop(old, None)
                if ep is not None:
                    ep.close()
            slab = self._slabs[info.name] = HostSlab.attach(info.name, info.slot_bytes,
                                                            info.num_slots, info.directory)
            if info.epochs:
                self._epochs[info.name] = SharedEpochs(info.epochs, info.num_slots, create=False,
                                                       directory=info.directory)
        return slab

    def _local_slab(self, info: SlabInfo | None) -> HostSlab | None:
        """The pool's slab mapped into this process; None when the pool is on another node or
        the slab cannot be mapped (its blocks then miss with ``NOT_SAME_NODE``)."""
        if info is None or info.node != self.node:
            return None
        try:
            return self._slab(info)
        except (OSError, ValueError) as exc:
            log.warning("cannot map slab %s: %s", info.name, exc)
            return None

    def _begin(
        self, kind: str, control: BlockControl,
        prepare: Callable[[Sequence[BlockHash], str, float], Reply[SlotReply]],
        hashes: Sequence[BlockHash], bufs: Sequence[ByteArray], deadline_s: float,
    ) -> tuple[Transfer, SlotReply | None]:
        """A new transfer and the pool's size-checked prepare reply (None: ``t`` has ended)."""
        t = self.new_transfer(kind, hashes, bufs, deadline_s, self.holder)
        return t, _prepared(t, control, prepare(hashes, t.holder, lease_ttl(deadline_s)), bufs)

    def _remember(self, slab: SlabInfo, blocks: Iterable[tuple[BlockHash, int, int]]) -> None:
        """Blocks now in ``slab`` at (slot, epoch), if the slab's epochs are shared."""
        if self.known_slots and slab.name in self._epochs:
            self.known.add(slab, blocks)

    def _known_read(
        self, source: BlockControl, hashes: Sequence[BlockHash], dest: Sequence[ByteArray],
        deadline_s: float, copy: SlotCopy | None,
    ) -> Transfer | None:
        """The batch read from slots this transport knows, with no round trip (module
        docstring); None when any block is unknown or its epoch moved (read the usual way)."""
        known = self.known.get(hashes) if hashes and self.known_slots and not self.verify else None
        if known is None:
            return None
        slab_name = known[0][0]
        if any(k[0] != slab_name for k in known):
            return None
        slab = self._slabs.get(slab_name)
        if slab is None:  # learned by another transport of this process: map it here too
            slab = self._local_slab(self.known.slab(slab_name))
        epochs = self._epochs.get(slab_name)
        if slab is None or epochs is None or slab.array.shape[1] != dest[0].nbytes:
            return None  # (a size mismatch is named by the usual path)
        if not epochs.owner_alive():  # the pool died: its blocks are misses, asked the usual way
            return None
        slots = [k[1] for k in known]
        want = [k[2] for k in known]
        now = epochs.array

        def unchanged() -> bool:
            return all(int(now[s]) == e for s, e in zip(slots, want, strict=True))

        if not unchanged():
            return None
        t = self.new_transfer("read", hashes, dest, deadline_s, self.holder)
        if copy is None:
            for i, s in enumerate(slots):
                copy_block(dest[i], slab.array[s])
        else:
            copy(slab.array, list(range(len(hashes))), slots)
        if not unchanged():  # a slot was freed or given to another block meanwhile
            return None
        self.fast_reads += 1
        try:
            source.touch(hashes)  # hits and LRU; not waited for
        except Exception as exc:  # noqa: BLE001 - the pool's books only, the bytes are good
            log.debug("touch after a known-slot read failed: %s", exc)
        return _done(t, [""] * len(hashes), dest)

    def submit_read(
        self, source: BlockControl, hashes: Sequence[BlockHash], dest: Sequence[ByteArray],
        *, deadline_s: float, copy: SlotCopy | None = None,
    ) -> Transfer:
        """Read ``hashes`` into ``dest`` (done when it returns). With ``copy``, the pinned
        slots go to ``copy(slab_rows, positions, slots)`` instead (one copy straight into the
        caller's memory; ``dest`` only sizes and counts the batch), before the epoch check:
        a block reported ``slot_reused`` may then hold another block's bytes there. Blocks
        whose slots this transport knows are read with no round trip (module docstring)."""
        fast = self._known_read(source, hashes, dest, deadline_s, copy)
        if fast is not None:
            return fast
        t, prep = self._begin("read", source, source.prepare_read, hashes, dest, deadline_s)
        if prep is None:
            return t
        reasons = [""] * len(hashes)
        copied: list[int] = []
        slab = self._local_slab(prep.slab)
        for i, b in enumerate(prep.blocks):
            reasons[i] = _blocked(t, slab) if isinstance(b, SourceBlock) else b
            if slab is not None and not reasons[i]:
                if copy is None:
                    copy_block(dest[i], slab.array[b.slot])  # type: ignore[union-attr]
                copied.append(i)
        pinned = [prep.blocks[i] for i in copied]
        if copy is not None and slab is not None and copied:
            _copy_or_release(source, t.holder, copy, slab, copied, [b.slot for b in pinned])  # type: ignore[union-attr]
        epochs = self._epochs.get(prep.slab.name) if prep.slab is not None else None
        if epochs is not None:  # re-check the epochs ourselves; the unpin needs no reply
            now = epochs.array
            valid = [bool(now[b.slot] == b.epoch) for b in pinned]  # type: ignore[union-attr]
            source.finish(t.holder, [])
        else:
            valid = finish_quietly(source, t.holder, [b.lease_id for b in pinned])  # type: ignore[union-attr]
        bad: list[BlockHash] = []
        for k, i in enumerate(copied):
            if k >= len(valid):
                reasons[i] = HOLDER_DEAD
            elif not valid[k]:
                reasons[i] = SLOT_REUSED
            elif self.verify and block_checksum(
                    dest[i] if copy is None or slab is None else slab.array[pinned[k].slot]  # type: ignore[union-attr]
            ) != pinned[k].checksum:  # type: ignore[union-attr]
                reasons[i] = CORRUPT
                bad.append(hashes[i])
        if bad:
            source.report_corrupt(bad)
        if prep.slab is not None:
            self._remember(prep.slab, ((hashes[i], pinned[k].slot, pinned[k].epoch)  # type: ignore[union-attr]
                                            for k, i in enumerate(copied) if not reasons[i]))
        return _done(t, reasons, dest)

    def submit_write(
        self, sink: BlockControl, hashes: Sequence[BlockHash], data: Sequence[ByteArray],
        *, deadline_s: float, copy: SlotCopy | None = None,
    ) -> Transfer:
        """Write ``data`` as ``hashes`` (done when it returns). With ``copy``, the reserved
        slots are filled by ``copy(slab_rows, positions, slots)`` from the caller's memory
        instead (``data`` only sizes and counts the batch)."""
        t, prep = self._begin("write", sink, sink.prepare_write, hashes, data, deadline_s)
        if prep is None:
            return t
        reasons = [""] * len(hashes)
        slab = self._local_slab(prep.slab)
        written: list[int] = []
        for i, s in enumerate(prep.blocks):
            if isinstance(s, str):
                reasons[i] = "" if s == PRESENT else s
                continue
            reasons[i] = _blocked(t, slab)
            if slab is not None and not reasons[i]:
                if copy is None:
                    copy_block(slab.array[s.slot], data[i])
                written.append(i)
        slots = [prep.blocks[i].slot for i in written]  # type: ignore[union-attr]
        if copy is not None and slab is not None and written:
            _copy_or_release(sink, t.holder, copy, slab, written, slots)
        sums = [block_checksum(data[i] if copy is None or slab is None else slab.array[s])
                for i, s in zip(written, slots, strict=True)]
        lease_ids = [prep.blocks[i].lease_id for i in written]  # type: ignore[union-attr]
        try:
            done = set(call(sink.commit_write(t.holder, lease_ids, sums), max(t.remaining, 2.0)))
        except (TimeoutError, SourceGone):
            finish_quietly(sink, t.holder, [])
            done = set()
        for i in written:
            if hashes[i] not in done:
                reasons[i] = HOLDER_DEAD
        if prep.slab is not None:
            self._remember(prep.slab, ((hashes[i], s.slot, s.epoch)  # type: ignore[union-attr]
                                            for i in written if (s := prep.blocks[i]) and not reasons[i]))
        return _done(t, reasons, data)

    def poll(self, transfer: Transfer) -> TransferResult | None:
        return transfer.result  # shared-memory batches complete inside submit

    def close(self) -> None:
        close_all(self._slabs, self._epochs)


def _copy_or_release(control: BlockControl, holder: str, copy: SlotCopy, slab: HostSlab,
                     positions: list[int], slots: list[int]) -> None:
    """Run the caller's slot copy; if it raises, release the batch's pins first."""
    try:
        copy(slab.array, positions, slots)
    except BaseException:
        finish_quietly(control, holder, [])
        raise


def _blocked(t: Transfer, slab: HostSlab | None) -> str:
    """Why a block the pool offered cannot be copied now; "" when it can."""
    if slab is None:
        return NOT_SAME_NODE
    return DEADLINE if t.remaining <= 0 else ""


def _done(t: Transfer, reasons: Sequence[str], bufs: Sequence[ByteArray]) -> Transfer:
    t.finish_reasons(reasons, bufs)
    return t


def _prepared(
    t: Transfer, control: BlockControl, reply: Reply[SlotReply], bufs: Sequence[ByteArray]
) -> SlotReply | None:
    """The pool's prepare reply, size-checked against ``bufs``; None once ``t`` ended with
    every block missed (the reply missed the deadline, or the pool is gone)."""
    try:
        prep = call(reply, t.remaining)
    except TimeoutError:
        finish_quietly(control, t.holder, [])
        _done(t, [DEADLINE] * len(t.hashes), bufs)
        return None
    except SourceGone:
        _done(t, [HOLDER_DEAD] * len(t.hashes), bufs)
        return None
    _check_size(control, t.holder, prep.slab, bufs)
    return prep


def _check_size(
    control: BlockControl, holder: str, slab: SlabInfo | None, bufs: Sequence[ByteArray]
) -> None:
    if slab is not None and bufs and bufs[0].nbytes != slab.slot_bytes:
        finish_quietly(control, holder, [])
        raise ValueError(
            f"buffers hold {bufs[0].nbytes} bytes but the pool's blocks are {slab.slot_bytes} "
            "bytes: check the KV layout of the namespace"
        )
