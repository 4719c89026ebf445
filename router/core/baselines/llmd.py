"""llm-d's precise prefix-cache scorer plus its kv-cache-utilization and queue scorers, as a
kvshare policy (``llmd_precise``).

Sources: llm-d/llm-d-kv-cache ``pkg/kvcache/kvblock_scorer.go`` (``LongestPrefixScorer``:
walk the request's blocks from block 0 while a pod holds each one; every held block adds
the pod's best tier weight, ``DefaultKVCacheBackendConfig``: gpu 1.0, cpu 0.8, storage 0.3),
llm-d/llm-d-inference-scheduler ``pkg/plugins/scorer/precise_prefix_cache.go`` and
``utils.go`` (``indexedScoresToNormalizedScoredPods``: min-max normalised over the pods that
hold the first block, 1.0 when they all tie, 0 for pods holding nothing), the Gateway API
Inference Extension's ``kv-cache-utilization-scorer``
(``pkg/epp/scheduling/framework/plugins/scorer/kvcache_utilization.go``:
``1 - KVCacheUsagePercent``) and ``queue-scorer`` (``(max_q - q) / (max_q - min_q)`` over
waiting requests, 1.0 when equal), and the ``max-score-picker`` (highest weighted sum, ties
at random). Weights: llm-d/llm-d ``guides/precise-prefix-cache-aware/scheduler/
precise-prefix-cache-aware.values.yaml`` (v0.8): prefix 2.0, kv-cache-utilization 1.0,
queue 1.0 (the older ``gaie-kv-events/values.yaml`` used 3.0 / 2.0 / 2.0).

What this does on a shared prefix, faithfully: while only one pod holds a request's first
block, that pod's prefix score is 1.0 (it ties only with itself), so it scores
``2 + (1 - usage) + queue >= 2`` against at most ``0 + 1 + 1 = 2`` for any other pod. The
holder takes every such request until its KV is full (usage 1.0) *and* its queue is the
deepest; only then does it tie with idle pods and the picker spreads at random. On a trace
whose requests start from a handful of system prompts (the Mooncake trace has 3 first
blocks) llm-d therefore concentrates them on that many pods whatever the cluster size.

Mapping onto kvshare's view: a pod is a worker; the blocks it holds are those on its own gpu
and its node's host/disk pool (the index's view, plus the router's pending blocks); waiting
requests are its requests in flight less the one running; KV usage is the worker's reported
``kv_usage`` (vLLM's ``kv_cache_usage_perc``; the simulator reports the share of a worker's
KV room its requests in flight take).
"""

from __future__ import annotations

from typing import ClassVar

from kvshare.cost import CostModel
from kvshare.router.core.baselines.rule import (
    PeerRule,
    own_prefix_weight,
    pick_tie,
    require_weights,
)
from kvshare.router.core.policy import Candidate, RouteRequest
from kvshare.router.core.sources import Sharing, SourceMap


class LlmdPrecise(PeerRule):
    """llm-d's precise-prefix-cache + kv-cache-utilization + queue scorers, max-score picker."""

    name: ClassVar[str] = "llmd_precise"

    def __init__(
        self,
        cost: CostModel,
        sharing: Sharing = Sharing.GLOBAL,
        *,
        prefix_weight: float = 2.0,
        kv_weight: float = 1.0,
        queue_weight: float = 1.0,
        tier_weights: tuple[float, float, float] = (1.0, 0.8, 0.3),
        seed: int = 0,
    ) -> None:
        super().__init__(cost, sharing, seed)
        gpu, cpu, storage = tier_weights
        require_weights(self.name, prefix_weight=prefix_weight, kv_weight=kv_weight,
                        queue_weight=queue_weight, gpu=gpu, cpu=cpu, storage=storage)
        self.prefix_weight, self.kv_weight, self.queue_weight = prefix_weight, kv_weight, queue_weight
        self.tier_weights = tier_weights

    def prefix_score(self, view: SourceMap, cand: Candidate) -> float:
        """Tier-weighted length of the worker's consecutive prefix (``LongestPrefixScorer``)."""
        return own_prefix_weight(view, cand, self.tier_weights)

    def _select(self, request: RouteRequest, view: SourceMap, cands: list[Candidate]) -> tuple[int, str]:
        raw = [self.prefix_score(view, c) for c in cands]
        held = [x for x in raw if x > 0]
        lo, hi = (min(held), max(held)) if held else (0.0, 0.0)
        prefix = [0.0 if x <= 0 else (1.0 if hi == lo else (x - lo) / (hi - lo)) for x in raw]
        waiting = [max(0, c.load.running - 1) for c in cands]
        qlo, qhi = min(waiting), max(waiting)
        queue = [1.0 if qhi == qlo else (qhi - q) / (qhi - qlo) for q in waiting]
        kv = [1.0 - min(1.0, max(0.0, c.load.kv_usage)) for c in cands]
        total = [self.prefix_weight * p + self.kv_weight * k + self.queue_weight * q
                 for p, k, q in zip(prefix, kv, queue, strict=True)]
        best = max(total)
        ties = [i for i, t in enumerate(total) if t == best]
        return pick_tie(ties, self._rng), "prefix" if prefix[ties[0]] > 0 else "queue"
