"""How big a tier should be: an LRU hit-rate-against-capacity curve, estimated online.

:class:`HitRateCurve` watches the lookups a pool serves and answers "what hit rate would an
LRU tier of ``capacity_bytes`` have had on this stream", for any capacity at once (Mattson's
stack distances: a block hits an LRU cache of C blocks iff fewer than C distinct blocks were
used since its last use). It keeps a bounded spatial sample of the blocks (SHARDS, Waldspurger
et al., FAST'15, fixed-size variant), so its memory does not grow with the working set.

Contract:

- One :meth:`HitRateCurve.lookup` is one request's chain of block hashes, looked up in order
  with prefix semantics, as a pool serves it: the hit prefix at capacity C ends at the first
  block not held, so a block counts as a hit only if every block before it in the chain does
  (its distance is the running maximum of the chain's distances). Distances are taken before
  the lookup touches anything, then the chain is touched tail first, so a prefix ends most
  recent (as :class:`~kvshare.pool.tiered.TieredBlockPool` stamps chains) and every block of the
  chain counts as used, hit or not (the pool stores what it missed).
- ``weights`` says what each block's hit is worth (default 1: block hit rate; the simulator
  passes tokens); ``always_miss`` adds weight that no capacity serves (a prompt's last token).
- :meth:`hit_rate` / :meth:`curve`: the weighted hit rate an LRU tier of that many bytes
  (``capacity_bytes // block_bytes`` blocks) would have had over every lookup so far.

Sampling (stratified SHARDS): a block is tracked iff ``key(hash) < threshold``, ``key`` the
64-bit blake2b of its hash bytes (uniform whatever the hashes look like, the same in every
process); the rate is ``threshold / 2**64``. It starts at ``SizingConfig.sample_rate`` (1.0:
exact) and, once more than ``max_tracked`` blocks are tracked, drops to the largest tracked key,
forgetting that block (fixed-size SHARDS). A block's reuse distance is the number of tracked
blocks used since its last use, over the rate. Plain spatial sampling errs by whether a few hot
blocks (a shared system prompt) happen to be sampled: they carry much of the hit weight. So the
``hot_blocks`` most used blocks (Space-Saving counters over every use, ties broken by age, never
by key) are a census: each of their uses counts with its own weight, sampled or not (their
distance still read off the tracked blocks); every other use counts only if sampled, weighted
by 1/rate. The curve is a ratio estimate: that weighted hit fraction times the share of all
weight that sits in blocks (counted exactly).

Error: at rate 1 the curve equals an exact LRU stack simulation of the same lookups (tests
check it against a brute-force LRU). Sampled, the error is statistical, shrinking as
1/sqrt(sampled blocks) with the hot blocks taken out of it; ``benchmarks/sizing.py`` measures
it against the simulator's exact replay on whole traces (the README's "Sizing tiers" has the
figures: within 0.03 on every shared trace at 25-100% of its working set). The pool is not
quite this stack model: it stamps a request's newly stored blocks above the prefix it read and
does not refresh blocks present after a chain's first miss, so where a tier holds about one
chain it evicts the end of a hit prefix first and serves less than the estimate says (the
README's figures: up to 2x less at 5% of a working set of long agentic chains).

Memory: at most ``max_tracked`` tracked blocks (a dict entry, a heap entry and two slots of a
Fenwick tree of at most ``2 * max_tracked`` timestamps) and ``hot_blocks`` counters, ~280
bytes a tracked block all told (~4.5 MB at the defaults, :meth:`memory_bytes`), plus ``bins``
histogram doubles, whatever the stream's length or working set. Time: one blake2b and one
counter update a block, plus O(log max_tracked) per sampled or hot block; timestamps are
compacted every ~``max_tracked`` sampled uses (amortised O(1)).

Not thread-safe: the owner (the pool, under its lock) serialises calls.
"""

from __future__ import annotations

import heapq
import math
from array import array
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from hashlib import blake2b
from typing import NamedTuple

_KEYS = 1 << 64  # sampling keys are 64-bit
_MIN_TIMESTAMPS = 1024


@dataclass(frozen=True)
class SizingConfig:
    """One estimator's knobs.

    ``block_bytes``: bytes a block takes in the tier (capacities are divided by it).
    ``sample_rate``: the starting share of blocks tracked (1.0: exact until ``max_tracked``).
    ``max_tracked``: the most blocks tracked at once (the memory bound).
    ``hot_blocks``: the most-used blocks (Space-Saving) counted at every use, sampled or not.
    ``bins``: histogram resolution; distances are kept exactly up to ``bins`` blocks, then in
    bins of a power-of-two width that doubles as the largest distance grows.
    """

    block_bytes: int
    sample_rate: float = 1.0
    max_tracked: int = 16384
    hot_blocks: int = 2048
    bins: int = 4096

    def __post_init__(self) -> None:
        if self.block_bytes < 1:
            raise ValueError(f"block_bytes must be >= 1, got {self.block_bytes}")
        if not 0 < self.sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {self.sample_rate}")
        if self.max_tracked < 1:
            raise ValueError(f"max_tracked must be >= 1 block, got {self.max_tracked}")
        if self.hot_blocks < 0:
            raise ValueError(f"hot_blocks must be >= 0, got {self.hot_blocks}")
        if self.bins < 2 or self.bins % 2:
            raise ValueError(f"bins must be an even number >= 2, got {self.bins}")


class CurvePoint(NamedTuple):
    """The estimated hit rate (0..1) of an LRU tier of ``capacity_bytes``."""

    capacity_bytes: int
    hit_rate: float


def sample_key(block_hash: bytes) -> int:
    """The 64-bit sampling key of a block hash (blake2b, so uniform and process-independent)."""
    return int.from_bytes(blake2b(block_hash, digest_size=8).digest(), "little")


class HitRateCurve:
    """Online LRU hit rate against capacity for one stream of lookups (module docstring)."""

    def __init__(self, config: SizingConfig) -> None:
        self.config = config
        self._threshold = min(_KEYS, math.ceil(config.sample_rate * _KEYS))
        self._last: dict[int, int] = {}  # tracked key -> timestamp of its last use
        self._heap: list[int] = []  # -key of every tracked block (largest key on top)
        self._size = _MIN_TIMESTAMPS
        self._tree = array("q", bytes(8 * (self._size + 1)))  # Fenwick over timestamps 1..size
        self._next = 1
        self._hot: dict[int, int] = {}  # Space-Saving: key -> use count of the hot blocks
        self._hot_heap: list[tuple[int, int, int]] = []  # (count, seq, key); stale ones skipped
        self._seq = 0
        self._clock: dict[int, int] = {}  # hot key -> the first timestamp after its last use
        self._bins = array("d", bytes(8 * config.bins))
        self._width = 1  # blocks per histogram bin
        self._cold = 0.0  # sampled weight never seen before (a miss at every capacity)
        self._sampled = 0.0  # sampled weight, each over the rate it was sampled at
        self._block_weight = 0.0  # every block's weight (exact)
        self._total_weight = 0.0  # ... plus always_miss
        self.lookups = 0
        self.blocks = 0

    # ------------------------------------------------------------------ queries
    @property
    def rate(self) -> float:
        """The share of blocks tracked now."""
        return self._threshold / _KEYS

    @property
    def tracked(self) -> int:
        return len(self._last)

    def hit_rate(self, capacity_bytes: int) -> float:
        """Estimated weighted hit rate of an LRU tier of ``capacity_bytes`` over every lookup."""
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        if self._sampled <= 0 or self._total_weight <= 0:
            return 0.0
        c = capacity_bytes // self.config.block_bytes  # blocks the tier holds
        w = self._width
        full = min(c // w, len(self._bins))
        hit = sum(self._bins[:full])
        if full < len(self._bins):
            hit += self._bins[full] * (c - full * w) / w
        return hit / self._sampled * (self._block_weight / self._total_weight)

    def curve(self, capacities: Sequence[int]) -> list[CurvePoint]:
        """:meth:`hit_rate` at each of ``capacities`` (bytes)."""
        return [CurvePoint(int(c), self.hit_rate(int(c))) for c in capacities]

    def memory_bytes(self) -> int:
        """Bytes this estimator holds (containers and the ints in them, not the class)."""
        import sys

        n = len(self._last)
        ints = sum(sys.getsizeof(k) + sys.getsizeof(t) for k, t in self._last.items())
        hot = sum(sys.getsizeof(k) + sys.getsizeof(c) for k, c in self._hot.items())
        hot += sum(sys.getsizeof(e) + sys.getsizeof(e[1]) for e in self._hot_heap)
        clocks = sum(sys.getsizeof(c) for c in self._clock.values())
        return (sys.getsizeof(self._last) + sys.getsizeof(self._heap) + ints
                + n * sys.getsizeof(-1 << 63)  # the heap's negated keys
                + sys.getsizeof(self._tree) + sys.getsizeof(self._bins)
                + sys.getsizeof(self._hot) + sys.getsizeof(self._hot_heap) + hot
                + sys.getsizeof(self._clock) + clocks)

    # ------------------------------------------------------------------ updates
    def lookup(
        self, hashes: Sequence[bytes], weights: Sequence[float] | None = None,
        always_miss: float = 0.0,
    ) -> None:
        """Account one lookup of the chain ``hashes`` (in order, prefix semantics)."""
        n = len(hashes)
        if weights is not None and len(weights) != n:
            raise ValueError(f"{len(weights)} weights for {n} hashes: pass one weight a block")
        if always_miss < 0:
            raise ValueError(f"always_miss must be >= 0, got {always_miss}")
        bw = float(sum(weights)) if weights is not None else float(n)
        self._block_weight += bw
        self._total_weight += bw + always_miss
        self.lookups += 1
        self.blocks += n
        threshold = self._threshold
        keys = [int.from_bytes(blake2b(h, digest_size=8).digest(), "little") for h in hashes]
        hot = self._hot
        seen: list[tuple[int, int, bool, bool]] = []  # (position, key, sampled, census)
        for j, k in enumerate(keys):
            census = k in hot  # a hot block before this use: counted whether sampled or not
            self._count(k)
            if census or k < threshold:
                seen.append((j, k, k < threshold, census))
        scale = _KEYS / threshold  # 1 / rate
        live = len(self._last)
        last, clocks = self._last, self._clock
        run = 0.0  # running maximum: the prefix hits at C only if every block before does
        for j, k, sampled, census in seen:
            t = last.get(k) if sampled else None
            if t is not None:
                d = (live - self._prefix(t)) * scale
            else:
                c = clocks.get(k) if census else None
                d = math.inf if c is None else (live - self._prefix(c - 1)) * scale
            if d > run:
                run = d
            w = weights[j] if weights is not None else 1.0
            self._record(run, w if census else w * scale)
        for k in reversed(keys):  # tail first: the chain's first block ends most recent
            if k < threshold:
                self._touch(k)
            if k in hot:
                clocks[k] = self._next  # what is used from now on has a timestamp >= this
        self._shrink()

    # ------------------------------------------------------------------ internals
    def _record(self, distance: float, weight: float) -> None:
        self._sampled += weight
        if distance == math.inf:
            self._cold += weight
            return
        i = int(distance // self._width)
        while i >= len(self._bins):
            self._coarsen()
            i = int(distance // self._width)
        self._bins[i] += weight

    def _coarsen(self) -> None:
        """Double the bin width: bin i takes old bins 2i and 2i+1."""
        b = self._bins
        half = len(b) // 2
        merged = array("d", (b[2 * i] + b[2 * i + 1] for i in range(half)))
        merged.extend(array("d", bytes(8 * half)))
        self._bins = merged
        self._width *= 2

    def _touch(self, key: int) -> None:
        old = self._last.pop(key, None)
        if old is None:
            heapq.heappush(self._heap, -key)
        else:
            self._add(old, -1)
        if self._next > self._size:
            self._compact()
        t = self._next
        self._next += 1
        self._last[key] = t
        self._add(t, 1)

    def _count(self, key: int) -> None:
        """Space-Saving over ``hot_blocks`` counters: a new key takes the least-counted slot.

        Ties go to the least recently counted, never by key: membership must not depend on
        the sampling key, or the census and the sample would count the same uses twice.
        """
        if not self.config.hot_blocks:
            return
        hot, heap = self._hot, self._hot_heap
        c = hot.get(key)
        if c is None:
            c = 0
            if len(hot) >= self.config.hot_blocks:
                while True:  # the least count still current
                    c, _, old = heapq.heappop(heap)
                    if hot.get(old) == c:
                        break
                del hot[old]
                self._clock.pop(old, None)
        hot[key] = c + 1
        self._seq += 1
        heapq.heappush(heap, (c + 1, self._seq, key))
        if len(heap) > 4 * len(hot) + 64:  # drop the stale entries
            live = {k: (n, q) for n, q, k in heap if hot.get(k) == n}
            self._hot_heap = [(n, q, k) for k, (n, q) in live.items()]
            heapq.heapify(self._hot_heap)

    def _shrink(self) -> None:
        """Fixed-size SHARDS: past ``max_tracked``, lower the threshold to the largest key."""
        while len(self._last) > self.config.max_tracked:
            key = -heapq.heappop(self._heap)
            self._add(self._last.pop(key), -1)
            self._threshold = max(1, key)

    def _compact(self) -> None:
        """Renumber the tracked blocks' timestamps 1..n in order and rebuild the tree."""
        order = sorted(self._last, key=self._last.__getitem__)
        olds = [self._last[k] for k in order]
        for k, c in self._clock.items():  # blocks tracked with an old timestamp < c come first
            self._clock[k] = bisect_left(olds, c) + 1
        self._size = max(_MIN_TIMESTAMPS, 2 * len(order))
        tree = array("q", bytes(8 * (self._size + 1)))
        for t, key in enumerate(order, 1):
            self._last[key] = t
            tree[t] = 1
        for i in range(1, self._size + 1):  # linear Fenwick build
            j = i + (i & -i)
            if j <= self._size:
                tree[j] += tree[i]
        self._tree = tree
        self._next = len(order) + 1

    def _add(self, i: int, delta: int) -> None:
        tree, n = self._tree, self._size
        while i <= n:
            tree[i] += delta
            i += i & -i

    def _prefix(self, i: int) -> int:
        tree = self._tree
        s = 0
        while i > 0:
            s += tree[i]
            i -= i & -i
        return s
