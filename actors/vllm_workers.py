"""vLLM workers as Ray actors pinned to nodes, and ``kvshare vllm start | list | stop``.

Each worker is a named, detached actor ``kvshare-vllm-<id>`` in the kvshare Ray namespace,
hard-pinned to its node; it runs :class:`kvshare.vllm.server.worker.VllmWorker` (the vLLM server
process, its registration under the lease, its KV-events consumer) with the cluster's
:class:`~kvshare.actors.index.client.IndexClient`. ``stop`` unregisters each worker (its gpu-tier
entries go at once), stops vLLM and kills the actor.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvshare.actors.config import RAY_NAMESPACE
from kvshare.vllm.server.launch import VllmSpec
from kvshare.vllm.server.worker import VllmWorker, VllmWorkerConfig

PREFIX = "kvshare-vllm-"


class VllmWorkerService:
    """The body of :data:`VllmWorkerActor`."""

    def __init__(self, config: VllmWorkerConfig) -> None:
        from kvshare.actors.index.client import IndexClient

        ctx = ray.get_runtime_context()
        self.config = VllmWorkerConfig(**{**config.__dict__, "node": config.node or ctx.get_node_id(),
                                          "ray_address": config.ray_address or ctx.gcs_address})
        self.worker = VllmWorker(self.config, IndexClient.connect(config.ray_namespace))

    def start(self, timeout_s: float = 300.0) -> str:
        return self.worker.start(timeout_s)

    def info(self) -> dict[str, Any]:
        i = self.worker.info
        return {"worker_id": i.worker_id, "node": i.node, "endpoint": i.endpoint,
                "namespace": i.namespaces[0], "layout": i.layout_fingerprint,
                "identity": self.worker.keys.identity, "block_tokens": self.config.block_tokens}

    def stats(self) -> dict[str, Any]:
        return self.worker.stats()

    def stop(self) -> None:
        self.worker.stop()


VllmWorkerActor: Any = ray.remote(num_cpus=0, max_restarts=0)(VllmWorkerService)


def start_workers(model: str, nodes: Sequence[str], *, namespace: str, block_tokens: int = 256,
                  page_tokens: int = 32, kv_cache_gb: float = 1.0, max_model_len: int = 4096,
                  num_blocks: int | None = None, connector: bool = False, dtype: str = "",
                  base_port: int = 0, ray_namespace: str = RAY_NAMESPACE,
                  timeout_s: float = 300.0,
                  cpus: Sequence[tuple[int, ...]] = (),
                  connector_settings: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """One vLLM worker per node id in ``nodes`` (vLLM servers start in parallel); returns
    each worker's :meth:`VllmWorkerService.info`. Needs ``ray.init`` and a deployed index.
    ``cpus``: each worker's cores on its node (:class:`VllmSpec`; empty: unpinned, and the
    servers of nodes on one machine (:func:`machine_id`) split its cores as OpenMP threads);
    ``connector_settings``: more connector keys (:class:`VllmWorkerConfig`), checked before
    any worker starts."""
    if cpus and len(cpus) != len(nodes):
        raise ValueError(f"cpus: one core set per node, got {len(cpus)} for {len(nodes)} nodes")
    machines = check_model_on_nodes(os.path.abspath(model), nodes)
    actors = []
    for i, node in enumerate(nodes):
        # Address, port (unless base_port) and events dir are chosen by the worker on its node.
        spec = VllmSpec(model=os.path.abspath(model), port=base_port + i if base_port else 0,
                        block_size=page_tokens, max_model_len=max_model_len,
                        kv_cache_gb=kv_cache_gb, num_blocks=num_blocks,
                        cpus=tuple(cpus[i]) if cpus else (),
                        host_servers=machines.count(machines[i]))  # nodes on one machine
        wid = f"vllm-{node[:8]}-{spec.port or secrets.token_hex(3)}"
        cfg = VllmWorkerConfig(wid, node, namespace, spec, block_tokens, dtype, connector,
                               ray_namespace, connector_settings=dict(connector_settings or {}))
        actors.append(VllmWorkerActor.options(
            name=PREFIX + wid, namespace=ray_namespace, lifetime="detached",
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
        ).remote(cfg))
    try:
        ray.get([a.start.remote(timeout_s) for a in actors], timeout=timeout_s + 60)
    except Exception:
        stop_workers(ray_namespace)
        raise
    return list(ray.get([a.info.remote() for a in actors]))


def machine_id() -> str:
    """Which machine this process runs on: the kernel's boot id, shared by every Ray node on
    one machine, containers and network namespaces (emulated hosts) included, and by nothing
    on another; the hostname where it cannot be read."""
    import socket

    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or socket.gethostname()
    except OSError:
        return socket.gethostname()


def _model_here(model: str) -> tuple[bool, str, str, str]:
    """On a node: whether ``model`` is a model directory there, the hostname, the node IP and
    :func:`machine_id`."""
    import socket

    ok = os.path.isfile(os.path.join(model, "config.json")) and os.access(model, os.R_OK)
    ip = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
    return ok, socket.gethostname(), ip, machine_id()


def check_model_on_nodes(model: str, nodes: Sequence[str], timeout_s: float = 60.0) -> list[str]:
    """Each node's :func:`machine_id`; ValueError naming every node of ``nodes`` on which ``model`` (an
    absolute path) is not a readable model directory: each vLLM server reads the model on its
    own node, so the path must be one every node can read (a shared filesystem, or the same
    copy on each node)."""
    probe = ray.remote(num_cpus=0)(_model_here)
    refs = [probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False))
            .remote(model) for n in nodes]
    found = ray.get(refs, timeout=timeout_s)
    missing = [f"{node} ({ip}, host {host})"
               for node, (ok, host, ip, _) in zip(nodes, found, strict=True) if not ok]
    if missing:
        raise ValueError(f"model {model!r} is not a readable model directory (no config.json) on "
                         f"node(s) {', '.join(missing)}: give a path every node can read (a "
                         "shared filesystem, or the same copy on each node)")
    return [str(machine) for _, _, _, machine in found]


def named_actors(ray_namespace: str, prefix: str = PREFIX) -> list[Any]:
    """The live actors of ``ray_namespace`` whose names start with ``prefix``."""
    names = ray.util.list_named_actors(all_namespaces=True)
    return [ray.get_actor(e["name"], namespace=ray_namespace) for e in names
            if e.get("namespace") == ray_namespace and str(e.get("name", "")).startswith(prefix)]


def list_workers(ray_namespace: str = RAY_NAMESPACE, prefix: str = PREFIX) -> list[dict[str, Any]]:
    return [dict(ray.get(a.info.remote(), timeout=30), **ray.get(a.stats.remote(), timeout=30))
            for a in named_actors(ray_namespace, prefix)]


def stop_workers(ray_namespace: str = RAY_NAMESPACE, prefix: str = PREFIX) -> int:
    """Stop every vLLM worker of the deployment (``prefix``: another engine's workers);
    returns how many."""
    actors = named_actors(ray_namespace, prefix)
    for a in actors:
        try:
            ray.get(a.stop.remote(), timeout=60)
        except Exception as exc:  # a dead actor: its vLLM went with its process
            print(f"stopping {a}: {exc}", file=sys.stderr)
        ray.kill(a)
    return len(actors)


# ---------------------------------------------------------------------- CLI
def alive_nodes(spec: str) -> list[str]:
    nodes = ray.nodes()  # type: ignore[no-untyped-call]
    alive = [n["NodeID"] for n in nodes if n.get("Alive") and n["Resources"].get("CPU", 0) > 0]
    if spec == "all":
        return alive
    chosen = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in chosen if n not in alive]
    if unknown:
        raise ValueError(f"unknown or dead node ids {unknown}; alive nodes with CPUs: {alive}")
    return chosen


def json_object_arg(text: str) -> dict[str, Any]:
    """``--connector-settings`` (and other JSON-object options): a JSON object, or an error
    naming what to fix."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object of connector keys, got {text!r}")
    return value


def _cmd(args: argparse.Namespace) -> int:
    from kvshare.actors.cli_connect import connect_from_cli as _connect

    _connect(args.address, args.ray_namespace, start=False)
    if args.vllm_cmd == "start":
        infos = start_workers(args.model, alive_nodes(args.nodes), namespace=args.namespace,
                              block_tokens=args.block_tokens, page_tokens=args.block_size,
                              kv_cache_gb=args.kv_cache_gb, max_model_len=args.max_model_len,
                              connector=args.connector, dtype=args.dtype,
                              ray_namespace=args.ray_namespace,
                              connector_settings=args.connector_settings)
        print(json.dumps(infos, indent=2))
    elif args.vllm_cmd == "list":
        print(json.dumps(list_workers(args.ray_namespace), indent=2, default=str))
    else:
        print(f"stopped {stop_workers(args.ray_namespace)} vLLM worker(s)")
    return 0


def register(sub: Any) -> None:
    """``kvshare vllm start | list | stop`` (a ``kvshare.commands`` plugin)."""
    p = sub.add_parser("vllm", help="vLLM workers on the Ray cluster")
    p.add_argument("--address", default=None, help="Ray cluster address (default: auto)")
    p.add_argument("--ray-namespace", default=RAY_NAMESPACE)
    vs = p.add_subparsers(dest="vllm_cmd", required=True)
    st = vs.add_parser("start", help="one vLLM OpenAI server per node, registered, events wired")
    st.add_argument("--model", required=True, help="local model directory")
    st.add_argument("--nodes", default="all", help="'all' or comma-separated Ray node ids")
    st.add_argument("--namespace", required=True, help="the kvshare namespace (kvshare up)")
    st.add_argument("--block-tokens", type=int, default=256, help="kvshare share block")
    st.add_argument("--block-size", type=int, default=32, help="vLLM --block-size")
    st.add_argument("--kv-cache-gb", type=float, default=1.0, help="VLLM_CPU_KVCACHE_SPACE")
    st.add_argument("--max-model-len", type=int, default=4096)
    st.add_argument("--dtype", default="",
                    help="vLLM --dtype (default: the model's); the namespace's layout must be "
                         "in the same dtype (kvshare up --dtype). float32 prefills faster than "
                         "bfloat16 on CPUs without AVX512-BF16 or AMX, which emulate bfloat16")
    st.add_argument("--connector", action="store_true",
                    help="load/store KV through the kvshare connector (kvshare.vllm.connector)")
    st.add_argument("--connector-settings", type=json_object_arg, default={},
                    help='more kv_connector_extra_config keys as JSON, e.g. \'{"sync_save_mib": 0}\' '
                         "(kvshare.vllm.connector.config lists them)")
    vs.add_parser("list", help="the running vLLM workers and their event counters")
    vs.add_parser("stop", help="stop every vLLM worker")
    p.set_defaults(func=_cmd)
