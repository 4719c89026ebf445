"""Peer fetch: get blocks that other nodes' pools hold, with the best transport, verified.

A :class:`PeerFetcher` runs where the bytes are needed (a worker, or a pool fetching for its
node). For a batch of hashes it learns the holders from the index (an ``IndexQuery`` or a
``MatchResult`` the caller already has), picks one node per block (this node first: shared
memory; else the node holding most of the batch), and per source node submits ONE batch on the
fastest transport that can reach it (measured bandwidths, see :mod:`kvshare.transfer.probe`).
Each transport pins the blocks on the source for the duration, verifies checksums and always
unpins. Blocks the NIXL path could not serve (NIXL missing on either side, a transfer error)
are retried once over the object store within the same deadline, and blocks a node could
not serve (dead, missing, corrupt) are tried once on another node that holds them. With ``keep_local`` the
blocks that arrived are also stored in this node's pool, so the next request here hits
locally. Anything else is a miss with a reason: the caller recomputes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kvshare.client.types import REMOTE_SOURCES, TRANSPORT_SHM
from kvshare.match import MatchResult
from kvshare.tiers.base import ByteArray
from kvshare.transfer.base import (
    DEADLINE,
    HOLDER_DEAD,
    MISSING,
    NIXL_UNAVAILABLE,
    TRANSFER_ERROR,
    BlockOutcomes,
    BlockResult,
    Transfer,
    TransferResult,
    Transport,
    check_batch,
)
from kvshare.transfer.wire import BlockControl
from kvshare.types import BlockHash, Location, node_location, parse_location
from kvshare.workers import IndexQuery

log = logging.getLogger(__name__)

RETRY_OVER_OBJSTORE = frozenset({NIXL_UNAVAILABLE, TRANSFER_ERROR})
LOCAL_ORDER = (TRANSPORT_SHM, *REMOTE_SOURCES)


@dataclass(frozen=True)
class FetchResult(BlockOutcomes):
    """Per-block outcomes (request order), which node and transport served each, and stats."""

    outcomes: tuple[BlockResult, ...]
    served_by: tuple[str, ...]  # "node:<id>/<transport>" per block, "" for misses
    kept_local: int = 0
    transfers: tuple[TransferResult, ...] = field(default=(), compare=False)
    seconds: float = 0.0


class PeerFetcher:
    """Fetch blocks of ``namespace`` into caller memory on node ``node``.

    ``controls(location)`` returns the :class:`BlockControl` of a node pool (None if unknown);
    ``transports`` maps names (``shm``, ``nixl``, ``objstore``) to ready transports; missing
    ones are simply not used. ``bandwidth`` (bytes/s per transport name) orders the choice;
    unknown names fall back to the fixed order shm > nixl > objstore.
    """

    def __init__(
        self,
        node: str,
        namespace: str,
        controls: Callable[[Location], BlockControl | None],
        transports: Mapping[str, Transport],
        *,
        bandwidth: Mapping[str, float] | None = None,
        index: IndexQuery | None = None,
    ) -> None:
        if "objstore" not in transports and "nixl" not in transports:
            raise ValueError("PeerFetcher needs an 'objstore' or 'nixl' transport to reach peers")
        self.node = node
        self.location = node_location(node)
        self.namespace = namespace
        self.controls = controls
        self.transports = dict(transports)
        self.bandwidth = dict(bandwidth or {})
        self.index = index

    def choose(self, location: Location) -> list[str]:
        """Transports that can reach ``location``, fastest first."""
        local = location == self.location
        order = LOCAL_ORDER if local else REMOTE_SOURCES
        names = [n for n in order if n in self.transports]
        if not self.bandwidth:
            return names
        return sorted(names, key=lambda n: -self.bandwidth.get(n, 0.0))

    def fetch(
        self,
        hashes: Sequence[BlockHash],
        dest: Sequence[ByteArray],
        *,
        match: MatchResult | None = None,
        deadline_s: float = 5.0,
        keep_local: bool = False,
    ) -> FetchResult:
        """Fill ``dest[i]`` with block ``hashes[i]`` from whichever node holds it."""
        start = time.monotonic()
        deadline = start + deadline_s
        if hashes:
            check_batch(hashes, dest, dest[0].nbytes)
        if match is None:
            if self.index is None:
                raise ValueError("fetch needs a MatchResult or a PeerFetcher built with an index")
            match = self.index.match(self.namespace, hashes)
        reasons = [MISSING] * len(hashes)
        served = [""] * len(hashes)
        results: list[TransferResult] = []
        tried: list[set[Location]] = [set() for _ in hashes]
        first = {(loc, self._best(loc)): idx for loc, idx in self._plan(match, len(hashes)).items()}
        last = self._round(first, hashes, dest, deadline, reasons, served, results, tried)
        # second round: NIXL could not serve -> objstore, same node; else another holder
        again: dict[tuple[Location, str], list[int]] = {}
        for i, (loc, name) in last.items():
            if reasons[i] in ("", DEADLINE) or time.monotonic() >= deadline:
                continue
            if name == "nixl" and reasons[i] in RETRY_OVER_OBJSTORE and "objstore" in self.transports:
                again.setdefault((loc, "objstore"), []).append(i)
                continue
            others = [h for h in match.holders(i) if _is_node(h) and h not in tried[i]] if (
                i < match.combined_prefix) else []
            if others:
                alt = self.location if self.location in others else sorted(others)[0]
                again.setdefault((alt, self._best(alt)), []).append(i)
        self._round(again, hashes, dest, deadline, reasons, served, results, tried)
        kept = self._keep(hashes, dest, reasons, served) if keep_local else 0
        outs = tuple(BlockResult(h, r == "", r) for h, r in zip(hashes, reasons, strict=True))
        return FetchResult(outs, tuple(served), kept, tuple(results), time.monotonic() - start)

    def _best(self, location: Location) -> str:
        names = self.choose(location)
        return names[0] if names else "objstore"

    def _round(
        self, groups: dict[tuple[Location, str], list[int]], hashes: Sequence[BlockHash],
        dest: Sequence[ByteArray], deadline: float, reasons: list[str], served: list[str],
        results: list[TransferResult], tried: list[set[Location]],
    ) -> dict[int, tuple[Location, str]]:
        """Submit one batch per (node, transport), then wait for all; returns who served what."""
        pending: list[tuple[Location, str, list[int], Transfer]] = []
        used: dict[int, tuple[Location, str]] = {}
        for (loc, name), idx in groups.items():
            for i in idx:
                tried[i].add(loc)
                used[i] = (loc, name)
            control = self.controls(loc)
            if control is None or name not in self.transports:
                for i in idx:
                    reasons[i] = HOLDER_DEAD
                continue
            pending.append((loc, name, idx, self._submit(name, control, hashes, dest, idx, deadline)))
        for loc, name, idx, t in pending:
            res = self.transports[name].wait(t)
            results.append(res)
            for i, o in zip(idx, res.outcomes, strict=True):
                reasons[i] = o.reason
                served[i] = f"{loc}/{name}" if o.ok else ""
        return used

    def _submit(
        self, name: str, control: BlockControl, hashes: Sequence[BlockHash],
        dest: Sequence[ByteArray], idx: list[int], deadline: float,
    ) -> Transfer:
        remaining = max(deadline - time.monotonic(), 0.0)
        return self.transports[name].submit_read(
            control, [hashes[i] for i in idx], [dest[i] for i in idx], deadline_s=remaining
        )

    def _plan(self, match: MatchResult, n: int) -> dict[Location, list[int]]:
        """One node per block: this node if it holds it, else the node holding the most."""
        nodes = {
            loc: m.prefix_blocks + sum(1 for t in m.tiers if t is not None)
            for loc, m in match.locations.items()
            if _is_node(loc)
        }
        groups: dict[Location, list[int]] = {}
        for i in range(min(n, match.combined_prefix)):
            holders = [loc for loc in match.holders(i) if loc in nodes]
            if not holders:
                continue
            best = self.location if self.location in holders else max(
                holders, key=lambda loc: (nodes[loc], loc)
            )
            groups.setdefault(best, []).append(i)
        return groups

    def _keep(
        self, hashes: Sequence[BlockHash], dest: Sequence[ByteArray], reasons: list[str],
        served: list[str],
    ) -> int:
        """Store blocks that came from other nodes in this node's pool (best effort)."""
        idx = [i for i, r in enumerate(reasons) if r == "" and not served[i].startswith(f"{self.location}/")]
        control = self.controls(self.location)
        if not idx or control is None:
            return 0
        name = next((n for n in LOCAL_ORDER if n in self.transports), "objstore")
        res = self.transports[name].write(
            control, [hashes[i] for i in idx], [dest[i] for i in idx], deadline_s=5.0
        )
        if not res.ok:
            log.info("keep_local stored %d of %d blocks: %s", res.num_ok, len(idx), res.reasons())
        return res.num_ok


def _is_node(location: Location) -> bool:
    try:
        return parse_location(location)[0] == "node"
    except ValueError:
        return False


__all__ = ["DEADLINE", "FetchResult", "PeerFetcher"]
