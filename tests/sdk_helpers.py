"""The worker SDK against a deployed kvshare (real Ray, real pools): store and load prompts,
and a worker's load report, for cluster tests."""

from __future__ import annotations

import time
from typing import Any

import torch


def sdk_client(layout: Any, ns: str, ray_namespace: str) -> Any:
    """The worker SDK on this process's node, for namespace ``ns``."""
    from kvshare.client.sdk import KVShareClient
    from kvshare.hashing import namespace_root

    root = namespace_root(f"sdk-{ns}", layout.fingerprint())
    return KVShareClient.connect(ns, layout, root, ray_namespace=ray_namespace,
                                 worker_id=f"sdk-{ns}", remote="objstore")


def prompt(i: int, blocks: int, block_tokens: int) -> list[int]:
    """Prompt ``i``: ``blocks`` full blocks plus one token (a full hit still computes one)."""
    return [i * 1000 + t for t in range(blocks * block_tokens + 1)]


def store(c: Any, toks: list[int], seed: int) -> None:
    """Store the prompt's full blocks (random KV) into this node's pool; all must land."""
    lay = c.layout
    kv = torch.randn(2, lay.num_layers, lay.num_kv_heads, len(toks), lay.head_dim,
                     generator=torch.Generator().manual_seed(seed))
    res = c.store(toks, kv).result(timeout=30)
    assert res.stored == (len(toks) - 1) // lay.block_tokens, res


def load(c: Any, toks: list[int], wait_s: float = 5.0) -> int:
    """Look the prompt up (once the index knows its blocks, waiting up to ``wait_s``) and
    load what is available."""
    from kvshare.kv_convert import new_contiguous

    deadline = time.monotonic() + wait_s
    plan = c.lookup(toks)
    while plan.available_blocks < (len(toks) - 1) // c.block_tokens and time.monotonic() < deadline:
        time.sleep(0.05)
        plan = c.lookup(toks)
    res = c.load(plan, new_contiguous(c.layout, plan.load_tokens))
    return int(res.loaded_blocks)


def report_speed(index: Any, worker: str, namespaces: tuple[str, ...], speed: float) -> None:
    """A worker of ``namespaces`` on this node registers and reports its prefill speed."""
    import ray

    from kvshare.types import NodeId, WorkerId
    from kvshare.workers import WorkerInfo, WorkerLoad

    node = ray.get_runtime_context().get_node_id()
    index.register_worker(WorkerInfo(WorkerId(worker), NodeId(node), namespaces))
    assert index.report_load(WorkerLoad(WorkerId(worker), prefill_tokens_per_s=speed,
                                        ts=time.time()))
