"""Identifiers shared by every kvshare component.

Identifiers are ``NewType``s so that a node id cannot be passed where a worker id is
expected; tiers are a small string enum so they travel through Arrow and JSON unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum
from typing import NewType

BlockHash = NewType("BlockHash", bytes)
"""A chained block hash: 32 bytes (sha256/blake3) or 16 bytes (xxh3-128)."""

NodeId = NewType("NodeId", str)
"""A Ray node id (hex) or, outside Ray, any stable node name."""

WorkerId = NewType("WorkerId", str)
"""An inference worker's id, unique in the cluster."""

Location = NewType("Location", str)
"""Where blocks live, as the index sees it: ``node:<NodeId>`` or ``worker:<WorkerId>``."""


class Tier(StrEnum):
    """Storage tiers, fastest first."""

    GPU = "gpu"
    HOST = "host"
    DISK = "disk"

    @property
    def rank(self) -> int:
        """0 for the fastest tier; smaller is faster. Also the tier's code on the wire and in
        the index (:data:`TIERS` ``[code]`` is the tier)."""
        return TIER_CODES[self]


TIERS: tuple[Tier, ...] = (Tier.GPU, Tier.HOST, Tier.DISK)
"""Every tier, fastest first; a tier's position is its code (:attr:`Tier.rank`)."""
TIER_CODES: dict[Tier, int] = {t: code for code, t in enumerate(TIERS)}


def node_location(node: str) -> Location:
    """The index location of a node's pool."""
    return Location(f"node:{node}")


def worker_location(worker: str) -> Location:
    """The index location of a worker's own (gpu-tier) cache."""
    return Location(f"worker:{worker}")


def parse_location(location: str) -> tuple[str, str]:
    """Split ``kind:id``; raise ValueError naming the expected form otherwise."""
    kind, sep, ident = location.partition(":")
    if not sep or kind not in ("node", "worker") or not ident:
        raise ValueError(
            f"location {location!r} is malformed: expected 'node:<id>' or 'worker:<id>'"
        )
    return kind, ident


class UnknownNamespace(KeyError):
    """A namespace the component asked does not serve. The message names the namespaces it
    does serve and how to add the missing one; nothing was changed."""

    def __init__(self, namespace: str, known: Iterable[str], fix: str) -> None:
        self.namespace, self.known, self.fix = namespace, sorted(known), fix
        super().__init__(f"unknown namespace {namespace!r}; known: {self.known} ({fix})")

    def __reduce__(self) -> tuple[type[UnknownNamespace], tuple[str, list[str], str]]:
        return UnknownNamespace, (self.namespace, self.known, self.fix)  # crosses Ray intact
