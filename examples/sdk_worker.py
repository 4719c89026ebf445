"""How an inference engine uses the kvshare SDK (copy this into your vLLM/SGLang connector).

Runs on its own: starts an embedded one-node Ray, deploys kvshare for the built-in tiny Llama,
and walks one request through the SDK twice (cold, then warm):

    scheduler side                      worker side (every TP rank)
    --------------                      ---------------------------
    plan = client.lookup(tokens)        plan = Plan.from_dict(msg)
    msg = plan.to_dict()   ---------->  client.start_load(plan, PagedKV(pages, page_table))
                                        for each layer: client.wait_for_layer(i); attention(i)
                                        for each layer: client.save_layer(i, k, v, tokens, start)
                                        client.wait_for_save()   # before freeing the pages

The engine here is kvshare's reference transformers engine; a real connector replaces it with
its own forward pass and page allocator. ``python examples/sdk_worker.py``
"""

from __future__ import annotations

import json
import random
import time

import torch

from kvshare.actors.deploy import deploy
from kvshare.actors.local_cluster import local_cluster
from kvshare.client.sdk import KVShareClient
from kvshare.client.types import PagedKV, Plan
from kvshare.engines.hf import EngineConfig, HFEngine, cache_layers
from kvshare.kv_convert import new_contiguous

NAMESPACE = "sdk-example"
PAGE_TOKENS = 16  # the engine's page size; kvshare blocks (256 tokens) span 16 pages


def serve_one(client: KVShareClient, engine: HFEngine, tokens: list[int]) -> list[int]:
    """One request: plan, load into the engine's pages, compute the rest, store new blocks."""
    layout = engine.layout
    # --- scheduler side: how much is cached, where; the plan travels as plain data
    msg = json.dumps(client.lookup(tokens).to_dict())
    # --- worker side
    plan = Plan.from_dict(json.loads(msg))
    n_pages = -(-len(tokens) // PAGE_TOKENS)
    pages = [torch.zeros(2, n_pages, PAGE_TOKENS, layout.num_kv_heads, layout.head_dim)
             for _ in range(layout.num_layers)]
    page_table = list(range(n_pages))  # your allocator's page ids
    client.start_load(plan, PagedKV(pages, page_table))
    for layer in range(layout.num_layers):  # a layered engine overlaps this with compute
        result = client.wait_for_layer(layer)
    assert result is not None or not plan.blocks
    reused = (result.loaded_blocks if result else 0) * layout.block_tokens
    # The reference engine computes on contiguous KV: gather the reused pages into it.
    kv = new_contiguous(layout, reused)
    for layer in range(layout.num_layers):
        flat = pages[layer][:, : reused // PAGE_TOKENS].reshape(
            2, reused, layout.num_kv_heads, layout.head_dim)
        kv[layer] = flat.transpose(1, 2)
    start = time.perf_counter()
    out, pre = engine.generate(tokens, 8, kv, reused)
    print(f"  plan: {plan.available_blocks} blocks available, {plan.load_blocks} loaded "
          f"({plan.by_transport()}); reused {pre.reused_tokens} tokens, computed "
          f"{pre.computed_tokens} in {time.perf_counter() - start:.3f}s")
    # Store the new full blocks, layer by layer, as a layered engine would after its forward.
    n_full = (pre.cache.get_seq_length() // layout.block_tokens)
    for layer, (k, v) in enumerate(cache_layers(pre.cache)):
        client.save_layer(layer, k, v, tokens[: n_full * layout.block_tokens],
                          start_block=reused // layout.block_tokens)
    print(f"  stored: {[r.stored for r in client.wait_for_save(timeout=30)]} blocks")
    return out


def main() -> None:
    with local_cluster(nodes=0, head_cpus=2, head_store_mib=200, temp_prefix="kvs-example-") as cluster:
        engine = HFEngine(EngineConfig())
        deploy(cluster.address, namespace=NAMESPACE, layout=engine.layout, host_gb=0.1)
        client = KVShareClient.connect(NAMESPACE, engine.layout, engine.hasher, worker_id="example")
        rng = random.Random(0)
        document = [rng.randrange(256) for _ in range(2048)]
        print("cold request:")
        first = serve_one(client, engine, document + [rng.randrange(256) for _ in range(40)])
        time.sleep(0.2)  # the pool publishes to the index every ~50 ms
        print("warm request (same document, new question):")
        second = serve_one(client, engine, document + [rng.randrange(256) for _ in range(40)])
        print(f"outputs: {first} / {second}; client counters: {client.counters}")
        client.close()


if __name__ == "__main__":
    main()
