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

Eviction (``PrefixTree.evict_tenant_by_lru``, started by ``do_eviction``): each tenant keeps
its nodes in least-recently-inserted order (an insert touches every node of the prompt's path);
a tenant above ``eviction_threshold_chars`` (400,000) drops its oldest nodes, all nodes of one
timestamp together, until it is at or below ``eviction_target_chars`` (360,000). Ray checks
every ``eviction_interval_secs`` (10 s) in a thread; this policy checks after each insert (it
has no clock), so a tenant never exceeds the threshold by more than one prompt.

Mapping onto kvshare: the tree is over block hashes instead of characters (a hash names its
whole prefix, so per-hash sets of replicas are the tree), a tenant's size counts the tokens of
its distinct blocks, and queue length is the worker's requests in flight. Eviction is off by
default, as in Ray (the tree grows with every distinct block routed: ~0.4 KB a block); with
``do_eviction=True`` the thresholds are Ray's at ~4 characters per token, 100,000 and 90,000
tokens per tenant. At those defaults the rule loses most of its affinity on 512-token-block
traces (a tenant keeps ~10 prompts of 10k tokens), so the simulator's baseline is Ray's default.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import ClassVar

from kvshare.cost import CostModel
from kvshare.router.core.baselines.rule import PeerRule
from kvshare.router.core.policy import Candidate, Decision, RouteRequest
from kvshare.router.core.sources import Sharing, SourceMap
from kvshare.types import BlockHash, WorkerId


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
        do_eviction: bool = False,
        eviction_threshold_tokens: int = 100_000,
        eviction_target_tokens: int = 90_000,
    ) -> None:
        super().__init__(cost, sharing, seed)
        if not 0 <= match_rate_threshold <= 1 or not imbalanced_threshold >= 0:
            raise ValueError(f"{self.name}: match_rate_threshold must be in [0, 1] and "
                             f"imbalanced_threshold >= 0, got {match_rate_threshold} and "
                             f"{imbalanced_threshold}")
        if not 0 <= eviction_target_tokens <= eviction_threshold_tokens:
            raise ValueError(f"{self.name}: need 0 <= eviction_target_tokens <= "
                             f"eviction_threshold_tokens, got {eviction_target_tokens} and "
                             f"{eviction_threshold_tokens}")
        self.imbalanced_threshold = imbalanced_threshold
        self.match_rate_threshold = match_rate_threshold
        self.do_eviction = do_eviction
        self.eviction_threshold_tokens = eviction_threshold_tokens
        self.eviction_target_tokens = eviction_target_tokens
        self._tree: dict[BlockHash, set[WorkerId]] = {}
        self._tenant_blocks: dict[WorkerId, int] = {}
        # with eviction, per tenant: its blocks, least recently inserted first, with the
        # insert's number
        self._lru: dict[WorkerId, OrderedDict[BlockHash, int]] = {}
        self._inserts = 0

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
            sizes = [self.tenant_tokens(c.info.worker_id) for c in cands]
            pool = [i for i, s in enumerate(sizes) if s == min(sizes)]
            reason = "smallest_tenant"
        low = min(queues[i] for i in pool)
        return self._rng.choice(sorted(i for i in pool if queues[i] == low)), reason

    def tenant_tokens(self, worker: WorkerId) -> int:
        """Tokens of the distinct blocks the tree holds for ``worker`` (Ray's char count)."""
        return self._tenant_blocks.get(worker, 0) * self.cost.block_tokens

    def observe(self, request: RouteRequest, decision: Decision) -> None:
        """Ray's ``insert``: every block of the prompt under the chosen replica (with
        eviction: touched at this insert's time, then the replica's eviction check)."""
        w = decision.worker
        tree = self._tree
        added = 0
        for h in request.hashes:
            holders = tree.get(h)
            if holders is None:
                tree[h] = {w}
                added += 1
            elif w not in holders:
                holders.add(w)
                added += 1
        self._tenant_blocks[w] = self._tenant_blocks.get(w, 0) + added
        if not self.do_eviction:
            return
        self._inserts += 1
        stamp = self._inserts
        lru = self._lru.setdefault(w, OrderedDict())
        for h in request.hashes:
            lru[h] = stamp
            lru.move_to_end(h)
        if self.tenant_tokens(w) > self.eviction_threshold_tokens:
            self._evict(w, lru)

    def _evict(self, w: WorkerId, lru: OrderedDict[BlockHash, int]) -> None:
        """Ray's ``evict_tenant_by_lru`` down to the target: oldest inserts first, all blocks
        of one insert together."""
        keep = self.eviction_target_tokens // self.cost.block_tokens
        tree = self._tree
        while len(lru) > keep:
            oldest = next(iter(lru.values()))
            while lru and next(iter(lru.values())) == oldest:
                h, _ = lru.popitem(last=False)
                holders = tree[h]
                holders.discard(w)
                if not holders:
                    del tree[h]
        self._tenant_blocks[w] = len(lru)
