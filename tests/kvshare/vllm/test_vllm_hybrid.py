"""A sliding-window hybrid (Gemma2-style: layers [sliding, full, sliding, full], window 128)
through KVShareConnector with vLLM's hybrid allocator on a real multi-node Ray cluster.

Head + 2 nodes, kvshare deployed with the model's own layout (kind ``sliding``). Engines run in
Ray actors pinned to a node (``OfflineEngine``): A on node_0, B on node_1, and a reference
engine without the connector. Prompts are 10 share blocks of 64 tokens + 1 (641 tokens, five
windows): vLLM gives the sliding group only the last window's pages of a hit, the rest are its
null page. A load must give the tokens and logprobs of vLLM's own prefix hit (same split, same
KV: bitwise), faults a recompute with the cold tokens.
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
from kvshare.testing.tiny_model import TinyHybridSpec, build_tiny_gemma2
from kvshare.vllm.server.offline import kv_transfer_config

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

NS = "vllm-hybrid"
BLOCK = 64
N_BLOCKS = 10
GEN = 6
PAGES = 64  # one prompt's prefill takes 2 x 21 pages (both groups): a third prompt evicts
SPEC = TinyHybridSpec(dtype="float32", max_position_embeddings=4096)


def prompt(seed: int, n: int = N_BLOCKS * BLOCK + 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


class Env(OfflineEngines):
    def __init__(self, model: str, layout: KVLayout) -> None:
        super().__init__(model, max_model_len=704, num_pages=PAGES)
        self.layout = layout
        self.refs: dict[int, dict[str, Any]] = {}
        self.events = ""  # engine A's KV events (ZMQ) endpoint

    def engine(self, name: str, node: str, connector: bool = True,
               kv_events: dict[str, Any] | None = None) -> Any:
        """Engine ``name`` on ``node``, started (with the connector unless told not to)."""
        self.start(name, node, kv_transfer_config(NS, block_tokens=BLOCK) if connector else None,
                   kv_events=kv_events)
        self.ready(name)
        return self.engines[name]

    def run(self, name: str, tokens: list[int], gen: int = GEN) -> dict[str, Any]:
        return super().run(name, tokens, gen)

    def hit_bytes(self) -> int:
        """Bytes a whole-prompt hit moves: every block, all layers (the share block format)."""
        return N_BLOCKS * self.layout.bytes_per_block


def chosen(res: dict[str, Any]) -> list[float]:
    return [lp[t] for t, lp in zip(res["tokens"], res["logprobs"], strict=True)]


def same_as_cold(res: dict[str, Any], ref: dict[str, Any]) -> None:
    assert res["tokens"] == ref["cold"]["tokens"]
    assert max(abs(a - b) for a, b in zip(chosen(res), chosen(ref["cold"]), strict=True)) < 1e-3


def same_as_vllm_prefix_hit(res: dict[str, Any], ref: dict[str, Any]) -> None:
    assert res["tokens"] == ref["warm"]["tokens"] == ref["cold"]["tokens"]
    assert chosen(res) == chosen(ref["warm"])  # bitwise: same KV, same split
    same_as_cold(res, ref)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    from kvshare.actors.deploy import deploy

    model = build_tiny_gemma2(str(tmp_path_factory.mktemp("model") / "gemma2"), SPEC)
    cluster = start_cluster(object_store_mb=200)
    e = Env(model, KVLayout.from_hf_config(f"{model}/config.json", dtype="fp32",
                                           block_tokens=BLOCK))
    try:
        assert e.layout.kind == "sliding"
        deploy(namespace=NS, layout=e.layout, host_gb=0.25)
        ev_dir = tmp_path_factory.mktemp("ev")
        e.events = f"ipc://{ev_dir}/kv.sock"
        e.start("ref", "node_0")  # vLLM without a connector: the reference
        kvt = kv_transfer_config(NS, block_tokens=BLOCK)
        e.start("A", "node_0", kvt, kv_events={  # (the three start side by side)
            "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": e.events,
            "replay_endpoint": f"ipc://{ev_dir}/kv-replay.sock", "topic": "kv"})
        e.start("B", "node_1", kvt)
        for seed in range(1, 6):
            cold = e.run("ref", prompt(seed))
            warm = e.run("ref", prompt(seed))  # vLLM's own prefix hit (hybrid allocator)
            assert warm["cached_tokens"] == N_BLOCKS * BLOCK
            e.refs[seed] = {"cold": cold, "warm": warm}
        e.kill("ref")
        e.ready()
        yield e
    finally:
        e.close()
        stop_cluster(cluster)


def test_engine_on_another_node_loads_the_prefix(env: Env) -> None:
    held = pool_blocks("node_0")
    first = env.run("A", prompt(1))
    assert first["cached_tokens"] == 0
    same_as_cold(first, env.refs[1])
    deadline = time.monotonic() + 60  # node_0's pool publishes A's blocks to the index
    while pool_blocks("node_0") < held + N_BLOCKS:
        assert time.monotonic() < deadline, "engine A's blocks never reached the index"
        time.sleep(0.05)
    before = env.counters("B")
    got = env.run("B", prompt(1))
    after = env.counters("B")
    assert got["cached_tokens"] == N_BLOCKS * BLOCK  # the external hit, as vLLM reports it
    assert after["kv_cache_groups"] == 2  # the hybrid allocator is on: sliding + full
    remote = sum(after.get(k, 0) - before.get(k, 0) for k in ("bytes_nixl", "bytes_objstore"))
    assert remote == env.hit_bytes()
    same_as_vllm_prefix_hit(got, env.refs[1])


def test_vllm_cache_too_small_gets_the_prefix_from_this_nodes_host_tier(env: Env) -> None:
    env.run("A", prompt(2))
    env.run("A", prompt(3))  # prompt 2's pages are evicted from vLLM's cache
    before = env.counters("A")
    got = env.run("A", prompt(2))
    after = env.counters("A")
    assert got["cached_tokens"] == N_BLOCKS * BLOCK  # vLLM's leftover pages + the host tier
    assert after.get("bytes_shm", 0) > before.get("bytes_shm", 0)
    assert after.get("load_tokens", 0) - before.get("load_tokens", 0) >= BLOCK
    same_as_vllm_prefix_hit(got, env.refs[2])


def test_corrupt_block_is_a_recompute_with_the_same_output(env: Env) -> None:
    from kvshare.actors.deploy import get_pool

    env.run("A", prompt(4))
    time.sleep(0.3)
    node0 = ray.get(env.engines["A"].ready.remote())["node"]
    stats = ray.get(get_pool(node0).stats.remote())
    path = os.path.join("/dev/shm", stats["namespaces"][NS]["shm_name"])
    with open(path, "r+b") as f:  # bit rot in every used slot of node_0's host slab
        data = bytearray(f.read())
        per = env.layout.bytes_per_block
        for slot in range(len(data) // per):
            data[slot * per + 64] ^= 0xFF
        f.seek(0)
        f.write(data)
    before = env.counters("B")
    got = env.run("B", prompt(4))
    after = env.counters("B")
    assert after.get("miss_corrupt", 0) > before.get("miss_corrupt", 0)
    same_as_cold(got, env.refs[4])


def test_pool_killed_is_a_recompute_with_the_same_output(env: Env) -> None:

    env.run("B", prompt(5))  # B stores prompt 5 in node_1's pool
    time.sleep(0.3)
    env.reset("B")
    node1 = ray.get(env.engines["B"].ready.remote())["node"]
    kill_pool(node1)
    before = env.counters("B")
    got = env.run("B", prompt(5))
    after = env.counters("B")
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert delta.get("miss_source_dead", 0) > 0 or delta.get("no_external_hit", 0) > 0
    same_as_cold(got, env.refs[5])


def test_events_reach_the_index_as_the_engines_gpu_tier(env: Env) -> None:
    """Engine A's KV events (two KV-cache groups) through kvshare's consumer into the index:
    a prompt it computed is held at its gpu tier once both groups hold it."""
    from kvshare.actors.deploy import get_index_client
    from kvshare.types import NodeId, Tier, WorkerId
    from kvshare.vllm.events.consumer import EventsConfig, KVEventsConsumer
    from kvshare.vllm.server.presence import Presence
    from kvshare.vllm.server.worker import VllmKeys
    from kvshare.workers import WorkerInfo

    index = get_index_client()
    hasher = VllmKeys.from_model(env.model, BLOCK, "float32").hasher()
    presence = Presence(WorkerInfo(WorkerId("hybrid-A"), NodeId("node_0"), (NS,),
                                   "http://127.0.0.1:1"), index).start()
    cfg = EventsConfig(env.events, NS, BLOCK, 32, replay_endpoint=env.events.replace(
        "kv.sock", "kv-replay.sock"), topic="kv")
    consumer = KVEventsConsumer(cfg, presence, hasher).start()
    try:
        tokens = prompt(6)
        env.run("A", tokens)
        hashes = hasher.hashes(tokens)

        def held() -> int:
            n = 0
            for holders in index.lookup(NS, hashes):
                if holders.get(presence.location) != Tier.GPU:
                    break
                n += 1
            return n

        deadline = time.monotonic() + 30
        while held() < N_BLOCKS:
            assert time.monotonic() < deadline, (held(), consumer.stats())
            time.sleep(0.05)
        stats = consumer.stats()
        assert stats["blocks_kv_cache_groups"] == 2 and stats["blocks_other_group_pages"] == 0
    finally:
        consumer.stop()
        presence.stop()
