"""NIXL transport: one-sided READ (or WRITE) of a batch of host-slab slots over UCX.

The pulling process (a worker, or a pool fetching for its node) owns one agent and registers
its destination memory once per buffer (cached, LRU-bounded). For each batch it asks the
source pool to pin the blocks (one control message), posts ONE transfer with batched
descriptor lists, polls ``check_xfer_state`` until done or the deadline (then cancels), and
ends the pins (one control message). Integrity (:mod:`kvshare.transfer.verify`): by default
the pool checksums the pinned slots while one transfer runs and the ``finish`` reply says
which were intact; with ``end_to_end=True`` the reader checksums what arrived (after the
read), and sends the ``finish`` without waiting for its reply.
Remote agent
metadata is cached per source agent name ``{namespace}/{node}/{generation}``; when a source's
generation changes the old agent is removed with ``remove_remote_agent``. Connections are
reused across batches.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvshare.tiers.base import ByteArray, block_checksum
from kvshare.transfer.base import (
    CORRUPT,
    DEADLINE,
    FINISH_WAIT_S,
    HOLDER_DEAD,
    NIXL_UNAVAILABLE,
    TRANSFER_ERROR,
    Transfer,
    TransferResult,
    Transport,
    TransportUnavailable,
    call,
    finish_quietly,
    lease_ttl,
)
from kvshare.transfer.nixl_agent import dram_reg, make_agent, xfer_descs
from kvshare.transfer.wire import (
    PRESENT,
    BlockControl,
    NixlPeerInfo,
    SourceBlock,
    SourceGone,
)
from kvshare.types import BlockHash

log = logging.getLogger(__name__)

MAX_REGIONS = 16


HUGE_PAGE = 2 * 1024 * 1024


def aligned_empty(shape: int | tuple[int, ...], align: int = HUGE_PAGE) -> np.ndarray:
    """An uninitialised uint8 array whose first byte sits on an ``align``-byte boundary.

    Use it for buffers that NIXL reads into. Over UCX ``cma`` (one host) a destination that is
    not page-aligned (``np.empty`` of a large size starts 16 bytes into a page) roughly halves
    the bandwidth of READs and of a pool's WRITEs (figures on the results page).
    """
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = int(np.prod(dims, dtype=np.int64))
    raw = np.empty(nbytes + align, dtype=np.uint8)
    off = (-int(raw.ctypes.data)) % align
    return raw[off : off + nbytes].reshape(dims)


def _stage(t: Transfer, name: str) -> None:
    """Add the time since the last mark to ``t.state["stages"][name]`` (seconds; see
    :attr:`NixlTransport.stages`)."""
    now = time.perf_counter()
    stages: dict[str, float] = t.state["stages"]
    stages[name] = stages.get(name, 0.0) + now - t.state["mark"]
    t.state["mark"] = now


def _root(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _failure(control: BlockControl, holder: str, what: str) -> str:
    """Why a transfer failed: the source is gone (disconnected, or its pool does not answer)
    or some other transport error. Ends the transfer's leases on the way."""
    if "DISCONNECT" in what.upper():
        return HOLDER_DEAD
    try:
        call(control.finish(holder, []), 2.0)
    except (TimeoutError, SourceGone):
        return HOLDER_DEAD
    return TRANSFER_ERROR


class NixlTransport(Transport):
    """A NIXL agent named ``name`` that pulls blocks from (or pushes into) pools' host slabs.

    ``verify``: every block read is checked against its checksum. ``end_to_end`` says who
    checks: the holding pool while the transfer runs (False, the default: the faster of the
    two on the results page), or this reader once they landed (True: after the whole read), which also
    covers the wire and this host's memory.
    Raises :class:`TransportUnavailable` (reason ``nixl_unavailable``) if NIXL cannot start.
    """

    name = "nixl"

    def __init__(self, name: str, *, verify: bool = True, end_to_end: bool = False) -> None:
        self.agent_name = name
        self.verify = verify
        self.end_to_end = end_to_end
        self.agent = make_agent(name)
        self._regions: OrderedDict[tuple[int, int], tuple[np.ndarray, Any]] = OrderedDict()
        self._peers: dict[str, tuple[str, NixlPeerInfo]] = {}  # agent name -> (remote, info)
        self._by_source: dict[str, str] = {}  # "{namespace}/{node}/" -> current agent name

    # ------------------------------------------------------------------ memory and peers
    def register(self, array: np.ndarray) -> None:
        """Register a host buffer (its whole underlying allocation) once; kept until close."""
        self._ensure_registered(array)

    def _ensure_registered(self, view: np.ndarray, keep: set[tuple[int, int]] | None = None) -> None:
        """Make ``view``'s memory registered; ``keep``: regions the current batch uses."""
        addr, end = int(view.ctypes.data), int(view.ctypes.data) + int(view.nbytes)
        for (base, size) in self._regions:
            if base <= addr and end <= base + size:
                self._regions.move_to_end((base, size))
                if keep is not None:
                    keep.add((base, size))
                return
        root = _root(view)
        if not root.flags.c_contiguous:
            root = view
        key = (int(root.ctypes.data), int(root.nbytes))
        reg = self.agent.register_memory(dram_reg(root.reshape(-1).view(np.uint8)), "DRAM")
        self._regions[key] = (root, reg)
        if keep is not None:
            keep.add(key)
        for old in [k for k in self._regions if k not in (keep or {key})]:
            if len(self._regions) <= MAX_REGIONS:
                break
            self.agent.deregister_memory(self._regions.pop(old)[1])

    def _covered(self, start: int, end: int) -> bool:
        """Whether one registered region holds all of ``[start, end)``."""
        return any(base <= start and end <= base + size for base, size in self._regions)

    @property
    def _source_verifies(self) -> bool:
        return self.verify and not self.end_to_end

    def _peer(self, control: BlockControl, agent: str, timeout: float) -> tuple[str, NixlPeerInfo]:
        cached = self._peers.get(agent)
        if cached is not None:
            return cached
        info = call(control.nixl_info(), timeout)
        if info is None or info.agent != agent:
            raise TransportUnavailable(NIXL_UNAVAILABLE, f"source agent {agent} is gone")
        prefix = agent.rsplit("/", 1)[0] + "/"
        old = self._by_source.get(prefix)
        if old is not None and old != agent:  # the source restarted: new generation
            remote, _ = self._peers.pop(old)
            try:
                self.agent.remove_remote_agent(remote)
            except Exception as exc:
                log.debug("remove_remote_agent(%s): %s", remote, exc)
        raw = self.agent.add_remote_agent(info.metadata)
        remote = raw.decode() if isinstance(raw, bytes) else str(raw)
        try:
            self.agent.make_connection(remote)
        except Exception as exc:  # the first transfer connects instead
            log.debug("make_connection(%s): %s", remote, exc)
        self._by_source[prefix] = agent
        self._peers[agent] = (remote, info)
        return remote, info

    # ------------------------------------------------------------------ reads
    def submit_read(
        self, source: BlockControl, hashes: Sequence[BlockHash], dest: Sequence[ByteArray],
        *, deadline_s: float,
    ) -> Transfer:
        return self._submit("read", source, hashes, dest, deadline_s)

    def submit_write(
        self, sink: BlockControl, hashes: Sequence[BlockHash], data: Sequence[ByteArray],
        *, deadline_s: float,
    ) -> Transfer:
        return self._submit("write", sink, hashes, data, deadline_s)

    def _submit(
        self, op: str, control: BlockControl, hashes: Sequence[BlockHash],
        bufs: Sequence[ByteArray], deadline_s: float,
    ) -> Transfer:
        t = self.new_transfer(op, hashes, bufs, deadline_s, self.agent_name)
        t.state.update(control=control, bufs=list(bufs), handles=[], outcome={},
                       stages={}, mark=time.perf_counter())
        if not hashes:
            t.finish([], 0)
            return t
        try:
            return self._start(t, control, bufs, deadline_s)
        except BaseException:  # a caller mistake or a bug: end the leases, then raise
            self._release(t)
            finish_quietly(control, t.holder, [])
            raise

    def _start(
        self, t: Transfer, control: BlockControl, bufs: Sequence[ByteArray], deadline_s: float
    ) -> Transfer:
        try:
            if t.op == "read":
                prep = call(control.prepare_read(t.hashes, t.holder, lease_ttl(deadline_s),
                                                 self._source_verifies, nixl=True), t.remaining)
                entries, agent = prep.blocks, prep.nixl_agent
            else:
                prepw = call(control.prepare_write(t.hashes, t.holder, lease_ttl(deadline_s),
                                                   nixl=True), t.remaining)
                entries, agent = prepw.blocks, prepw.nixl_agent
        except TimeoutError:
            return self._end(t, DEADLINE)
        except SourceGone:
            return self._end(t, HOLDER_DEAD)
        _stage(t, "control")
        outcome: dict[int, str] = t.state["outcome"]
        moving: list[int] = []
        for i, e in enumerate(entries):
            if isinstance(e, SourceBlock):
                moving.append(i)
            else:
                outcome[i] = "" if e == PRESENT else e
        t.state.update(entries=entries, moving=moving)
        if not moving:
            return self._end(t, None)
        if not agent:
            return self._end(t, NIXL_UNAVAILABLE)
        if t.remaining <= 0:
            return self._end(t, DEADLINE)
        try:
            remote, info = self._peer(control, agent, max(t.remaining, 0.001))
            size = info.slot_bytes
            if bufs[0].nbytes != size:
                raise ValueError(
                    f"buffers hold {bufs[0].nbytes} bytes but the pool's blocks are {size} "
                    "bytes: check the KV layout of the namespace"
                )
            if t.op == "write":
                t.state["sums"] = [block_checksum(bufs[i]) for i in moving]
            addrs = [int(bufs[i].ctypes.data) for i in moving]
            if not self._covered(min(addrs), max(addrs) + size):
                keep: set[tuple[int, int]] = set()
                for i in moving:
                    self._ensure_registered(bufs[i], keep)
            remotes = [info.base_addr + entries[i].slot * size for i in moving]  # type: ignore[union-attr]
            _stage(t, "prepare")
            self._post(t, remote, moving, addrs, remotes, size)
            _stage(t, "post")
        except TimeoutError:
            return self._end(t, DEADLINE)
        except SourceGone:
            return self._end(t, HOLDER_DEAD)
        except TransportUnavailable:
            return self._end(t, NIXL_UNAVAILABLE)
        except ValueError:
            raise
        except Exception as exc:
            log.warning("nixl %s from %s failed: %s", t.op, agent, exc)
            return self._end(t, _failure(control, t.holder, f"{type(exc).__name__} {exc}"))
        return t

    def _post(self, t: Transfer, remote: str, group: list[int], addrs: list[int],
              remotes: list[int], size: int) -> None:
        """Post one transfer of the blocks ``group`` (indices into the batch)."""
        handle = self.agent.initialize_xfer(
            "READ" if t.op == "read" else "WRITE",
            self.agent.get_xfer_descs(xfer_descs(addrs, size), "DRAM"),
            self.agent.get_xfer_descs(xfer_descs(remotes, size), "DRAM"),
            remote,
        )
        t.state["handles"].append([handle, "PROC", group])
        self._advance(t, t.state["handles"][-1], self.agent.transfer(handle))

    def _advance(self, t: Transfer, entry: list[Any], status: str) -> None:
        """Record a transfer's status."""
        entry[1] = status

    def _status(self, t: Transfer) -> str:
        """DONE when every transfer is done, PROC while some still run, else a failure."""
        for entry in t.state["handles"]:
            if entry[1] == "PROC":
                self._advance(t, entry, self.agent.check_xfer_state(entry[0]))
        states = {entry[1] for entry in t.state["handles"]}
        bad = states - {"DONE", "PROC"}
        return str(next(iter(bad))) if bad else "PROC" if "PROC" in states else "DONE"

    def poll(self, transfer: Transfer) -> TransferResult | None:
        t = transfer
        if t.result is not None:
            return t.result
        try:
            status = self._status(t)
        except Exception as exc:
            self._end(t, _failure(t.state["control"], t.holder, f"{type(exc).__name__} {exc}"))
            return t.result
        if status == "DONE" and t.remaining < 0:  # arrived, but later than the caller can use
            self._end(t, DEADLINE)
            return t.result
        if status == "DONE":
            _stage(t, "move")
            self._release(t)
            _stage(t, "release")
            res = self._done(t)
            _stage(t, "finish")
            return res
        if status != "PROC":
            self._end(t, _failure(t.state["control"], t.holder, str(status)))
            return t.result
        if t.remaining <= 0:
            self._end(t, DEADLINE)
            return t.result
        return None

    def _done(self, t: Transfer) -> TransferResult:
        outcome: dict[int, str] = t.state["outcome"]
        entries = t.state["entries"]
        bufs: list[ByteArray] = t.state["bufs"]
        bad: list[BlockHash] = []
        lease_ids = [entries[i].lease_id for i in t.state["moving"]]
        control: BlockControl = t.state["control"]
        if t.op == "read" and self._source_verifies:
            self._source_verdict(t, lease_ids)
        elif t.op == "read":
            control.finish(t.holder, [])  # the pins end; nothing to wait for
            for i in t.state["moving"]:
                got = block_checksum(bufs[i]) if self.verify else entries[i].checksum
                if got != entries[i].checksum:
                    outcome[i] = CORRUPT
                    bad.append(t.hashes[i])
                else:
                    outcome[i] = ""
            if bad:
                control.report_corrupt(bad)
        else:
            try:
                done = set(call(t.state["control"].commit_write(t.holder, lease_ids, t.state["sums"]), 5.0))
            except (TimeoutError, SourceGone):
                done = set()
            for i in t.state["moving"]:
                outcome[i] = "" if t.hashes[i] in done else HOLDER_DEAD
        return self._result(t)

    def _source_verdict(self, t: Transfer, lease_ids: list[int]) -> None:
        """End the pins and learn from the pool which slots passed their checksum (an invalid
        lease: the slot failed, and the pool dropped the block; or the lease ended early)."""
        outcome: dict[int, str] = t.state["outcome"]
        gone = ""
        try:
            valid = call(t.state["control"].finish(t.holder, lease_ids),
                         max(t.remaining, 0.0) + FINISH_WAIT_S)
        except TimeoutError:
            valid, gone = [], DEADLINE
        except SourceGone:
            valid, gone = [], HOLDER_DEAD
        for k, i in enumerate(t.state["moving"]):
            outcome[i] = gone if k >= len(valid) else "" if valid[k] else CORRUPT

    def _end(self, t: Transfer, reason: str | None) -> Transfer:
        """Stop the transfer: blocks still moving miss with ``reason``; leases end."""
        self._release(t)
        outcome: dict[int, str] = t.state["outcome"]
        if reason is not None:
            for i in range(len(t.hashes)):
                outcome.setdefault(i, reason)
        finish_quietly(t.state["control"], t.holder, [])
        self._result(t)
        return t

    def _release(self, t: Transfer) -> None:
        handles, t.state["handles"] = t.state.get("handles", []), []
        for handle, _, _ in handles:
            try:
                self.agent.release_xfer_handle(handle)
            except Exception as exc:  # could not cancel: keep the handle out of reuse
                log.warning("nixl transfer %d could not be released: %s", t.transfer_id, exc)

    def _result(self, t: Transfer) -> TransferResult:
        outcome: dict[int, str] = t.state["outcome"]
        reasons = [outcome.get(i, TRANSFER_ERROR) for i in range(len(t.hashes))]
        return t.finish_reasons(reasons, t.state["bufs"])

    def close(self) -> None:
        for remote, _ in self._peers.values():
            try:
                self.agent.remove_remote_agent(remote)
            except Exception as exc:
                log.debug("remove_remote_agent(%s): %s", remote, exc)
        self._peers.clear()
        for _, reg in self._regions.values():
            try:
                self.agent.deregister_memory(reg)
            except Exception as exc:
                log.debug("deregister: %s", exc)
        self._regions.clear()
