"""The actor-facing transfer API of a node pool: ``transfer_*`` methods keyed by namespace.

:class:`TransferService` holds one :class:`~kvshare.transfer.holder.server.BlockServer` per namespace
of a node. :class:`TransferEndpoints` is a mixin with exactly the methods
:class:`~kvshare.transfer.reader.control.ActorControl` calls, delegating to ``self.transfer``; a Ray
actor that owns pools (``kvshare.actors.node_pool.NodePoolActor``) gets the whole data plane by
mixing it in. Nothing here imports Ray.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvshare.pool.tiered import TieredBlockPool
from kvshare.tiers.base import ByteArray
from kvshare.transfer.base import Transport, TransportUnavailable, close_all
from kvshare.transfer.estimate import BandwidthEstimator
from kvshare.transfer.holder.server import BlockServer
from kvshare.transfer.probe import (
    PROBE_BLOCKS,
    PROBE_LAYOUT,
    PROBE_NAMESPACE,
    TransportBandwidths,
    parse_overrides,
    probe,
)
from kvshare.transfer.wire import (
    BlockBatch,
    BlockControl,
    NixlPeerInfo,
    PushRequest,
    SlabInfo,
    SlotReply,
)
from kvshare.types import BlockHash, UnknownNamespace


class TransferService:
    """Serves transport control calls for the pools of one node, and measures bandwidths.

    ``on_holder(holder)`` hears of every holder that takes leases (the node pool checks
    their liveness). ``bandwidth_overrides`` (bytes/s per transport; default from ``KVSHARE_BANDWIDTH_GBPS``,
    e.g. ``"nixl=10,objstore=1.5"``) take precedence over what :meth:`measure` finds.
    The private namespace :data:`~kvshare.transfer.probe.PROBE_NAMESPACE` (a small pool of
    probe blocks, slab named after ``generation``) is opened on first use.
    """

    def __init__(
        self, node: str, *, nixl: bool | None = None,
        bandwidth_overrides: Mapping[str, float] | None = None, generation: int = 0,
        on_holder: Callable[[str], None] | None = None,
    ) -> None:
        self.node = node
        self.on_holder = on_holder
        self.generation = generation
        self.nixl = os.environ.get("KVSHARE_NIXL", "1") != "0" if nixl is None else nixl
        if bandwidth_overrides is None:
            bandwidth_overrides = parse_overrides(os.environ.get("KVSHARE_BANDWIDTH_GBPS", ""))
        self.bandwidths = TransportBandwidths({}, dict(bandwidth_overrides))
        self.per_node: dict[str, dict[str, float]] = {}
        self.estimator = BandwidthEstimator()  # probe samples per (transport, peer node)
        self.measured_at = 0.0  # time.time() of the last measure (0: never)
        self._sources: dict[str, BlockServer] = {}
        self._pullers: dict[str, Transport] = {}
        self._probe_pool: TieredBlockPool | None = None
        self._dest: list[ByteArray] = []
        self._measuring = threading.Lock()  # one probe at a time (threaded actors)
        self._opening = threading.Lock()

    def add_pool(self, pool: TieredBlockPool) -> BlockServer:
        """Serve ``pool`` (replacing the source of an older generation of its namespace)."""
        ns = pool.config.namespace
        old = self._sources.pop(ns, None)
        if old is not None:
            old.close()
        src = self._sources[ns] = BlockServer(pool, self.node, nixl=self.nixl)
        return src

    def leasing(self, namespace: str, holder: str) -> BlockServer:
        """:meth:`source`, for a call that takes leases under ``holder`` (``on_holder`` hears
        of it first, so the host can release the leases of a holder that dies)."""
        src = self.source(namespace)
        if self.on_holder is not None:
            self.on_holder(holder)
        return src

    def source(self, namespace: str) -> BlockServer:
        src = self._sources.get(namespace)
        if src is None and namespace == PROBE_NAMESPACE:
            src = self._open_probe()
        if src is None:
            raise UnknownNamespace(namespace, self._sources, f"node {self.node}: deploy with this "
                                   "namespace or call add_namespace first")
        return src

    def _open_probe(self) -> BlockServer:
        """The probe namespace's source (a 4-block private pool, opened once)."""
        from kvshare.transfer.holder.local import make_local_pool

        with self._opening:
            src = self._sources.get(PROBE_NAMESPACE)
            if src is None:
                self._probe_pool = make_local_pool(
                    PROBE_NAMESPACE, self.node, PROBE_LAYOUT, PROBE_BLOCKS,
                    generation=self.generation)
                src = self._sources[PROBE_NAMESPACE] = BlockServer(
                    self._probe_pool, self.node, nixl=self.nixl)
            return src

    def nixl_errors(self) -> dict[str, str]:
        """Per namespace, why NIXL is unavailable ('' when it works)."""
        return {ns: s.nixl_error for ns, s in self._sources.items()}

    def measure(
        self, namespace: str, peers: Mapping[str, BlockControl], *, blocks: int = PROBE_BLOCKS
    ) -> dict[str, float]:
        """Probe every transport from this node to each peer pool (node id -> control).

        shm is measured against this node only; nixl and objstore against the other nodes.
        Reads move ``blocks // 4`` and ``blocks`` blocks of ``namespace`` after a warm-up,
        repeated, fitted robustly (:func:`~kvshare.transfer.probe.probe`).
        Per transport the best figure over peers becomes ``bandwidths.measured``; per peer
        figures stay in ``per_node``. Returns the effective bytes/s (overrides applied).
        """
        with self._measuring:
            return self._measure(namespace, peers, blocks)

    def _measure(
        self, namespace: str, peers: Mapping[str, BlockControl], blocks: int
    ) -> dict[str, float]:
        from kvshare.transfer.reader.objstore import ObjStoreTransport
        from kvshare.transfer.reader.shm import ShmTransport

        src = self.source(namespace)
        if not self._pullers:
            self._pullers["shm"] = ShmTransport(self.node, holder=f"probe-{self.node}",
                                                known_slots=False)
            self._pullers["objstore"] = ObjStoreTransport(f"probe-{self.node}")
            if self.nixl:
                from kvshare.transfer.reader.nixl import NixlTransport

                try:
                    self._pullers["nixl"] = NixlTransport(f"{src.agent_name}/probe")
                except TransportUnavailable:
                    pass
        if len(self._dest) != blocks or self._dest[0].nbytes != src.block_bytes:
            from kvshare.transfer.reader.nixl import aligned_empty  # NIXL over cma: 2x when aligned

            buf = aligned_empty((blocks, src.block_bytes))
            buf.fill(0)  # pre-touched: page faults are not bandwidth
            self._dest = list(buf)
        dest = self._dest  # kept: NIXL registers it once
        best: dict[str, float] = {}
        for node, control in peers.items():
            names = ["shm"] if node == self.node else ["nixl", "objstore"]
            got = probe({n: self._pullers[n] for n in names if n in self._pullers}, control, dest,
                        estimator=self.estimator, peer=node)
            self.per_node[node] = got
            for n, v in got.items():
                best[n] = max(best.get(n, 0.0), v)
        self.bandwidths.update(best)
        self.measured_at = time.time()
        return self.bandwidths.as_dict()

    def close(self) -> None:
        close_all(self._pullers, self._sources)
        if self._probe_pool is not None:  # ours alone: unmap and unlink its slab
            self._probe_pool.close()
            self._probe_pool = None


class TransferEndpoints:
    """Mixin: the ``transfer_*`` methods ActorControl calls, served by ``self.transfer``."""

    transfer: TransferService

    def transfer_slab_info(self, namespace: str) -> SlabInfo | None:
        return self.transfer.source(namespace).slab_info()

    def transfer_nixl_info(self, namespace: str) -> NixlPeerInfo | None:
        return self.transfer.source(namespace).nixl_info()

    def transfer_prepare_read(
        self, namespace: str, hashes: Sequence[BlockHash], holder: str, ttl_s: float,
        verify: bool = False, nixl: bool = False,
    ) -> SlotReply:
        return self.transfer.leasing(namespace, holder).prepare_read(hashes, holder, ttl_s, verify,
                                                                     nixl)

    def transfer_push_read(
        self, namespace: str, hashes: Sequence[BlockHash], holder: str, ttl_s: float,
        request: PushRequest,
    ) -> SlotReply:
        return self.transfer.leasing(namespace, holder).push_read(hashes, holder, ttl_s, request)

    def transfer_finish(self, namespace: str, holder: str, lease_ids: Sequence[int]) -> list[bool]:
        return self.transfer.source(namespace).finish(holder, lease_ids)

    def transfer_read_blocks(self, namespace: str, hashes: Sequence[BlockHash]) -> BlockBatch:
        return self.transfer.source(namespace).read_blocks(hashes)

    def transfer_prepare_write(
        self, namespace: str, hashes: Sequence[BlockHash], holder: str, ttl_s: float,
        nixl: bool = False,
    ) -> SlotReply:
        return self.transfer.leasing(namespace, holder).prepare_write(hashes, holder, ttl_s, nixl)

    def transfer_commit_write(
        self, namespace: str, holder: str, lease_ids: Sequence[int], checksums: Sequence[int]
    ) -> list[BlockHash]:
        return self.transfer.source(namespace).commit_write(holder, lease_ids, checksums)

    def transfer_write_blocks(
        self, namespace: str, hashes: Sequence[BlockHash], data: ByteArray, checksums: Sequence[int]
    ) -> list[str]:
        return self.transfer.source(namespace).write_blocks(hashes, data, checksums)

    def transfer_report_corrupt(self, namespace: str, hashes: Sequence[BlockHash]) -> int:
        return self.transfer.source(namespace).report_corrupt(hashes)

    def transfer_touch(self, namespace: str, hashes: Sequence[BlockHash]) -> int:
        return self.transfer.source(namespace).touch(hashes)

    def transfer_probe_blocks(self, namespace: str, n: int) -> list[BlockHash]:
        return self.transfer.source(namespace).probe_blocks(n)

    def transfer_measure(
        self, namespace: str, peers: Mapping[str, Any], blocks: int = PROBE_BLOCKS
    ) -> dict[str, float]:
        """Probe peer pools (node id -> NodePoolActor handle) from this node; bytes/s per transport."""
        from kvshare.transfer.reader.control import ActorControl

        return self.transfer.measure(
            namespace, {node: ActorControl(actor, namespace) for node, actor in peers.items()},
            blocks=blocks,
        )

    def transfer_bandwidths(self) -> dict[str, Any]:
        """Effective bytes/s per transport (measured, overrides applied), per peer node, the
        overrides, and ``measured_at`` (unix time of the last probe; 0 = not probed yet)."""
        return {"transports": self.transfer.bandwidths.as_dict(),
                "per_node": dict(self.transfer.per_node),
                "overrides": dict(self.transfer.bandwidths.overrides),
                "measured_at": self.transfer.measured_at}
