"""Pool events: what the index learns about blocks coming and going.

Events are small frozen structs drained from a pool with ``take_events()``. On the wire
(pool actor -> index actor) a batch is one Arrow record batch with a ``FixedSizeBinary``
hash column, so Ray moves it without pickling per item.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import IntEnum

import pyarrow as pa

from kvshare.types import BlockHash, Location, Tier


class EventKind(IntEnum):
    STORED = 0
    REMOVED = 1
    CLEARED = 2


@dataclass(frozen=True, slots=True)
class _BlockEvent:
    namespace: str
    location: Location
    tier: Tier
    block_hash: BlockHash
    generation: int
    seq: int


@dataclass(frozen=True, slots=True)
class BlockStored(_BlockEvent):
    """``block_hash`` is now readable from ``tier`` at ``location``."""


@dataclass(frozen=True, slots=True)
class BlockRemoved(_BlockEvent):
    """``block_hash`` is no longer in ``tier`` at ``location``."""


@dataclass(frozen=True, slots=True)
class AllCleared:
    """Every block of ``namespace`` at ``location`` is gone."""

    namespace: str
    location: Location
    generation: int
    seq: int


Event = BlockStored | BlockRemoved | AllCleared

_TIERS = [t.value for t in Tier]


def event_schema(hash_size: int = 32) -> pa.Schema:
    return pa.schema(
        [
            ("kind", pa.int8()),
            ("namespace", pa.string()),
            ("location", pa.string()),
            ("tier", pa.string()),
            ("hash", pa.binary(hash_size)),
            ("generation", pa.int64()),
            ("seq", pa.int64()),
        ]
    )


def events_to_arrow(events: Iterable[Event], hash_size: int = 32) -> pa.RecordBatch:
    """Pack events into one record batch (columnar; AllCleared rows carry a zero hash)."""
    kinds: list[int] = []
    namespaces: list[str] = []
    locations: list[str] = []
    tiers: list[str] = []
    hashes: list[bytes] = []
    gens: list[int] = []
    seqs: list[int] = []
    zero = bytes(hash_size)
    for ev in events:
        namespaces.append(ev.namespace)
        locations.append(ev.location)
        gens.append(ev.generation)
        seqs.append(ev.seq)
        if isinstance(ev, AllCleared):
            kinds.append(EventKind.CLEARED)
            tiers.append("")
            hashes.append(zero)
        else:
            kinds.append(EventKind.STORED if isinstance(ev, BlockStored) else EventKind.REMOVED)
            tiers.append(ev.tier.value)
            hashes.append(ev.block_hash)
    return pa.RecordBatch.from_arrays(
        [
            pa.array(kinds, pa.int8()),
            pa.array(namespaces, pa.string()),
            pa.array(locations, pa.string()),
            pa.array(tiers, pa.string()),
            pa.array(hashes, pa.binary(hash_size)),
            pa.array(gens, pa.int64()),
            pa.array(seqs, pa.int64()),
        ],
        schema=event_schema(hash_size),
    )


def events_from_arrow(batch: pa.RecordBatch) -> list[Event]:
    """Inverse of :func:`events_to_arrow`; ValueError on an unknown kind or tier."""
    cols = batch.to_pydict()
    out: list[Event] = []
    for kind, ns, loc, tier, h, gen, seq in zip(
        cols["kind"], cols["namespace"], cols["location"], cols["tier"], cols["hash"],
        cols["generation"], cols["seq"], strict=True,
    ):
        if kind == EventKind.CLEARED:
            out.append(AllCleared(ns, Location(loc), gen, seq))
        elif kind in (EventKind.STORED, EventKind.REMOVED):
            if tier not in _TIERS:
                raise ValueError(f"event batch has unknown tier {tier!r}")
            cls = BlockStored if kind == EventKind.STORED else BlockRemoved
            out.append(cls(ns, Location(loc), Tier(tier), BlockHash(h), gen, seq))
        else:
            raise ValueError(f"event batch has unknown event kind {kind!r}")
    return out
