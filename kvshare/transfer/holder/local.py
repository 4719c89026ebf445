"""Build a pool over a named host slab (and optionally disk) plus its BlockServer, in-process.

What a NodePoolActor does per namespace, without Ray: used by the transport tests, the
transfer benchmark and any process that wants to serve its own blocks to peers.
"""

from __future__ import annotations

from kvshare.layout import KVLayout
from kvshare.pool.tiered import TieredBlockPool
from kvshare.pool.types import PoolConfig, TierSpec
from kvshare.tiers.base import TierStore
from kvshare.tiers.disk import DiskStore
from kvshare.tiers.host import HostSlab, remove_stale_segments, segment_name
from kvshare.transfer.holder.server import BlockServer
from kvshare.types import Tier, node_location


def make_local_pool(
    namespace: str,
    node: str,
    layout: KVLayout,
    host_blocks: int,
    *,
    disk_dir: str | None = None,
    disk_blocks: int = 0,
    generation: int = 0,
    lease_ttl_s: float = 30.0,
) -> TieredBlockPool:
    """A host(+disk) pool whose slab is ``/dev/shm/kvshare-{namespace}-{node}-{generation}``.

    Stale slabs of older generations of the same namespace and node are removed first.
    """
    if host_blocks <= 0:
        raise ValueError("host_blocks must be positive: the host tier is what transports serve")
    name = segment_name(namespace, node, generation)
    remove_stale_segments(namespace, node)
    bpb = layout.bytes_per_block
    stores: dict[Tier, TierStore] = {Tier.HOST: HostSlab(bpb, host_blocks, name)}
    tiers = [TierSpec(Tier.HOST, host_blocks * bpb)]
    if disk_blocks > 0:
        if disk_dir is None:
            raise ValueError("disk_blocks > 0 needs a disk_dir")
        stores[Tier.DISK] = DiskStore(disk_dir, bpb, disk_blocks, layout.fingerprint())
        tiers.append(TierSpec(Tier.DISK, disk_blocks * bpb))
    config = PoolConfig(
        namespace, layout, tuple(tiers), location=node_location(node), generation=generation,
        lease_ttl_s=lease_ttl_s,
    )
    return TieredBlockPool(config, stores)


def make_local_source(
    namespace: str, node: str, layout: KVLayout, host_blocks: int, *, nixl: bool = True,
    **kwargs: object,
) -> BlockServer:
    """:func:`make_local_pool` wrapped in a :class:`BlockServer` (NIXL agent if ``nixl``)."""
    pool = make_local_pool(namespace, node, layout, host_blocks, **kwargs)  # type: ignore[arg-type]
    return BlockServer(pool, node, nixl=nixl)
