"""NodePool: one node's tiered block pools (one per namespace) and their link to the index.

Plain class, usable without Ray (give it any :class:`IndexSink`, e.g. a ``GlobalIndex``);
:data:`NodePoolActor` is the Ray actor over it: one per node, named ``kvshare-pool-<node>``,
threaded (``max_concurrency``) so a slow call never blocks the control path.

- **Generation**: taken from the index at start; the host slab of namespace ``ns`` is
  ``/dev/shm/kvshare-{ns}-{node}-{generation}`` (older slabs of this node are removed), the
  disk tier is ``{disk_dir}/{node}/{ns}`` and survives restarts.
- **Events** are drained by a background thread every ``publish_interval_s`` (sooner when
  ``publish_max_events`` are pending) and published as one Arrow batch per namespace.
- **Resync**: the whole inventory is republished on start, when the index asks (after its
  restart, or a sequence gap), and when a publish failed or the index epoch changed.
- **One data plane**: the ``transfer_*`` endpoints (:class:`TransferEndpoints` over the
  :attr:`NodePool.transfer` member) that every transport calls through
  :class:`~kvshare.transfer.reader.control.ActorControl`: pin for reading (disk blocks are promoted
  to host so shm/NIXL readers can reach them), reserve + commit for writing through shared
  memory or NIXL, batched copies for the object store. Every method takes the namespace first;
  an unknown namespace is a KeyError naming the known ones. ``slab_info`` checks a worker's
  KV layout against the namespace's.
- **Leases** end when the transfer finishes, at their deadline, or when the holder died:
  holders named ``pid:<n>`` (a process on this node) or a Ray actor id are checked every
  ``holder_check_s``.
- **Admin pins** (``pin_prefix``/``unpin_prefix``, the :attr:`NodePool.admin` member, driven
  by :mod:`kvshare.actors.admin`): leases of holders named ``admin:<name>`` that last until their ttl
  or an unpin; never judged dead.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import pyarrow as pa

from kvshare.actors.admin_pins import AdminPins
from kvshare.actors.config import NamespaceSpec, PoolSettings
from kvshare.actors.index.global_index import PublishAck
from kvshare.actors.liveness import pid_alive, ray_holder_alive
from kvshare.events import Event, events_to_arrow
from kvshare.pool.tiered import TieredBlockPool
from kvshare.pool.types import (
    PoolConfig,
    TierSpec,
)
from kvshare.tiers.base import ByteArray, TierStore
from kvshare.tiers.disk import DiskStore
from kvshare.tiers.host import HostSlab, remove_stale_segments, segment_name
from kvshare.transfer.node_api import TransferEndpoints, TransferService
from kvshare.transfer.probe import parse_overrides
from kvshare.transfer.wire import SlabInfo
from kvshare.types import BlockHash, Tier, UnknownNamespace, node_location

log = logging.getLogger(__name__)


class IndexSink(Protocol):
    """What a pool needs from the index (``IndexClient`` or an in-process ``GlobalIndex``)."""

    def new_generation(self, location: str) -> int: ...
    def declare_namespace(self, namespace: str, hash_size: int = 32, layout_fingerprint: str = "") -> None: ...
    def publish(self, batch: pa.RecordBatch) -> PublishAck: ...
    def replace_inventory(self, location: str, generation: int, batch: pa.RecordBatch,
                          seq: int, namespace: str | None = None) -> bool: ...


class NodePool(TransferEndpoints):
    """The pools of one node, publishing to the index.

    Members: :attr:`transfer` (:class:`TransferService`, the data plane that the
    ``transfer_*`` endpoints serve) and :attr:`admin` (:class:`AdminPins`).
    """

    def __init__(
        self,
        node_id: str,
        settings: PoolSettings,
        index: IndexSink,
        *,
        holder_alive: Callable[[str], bool | None] = pid_alive,
        background: bool = True,
    ) -> None:
        self.node_id = node_id
        self.settings = settings
        self.index = index
        self.location = node_location(node_id)
        self._holder_alive = holder_alive
        self._lock = threading.RLock()  # pools and specs
        self._publish_lock = threading.Lock()  # orders drains with their index calls
        self._pools: dict[str, TieredBlockPool] = {}
        self._specs: dict[str, NamespaceSpec] = {}
        self._slabs: dict[str, HostSlab] = {}
        self._seq: dict[str, int] = {}
        self._holders: dict[str, float] = {}
        self._pending = 0
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._epoch: str | None = None
        self._resync_all = False
        self.counters = dict.fromkeys(
            ("published_events", "batches", "publish_errors", "republishes", "stale_acks",
             "holders_released"), 0)
        self.generation = int(index.new_generation(self.location))
        # shm/nixl/objstore source side per namespace; bandwidth overrides: env, then config
        overrides = {**dict(settings.bandwidth_overrides),
                     **parse_overrides(os.environ.get("KVSHARE_BANDWIDTH_GBPS", ""))}
        self.transfer = TransferService(node_id, bandwidth_overrides=overrides,
                                        generation=self.generation, on_holder=self._seen)
        self.admin = AdminPins(self._pool, lambda: self._kick(0))
        for spec in settings.namespaces:
            self._open(spec)
        self.republish()
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._run, name="kvshare-pool-pump", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ namespaces
    def _open(self, spec: NamespaceSpec) -> None:
        layout = spec.layout
        bb = layout.bytes_per_block
        name = segment_name(spec.name, self.node_id, self.generation)
        remove_stale_segments(spec.name, self.node_id, keep=name)
        # pinning for CUDA imports torch (seconds); only worth it where a GPU exists
        slab = HostSlab(bb, spec.host_bytes // bb, name, pin_cuda=os.path.exists("/dev/nvidiactl"))
        stores: dict[Tier, TierStore] = {Tier.HOST: slab}
        tiers = [TierSpec(Tier.HOST, slab.num_slots * bb)]
        if spec.disk_bytes >= bb:
            directory = os.path.join(self.settings.disk_dir, self.node_id, spec.name)
            stores[Tier.DISK] = DiskStore(directory, bb, spec.disk_bytes // bb, layout.fingerprint())
            tiers.append(TierSpec(Tier.DISK, (spec.disk_bytes // bb) * bb))
        config = PoolConfig(
            namespace=spec.name, layout=layout, tiers=tuple(tiers), location=self.location,
            generation=self.generation, lease_ttl_s=self.settings.lease_ttl_s,
            demote_min_hits=self.settings.demote_min_hits, hash_size=spec.hash_size,
            sizing_blocks=self.settings.sizing_blocks, value_window_s=self.settings.value_window_s,
        )
        try:
            pool = TieredBlockPool(config, stores)
        except BaseException:
            slab.close()
            raise
        self.index.declare_namespace(spec.name, spec.hash_size, layout.fingerprint())
        self._pools[spec.name] = pool
        self._specs[spec.name] = spec
        self._slabs[spec.name] = slab
        self.transfer.add_pool(pool)
        self._seq[spec.name] = 0

    def add_namespace(self, spec: NamespaceSpec) -> bool:
        """Serve another namespace; False if it is already served with the same spec."""
        with self._lock:
            cur = self._specs.get(spec.name)
            if cur is not None:
                if cur.layout != spec.layout or cur.hash_size != spec.hash_size:
                    raise ValueError(
                        f"namespace {spec.name!r} is served with layout {cur.layout.to_dict()}; "
                        "another layout needs another namespace"
                    )
                return False
            self._open(spec)
        self.republish([spec.name])
        return True

    def namespaces(self) -> list[str]:
        return list(self._specs)

    def _pool(self, namespace: str) -> TieredBlockPool:
        if namespace not in self._pools:
            raise UnknownNamespace(namespace, self._pools, "deploy with this namespace or call "
                                   "add_namespace first")
        return self._pools[namespace]

    def slab_info(self, namespace: str, layout_fingerprint: str | None = None) -> SlabInfo | None:
        """Where the namespace's host slab lives; ValueError if the caller's layout differs."""
        self._pool(namespace)
        spec = self._specs[namespace]
        if layout_fingerprint is not None and layout_fingerprint != spec.layout.fingerprint():
            raise ValueError(
                f"namespace {namespace!r} stores layout {spec.layout.fingerprint()} "
                f"{spec.layout.to_dict()}, not {layout_fingerprint}: fix the worker's KV layout"
            )
        return self.transfer.source(namespace).slab_info()

    # ------------------------------------------------------------------ holders, admin pins
    def _seen(self, holder: str) -> None:
        """A transfer leased blocks for ``holder``: its liveness is checked from now on."""
        if not isinstance(holder, str) or not holder:
            raise ValueError("holder must be a non-empty string (e.g. 'pid:<n>' or an actor id)")
        self._holders[holder] = time.monotonic()

    # admin pins (kvshare.actors.admin): served by the AdminPins member
    def contains(self, namespace: str, hashes: Sequence[BlockHash]) -> list[bool]:
        return self.admin.contains(namespace, hashes)

    def pin_prefix(self, namespace: str, hashes: Sequence[BlockHash], holder: str,
                   ttl_s: float) -> int:
        return self.admin.pin_prefix(namespace, hashes, holder, ttl_s)

    def unpin_prefix(self, namespace: str, holder: str) -> int:
        return self.admin.unpin_prefix(namespace, holder)

    def release_holder(self, holder: str) -> int:
        """End every lease of ``holder`` in every namespace (it died); returns how many."""
        n = sum(p.release_holder(holder) for p in list(self._pools.values()))
        self._holders.pop(holder, None)
        self.counters["holders_released"] += n
        return n

    def prefix_len(self, namespace: str, hashes: Sequence[BlockHash]) -> int:
        return self._pool(namespace).prefix_len(list(hashes))

    def clear(self, namespace: str) -> int:
        n = self._pool(namespace).clear()
        self._kick(n)
        return n

    def stats(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "location": self.location,
            "generation": self.generation,
            "namespaces": {
                ns: {**pool.stats(), "shm_name": self._slabs[ns].name}
                for ns, pool in list(self._pools.items())
            },
            "holders": len(self._holders),
            **self.counters,
        }

    # ------------------------------------------------------------------ writes
    def transfer_commit_write(
        self, namespace: str, holder: str, lease_ids: Sequence[int], checksums: Sequence[int]
    ) -> list[BlockHash]:
        """Commit a writer's blocks; with ``publish_on_commit`` they are published to the
        index before this returns, so a writer that waits for its store before answering
        leaves blocks that the very next lookup, on any node, finds (not 50 ms later)."""
        done = super().transfer_commit_write(namespace, holder, lease_ids, checksums)
        if done and self.settings.publish_on_commit:
            self.flush()
        return done

    def transfer_write_blocks(
        self, namespace: str, hashes: Sequence[BlockHash], data: ByteArray, checksums: Sequence[int]
    ) -> list[str]:
        """Write blocks sent by value (a writer on another node), published as
        :meth:`transfer_commit_write` does."""
        reasons = super().transfer_write_blocks(namespace, hashes, data, checksums)
        if self.settings.publish_on_commit and any(r == "" for r in reasons):
            self.flush()
        return reasons

    # ------------------------------------------------------------------ publishing
    def _kick(self, n: int) -> None:
        self._pending += n
        if self._pending >= self.settings.publish_max_events:
            self._wake.set()

    def flush(self) -> int:
        """Publish pending events now; returns how many were sent."""
        sent = 0
        resync: list[str] = []
        with self._publish_lock:
            for ns in list(self._pools):
                with self._lock:
                    events: list[Event] = self._pools[ns].take_events()
                if not events:
                    continue
                self._seq[ns] = events[-1].seq
                try:
                    ack = self.index.publish(events_to_arrow(events, self._specs[ns].hash_size))
                except Exception as exc:  # index down: its entries for us are unknown now
                    self.counters["publish_errors"] += 1
                    self._resync_all = True
                    log.warning("publishing %d events failed (%s); will resync", len(events), exc)
                    continue
                sent += len(events)
                self.counters["batches"] += 1
                self.counters["published_events"] += len(events)
                self.counters["stale_acks"] += int(ack.stale > 0)
                if self._epoch is not None and ack.epoch != self._epoch:
                    self._resync_all = True
                self._epoch = ack.epoch
                resync += [n for n, loc in ack.resync if loc == self.location and n in self._pools]
        self._pending = 0
        if self._resync_all:
            self.republish()
        elif resync:
            self.republish(sorted(set(resync)))
        return sent

    def republish(self, namespaces: Sequence[str] | None = None) -> int:
        """Send the whole inventory of (some) namespaces; returns the number of blocks."""
        total = 0
        with self._publish_lock:
            if namespaces is None:
                self._resync_all = False
            for ns in list(namespaces or self._pools):
                pool = self._pool(ns)
                with self._lock:
                    events = pool.take_events()
                    inv = pool.inventory()
                if events:
                    self._seq[ns] = events[-1].seq
                spec = self._specs[ns]
                batch = _inventory_batch(ns, self.location, self.generation, inv, spec.hash_size)
                try:  # a restarted index may not know the namespace yet
                    self.index.declare_namespace(ns, spec.hash_size, spec.layout.fingerprint())
                    self.index.replace_inventory(self.location, self.generation, batch,
                                                 self._seq[ns], ns)
                except Exception as exc:
                    self._resync_all = True
                    log.warning("republishing %s failed (%s); will retry", ns, exc)
                    continue
                total += len(inv)
            self.counters["republishes"] += 1
            epoch = getattr(self.index, "epoch", None)
            try:
                self._epoch = epoch() if callable(epoch) else self._epoch
            except Exception:
                self._resync_all = True
        return total

    # ------------------------------------------------------------------ background
    def maintain(self) -> int:
        """Demote over-full host tiers, expire leases; returns blocks moved."""
        moved = 0
        for pool in list(self._pools.values()):
            moved += pool.maintain()
            pool.expire_leases()
        return moved

    def check_holders(self) -> int:
        """Release leases of holders that died; forget holders idle past the lease ttl."""
        released = 0
        now = time.monotonic()
        for holder, seen in list(self._holders.items()):
            alive = self._holder_alive(holder)
            if alive is False:
                released += self.release_holder(holder)
            elif now - seen > self.settings.lease_ttl_s:
                self._holders.pop(holder, None)
        return released

    def _run(self) -> None:
        last_check = time.monotonic()
        while not self._closed.is_set():
            self._wake.wait(self.settings.publish_interval_s)
            self._wake.clear()
            if self._closed.is_set():
                break
            try:
                self.maintain()
                self.flush()
                if time.monotonic() - last_check >= self.settings.holder_check_s:
                    last_check = time.monotonic()
                    self.check_holders()
            except Exception:  # keep pumping; one bad round must not stop publishing
                log.exception("pool background round failed")

    def watch(self, timeout_s: float = 30.0) -> int:
        """Block until the pool closes or ``timeout_s`` passes; returns the generation.

        The watcher keeps one such call outstanding: when the actor dies, the call fails
        with Ray's actor-death error, which is how the index learns of it at once.
        """
        self._closed.wait(max(0.0, timeout_s))
        return self.generation

    def close(self) -> None:
        """Stop publishing and unmap/unlink the slabs (disk blocks stay for the next start)."""
        self._closed.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        with self._lock:
            self.transfer.close()  # NIXL deregisters the slabs before they are unmapped
            for pool in self._pools.values():
                pool.close()


def _inventory_batch(ns: str, location: str, generation: int,
                     inv: list[tuple[BlockHash, Tier]], hash_size: int) -> pa.RecordBatch:
    from kvshare.events import BlockStored
    from kvshare.types import Location

    loc = Location(location)
    return events_to_arrow(
        (BlockStored(ns, loc, tier, h, generation, 0) for h, tier in inv), hash_size
    )


class NodePoolService(NodePool):
    """The body of :data:`NodePoolActor`: a NodePool on the node it runs on."""

    def __init__(self, settings: PoolSettings, index: IndexSink | None = None) -> None:
        import ray

        from kvshare.actors.index.client import IndexClient

        node_id = ray.get_runtime_context().get_node_id()
        super().__init__(node_id, settings, index or IndexClient.connect(settings.ray_namespace),
                         holder_alive=ray_holder_alive)

    def ready(self) -> dict[str, Any]:
        """``node_id``, ``generation`` and the namespaces served."""
        return {"node_id": self.node_id, "generation": self.generation,
                "namespaces": self.namespaces()}


def _make_actor() -> Any:
    import ray

    return ray.remote(  # type: ignore[call-overload]
        max_restarts=-1, max_task_retries=0, max_concurrency=32, num_cpus=0
    )(
        NodePoolService
    )


NodePoolActor: Any = _make_actor()
"""One per node: ``NodePoolActor.options(name=pool_name(node), namespace=..., lifetime="detached",
scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(settings)``."""
