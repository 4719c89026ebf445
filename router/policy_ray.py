"""Ray Serve LLM's ``PrefixCacheAffinityRouter`` as shipped in ray 2.60, as a kvshare policy
(``ray_prefix``).

Source: ``ray/llm/_internal/serve/routing_policies/prefix_aware/prefix_aware_router.py`` and
``prefix_tree.py`` of the installed ray 2.60.0. The router keeps its *own* prefix tree of the
prompts it routed (``on_request_routed`` inserts each prompt under the chosen replica; it
never sees the engines' caches, and ``do_eviction`` defaults to False). Per request
(``_prefix_match_best_replicas``):

1. If the replicas' queue lengths differ by more than ``imbalanced_threshold`` (default
   infinity: never), fall back to power-of-two choices.
2. Else match the prompt in the tree: ``match_rate = matched chars / prompt chars``. At or
   above ``match_rate_threshold`` (0.1) the candidates are the replicas holding the longest
   match; below it, the "smallest tenants" (fewest characters in the tree).
3. Serve then takes the candidate with the shortest queue (ongoing requests), ties at random.

Mapping onto kvshare: the tree is over block hashes instead of characters (a hash names its
whole prefix, so per-hash sets of replicas are the tree), a tenant's size counts the tokens of
its distinct blocks, and queue length is the worker's requests in flight.
"""

from __future__ import annotations

import math
from typing import ClassVar

from kvshare.cost import CostModel
from kvshare.types import BlockHash, WorkerId
from router.peer_rule import PeerRule
from router.policy import Candidate, Decision, RouteRequest
from router.sources import Sharing, SourceMap


class RayPrefixAffinity(PeerRule):
    """Ray 2.60's PrefixCacheAffinityRouter rule (module docstring)."""

    name: ClassVar[str] = "ray_prefix"

    def __init__(
        self,
        cost: CostModel,
        sharing: Sharing = Sharing.GLOBAL,
        *,
        imbalanced_threshold: float = math.inf,
        match_rate_threshold: float = 0.1,
        seed: int = 0,
    ) -> None:
        super().__init__(cost, sharing, seed)
        if not 0 <= match_rate_threshold <= 1 or not imbalanced_threshold >= 0:
            raise ValueError(f"{self.name}: match_rate_threshold must be in [0, 1] and "
                             f"imbalanced_threshold >= 0, got {match_rate_threshold} and "
                             f"{imbalanced_threshold}")
        self.imbalanced_threshold = imbalanced_threshold
        self.match_rate_threshold = match_rate_threshold
        self._tree: dict[BlockHash, set[WorkerId]] = {}
        self._tenant_tokens: dict[WorkerId, int] = {}

    def prefix_match(self, request: RouteRequest, tenants: set[WorkerId]) -> tuple[int, set[WorkerId]]:
        """Longest routed prefix (blocks) among ``tenants`` and the tenants that hold it."""
        best: set[WorkerId] = set()
        depth = 0
        alive = tenants
        for h in request.hashes:
            holders = self._tree.get(h)
            if not holders:
                break
            alive = alive & holders
            if not alive:
                break
            best, depth = alive, depth + 1
        return depth, best

    def _select(self, request: RouteRequest, view: SourceMap, cands: list[Candidate]) -> tuple[int, str]:
        queues = [c.load.running for c in cands]
        if max(queues) - min(queues) > self.imbalanced_threshold:
            pair = self._rng.sample(range(len(cands)), min(2, len(cands)))
            return min(pair, key=queues.__getitem__), "pow2"
        ids = {c.info.worker_id: i for i, c in enumerate(cands)}
        depth, holders = self.prefix_match(request, set(ids))
        matched = min(depth * self.cost.block_tokens, request.num_tokens)
        if holders and matched / request.num_tokens >= self.match_rate_threshold:
            pool, reason = [ids[w] for w in holders], "prefix_match"
        else:
            sizes = [self._tenant_tokens.get(c.info.worker_id, 0) for c in cands]
            pool = [i for i, s in enumerate(sizes) if s == min(sizes)]
            reason = "smallest_tenant"
        low = min(queues[i] for i in pool)
        return self._rng.choice(sorted(i for i in pool if queues[i] == low)), reason

    def observe(self, request: RouteRequest, decision: Decision) -> None:
        w = decision.worker
        added = 0
        for h in request.hashes:
            holders = self._tree.setdefault(h, set())
            if w not in holders:
                holders.add(w)
                added += 1
        self._tenant_tokens[w] = self._tenant_tokens.get(w, 0) + added * self.cost.block_tokens
