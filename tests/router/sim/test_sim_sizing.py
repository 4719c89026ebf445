"""The online sizing estimate against the simulator's exact LRU replay, on a slice of each
shared trace (``benchmarks/sizing.py`` does whole traces)."""

from __future__ import annotations

import numpy as np
import pytest
from paths import TRACES

from kvshare.pool.sizing import SizingConfig
from kvshare.router.sim.cluster_model import ClusterConfig
from kvshare.router.sim.replay import global_lru
from kvshare.router.sim.sizing import block_weights, estimate
from kvshare.router.sim.trace_read import read_trace

SLICES = [  # (trace, block_tokens: agentic ids coarsened 8x to keep the replay short)
    ("synthetic_trace.jsonl", None), ("dynamo_mooncake_trace_1000.jsonl", None),
    ("agentic/trace_00[0-5]*.json", 512),
]


def test_block_weights_match_what_global_lru_counts() -> None:
    # global_lru serves min(k * 512, input - 1) tokens for a hit prefix of k blocks
    weights, rest = block_weights(1100, 3, 512)
    assert weights == [512.0, 512.0, 75.0] and rest == 1.0
    weights, rest = block_weights(1025, 3, 512)  # the last block's only token is the last one
    assert weights == [512.0, 512.0, 0.0] and rest == 1.0
    weights, rest = block_weights(200, 3, 64)  # agentic: full blocks only, the rest misses
    assert weights == [64.0, 64.0, 64.0] and rest == 8.0


@pytest.mark.parametrize(("name", "block_tokens"), SLICES)
def test_sampled_estimate_within_003_of_the_exact_replay(name: str, block_tokens: int | None
                                                         ) -> None:
    paths = sorted(TRACES.glob(name))  # the agentic slice: its first five conversations' files
    if not paths:
        pytest.skip(f"{TRACES / name} is not here")
    trace = read_trace(paths, 300, block_tokens=block_tokens)
    cfg = ClusterConfig(block_tokens=trace.block_tokens)
    blocks = len(np.unique(trace.ids))
    # sampled for real: a quarter of the slice's blocks tracked at most
    sizing = SizingConfig(cfg.layout.bytes_per_block, max_tracked=blocks // 4, hot_blocks=256)
    curve = estimate(trace, cfg, sizing)
    assert curve.rate < 0.5
    for fraction in (0.25, 0.5, 1.0):
        cap = max(1, int(fraction * blocks)) * cfg.block_tokens
        got = curve.hit_rate(cap * cfg.layout.bytes_per_token)
        assert got == pytest.approx(global_lru(trace, cfg, cap), abs=0.03), (name, fraction)
