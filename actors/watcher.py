"""ClusterWatcher: keeps one pool on every alive node and tells the index about deaths.

It relies on Ray's own signals, not heartbeats of its own:
- **node state** (``ray.nodes()``, polled every ``poll_s``): a node that joins gets a pool
  (``NodeAffinitySchedulingStrategy(node, soft=False)``, detached, named per node); a node
  marked dead has its pool's and its workers' entries dropped from the index;
- **actor death errors**: one ``watch()`` call is kept outstanding on every pool; when the pool
  dies (node removed, process killed) that call fails at once with a ``RayActorError`` and the
  pool's entries up to its generation are dropped. A restarted pool registers a new
  generation itself; a pool that is gone for good is created again.

**Bandwidth probes**: whenever a pool comes up (at start, a node joined, a pool restarted), and
every ``PoolSettings.probe_every_s`` seconds after the last round (default 10 min), the
watcher asks every pool that is up to measure each transport to every other one
(``transfer_measure`` over the private probe namespace: 8 and 32 MiB reads after a warm-up, fitted robustly, bounded by
the transports' deadlines). The calls run in the pools' own threads; the watcher never waits
for them, it only starts the next round once the previous one is done. The figures live in
the pools (``transfer_bandwidths``; ``kvshare.actors.deploy.bandwidths`` collects them).

**Index shards**: with ``index_config`` the watcher also checks every round that each index
shard's name is held, and starts a fresh shard when one is gone for good
(:class:`~kvshare.actors.index.keeper.IndexKeeper`); the new shard asks the pools to republish, so the
entries come back within a few rounds.

Runs as a detached, restartable actor (:data:`WatcherActor`) with one background thread.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvshare.actors.config import IndexConfig, NamespaceSpec, PoolSettings, pool_name
from kvshare.actors.index.client import IndexClient
from kvshare.actors.index.keeper import IndexKeeper
from kvshare.actors.node_pool import NodePoolActor
from kvshare.cost import GB
from kvshare.transfer.probe import PROBE_NAMESPACE
from kvshare.types import node_location

log = logging.getLogger(__name__)


def alive_nodes() -> dict[str, bool]:
    """``node_id -> alive`` for every node Ray knows (dead ones included)."""
    return {n["NodeID"]: bool(n["Alive"]) for n in ray.nodes()}  # type: ignore[no-untyped-call]


def start_pool(node_id: str, settings: PoolSettings) -> Any:
    """The pool actor of ``node_id`` (created if missing; an existing one is returned)."""
    return NodePoolActor.options(
        name=pool_name(node_id),
        namespace=settings.ray_namespace,
        lifetime="detached",
        get_if_exists=True,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(settings)


class ClusterWatcher:
    """Reconciles pools with Ray's node table; see the module docstring."""

    def __init__(self, settings: PoolSettings, poll_s: float = 0.5, watch_s: float = 10.0,
                 snapshot_every_s: float = 0.0, probe: bool = True,
                 probe_settle_s: float = 3.0, index_config: IndexConfig | None = None) -> None:
        self.settings = settings
        self.keeper = IndexKeeper(index_config) if index_config is not None else None
        self.probe = probe
        self.probe_settle_s = probe_settle_s  # wait this long for pools still starting
        self._probe_due: float | None = None  # when a probe round was asked for
        self._probes: dict[Any, str] = {}  # outstanding transfer_measure ref -> node
        self.probe_rounds = 0
        self._last_round = 0.0  # monotonic time the last probe round started
        self.poll_s = poll_s
        self.watch_s = watch_s
        self.snapshot_every_s = snapshot_every_s
        self.index = IndexClient.connect(settings.ray_namespace)
        self.pools: dict[str, Any] = {}
        self.generations: dict[str, int] = {}
        self._watch: dict[Any, str] = {}  # outstanding watch ref -> node
        self.dead: set[str] = set()
        self._failures: dict[str, int] = {}  # pools that died before answering once
        self._retry_at: dict[str, float] = {}
        self.events: list[str] = []
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvshare-watcher", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ API
    def reconcile(self, wait_s: float = 0.0) -> dict[str, int]:
        """One round now; with ``wait_s`` also wait for every pool to be up.

        Returns ``node_id -> generation`` of the pools that answered.
        """
        with self._lock:
            self._round()
            pools = dict(self.pools)
        if wait_s <= 0:
            return dict(self.generations)
        refs = {node: pool.ready.remote() for node, pool in pools.items()}
        out: dict[str, int] = {}
        for node, ref in refs.items():
            try:
                out[node] = int(ray.get(ref, timeout=wait_s)["generation"])
            except (RayError, TimeoutError) as exc:
                log.warning("pool on node %s not ready: %s", node, exc)
        return out

    def add_namespace(self, spec: NamespaceSpec) -> int:
        """Serve ``spec`` on every pool (and on pools created later); returns pools updated."""
        with self._lock:
            if spec.name not in {s.name for s in self.settings.namespaces}:
                self.settings = replace(self.settings, namespaces=(*self.settings.namespaces, spec))
            pools = list(self.pools.values())
        self.index.declare_namespace(spec.name, spec.hash_size, spec.layout.fingerprint())
        if self.keeper is not None:
            self.keeper.declare(spec.name, spec.hash_size, spec.layout.fingerprint())
        ray.get([p.add_namespace.remote(spec) for p in pools], timeout=60)
        return len(pools)

    def get_settings(self) -> PoolSettings:
        return self.settings

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {"pools": {n: self.generations.get(n) for n in self.pools},
                    "dead_nodes": sorted(self.dead), "events": self.events[-50:],
                    "probe_rounds": self.probe_rounds,
                    "index_recreated": self.keeper.recreated if self.keeper else 0,
                    "probing": sorted(set(self._probes.values()))}

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    # ------------------------------------------------------------------ loop
    def _note(self, what: str) -> None:
        log.info("%s", what)
        self.events.append(what)

    def _round(self) -> None:
        now = time.monotonic()
        for node, alive in alive_nodes().items():
            if alive and node not in self.pools and self._retry_at.get(node, 0.0) <= now:
                self.dead.discard(node)
                pool = start_pool(node, self.settings)
                self.pools[node] = pool
                self._watch[pool.watch.remote(0.0)] = node
                self._note(f"pool placed on node {node}")
            elif not alive and node not in self.dead:
                self.dead.add(node)
                pool = self.pools.pop(node, None)
                self._watch = {r: n for r, n in self._watch.items() if n != node}
                self.generations.pop(node, None)
                self.index.drop_node(node)
                if pool is not None:
                    ray.kill(pool)
                self._note(f"node {node} dead: its entries were dropped")

    def _check_watches(self) -> None:
        refs = list(self._watch)
        if not refs:
            self._stop.wait(self.poll_s)
            return
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.poll_s)
        with self._lock:
            for ref in ready:
                self._settle(ref)

    def _settle(self, ref: Any) -> None:
        if ref not in self._watch:
            return
        node = self._watch.pop(ref)
        pool = self.pools.get(node)
        try:
            gen = int(ray.get(ref))
        except (RayActorError, RayError) as exc:
            if node not in self.generations:  # it never came up: back off before retrying
                self._failures[node] = self._failures.get(node, 0) + 1
                delay = min(60.0, self.poll_s * 2 ** self._failures[node])
                self._retry_at[node] = time.monotonic() + delay
                self._note(f"pool on node {node} failed to start ({str(exc)[-300:]}); "
                           f"retrying in {delay:.0f} s")
            last = self.generations.pop(node, None)
            n = self.index.drop_location(node_location(node), last or 0)
            self.pools.pop(node, None)  # next round: get_if_exists finds or re-creates it
            self._note(f"pool on node {node} died ({type(exc).__name__}); "
                       f"dropped {n} entries up to generation {last}")
            return
        if pool is None:
            return
        if self.probe and self.generations.get(node) != gen:  # a pool came up: measure again
            self._probe_due = self._probe_due or time.monotonic()
        self.generations[node] = gen
        self._failures.pop(node, None)
        self._watch[pool.watch.remote(self.watch_s)] = node

    def _maybe_probe(self) -> None:
        """Collect finished probes; start a round when one is due (see the module docstring)."""
        if self._probes:
            done, _ = ray.wait(list(self._probes), num_returns=len(self._probes), timeout=0)
            for ref in done:
                node = self._probes.pop(ref)
                try:
                    got = ray.get(ref)
                    self._note(f"bandwidths of node {node} (GB/s): "
                               + ", ".join(f"{k}={v / GB:.2f}" for k, v in sorted(got.items())))
                except RayError as exc:
                    self._note(f"probe from node {node} failed: {str(exc)[-200:]}")
        every = self.settings.probe_every_s
        if (self._probe_due is None and every and self.probe_rounds
                and time.monotonic() - self._last_round >= every):
            self._probe_due = time.monotonic()  # periodic: bandwidth changes under load
        if self._probe_due is None or self._probes:
            return
        with self._lock:
            up = {n: self.pools[n] for n in self.generations if n in self.pools}
            starting = [n for n in self.pools if n not in self.generations]
        if not up or (starting and time.monotonic() - self._probe_due < self.probe_settle_s):
            return
        self._probe_due = None
        self._last_round = time.monotonic()
        self.probe_rounds += 1
        for node, pool in up.items():
            self._probes[pool.transfer_measure.remote(PROBE_NAMESPACE, up)] = node

    def _run(self) -> None:
        ticks = 0
        while not self._stop.is_set():
            try:
                with self._lock:
                    self._round()
                if self.keeper is not None:
                    for shard in self.keeper.check():
                        self._note(f"index shard {shard} was gone for good: started a new one")
                self._check_watches()
                if self.probe:
                    self._maybe_probe()
                ticks += 1
                if self.snapshot_every_s and ticks % max(1, int(self.snapshot_every_s / self.poll_s)) == 0:
                    for shard in self.index.shards:
                        shard.save_snapshot.remote()
            except Exception:
                log.exception("watcher round failed")
                self._stop.wait(self.poll_s)


WatcherActor: Any = ray.remote(max_restarts=-1, max_task_retries=0, max_concurrency=4, num_cpus=0)(  # type: ignore[call-overload]
    ClusterWatcher
)
