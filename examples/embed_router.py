"""Embed kvshare's CacheAwareRouter in your own asyncio gateway (a few lines).

Runs stand-alone: an in-process GlobalIndex stands in for the cluster's index (with a cluster,
pass ``kvshare.actors.index.client.IndexClient.connect()`` instead), three workers, two tenants.
It shows: a prefix already cached on one node attracts its request (or is pulled by an idle
worker when that node's worker is busy); a burst sharing a new
prefix stays together (pending blocks); another tenant never matches those blocks; a dead
index degrades to load-only routing.

    .venv/bin/python examples/embed_router.py
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvshare.actors.index.global_index import GlobalIndex  # noqa: E402
from kvshare.events import BlockStored  # noqa: E402
from kvshare.router.core.embed import CacheAwareRouter, InProcessIndex, RouterConfig, Tenant  # noqa: E402
from kvshare.router.core.workers_view import StaticWorkers  # noqa: E402
from kvshare.types import NodeId, Tier, WorkerId, node_location  # noqa: E402
from kvshare.workers import WorkerInfo, WorkerLoad  # noqa: E402

SYSTEM = "You are the support assistant of Acme Corp. Answer briefly and politely. " * 12


async def main() -> None:
    # --- the few lines a gateway needs -------------------------------------------------
    workers = StaticWorkers([
        WorkerInfo(WorkerId(f"w{i}"), NodeId(f"node{i}"), ("llama",), f"http://10.0.0.{i}:8000")
        for i in range(3)
    ])
    index = GlobalIndex()  # in a cluster: IndexClient.connect()
    index.declare_namespace("llama")
    router = CacheAwareRouter(InProcessIndex(index), workers,
                              RouterConfig(namespace="llama", model_id="llama-3-8b", block_tokens=64))
    acme, globex = Tenant("acme", salt="acme-secret"), Tenant("globex", salt="globex-secret")

    async def handle(messages: list[dict[str, str]], tenant: Tenant) -> str:
        routed = await router.route(messages=messages, tenant=tenant)
        # forward to routed.decision.endpoint with body["kvshare"] = routed.kvshare_field()
        router.finished(routed.request_id)  # after the response completes
        d = routed.decision
        return (f"{tenant.name:7s} -> {d.worker} ({d.reason}, {d.cached_blocks} cached blocks, "
                f"est. TTFT {d.est_ttft_s * 1000:.1f} ms, saves {d.est_ttft_saved_s * 1000:.1f} ms)")
    # -------------------------------------------------------------------------------------

    # node2's pool already holds Acme's system prompt (its pool published these events)
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi!"}]
    ids = router.tokenize(messages=chat)
    hashes = router.hashes(ids, acme)
    index.apply([BlockStored("llama", node_location("node2"), Tier.HOST, h, 0, i + 1)
                 for i, h in enumerate(hashes[:-1])])

    print("1) a cached prefix attracts its request (acme's blocks sit on node2):")
    print("  ", await handle(chat, acme))
    print("   ...unless node2's worker is busy: then an idle worker pulls the blocks over the network")
    workers.report(WorkerLoad(WorkerId("w2"), 2000, 3, 5000.0, 0.0))
    print("  ", await handle(chat, acme))
    print("2) the same prompt from another tenant: different hashes, no match:")
    print("  ", await handle(chat, globex))
    print("3) a burst sharing a brand-new prefix stays on one worker (pending blocks):")
    fresh = "Summarise this contract clause by clause. " * 20
    for q in ("clause 1", "clause 2", "clause 3"):
        print("  ", await handle([{"role": "user", "content": fresh + q}], globex))

    class DeadIndex(InProcessIndex):  # awaited (not inline), and every match fails
        inline = False

        async def match_runs_async(self, namespace, hashes):  # type: ignore[no-untyped-def]
            raise ConnectionError("index is down")

    router.core.index = DeadIndex(index)
    print("4) the index is down: load-only routing, counted as a fallback:")
    print("  ", await handle(chat, acme), f"[fallbacks={router.fallbacks}]")


if __name__ == "__main__":
    asyncio.run(main())
