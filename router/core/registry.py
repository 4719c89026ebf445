"""The routing policies by name: the cost policy, the cache-blind baselines and the peers'
rules (:mod:`kvshare.router.core.baselines`), and how a router or the simulator makes one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvshare.cost import CostModel
from kvshare.router.core.baselines import PEER_POLICIES
from kvshare.router.core.policy import CostPolicy, LeastLoaded, Policy, RoundRobin
from kvshare.router.core.sources import Sharing

POLICIES: dict[str, Callable[..., Policy]] = {
    cls.name: cls for cls in (RoundRobin, LeastLoaded, CostPolicy)
} | PEER_POLICIES
DEFAULT_POLICY = "cost"
ALIASES: dict[str, str] = {"prefix_affinity": "ray_prefix", "kv_overlap": "dynamo_kv"}
"""Older names of the peers' rules, still accepted: each is the policy it names, options and
all (``--policy all`` and sweeps run the policies of :data:`POLICIES` once each)."""


def policy_names() -> list[str]:
    """Every name :func:`make_policy` accepts: the registry's, then the aliases."""
    return [*sorted(POLICIES), *sorted(ALIASES)]


def make_policy(
    name: str, cost: CostModel, sharing: Sharing | str = Sharing.GLOBAL, **options: Any
) -> Policy:
    """A fresh policy by registry name or alias; KeyError listing the names if unknown."""
    try:
        factory = POLICIES[ALIASES.get(name, name)]
    except KeyError:
        raise KeyError(f"unknown policy {name!r}: choose one of {policy_names()}") from None
    return factory(cost, Sharing(sharing), **options)
