"""`make demo-reference`: kvshare end to end with the reference transformers workers.

1. starts a local Ray cluster (head + 2 nodes, ``ray.cluster_utils.Cluster``) and deploys
   kvshare (index + one pool actor per node);
2. starts one reference transformers worker (tiny Llama, random weights) on each node;
3. starts the OpenAI-compatible gateway (cache-aware ``cost`` policy) on loopback;
4. drives a multi-user, multi-turn chat workload with shared system prompts and documents
   through the gateway with the official ``openai`` client (``demo_common.drive``);
5. prints per-tier hit rates, bytes moved per transport, TTFT cold vs warm and prefill tokens
   saved, and writes ``out/demo-reference.png`` and a screenshot of the live page,
   ``out/dashboard-reference.png``.

Exits non-zero if no prefix was reused. Runs in a few minutes on 2 CPU cores.
``make demo`` (``examples/demo.py``) is the same job on vLLM workers.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
from collections import Counter
from typing import Any

import demo_common
from demo_common import (
    Turn,
    drive,
    finish_report,
    serve_gateway,
    ttft_table,
    wrap_up,
)

NAMESPACE = "demo"


def start_workers(engine_cfg: Any) -> dict[str, Any]:
    import ray

    from kvshare.engines.service import WorkerService

    worker_cls = ray.remote(num_cpus=1)(WorkerService)
    workers = {
        f"worker-{i}": worker_cls.options(resources={f"node_{i}": 0.1}).remote(  # type: ignore[attr-defined]
            NAMESPACE, engine_cfg, worker_id=f"worker-{i}", model_name="tiny-llama")
        for i in range(2)
    }
    for name, w in workers.items():
        info = ray.get(w.ready.remote(), timeout=180)
        print(f"  {name} on node {info['node'][:8]}  {info['endpoint']}  remote={info['nixl']}")
    return workers


def start_gateway(engine_cfg: Any) -> tuple[str, Any]:
    from kvshare.actors.admin import ClusterAdmin
    from kvshare.actors.deploy import get_index_client, measured_bandwidths
    from kvshare.cost import Bandwidths
    from kvshare.engines.hf import model_keys
    from kvshare.router.core.embed import CacheAwareRouter, RouterConfig
    from kvshare.router.core.workers_view import IndexWorkers
    from kvshare.router.gateway.app import create_app

    keys = model_keys(engine_cfg)
    index = get_index_client()
    measured = measured_bandwidths(wait_s=20.0)  # bytes/s the pools probed at start
    print("  measured bandwidths (GB/s): "
          + ", ".join(f"{k}={v / 1e9:.2f}" for k, v in sorted(measured.items())))
    cfg = RouterConfig.from_model_keys(keys, namespace=NAMESPACE, policy="cost",
                                       prefill_tokens_per_s=4000.0,
                                       bandwidths=Bandwidths.from_measured(measured))
    router = CacheAwareRouter(index, IndexWorkers(index), cfg, keys.tokenizer)
    return serve_gateway(create_app(router, admin=ClusterAdmin()))  # admin: the live page


def report(turns: list[Turn], pool_status: dict[str, Any], path: str) -> bool:
    transports: Counter[str] = Counter()
    for t in turns:
        transports.update(t.bytes_by_transport)
    print("\n== kvshare demo (reference workers) ==")
    ttft_table(turns)
    print("bytes moved per transport")
    for name, n in sorted(transports.items()):
        print(f"  {name:12s} {n / 2**20:10.1f} MiB")
    return finish_report(turns, pool_status, path,
                         "kvshare demo (reference workers): time to first token per request")


def main() -> int:
    logging.basicConfig(level=logging.WARNING)
    import ray

    from kvshare.actors.deploy import deploy, status
    from kvshare.engines.hf import EngineConfig, model_keys

    t0 = time.monotonic()
    engine_cfg = EngineConfig(threads=1)
    print("starting a local Ray cluster with 2 emulated nodes ...", flush=True)
    with demo_common.cluster() as cluster:
        layout = model_keys(engine_cfg).layout
        deploy(cluster.address, namespace=NAMESPACE, layout=layout, host_gb=0.06,
               disk_gb=0.5, disk_dir=tempfile.mkdtemp(prefix="kvshare-demo-disk-"))
        print("kvshare deployed; starting 2 reference workers ...", flush=True)
        workers = start_workers(engine_cfg)
        base_url, server = start_gateway(engine_cfg)
        print(f"gateway at {base_url}; driving 4 users x 4 turns ...", flush=True)
        turns = drive(base_url, NAMESPACE)  # the gateway serves its namespace as a model
        ok = report(turns, status(), os.path.join("out", "demo-reference.png"))
        code = wrap_up(ok, base_url, server, os.path.join("out", "dashboard-reference.png"), t0)
        for w in workers.values():
            ray.get(w.stop.remote(), timeout=30)
        return code


if __name__ == "__main__":
    sys.exit(main())
