"""GlobalIndexActor: one index shard as a restartable Ray actor (thin wrapper).

The actor *is* a :class:`~kvshare.actors.index.global_index.GlobalIndex` (every public method is callable
remotely) plus what only an actor needs: it starts from its Parquet snapshot when one is
configured, and on every start (including a restart after a crash) it asks every node pool
found among the named actors of its Ray namespace to republish its inventory.
"""

from __future__ import annotations

import gc
import logging
import os
from typing import Any

import ray

from kvshare.actors.config import POOL_PREFIX, IndexConfig, index_name
from kvshare.actors.index.arrow_io import read_snapshot, write_snapshot
from kvshare.actors.index.client import IndexClient
from kvshare.actors.index.global_index import GlobalIndex

log = logging.getLogger(__name__)


class IndexService(GlobalIndex):
    """The body of :data:`GlobalIndexActor` (usable in-process too)."""

    def __init__(self, config: IndexConfig) -> None:
        super().__init__(worker_ttl_s=config.worker_ttl_s)
        self.config = config
        self.restarted = False
        self._unfrozen = 0
        for name, hash_size, fingerprint in config.namespaces:
            self.declare_namespace(name, hash_size, fingerprint)
        path = config.shard_snapshot_path
        if path and os.path.exists(path):
            try:
                n = self.load_snapshot(read_snapshot(path))
                log.info("index shard %d warm-started with %d entries", config.shard, n)
            except Exception as exc:  # a bad snapshot only costs the warm start
                log.warning("ignoring index snapshot %s: %s", path, exc)
        if ray.is_initialized():
            ctx = ray.get_runtime_context()
            self.restarted = bool(ctx.was_current_actor_reconstructed)
            self.ask_pools_to_republish()

    def publish(self, batch: Any, seq_range: tuple[int, int] | None = None) -> Any:
        ack = super().publish(batch, seq_range)
        self._maybe_freeze(ack.applied)
        return ack

    def replace_inventory(self, location: str, generation: int, batch: Any, seq: int,
                          namespace: str | None = None) -> bool:
        ok = super().replace_inventory(location, generation, batch, seq, namespace)
        self._maybe_freeze(int(batch.num_rows))
        return ok

    def _maybe_freeze(self, added: int) -> None:
        """Move the (long-lived) index entries out of the cyclic GC's way every ~100k
        entries: the GC then stops re-scanning them, which keeps match latency flat."""
        self._unfrozen += added
        if self._unfrozen >= 100_000:
            gc.collect(0)
            gc.freeze()
            self._unfrozen = 0

    def ready(self) -> dict[str, Any]:
        """Shard facts: ``epoch`` (new on every start), ``shard``, ``num_shards``, ``restarted``,
        ``node`` (the Ray node it runs on)."""
        return {"epoch": self.epoch, "shard": self.config.shard,
                "num_shards": self.config.num_shards, "restarted": self.restarted,
                "node": ray.get_runtime_context().get_node_id()}

    def client(self, timeout_s: float = 5.0) -> IndexClient:
        """The deployment's index client (every shard, by name), each call bounded by
        ``timeout_s``: how engine processes find the index (:func:`kvshare.discovery.find_index`)."""
        ns = self.config.ray_namespace  # with it, the client finds a recreated shard again
        return IndexClient([ray.get_actor(index_name(i), namespace=ns)
                            for i in range(self.config.num_shards)], timeout_s, ns)

    def get_epoch(self, _payload: Any = None) -> str:
        """The shard's epoch (``_payload`` is ignored: benchmarks time bare calls with it)."""
        return self.epoch

    def ping(self, _query: bytes = b"") -> bytes:
        """Does nothing: Ray's own cost of a call shaped like :meth:`match_query` (one bytes
        argument, a bytes reply), which benchmarks print as the floor."""
        return b""

    def ask_pools_to_republish(self) -> int:
        """Fire-and-forget ``republish()`` to every named pool actor; returns how many."""
        ns = self.config.ray_namespace
        n = 0
        try:
            names = ray.util.list_named_actors(all_namespaces=True)
        except Exception as exc:
            log.warning("cannot list pool actors: %s", exc)
            return 0
        for entry in names:
            if entry.get("namespace") != ns or not str(entry.get("name", "")).startswith(POOL_PREFIX):
                continue
            try:
                ray.get_actor(entry["name"], namespace=ns).republish.remote()
                n += 1
            except Exception as exc:  # the pool may be dying; the watcher handles it
                log.info("pool %s not asked to republish: %s", entry["name"], exc)
        return n

    def save_snapshot(self, path: str = "") -> int:
        """Write :meth:`snapshot` as Parquet to ``path`` (default: the configured one)."""
        path = path or self.config.shard_snapshot_path
        if not path:
            raise ValueError("no snapshot path: pass one or set IndexConfig.snapshot_path")
        table = self.snapshot()
        write_snapshot(table, path)
        return int(table.num_rows)


GlobalIndexActor: Any = ray.remote(
    max_restarts=-1, max_task_retries=0, num_cpus=0)(IndexService)
"""``GlobalIndexActor.options(name=index_name(i), namespace=..., lifetime="detached").remote(cfg)``."""
