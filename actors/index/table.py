"""BlockTable: one namespace's ``hash -> holder state`` map.

Storage only: no generations, sequence numbers or workers (``GlobalIndex`` applies those
rules and calls in here). Holder states are interned ints shared across namespaces
(:class:`~kvshare.actors.index.holders.HolderStates`); the map itself is a
:class:`~kvshare.statemap.StateMap` (a C hash table where built): a hash whose last holder goes
is deleted, so a lookup that finds nothing returns ``EMPTY``. There is no reverse map:
dropping a location rewrites every state that names it in one pass over the table (rare: a
pool or worker died or restarted), which keeps stores to one table write per hash.

When :attr:`feed` is a list, every change is also appended to it as a *delta* that names
locations by name and hashes packed in one bytes (see :mod:`kvshare.actors.index.feed`): what a
router-side replica applies to stay equal to this table.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from kvshare.actors.index.holders import HolderStates
from kvshare.actors.index.runs import Runs
from kvshare.statemap import make_state_map
from kvshare.types import BlockHash, Location, Tier

Delta = tuple[Any, ...]
"""``(op, namespace, location, tier code, packed hashes)``; op ``S`` store, ``R`` remove,
``D`` drop (tier code -1: every tier)."""


class BlockTable:
    """Blocks of one namespace: hash -> interned holder state."""

    def __init__(self, name: str, hash_size: int, layout_fingerprint: str,
                 states: HolderStates, *, native: bool = True) -> None:
        self.name = name
        self.hash_size = hash_size
        self.layout_fingerprint = layout_fingerprint
        self.map = make_state_map(hash_size, native)
        self.feed: list[Delta] | None = None
        self._s = states

    def __len__(self) -> int:
        return len(self.map)

    # ------------------------------------------------------------------ updates
    def store_many(self, lid: int, tier: int, hashes: list[bytes] | bytes | memoryview) -> None:
        """Store hashes (a list, or one buffer of packed hashes) at one location and tier."""
        add = self._s.add
        self.map.update(hashes, lambda s: add(s, lid, tier))
        if self.feed is not None:
            blob = b"".join(hashes) if isinstance(hashes, list) else bytes(hashes)
            self.feed.append(("S", self.name, self._s.loc_names[lid], tier, blob))

    def store(self, lid: int, tier: int, h: bytes) -> None:
        self.store_many(lid, tier, [h])

    def remove(self, lid: int, tier: int, h: bytes) -> None:
        """Drop ``lid`` as holder of ``h`` if its recorded tier is ``tier`` (else no-op)."""
        remove = self._s.remove
        if self.map.update([h], lambda s: remove(s, lid, tier)) and self.feed is not None:
            self.feed.append(("R", self.name, self._s.loc_names[lid], tier, h))

    def drop(self, lid: int) -> int:
        """Forget every block of one location; returns how many."""
        drop = self._s.drop
        if self.feed is None:
            n: int = self.map.transform_all(lambda s: drop(s, lid))
            return n
        n, keys = self.map.transform_all(lambda s: drop(s, lid), True)
        if n:
            self.feed.append(("D", self.name, self._s.loc_names[lid], -1, keys))
        return n

    def drop_keys(self, lid: int, hashes: bytes) -> int:
        """Forget ``lid`` as holder of the packed ``hashes`` (a replica applying a drop)."""
        drop = self._s.drop
        n: int = self.map.update(hashes, lambda s: drop(s, lid))
        return n

    # ------------------------------------------------------------------ reads
    def check(self, hashes: Sequence[BlockHash]) -> None:
        """ValueError unless ``hashes`` is a list of ``hash_size``-byte bytes."""
        if isinstance(hashes, bytes | str) or not isinstance(hashes, Sequence):
            raise ValueError("hashes must be a list of block hashes (bytes), not one value")
        self._states(hashes)

    def lookup(self, hashes: Sequence[BlockHash]) -> list[dict[Location, Tier]]:
        as_map = self._s.as_map
        return [dict(as_map(s)) for s in self._states(hashes)]

    def _states(self, hashes: Sequence[BlockHash]) -> list[int]:
        try:
            return self.map.states(hashes if isinstance(hashes, list) else list(hashes))
        except ValueError as exc:
            raise ValueError(f"namespace {self.name!r}: {exc}") from None

    def match_runs(self, hashes: Sequence[BlockHash] | bytes) -> tuple[int, Runs]:
        """``(num_blocks, runs)`` of the combined prefix (see :mod:`kvshare.actors.index.runs`);
        ``hashes`` may also be one bytes object of packed hashes (a wire query)."""
        if type(hashes) is list:  # (the common case first)
            n = len(hashes)
        elif isinstance(hashes, bytes):
            n = len(hashes) // self.hash_size
        elif isinstance(hashes, list):
            n = len(hashes)
        elif isinstance(hashes, Sequence) and not isinstance(hashes, str):
            hashes = list(hashes)  # type: ignore[arg-type]
            n = len(hashes)
        else:
            raise ValueError("hashes must be a list of block hashes (bytes), not one value")
        try:
            runs = self.map.prefix_runs(hashes)
        except ValueError as exc:
            raise ValueError(f"namespace {self.name!r}: {exc}") from None
        named = self._s.named
        return n, [(named(s), k) for s, k in runs]

    def check_packed(self, blob: bytes, hash_len: int) -> bytes:
        """``blob`` if it holds ``hash_size``-byte hashes; ValueError otherwise."""
        if not isinstance(blob, bytes) or (blob and hash_len != self.hash_size) or (
            hash_len <= 0 or len(blob) % hash_len
        ):
            raise ValueError(
                f"block hashes of namespace {self.name!r} must be {self.hash_size}-byte bytes; "
                f"got {hash_len}-byte hashes"
            )
        return blob

    def entries(self) -> Iterator[tuple[bytes, int, int]]:
        """``(hash, location id, tier code)`` of every holding."""
        items = self._s.items
        for h, s in self.map.items():
            for lid, code in items[s]:
                yield h, lid, code

    def store_deltas(self, loc_names: Sequence[str]) -> list[Delta]:
        """Every holding as store deltas, one per (location, tier) (a replica's snapshot)."""
        groups: dict[tuple[int, int], list[bytes]] = {}
        for h, lid, code in self.entries():
            groups.setdefault((lid, code), []).append(h)
        return [("S", self.name, loc_names[lid], code, b"".join(hs))
                for (lid, code), hs in groups.items()]

    def block_counts(self) -> dict[int, int]:
        """Blocks per location id."""
        out: dict[int, int] = {}
        items = self._s.items
        for s, n in self.map.state_counts().items():
            for lid, _ in items[s]:
                out[lid] = out.get(lid, 0) + n
        return out
