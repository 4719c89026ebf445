"""The routing rules peers ship today, as baseline policies (one module each, cited there)."""

from __future__ import annotations

from collections.abc import Callable

from kvshare.router.core.policy import Policy
from kvshare.router.sim.peers.dynamo import DynamoKv
from kvshare.router.sim.peers.llmd import LlmdPrecise
from kvshare.router.sim.peers.ray_prefix import RayPrefixAffinity

PEER_POLICIES: dict[str, Callable[..., Policy]] = {
    cls.name: cls for cls in (DynamoKv, LlmdPrecise, RayPrefixAffinity)
}
