"""The routing rules peers ship today, as baseline policies (one module each, cited there)."""

from __future__ import annotations

from collections.abc import Callable

from router.policy import Policy
from router.policy_dynamo import DynamoKv
from router.policy_llmd import LlmdPrecise
from router.policy_ray import RayPrefixAffinity

PEER_POLICIES: dict[str, Callable[..., Policy]] = {
    cls.name: cls for cls in (DynamoKv, LlmdPrecise, RayPrefixAffinity)
}
