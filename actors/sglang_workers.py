"""SGLang workers as Ray actors pinned to nodes, and ``kvshare sglang start | list | stop``.

Each worker is a named, detached actor ``kvshare-sglang-<id>`` in the kvshare Ray namespace,
hard-pinned to its node; it runs :class:`kvshare.sglang.worker.SglangWorker` (the SGLang server
with HiCache and kvshare as its storage tier using this node's pool, its registration under
the lease, its KV-events consumer) with the cluster's
:class:`~kvshare.actors.index.client.IndexClient`. The server listens on its node's address
(:mod:`kvshare.addresses`). ``stop`` unregisters each worker, stops SGLang and kills the actor.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvshare.actors.config import RAY_NAMESPACE
from kvshare.actors.vllm_workers import alive_nodes, json_object_arg, list_workers, stop_workers
from kvshare.sglang.launch import SglangSpec
from kvshare.sglang.worker import SglangWorker, SglangWorkerConfig

PREFIX = "kvshare-sglang-"


class SglangWorkerService:
    """The body of :data:`SglangWorkerActor`."""

    def __init__(self, config: SglangWorkerConfig) -> None:
        from kvshare.actors.index.client import IndexClient

        ctx = ray.get_runtime_context()
        self.config = SglangWorkerConfig(**{**config.__dict__,
                                            "node": config.node or ctx.get_node_id(),
                                            "ray_address": config.ray_address or ctx.gcs_address})
        self.worker = SglangWorker(self.config, IndexClient.connect(config.ray_namespace))

    def start(self, timeout_s: float = 300.0) -> str:
        return self.worker.start(timeout_s)

    def info(self) -> dict[str, Any]:
        i = self.worker.info
        return {"worker_id": i.worker_id, "node": i.node, "endpoint": i.endpoint,
                "namespace": i.namespaces[0], "layout": i.layout_fingerprint,
                "engine": "sglang", "page_size": self.worker.spec.page_size,
                "storage": self.worker.spec.storage or "none"}

    def stats(self) -> dict[str, Any]:
        return self.worker.stats()

    def stop(self) -> None:
        self.worker.stop()


SglangWorkerActor: Any = ray.remote(num_cpus=0, max_restarts=0)(SglangWorkerService)


def start_workers(model: str, nodes: Sequence[str], *, namespace: str, page_size: int = 16,
                  max_total_tokens: int = 8192, hicache_ratio: float = 2.0, cpu: bool = False,
                  storage_settings: Mapping[str, Any] | None = None, dtype: str = "",
                  extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                  ray_namespace: str = RAY_NAMESPACE,
                  timeout_s: float = 300.0) -> list[dict[str, Any]]:
    """One SGLang worker per node id in ``nodes`` (servers start in parallel), each with
    HiCache and the kvshare backend on its node's pool; returns each worker's
    :meth:`SglangWorkerService.info`. Needs ``ray.init`` and a deployed namespace whose
    ``--block-tokens`` is ``page_size``. ``storage_settings``: more of the backend's keys
    (:class:`~kvshare.sglang.settings.StorageSettings`, e.g. ``{"remote": "objstore"}``);
    ``extra_args``/``env``: more of SGLang's flags and environment."""
    owned = sorted(set(storage_settings or {}) & {"namespace", "ray_namespace", "node",
                                                  "ray_address"})
    if owned:
        raise ValueError(f"storage_settings: {owned} are set by the launcher: leave them out")
    actors = []
    for node in nodes:
        spec = SglangSpec(model=os.path.abspath(model), page_size=page_size,
                          max_total_tokens=max_total_tokens, hicache_ratio=hicache_ratio,
                          storage_settings={"namespace": namespace, **(storage_settings or {})},
                          cpu=cpu, extra_args=tuple(extra_args), env=dict(env or {}))
        wid = f"sglang-{node[:8]}-{secrets.token_hex(3)}"
        cfg = SglangWorkerConfig(wid, node, namespace, spec, dtype, ray_namespace)
        actors.append(SglangWorkerActor.options(
            name=PREFIX + wid, namespace=ray_namespace, lifetime="detached",
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
        ).remote(cfg))
    try:
        ray.get([a.start.remote(timeout_s) for a in actors], timeout=timeout_s + 60)
    except Exception:
        stop_workers(ray_namespace, PREFIX)
        raise
    return list(ray.get([a.info.remote() for a in actors]))


# ---------------------------------------------------------------------- CLI
def _cmd(args: argparse.Namespace) -> int:
    from kvshare.actors.cli_connect import connect_from_cli as _connect

    _connect(args.address, args.ray_namespace, start=False)
    if args.sglang_cmd == "start":
        extra = args.sglang_args[1:] if args.sglang_args[:1] == ["--"] else args.sglang_args
        infos = start_workers(args.model, alive_nodes(args.nodes), namespace=args.namespace,
                              page_size=args.page_size, max_total_tokens=args.max_total_tokens,
                              hicache_ratio=args.hicache_ratio, cpu=args.cpu,
                              storage_settings=args.storage_settings, dtype=args.dtype,
                              extra_args=extra, ray_namespace=args.ray_namespace)
        print(json.dumps(infos, indent=2))
    elif args.sglang_cmd == "list":
        print(json.dumps(list_workers(args.ray_namespace, PREFIX), indent=2, default=str))
    else:
        print(f"stopped {stop_workers(args.ray_namespace, PREFIX)} SGLang worker(s)")
    return 0


def register(sub: Any) -> None:
    """``kvshare sglang start | list | stop`` (a ``kvshare.commands`` plugin)."""
    p = sub.add_parser("sglang", help="SGLang workers (HiCache on kvshare) on the Ray cluster")
    p.add_argument("--address", default=None, help="Ray cluster address (default: auto)")
    p.add_argument("--ray-namespace", default=RAY_NAMESPACE)
    ss = p.add_subparsers(dest="sglang_cmd", required=True)
    st = ss.add_parser("start", help="one SGLang server per node, HiCache's L3 on kvshare, "
                                     "registered, events wired")
    st.add_argument("--model", required=True, help="local model directory every node can read")
    st.add_argument("--nodes", default="all", help="'all' or comma-separated Ray node ids")
    st.add_argument("--namespace", required=True,
                    help="the kvshare namespace (kvshare up --block-tokens PAGE_SIZE)")
    st.add_argument("--page-size", type=int, default=16,
                    help="SGLang --page-size: the namespace's --block-tokens")
    st.add_argument("--max-total-tokens", type=int, default=8192,
                    help="SGLang's device KV pool, in tokens")
    st.add_argument("--hicache-ratio", type=float, default=2.0,
                    help="HiCache host pool size against the device pool")
    st.add_argument("--cpu", action="store_true",
                    help="serve on the CPU (--device cpu, torch_native attention, HiCache "
                         "direct I/O); see docs/sglang.md for what SGLang needs there")
    st.add_argument("--dtype", default="", help="the KV dtype the namespace was deployed with "
                                                "(default: the model's)")
    st.add_argument("--storage-settings", type=json_object_arg, default={},
                    help='more backend keys as JSON, e.g. \'{"remote": "objstore"}\' '
                         "(kvshare.sglang.settings lists them)")
    st.add_argument("sglang_args", nargs=argparse.REMAINDER,
                    help="after --: more flags for sglang.launch_server")
    ss.add_parser("list", help="the running SGLang workers, their cache hits and events")
    ss.add_parser("stop", help="stop every SGLang worker")
    p.set_defaults(func=_cmd)
