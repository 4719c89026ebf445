"""Launching kvshare on a Ray cluster: ``deploy``, ``status``, ``shutdown``.

``deploy`` connects to a cluster (``address``), to the one already running on this machine,
or starts an embedded local Ray; it then starts, in the Ray namespace ``kvshare``, the index
shard(s) ``kvshare-index-<i>``, the watcher ``kvshare-watcher`` and through it one pool
``kvshare-pool-<node_id>`` on every alive node (all detached, restartable). Calling it again
adds namespaces to a running deployment. Other components find the pieces with
:func:`get_index_client` and :func:`get_pool`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import ray

from kvshare.actors.config import (
    POOL_PREFIX,
    RAY_NAMESPACE,
    WATCHER_NAME,
    GiB,
    IndexConfig,
    NamespaceSpec,
    PoolSettings,
    pool_name,
)
from kvshare.actors.index.client import IndexClient
from kvshare.actors.index.keeper import control_plane_placement, start_shard
from kvshare.auth import cluster_secret
from kvshare.layout import KVLayout
from kvshare.links import Links
from kvshare.tiers.host import SHM_DIR, shm_dir
from kvshare.types import WorkerId
from kvshare.workers import WorkerInfo, WorkerLoad, measured_prefill_tokens_per_s

log = logging.getLogger(__name__)

DEFAULT_LAYOUT = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, dtype="fp32", block_tokens=256)
"""The reference worker's small Llama (2 MiB blocks); real models pass their own layout."""

_clients: dict[str, IndexClient] = {}


def connect(address: str | None = None, ray_namespace: str = RAY_NAMESPACE,
            start: Callable[[], None] | None = None) -> None:
    """Attach this process to Ray: ``address``, else a running local cluster, else (no
    cluster runs) ``start()`` and then that cluster, or without ``start`` a new embedded one.
    A process already connected stays as it is."""
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, namespace=ray_namespace, log_to_driver=False)
        return
    try:
        ray.init(address="auto", namespace=ray_namespace, log_to_driver=False)
    except ConnectionError:
        if start is not None:
            start()
            ray.init(address="auto", namespace=ray_namespace, log_to_driver=False)
            return
        log.info("no running Ray cluster found: starting an embedded local one")
        ray.init(namespace=ray_namespace, log_to_driver=False)


def namespace_specs(
    namespaces: Mapping[str, KVLayout] | Sequence[NamespaceSpec] | None,
    namespace: str,
    host_gb: float,
    disk_gb: float,
    layout: KVLayout | None = None,
) -> tuple[NamespaceSpec, ...]:
    """Specs for ``namespaces`` (or the single ``namespace``); quotas split evenly."""
    if namespaces is None:
        namespaces = {namespace: layout or DEFAULT_LAYOUT}
    if isinstance(namespaces, Mapping):
        items = list(namespaces.items())
        if not items:
            raise ValueError("deploy needs at least one namespace")
        host = int(host_gb * GiB) // len(items)
        disk = int(disk_gb * GiB) // len(items)
        return tuple(NamespaceSpec(name, lay, host, disk) for name, lay in items)
    specs = tuple(namespaces)
    if not specs or not all(isinstance(s, NamespaceSpec) for s in specs):
        raise ValueError("namespaces must map names to KVLayouts or be NamespaceSpecs")
    return specs


def check_shm(settings: PoolSettings) -> None:
    """Refuse when the slabs plus Ray's object stores of this machine exceed free /dev/shm
    (or the slabs exceed their own directory's free room, under ``KVSHARE_SHM_DIR``)."""
    me = ray.get_runtime_context().get_node_id()
    nodes = [n for n in ray.nodes() if n["Alive"]]  # type: ignore[no-untyped-call]
    here = next((n["NodeManagerAddress"] for n in nodes if n["NodeID"] == me), None)
    local = [n for n in nodes if n["NodeManagerAddress"] == here]  # this machine's nodes
    store = sum(int(n["Resources"].get("object_store_memory", 0)) for n in local)
    slabs = settings.host_bytes * max(1, len(local))
    what = (f"{slabs / GiB:.2f} GiB of host slabs ({len(local)} node(s) x "
            f"{settings.host_bytes / GiB:.2f} GiB)")
    need = [(what, slabs, shm_dir()), (f"{store / GiB:.2f} GiB of Ray object store", store, SHM_DIR)]
    if os.path.realpath(need[0][2]) == os.path.realpath(SHM_DIR):  # one room for both
        need = [(f"{what} plus {need[1][0]}", slabs + store, SHM_DIR)]
    for label, nbytes, where in need:
        st = os.statvfs(where)
        free = st.f_bavail * st.f_frsize
        if nbytes > free:
            raise MemoryError(
                f"kvshare needs {label} in {where}, which has {free / GiB:.2f} GiB free: "
                f"lower --host-gb or enlarge {where} (hugetlbfs: reserve more pages)"
            )


def deploy(
    address: str | None = None,
    *,
    host_gb: float = 1.0,
    disk_dir: str | None = None,
    disk_gb: float = 0.0,
    namespace: str = "default",
    layout: KVLayout | None = None,
    namespaces: Mapping[str, KVLayout] | Sequence[NamespaceSpec] | None = None,
    index_shards: int = 1,
    ray_namespace: str = RAY_NAMESPACE,
    worker_ttl_s: float = 3.0,
    snapshot_path: str = "",
    wait_s: float = 60.0,
    **pool_options: Any,
) -> dict[str, Any]:
    """Start (or extend) kvshare on a Ray cluster; returns :func:`status`.

    ``host_gb``/``disk_gb`` are per node and split evenly over the namespaces; ``disk_dir``
    defaults to ``/tmp/kvshare-disk`` when ``disk_gb > 0``. ``pool_options`` go to
    :class:`PoolSettings` (``lease_ttl_s``, ``publish_interval_s``, ``bandwidth_overrides`` to
    override the probed bytes/s per transport, ...). Each pool probes its peers in the
    background once it is up (:func:`bandwidths` reads the results).
    """
    if host_gb <= 0 or disk_gb < 0 or index_shards < 1:
        raise ValueError("need host_gb > 0, disk_gb >= 0 and index_shards >= 1")
    connect(address, ray_namespace)
    cluster_secret(create=True)  # tenant salts and worker tokens derive from it (kvshare.auth)
    specs = namespace_specs(namespaces, namespace, host_gb, disk_gb, layout)
    settings = PoolSettings(namespaces=specs, disk_dir=disk_dir or "/tmp/kvshare-disk",
                            ray_namespace=ray_namespace, **pool_options)
    existing = _find_watcher(ray_namespace)
    if existing is None:
        check_shm(settings)
    here = control_plane_placement()  # the head node: it outlives every worker node
    known = tuple((s.name, s.hash_size, s.layout.fingerprint()) for s in specs)
    index_config = IndexConfig(0, index_shards, worker_ttl_s, snapshot_path, ray_namespace, known)
    shards = [start_shard(replace(index_config, shard=i), here) for i in range(index_shards)]
    ray.get([s.ready.remote() for s in shards], timeout=wait_s)
    client = IndexClient(shards, ray_namespace=ray_namespace)
    _clients[ray_namespace] = client
    for spec in specs:
        client.declare_namespace(spec.name, spec.hash_size, spec.layout.fingerprint())
    if existing is not None:
        for spec in specs:
            ray.get(existing.add_namespace.remote(spec), timeout=wait_s)
        watcher = existing
    else:
        from kvshare.actors.watcher import WatcherActor

        watcher = WatcherActor.options(
            name=WATCHER_NAME, namespace=ray_namespace, lifetime="detached",
            get_if_exists=True, scheduling_strategy=here,
        ).remote(settings, snapshot_every_s=10.0 if snapshot_path else 0.0,
                 index_config=index_config)
    ray.get(watcher.reconcile.remote(wait_s=wait_s), timeout=wait_s + 10)
    return status(ray_namespace)


def _find_watcher(ray_namespace: str) -> Any | None:
    try:
        return ray.get_actor(WATCHER_NAME, namespace=ray_namespace)
    except ValueError:
        return None


def _named(ray_namespace: str, prefix: str) -> list[str]:
    return sorted(
        a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
        if a.get("namespace") == ray_namespace and str(a.get("name", "")).startswith(prefix)
    )


def get_index_client(ray_namespace: str = RAY_NAMESPACE, timeout_s: float = 5.0) -> IndexClient:
    """The index client of the running deployment (cached per process)."""
    client = _clients.get(ray_namespace)
    if client is None:
        client = _clients[ray_namespace] = IndexClient.connect(ray_namespace, timeout_s)
    return client


def get_pool(node_id: str | None = None, ray_namespace: str = RAY_NAMESPACE) -> Any:
    """The pool actor of ``node_id`` (default: this process's node). ValueError if none."""
    node = node_id or ray.get_runtime_context().get_node_id()
    try:
        return ray.get_actor(pool_name(node), namespace=ray_namespace)
    except ValueError:
        raise ValueError(
            f"no kvshare pool on node {node}: run `kvshare up` (or kvshare.actors.deploy.deploy()) first"
        ) from None


def status(ray_namespace: str = RAY_NAMESPACE, timeout_s: float = 5.0) -> dict[str, Any]:
    """Nodes (alive, pool stats per namespace and tier, ``bandwidth_bytes_per_s``: bytes/s per
    transport as probed from that node with overrides applied, ``{}`` until its first probe;
    ``bandwidth``: also per peer and when), index shards and workers (with their reported
    prefill speed), and ``prefill_tokens_per_s`` per namespace (:func:`prefill_speeds`)."""
    nodes = {n["NodeID"]: n for n in ray.nodes()}  # type: ignore[no-untyped-call]
    out: dict[str, Any] = {"ray_namespace": ray_namespace, "nodes": [], "index": [],
                           "workers": [], "prefill_tokens_per_s": {}}
    refs: dict[str, Any] = {}
    bw_refs: dict[str, Any] = {}
    for name in _named(ray_namespace, POOL_PREFIX):
        node = name[len(POOL_PREFIX):]
        actor = ray.get_actor(name, namespace=ray_namespace)
        refs[node] = actor.stats.remote()
        bw_refs[node] = actor.transfer_bandwidths.remote()
    for node_id, info in nodes.items():
        entry: dict[str, Any] = {"node_id": node_id, "alive": bool(info["Alive"]),
                                 "address": info.get("NodeManagerAddress", "")}
        if node_id in refs:
            try:
                entry["pool"] = ray.get(refs[node_id], timeout=timeout_s)
            except Exception as exc:
                entry["pool_error"] = f"{type(exc).__name__}: {exc}"[:200]
            try:
                bw = ray.get(bw_refs[node_id], timeout=timeout_s)
                entry["bandwidth_bytes_per_s"] = bw["transports"]
                entry["bandwidth"] = bw
            except Exception as exc:
                entry["bandwidth_error"] = f"{type(exc).__name__}: {exc}"[:200]
        if info["Alive"] or node_id in refs:
            out["nodes"].append(entry)
    try:
        client = get_index_client(ray_namespace)
        out["index"] = client.stats()
        workers, loads = client.workers(), client.loads()
        out["workers"] = [
            {"worker_id": w.worker_id, "node": w.node, "namespaces": list(w.namespaces),
             "endpoint": w.endpoint,
             "prefill_tokens_per_s": loads[w.worker_id].prefill_tokens_per_s
             if w.worker_id in loads else 0.0} for w in workers
        ]
        out["prefill_tokens_per_s"] = prefill_speeds(workers, loads)
    except Exception as exc:
        out["index_error"] = f"{type(exc).__name__}: {exc}"[:200]
    return out


def prefill_speeds(workers: Sequence[WorkerInfo],
                   loads: Mapping[WorkerId, WorkerLoad]) -> dict[str, float]:
    """Per namespace, the prefill speed its workers measured (tokens/s, the median of their
    reports as the router's cost model takes it; a namespace no worker reported is left out):
    what the tier value ledger prices a served token at (:mod:`kvshare.pool.value`)."""
    out: dict[str, float] = {}
    for ns in sorted({ns for w in workers for ns in w.namespaces}):
        reports = [loads[w.worker_id] for w in workers
                   if ns in w.namespaces and w.worker_id in loads]
        speed = measured_prefill_tokens_per_s(reports)
        if speed > 0:
            out[ns] = speed
    return out


def _bandwidth_records(ray_namespace: str, timeout_s: float) -> dict[str, dict[str, Any]]:
    """Every answering pool's ``transfer_bandwidths()`` record, by node id."""
    refs: dict[str, Any] = {
        name[len(POOL_PREFIX):]: ray.get_actor(name, namespace=ray_namespace)
        .transfer_bandwidths.remote() for name in _named(ray_namespace, POOL_PREFIX)}
    out: dict[str, dict[str, Any]] = {}
    for node, ref in refs.items():
        try:
            out[node] = dict(ray.get(ref, timeout=timeout_s))
        except Exception as exc:  # a dead or busy pool: no figures for it
            log.info("no bandwidths from node %s: %s", node, exc)
    return out


def bandwidths(ray_namespace: str = RAY_NAMESPACE, timeout_s: float = 5.0) -> dict[str, dict[str, float]]:
    """``{node_id: {transport: bytes/s}}`` for every pool that answers: what that node's probe
    measured (``shm`` to itself, the best ``nixl``/``objstore`` to its peers), overrides
    applied. A node not probed yet maps to ``{}``."""
    return {node: dict(got["transports"])
            for node, got in _bandwidth_records(ray_namespace, timeout_s).items()}


def measured_links(ray_namespace: str = RAY_NAMESPACE, timeout_s: float = 5.0) -> Links:
    """Per probed link, holder node -> reader node, the bytes/s of its faster remote transport
    (:meth:`kvshare.links.Links.from_probes` of every pool's per-peer figures). A pool with a
    ``nixl``/``objstore`` override contributes no links (the override prices its pulls)."""
    per_reader = {node: dict(got.get("per_node") or {})
                  for node, got in _bandwidth_records(ray_namespace, timeout_s).items()
                  if not set(got.get("overrides") or {}) & {"nixl", "objstore"}}
    return Links.from_probes(per_reader)


def measured_bandwidths(
    ray_namespace: str = RAY_NAMESPACE, wait_s: float = 0.0, timeout_s: float = 5.0
) -> dict[str, float]:
    """Bytes/s per transport for the whole cluster: the median over nodes that measured it
    above 0; ready for :meth:`kvshare.cost.Bandwidths.from_measured`. ``wait_s``: wait up to
    that long for every pool's first probe (returns what there is then; ``{}`` if nothing)."""
    import statistics
    import time

    deadline = time.monotonic() + wait_s
    while True:
        per_node = bandwidths(ray_namespace, timeout_s)
        probed = per_node and all(per_node.values()) and (
            len(per_node) == 1 or all({"nixl", "objstore"} & set(bw) for bw in per_node.values()))
        if probed or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    out: dict[str, float] = {}
    for name in ("shm", "nixl", "objstore"):
        vals = [bw[name] for bw in per_node.values() if bw.get(name, 0.0) > 0]
        if vals:
            out[name] = float(statistics.median(vals))
    return out


def shutdown(ray_namespace: str = RAY_NAMESPACE, address: str | None = None,
             timeout_s: float = 10.0) -> int:
    """Stop the watcher, every pool (slabs unlinked; disk blocks stay) and the index.

    Returns the number of actors removed.
    """
    connect(address, ray_namespace)
    n = 0
    watcher = _find_watcher(ray_namespace)
    if watcher is not None:
        try:
            ray.get(watcher.stop.remote(), timeout=timeout_s)
        except Exception as exc:
            log.warning("watcher did not stop cleanly: %s", exc)
        ray.kill(watcher)
        n += 1
    pools = [ray.get_actor(name, namespace=ray_namespace)
             for name in _named(ray_namespace, POOL_PREFIX)]
    closing: list[Any] = [p.close.remote() for p in pools]
    if closing:
        ray.wait(closing, num_returns=len(closing), timeout=timeout_s)
    for p in pools:
        ray.kill(p)
        n += 1
    for name in _named(ray_namespace, "kvshare-index-"):
        ray.kill(ray.get_actor(name, namespace=ray_namespace))
        n += 1
    _clients.pop(ray_namespace, None)
    return n
