"""Per-link bandwidths: bytes/s of a pull from holder node X to reader node Y.

Every node's pool probes each peer (:mod:`kvshare.transfer.probe`): the figures node Y
measured reading from node X's pool are the X->Y link, per transport (``per_node`` in a
pool's ``transfer_bandwidths()``). One slow link (a shaped or congested port) then prices
only the pulls that cross it, not every pull in the cluster. :class:`Links` holds them for
the cost model (:attr:`kvshare.cost.Bandwidths.links`); a link nobody probed falls back to
the cluster-wide remote figure.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

REMOTE_TRANSPORTS = ("nixl", "objstore")
"""The transports between nodes; a link's figure is the best of them (a reader pulls over
the faster one)."""


@dataclass(frozen=True)
class Links:
    """``(holder, reader, bytes/s)`` per probed link; hashable and comparable by value."""

    pairs: tuple[tuple[str, str, float], ...] = ()
    _by: dict[tuple[str, str], float] = field(default_factory=dict, init=False, repr=False,
                                             compare=False, hash=False)

    def __post_init__(self) -> None:
        for holder, reader, bps in self.pairs:
            if not bps > 0:
                raise ValueError(f"link {holder} -> {reader}: bytes/s must be positive, got {bps}")
            self._by[(holder, reader)] = float(bps)

    def __bool__(self) -> bool:
        return bool(self.pairs)

    def get(self, holder: str, reader: str) -> float | None:
        """Bytes/s of a pull from ``holder`` to ``reader``; None where it was not probed."""
        return self._by.get((holder, reader))

    def slowest(self, holders: Iterable[str], reader: str) -> float | None:
        """The slowest probed link from any of ``holders`` to ``reader`` (a plan pulling from
        several holders is priced at its slowest link); None when none of them was probed."""
        known = [bw for h in holders if h != reader and (bw := self._by.get((h, reader)))]
        return min(known) if known else None

    @classmethod
    def from_probes(cls, per_reader: Mapping[str, Mapping[str, Mapping[str, float]]],
                    transports: Iterable[str] = REMOTE_TRANSPORTS) -> Links:
        """From ``{reader: {holder: {transport: bytes/s}}}`` (each pool's ``per_node``): per
        link the best of ``transports`` measured above 0; a node's own entry is skipped."""
        names = tuple(transports)
        pairs = []
        for reader, peers in sorted(per_reader.items()):
            for holder, figures in sorted(peers.items()):
                best = max((float(figures.get(t, 0.0)) for t in names), default=0.0)
                if holder != reader and best > 0:
                    pairs.append((str(holder), str(reader), best))
        return cls(tuple(pairs))

    def as_dict(self) -> dict[str, dict[str, float]]:
        """``{reader: {holder: bytes/s}}`` (JSON-ready)."""
        out: dict[str, dict[str, float]] = {}
        for holder, reader, bps in self.pairs:
            out.setdefault(reader, {})[holder] = bps
        return out
