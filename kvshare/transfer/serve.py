"""The actor-facing transfer API of a node pool: ``transfer_*`` methods keyed by namespace.

:class:`TransferService` holds one :class:`~kvshare.transfer.source.BlockSource` per namespace
of a node. :class:`TransferEndpoints` is a mixin with exactly the methods
:class:`~kvshare.transfer.control.ActorControl` calls, delegating to ``self.transfer``; a Ray
actor that owns pools (``actors.node_pool.NodePoolActor``) gets the whole data plane by
mixing it in. Nothing here imports Ray.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from kvshare.pool import TieredBlockPool
from kvshare.tiers.base import ByteArray
from kvshare.transfer.probe import seed_probe_blocks
from kvshare.transfer.source import BlockSource
from kvshare.transfer.wire import BlockBatch, NixlPeerInfo, PreparedRead, PreparedWrite, SlabInfo
from kvshare.types import BlockHash


class TransferService:
    """Serves transport control calls for the pools of one node."""

    def __init__(self, node: str, *, nixl: bool | None = None, probe_blocks: int = 0) -> None:
        self.node = node
        self.nixl = os.environ.get("KVSHARE_NIXL", "1") != "0" if nixl is None else nixl
        self.probe_blocks = probe_blocks
        self._sources: dict[str, BlockSource] = {}

    def add_pool(self, pool: TieredBlockPool) -> BlockSource:
        """Serve ``pool`` (replacing the source of an older generation of its namespace)."""
        ns = pool.config.namespace
        old = self._sources.pop(ns, None)
        if old is not None:
            old.close()
        src = self._sources[ns] = BlockSource(pool, self.node, nixl=self.nixl)
        if self.probe_blocks:
            seed_probe_blocks(pool, self.node, self.probe_blocks)
        return src

    def source(self, namespace: str) -> BlockSource:
        src = self._sources.get(namespace)
        if src is None:
            raise KeyError(
                f"namespace {namespace!r} is not served on node {self.node}: "
                f"served are {sorted(self._sources)}"
            )
        return src

    def nixl_errors(self) -> dict[str, str]:
        """Per namespace, why NIXL is unavailable ('' when it works)."""
        return {ns: s.nixl_error for ns, s in self._sources.items()}

    def close(self) -> None:
        for src in self._sources.values():
            src.close()
        self._sources.clear()


class TransferEndpoints:
    """Mixin: the ``transfer_*`` methods ActorControl calls, served by ``self.transfer``."""

    transfer: TransferService

    def transfer_slab_info(self, namespace: str) -> SlabInfo | None:
        return self.transfer.source(namespace).slab_info()

    def transfer_nixl_info(self, namespace: str) -> NixlPeerInfo | None:
        return self.transfer.source(namespace).nixl_info()

    def transfer_prepare_read(
        self, namespace: str, hashes: Sequence[BlockHash], holder: str, ttl_s: float
    ) -> PreparedRead:
        return self.transfer.source(namespace).prepare_read(hashes, holder, ttl_s)

    def transfer_finish(self, namespace: str, holder: str, lease_ids: Sequence[int]) -> list[bool]:
        return self.transfer.source(namespace).finish(holder, lease_ids)

    def transfer_read_blocks(self, namespace: str, hashes: Sequence[BlockHash]) -> BlockBatch:
        return self.transfer.source(namespace).read_blocks(hashes)

    def transfer_prepare_write(
        self, namespace: str, hashes: Sequence[BlockHash], holder: str, ttl_s: float
    ) -> PreparedWrite:
        return self.transfer.source(namespace).prepare_write(hashes, holder, ttl_s)

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
