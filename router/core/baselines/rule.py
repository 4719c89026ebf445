"""What the peers' routing rules share (``dynamo_kv``, ``llmd_precise``, ``ray_prefix``).

Each peer rule is a :class:`~kvshare.router.core.policy.Policy` tuned by the peer's own knobs, under the
peer's names and defaults, as keyword options of :func:`~kvshare.router.core.registry.make_policy`; a bad
value is a ``ValueError`` naming the rule and no policy is made. Ties break at random from
the rule's own seeded stream (``seed``), as the peers' routers do.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from kvshare.cost import CostModel, Source
from kvshare.router.core.policy import Candidate, Policy
from kvshare.router.core.sources import Sharing, SourceMap


class PeerRule(Policy):
    """A peer's rule: a :class:`Policy` with a seeded random stream for its ties."""

    def __init__(self, cost: CostModel, sharing: Sharing = Sharing.GLOBAL, seed: int = 0) -> None:
        super().__init__(cost, sharing)
        self._rng = random.Random(seed)


def own_prefix_weight(view: SourceMap, cand: Candidate, tier_weights: Sequence[float]) -> float:
    """The worker's own consecutive prefix (gpu, host, disk: no remote blocks), each block
    weighted by its tier's ``tier_weights[source]`` (Dynamo's overlap credits, llm-d's
    ``LongestPrefixScorer`` weights)."""
    return sum(tier_weights[src] * n for src, n in view.source_runs(
        cand.info.worker_id, cand.info.node, Sharing.LOCAL) if src <= Source.LOCAL_DISK)


def pick_tie(ties: Sequence[int], rng: random.Random) -> int:
    """One of ``ties`` (candidate indices): the only one, else one drawn from ``rng``."""
    return ties[0] if len(ties) == 1 else rng.choice(ties)


def require_weights(rule: str, **weights: float) -> None:
    """ValueError naming ``rule`` and the weights unless each is finite and >= 0."""
    bad = {k: w for k, w in weights.items() if not (math.isfinite(w) and w >= 0)}
    if bad:
        raise ValueError(f"{rule}: weights must be finite and >= 0, got {bad}")
