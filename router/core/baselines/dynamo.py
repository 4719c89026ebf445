"""NVIDIA Dynamo's current KV router cost, as a kvshare policy (``dynamo_kv``).

Source: ai-dynamo/dynamo ``lib/kv-router/src/scheduling/selector/default.rs``
(``DefaultWorkerScorer::worker_logit``, ``softmax_sample_index``) with the defaults of
``lib/kv-router/src/scheduling/config.rs`` and the load inputs of ``selector/mod.rs``::

    raw_prefill_blocks    = (active_prefill_tokens + isl_tokens) / block_size
    overlap_credit_blocks = overlap_score_credit * device_overlap_blocks
                          + host_cache_hit_weight * host_overlap_blocks
                          + disk_cache_hit_weight * disk_overlap_blocks
    logit = prefill_load_scale * max(raw_prefill_blocks - overlap_credit_blocks, 0)
          + decode_blocks + decode_active_request_weight * active_requests

Defaults: ``overlap_score_credit`` 1.0, ``host_cache_hit_weight`` 0.75,
``disk_cache_hit_weight`` 0.25, ``prefill_load_scale`` 1.0, ``decode_active_request_weight``
0 (the overlap-credit decay and the shared-cache multiplier are off by default and left out).
Lowest logit wins, ties at random; with ``router_temperature`` > 0 a worker is sampled with
probability ``exp(-(logit - min) / ((max - min) * T))`` (min-max normalised, as Dynamo does).

Mapping onto kvshare's view: a worker's device/host/disk overlap is the leading run of blocks
its own gpu / its node's host / its node's disk hold (consecutive from block 0, per tier, the
prefix Dynamo's per-worker radix tree returns); ``active_prefill_tokens`` is the worker's
queued prefill tokens; ``decode_blocks`` the blocks of its requests in flight plus this
request's (``potential_decode_blocks``). Dynamo's router sees only its own workers' caches, so
blocks on other nodes earn no credit (the worker may still pull them under global sharing).
"""

from __future__ import annotations

import math
import random
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


class DynamoKv(PeerRule):
    """Dynamo's current ``DefaultWorkerSelector`` cost (module docstring)."""

    name: ClassVar[str] = "dynamo_kv"

    def __init__(
        self,
        cost: CostModel,
        sharing: Sharing = Sharing.GLOBAL,
        *,
        overlap_score_credit: float = 1.0,
        host_cache_hit_weight: float = 0.75,
        disk_cache_hit_weight: float = 0.25,
        prefill_load_scale: float = 1.0,
        decode_active_request_weight: float = 0.0,
        router_temperature: float = 0.0,
        seed: int = 0,
    ) -> None:
        super().__init__(cost, sharing, seed)
        require_weights(self.name, overlap_score_credit=overlap_score_credit,
                        host_cache_hit_weight=host_cache_hit_weight,
                        disk_cache_hit_weight=disk_cache_hit_weight,
                        prefill_load_scale=prefill_load_scale,
                        decode_active_request_weight=decode_active_request_weight,
                        router_temperature=router_temperature)
        self.tier_credit = (overlap_score_credit, host_cache_hit_weight, disk_cache_hit_weight)
        self.prefill_load_scale = prefill_load_scale
        self.request_weight = decode_active_request_weight
        self.temperature = router_temperature

    def logit(self, request: RouteRequest, view: SourceMap, cand: Candidate) -> float:
        """The worker's cost in blocks (lower is better)."""
        bt = self.cost.block_tokens
        credit = own_prefix_weight(view, cand, self.tier_credit)
        raw = (cand.load.queued_prefill_tokens + request.num_tokens) / bt
        decode = cand.active_blocks + len(request.hashes)
        return (self.prefill_load_scale * max(raw - credit, 0.0) + decode
                + self.request_weight * cand.load.running)

    def _select(self, request: RouteRequest, view: SourceMap, cands: list[Candidate]) -> tuple[int, str]:
        logits = [self.logit(request, view, c) for c in cands]
        return sample_lowest(logits, self.temperature, self._rng), "dynamo_kv"


def sample_lowest(costs: list[float], temperature: float, rng: random.Random) -> int:
    """Dynamo's pick: the lowest cost (ties at random) at temperature 0, else a softmax over
    the min-max normalised costs: ``p_i ~ exp(-(c_i - min) / ((max - min) * T))``."""
    low, high = min(costs), max(costs)
    if temperature == 0 or low == high:
        return pick_tie([i for i, c in enumerate(costs) if c == low], rng)
    scale = (high - low) * temperature
    weights = [math.exp(-(c - low) / scale) for c in costs]
    return rng.choices(range(len(costs)), weights)[0]
