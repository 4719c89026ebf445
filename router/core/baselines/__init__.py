"""The routing rules peers ship today, as baseline policies (one module each, cited there)."""

from __future__ import annotations

from collections.abc import Callable

from kvshare.router.core.baselines.dynamo import DynamoKv
from kvshare.router.core.baselines.llmd import LlmdPrecise
from kvshare.router.core.baselines.ray_prefix import RayPrefixAffinity
from kvshare.router.core.policy import Policy

PEER_POLICIES: dict[str, Callable[..., Policy]] = {
    cls.name: cls for cls in (DynamoKv, LlmdPrecise, RayPrefixAffinity)
}
