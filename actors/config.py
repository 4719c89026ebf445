"""Configs and small wire types of the cluster layer.

One frozen config per component: :class:`IndexConfig` for the index shards,
:class:`PoolSettings` (with one :class:`NamespaceSpec` per namespace) for the node pools.
Actor names live in one Ray namespace; both are the SDK's contract (:mod:`kvshare.discovery`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvshare.discovery import INDEX_NAME as INDEX_NAME  # the actor names: the SDK's contract
from kvshare.discovery import POOL_PREFIX as POOL_PREFIX
from kvshare.discovery import RAY_NAMESPACE as RAY_NAMESPACE
from kvshare.discovery import WATCHER_NAME as WATCHER_NAME
from kvshare.discovery import index_name as index_name
from kvshare.discovery import pool_name as pool_name
from kvshare.layout import KVLayout
from kvshare.pool.types import check_namespace

GiB = 2**30


@dataclass(frozen=True)
class NamespaceSpec:
    """One namespace a node pool serves: its layout and per-node byte quotas.

    ``host_bytes`` sizes the shared-memory slab, ``disk_bytes`` the disk tier (0 = none).
    ``hash_size`` is the block hash length (32 for sha256/blake3, 16 for xxh3-128).
    """

    name: str
    """The namespace's name (one model and layout)."""
    layout: KVLayout
    """The KV layout of the namespace's blocks."""
    host_bytes: int
    """Bytes of the shared-memory host slab per node for this namespace."""
    disk_bytes: int = 0
    """Bytes of the disk tier per node for this namespace (0 = no disk tier)."""
    hash_size: int = 32
    """Block hash length in bytes: 32 for sha256/blake3, 16 for xxh3-128."""

    def __post_init__(self) -> None:
        check_namespace(self.name)
        if not isinstance(self.layout, KVLayout):
            raise ValueError(f"namespace {self.name}: layout must be a KVLayout")
        if self.host_bytes < self.layout.bytes_per_block:
            raise ValueError(
                f"namespace {self.name}: host_bytes {self.host_bytes} is smaller than one block "
                f"({self.layout.bytes_per_block} bytes): raise --host-gb"
            )
        if self.disk_bytes < 0:
            raise ValueError(f"namespace {self.name}: disk_bytes must be >= 0")
        if self.hash_size not in (16, 32):
            raise ValueError(f"namespace {self.name}: hash_size must be 16 or 32 bytes")


@dataclass(frozen=True)
class PoolSettings:
    """What every node pool runs with.

    ``disk_dir``: root of the disk tier; each node uses ``{disk_dir}/{node_id}/{namespace}``
    so pools on one machine (fake multi-node clusters) never share files.
    ``publish_interval_s`` / ``publish_max_events``: events reach the index at most that late,
    or as soon as that many are pending. ``publish_on_commit``: a committed write is
    published before the writer's commit returns (read-after-write: a worker that waits for
    its stores before answering leaves blocks any worker's next lookup finds; see
    :meth:`kvshare.actors.node_pool.NodePool.transfer_commit_write`). ``holder_check_s``: how often
    leases of dead holders are looked for. ``sizing_blocks``: blocks each namespace's
    hit-rate-against-capacity estimate tracks at most (~280 bytes each; 0: none; see
    :mod:`kvshare.pool.sizing`).
    """

    namespaces: tuple[NamespaceSpec, ...]
    """The namespaces every pool serves, one `NamespaceSpec` each (distinct names)."""
    disk_dir: str = "/tmp/kvshare-disk"
    """Root of the disk tier; each node uses `{disk_dir}/{node_id}/{namespace}`."""
    lease_ttl_s: float = 30.0
    """Seconds a lease (pin or reservation) lasts unless its holder releases it first."""
    demote_min_hits: int = 0
    """Hits a host block needs before eviction demotes it to disk instead of dropping it."""
    sizing_blocks: int = 16384
    """Blocks each namespace's hit-rate-against-capacity estimate tracks at most (~280 bytes
    each; 0: none; see :mod:`kvshare.pool.sizing`)."""
    value_window_s: float = 300.0
    """Seconds of the sliding window over which each tier's value (prefill seconds saved less
    seconds spent moving blocks) is reported and judged (see :mod:`kvshare.pool.value`)."""
    publish_interval_s: float = 0.05
    """Events reach the index at most this many seconds late."""
    publish_max_events: int = 4096
    """Events are published as soon as this many are pending."""
    publish_on_commit: bool = True
    """A committed write is published before the writer's commit returns (read-after-write)."""
    maintain_interval_s: float = 0.05
    """Unused: a pool's maintenance pass (demotion, expired leases, publishing) runs every
    `publish_interval_s`."""
    holder_check_s: float = 1.0
    """How often, in seconds, leases of dead holders are looked for."""
    ray_namespace: str = RAY_NAMESPACE
    """The Ray namespace the pools are registered in."""
    probe_every_s: float = 600.0
    """Re-measure the transports this often (seconds; 0 = only when a pool comes up), so
    the cost model follows bandwidth that changes under load."""
    bandwidth_overrides: tuple[tuple[str, float], ...] = ()
    """Bytes/s per transport (``shm``/``nixl``/``objstore``) that replace what the pools'
    probes measure; a node's ``KVSHARE_BANDWIDTH_GBPS`` env var (GB/s) wins over these. A
    mapping is accepted and stored as sorted pairs."""

    def __post_init__(self) -> None:
        bw = self.bandwidth_overrides
        pairs = tuple(sorted(bw.items() if isinstance(bw, Mapping) else bw))
        for name, value in pairs:
            if name not in ("shm", "nixl", "objstore") or not float(value) >= 0:
                raise ValueError(
                    f"bandwidth override {name}={value} is invalid: use shm, nixl or objstore "
                    "with a bytes/s value >= 0"
                )
        object.__setattr__(self, "bandwidth_overrides", tuple((n, float(v)) for n, v in pairs))
        names = [ns.name for ns in self.namespaces]
        if len(names) != len(set(names)):
            raise ValueError(f"namespaces must be distinct, got {names}")
        if self.publish_interval_s <= 0 or self.publish_max_events <= 0:
            raise ValueError("publish_interval_s and publish_max_events must be positive")
        if self.sizing_blocks < 0:
            raise ValueError(f"sizing_blocks must be >= 0 (0: no sizing estimate), got "
                             f"{self.sizing_blocks}")
        if not (self.value_window_s > 0 and self.value_window_s < float("inf")):
            raise ValueError(f"value_window_s must be a positive number of seconds, got "
                             f"{self.value_window_s}")
        if not self.probe_every_s >= 0:
            raise ValueError(f"probe_every_s must be >= 0 (0 = no periodic probe), got "
                             f"{self.probe_every_s}")

    @property
    def host_bytes(self) -> int:
        return sum(ns.host_bytes for ns in self.namespaces)


@dataclass(frozen=True)
class IndexConfig:
    """One index shard. ``worker_ttl_s``: a worker whose load reports stop is dropped
    after this long. ``snapshot_path``: Parquet file to warm-start from (optional).
    ``namespaces`` are declared at every start, so a restarted index answers misses (not
    "unknown namespace") until the pools have republished."""

    shard: int = 0
    """This shard's number, 0 <= shard < num_shards."""
    num_shards: int = 1
    """How many shards the index is split into by hash range."""
    worker_ttl_s: float = 3.0
    """A worker whose load reports stop is dropped after this many seconds."""
    snapshot_path: str = ""
    """Parquet file to warm-start from ('' = none); each shard adds its number to the name."""
    ray_namespace: str = RAY_NAMESPACE
    """The Ray namespace the index shards are registered in."""
    namespaces: tuple[tuple[str, int, str], ...] = ()
    """``(name, hash_size, layout_fingerprint)`` known from the start (also after a restart)."""

    def __post_init__(self) -> None:
        if self.num_shards < 1 or not 0 <= self.shard < self.num_shards:
            raise ValueError(
                f"index shard {self.shard} of {self.num_shards} is invalid: need 0 <= shard < n"
            )
        if self.worker_ttl_s <= 0:
            raise ValueError("worker_ttl_s must be positive")

    @property
    def shard_snapshot_path(self) -> str:
        """This shard's snapshot file ('' = none): ``index.parquet`` -> ``index-1.parquet``."""
        if not self.snapshot_path or self.num_shards == 1:
            return self.snapshot_path
        stem, dot, ext = self.snapshot_path.rpartition(".")
        return f"{stem}-{self.shard}.{ext}" if dot else f"{self.snapshot_path}-{self.shard}"
