"""PendingBlocks: the router's blocks-about-to-exist. Its holder maps are shared between
blocks and copied on write, and kept per namespace keyed by the hash alone; this checks that
it answers, holds and evicts exactly as the first version did (one map of ``(namespace, hash)``
keys, holder maps updated in place: kept here as the reference) on random
add/expire/evict sequences over two namespaces."""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import Any

from kvshare.router.core.pending import PendingBlocks
from kvshare.types import BlockHash, Location, Tier


class InPlace(PendingBlocks):
    """The first version, kept as the reference: one ordered map keyed by ``(namespace,
    hash)`` for every namespace, every block its own holder map, updated in place."""

    def __init__(self, ttl_s: float, clock: Callable[[], float], max_entries: int) -> None:
        super().__init__(ttl_s, clock, max_entries)
        self._entries: OrderedDict[tuple[str, BlockHash], dict[Location, tuple[Tier, float]]] = (
            OrderedDict())

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, namespace: str, location: Location, hashes: Sequence[BlockHash],
            tier: Tier = Tier.GPU) -> None:
        now = self._clock()
        self._expire(now)
        value = (tier, now + self.ttl_s)
        for key in zip(repeat(namespace), hashes):
            holders = self._entries.get(key)
            if holders is None:
                self._entries[key] = {location: value}
            else:
                self._entries.move_to_end(key)
                holders[location] = value
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)

    def _live_runs(self, namespace: str, hashes: Sequence[BlockHash]) -> tuple[int, list[list[Any]]]:
        if not self._entries:
            return 0, []
        now = self._clock()
        self._expire(now)
        runs: list[list[Any]] = []
        prev: dict[Location, tuple[Tier, float]] | None = None
        k = 0
        for pending in map(self._entries.get, zip(repeat(namespace), hashes)):
            if not pending:
                break
            if pending is not prev and pending != prev:
                live = tuple([(loc, t) for loc, (t, expiry) in pending.items() if expiry > now])
                if not live:
                    break
                prev = pending
                if runs and runs[-1][2] == live:
                    runs[-1][1] = k + 1
                else:
                    runs.append([k, k + 1, live])
            else:
                runs[-1][1] = k + 1
            k += 1
        return k, runs

    def _expire(self, now: float) -> None:
        while self._entries:
            key, holders = next(iter(self._entries.items()))
            live = {loc: v for loc, v in holders.items() if v[1] > now}
            if live:
                if len(live) != len(holders):
                    self._entries[key] = live
                return
            del self._entries[key]


def test_shared_holder_maps_answer_as_the_in_place_ones() -> None:
    rng = random.Random(13)
    for trial in range(40):
        now = [0.0]

        def clock(now: list[float] = now) -> float:
            return now[0]

        cap = rng.choice((12, 40, 1000))
        names = "a" if trial % 2 else "ab"  # one namespace (its own path) or two
        fast, ref = PendingBlocks(5.0, clock, cap), InPlace(5.0, clock, cap)
        pool = [BlockHash(bytes([trial, i]) * 16) for i in range(30)]
        locs = [Location(f"worker:w{i}") for i in range(5)]
        for _ in range(120):
            now[0] += rng.choice((0.0, 0.01, 0.5, 2.0, 6.0))
            start = rng.randrange(len(pool))
            hashes = pool[start:start + rng.randrange(1, 12)]
            if rng.random() < 0.3:  # a prompt that diverges after a shared prefix
                hashes = hashes[:3] + rng.sample(pool, 4)
            ns, loc, tier = rng.choice(names), rng.choice(locs), rng.choice((Tier.GPU, Tier.HOST))
            fast.add(ns, loc, hashes, tier)
            ref.add(ns, loc, hashes, tier)
            for _ in range(3):
                q = pool[rng.randrange(len(pool)):][:rng.randrange(1, 16)]
                qns = rng.choice("ab")
                assert fast.match_runs(qns, q) == ref.match_runs(qns, q)
                assert fast.match(qns, q) == ref.match(qns, q)
            assert len(fast) == len(ref)
