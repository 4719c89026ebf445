"""The online sizing estimator fed the stream the simulator's ``global_lru`` sees.

:func:`~kvshare.router.sim.replay.global_lru` replays a trace in arrival order through one
LRU pool and counts cached tokens over input tokens (a prompt's last token is always
computed). :func:`estimate` feeds :class:`~kvshare.pool.sizing.HitRateCurve` the same
lookups (the same requests left out, the same chained hashes) with each block weighted by the
tokens its hit would serve, so the estimate at a capacity and ``global_lru`` at that capacity
measure the same thing. ``benchmarks/sizing.py`` and ``tests/test_sim_sizing.py`` compare them.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvshare.pool.sizing import HitRateCurve, SizingConfig
from kvshare.router.sim.cluster_model import ClusterConfig
from kvshare.router.sim.trace import TraceHasher, TraceRequest


def block_weights(input_tokens: int, blocks: int, block_tokens: int) -> tuple[list[float], float]:
    """Tokens each block's hit serves, and the tokens no cache serves.

    ``global_lru`` counts ``min(k * block_tokens, input_tokens - 1)`` tokens for a hit prefix
    of ``k`` blocks, so block ``j`` serves ``min(block_tokens, input_tokens - 1 - j *
    block_tokens)`` (at least 0); the rest of the prompt always misses.
    """
    last = input_tokens - 1
    weights = [float(max(0, min(block_tokens, last - j * block_tokens))) for j in range(blocks)]
    return weights, float(input_tokens) - sum(weights)


def estimate(
    requests: Sequence[TraceRequest], config: ClusterConfig, sizing: SizingConfig | None = None,
) -> HitRateCurve:
    """A :class:`HitRateCurve` fed every request ``global_lru`` replays (``sizing`` default:
    the pool's default knobs with the cluster's block size)."""
    layout = config.layout
    curve = HitRateCurve(sizing or SizingConfig(layout.bytes_per_block))
    if curve.config.block_bytes != layout.bytes_per_block:
        raise ValueError(
            f"sizing block_bytes {curve.config.block_bytes} != the cluster's "
            f"{layout.bytes_per_block}-byte blocks"
        )
    hasher = TraceHasher(config.model, layout.fingerprint())
    bt = config.block_tokens
    fits = config.kv_capacity_tokens
    for req in requests:
        if req.input_tokens > fits:
            continue
        hashes = hasher.hashes(req.hash_ids)
        weights, rest = block_weights(req.input_tokens, len(hashes), bt)
        curve.lookup(hashes, weights, rest)
    return curve
