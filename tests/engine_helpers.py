"""Small engines and pools shared by the engine, client and lossless tests."""

from __future__ import annotations

import random
from typing import Any

from kvshare.engines.hf import EngineConfig, HFEngine

SMALL = {
    "num_hidden_layers": 2,
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 512,
}
BLOCK = 16


def small_engine(seed: int = 0, block_tokens: int = BLOCK, **kw: Any) -> HFEngine:
    return HFEngine(EngineConfig(overrides=dict(SMALL), seed=seed, block_tokens=block_tokens, **kw))


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]
