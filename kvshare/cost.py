"""The transfer-vs-recompute cost model (DESIGN.md, "The cost model"); shared by the router and the worker SDK.

Engines load a contiguous prefix, so a plan is one cut point ``k`` (in blocks)::

    total(k) = sum_{i<k} fetch_i + prefill(P - c_k | c_k)        c_k = min(k * B, P - 1)
    prefill(n | c) = a*n + b*n*(c + n/2)                          (seconds)

``fetch_i`` depends on where block ``i`` is cheapest to get from, for this worker: its own
gpu tier (free), its node's host or disk tier, or another node (the network). ``a`` (s/token)
and ``b`` (s/token^2, the attention term) are fitted from measured timings
(:meth:`PrefillModel.fit`); bandwidths come from the transports' measurements
(:meth:`Bandwidths.from_measured`). A full hit still computes the last token.

The router adds the worker's queue wait; the worker uses the same plan to pick its cut.
Because ``k`` minimises the total exactly, a remote block is used only when pulling it (and
everything before it) beats recomputing it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import IntEnum
from itertools import groupby

import numpy as np

from kvshare.layout import KVLayout
from kvshare.links import Links
from kvshare.quick_init import quick_init
from kvshare.types import Tier


class Source(IntEnum):
    """Where a worker would get one block from, cheapest first."""

    LOCAL_GPU = 0
    LOCAL_HOST = 1
    LOCAL_DISK = 2
    REMOTE_GPU = 3
    REMOTE_HOST = 4
    REMOTE_DISK = 5

    @property
    def remote(self) -> bool:
        return self >= Source.REMOTE_GPU

    @classmethod
    def of(cls, tier: Tier, remote: bool) -> Source:
        """The source of a block in ``tier`` of this node (``remote=False``) or another one."""
        return cls(tier.rank + (REMOTE_OFFSET if remote else 0))


REMOTE_OFFSET = int(Source.REMOTE_GPU)
"""A tier's code (:attr:`Tier.rank`) plus this is its remote :class:`Source`; plus 0 its local one."""


_SOURCES = tuple(Source)
_FLAT = 1e-12
"""Slopes and curvatures below this fraction of a plan's cost scale count as flat
(:meth:`CostModel.plan_runs` then computes every cut; rounding is ~1e-15 of it)."""


def source_runs(sources: Sequence[int]) -> list[tuple[int, int]]:
    """Per-block sources as runs ``(source, count)`` of equal consecutive sources."""
    return [(int(src), len(list(group))) for src, group in groupby(sources)]


@dataclass(frozen=True)
class PrefillModel:
    """Prefill time ``a*n + b*n*(c + n/2)`` for ``n`` new tokens after ``c`` cached ones."""

    a: float
    b: float = 0.0

    def __post_init__(self) -> None:
        if not (self.a > 0 and math.isfinite(self.a)) or not (self.b >= 0 and math.isfinite(self.b)):
            raise ValueError(
                f"PrefillModel needs a > 0 s/token and b >= 0, got a={self.a}, b={self.b}"
            )

    def time(self, n: float, c: float = 0.0) -> float:
        """Seconds to prefill ``n`` tokens on top of ``c`` cached tokens."""
        return self.a * n + self.b * n * (c + n / 2)

    @property
    def tokens_per_s(self) -> float:
        """Linear-term throughput (short prompts)."""
        return 1.0 / self.a

    @classmethod
    def from_tokens_per_s(cls, tokens_per_s: float) -> PrefillModel:
        if tokens_per_s <= 0:
            raise ValueError(f"tokens_per_s must be positive, got {tokens_per_s}")
        return cls(1.0 / tokens_per_s, 0.0)

    @classmethod
    def fit(cls, samples: Sequence[tuple[float, float, float]]) -> PrefillModel:
        """Least-squares fit from ``(new_tokens, cached_tokens, seconds)`` timings.

        Needs at least two samples with ``new_tokens > 0``. If the attention term comes out
        negative (noise on short prompts) it is dropped and ``a`` is refitted alone.
        """
        rows = [(float(n), float(c), float(t)) for n, c, t in samples if n > 0 and t > 0]
        if len(rows) < 2:
            raise ValueError(
                "PrefillModel.fit needs at least 2 timings (new_tokens > 0, seconds > 0); "
                f"got {len(rows)} usable of {len(samples)}"
            )
        arr = np.asarray(rows)
        n, c, t = arr[:, 0], arr[:, 1], arr[:, 2]
        x = np.stack([n, n * (c + n / 2)], axis=1)
        coef, *_ = np.linalg.lstsq(x, t, rcond=None)
        a, b = float(coef[0]), float(coef[1])
        if b < 0 or a <= 0:
            b = 0.0
            a = float(np.dot(n, t) / np.dot(n, n))
        return cls(max(a, 1e-12), b)


GB = 1e9
"""Bytes in a GB. Bandwidths are bytes/s everywhere in kvshare; GB/s only where a person reads
or writes them (command lines, ``KVSHARE_BANDWIDTH_GBPS``, pages, logs)."""


class PrefillTimings:
    """Measured prefill timings ``(new_tokens, cached_tokens, seconds)``, the last
    ``max_samples`` of them, refitted into a :class:`PrefillModel` every ``refit_every``.
    Not thread-safe (callers that share one hold their own lock)."""

    def __init__(self, refit_every: int, max_samples: int = 512,
                 samples: Sequence[tuple[float, float, float]] = ()) -> None:
        if refit_every < 1 or max_samples < 2:
            raise ValueError("refit_every must be >= 1 and max_samples >= 2")
        self.refit_every = refit_every
        self.max_samples = max_samples
        self.samples: list[tuple[float, float, float]] = list(samples)[-max_samples:]
        self.seen = 0

    def add(self, new_tokens: int, cached_tokens: int, seconds: float) -> PrefillModel | None:
        """Record one timing (ignored unless ``new_tokens`` and ``seconds`` are positive);
        the refitted model when this sample completes a round of ``refit_every``, else None."""
        if new_tokens <= 0 or seconds <= 0:
            return None
        self.samples.append((float(new_tokens), float(cached_tokens), float(seconds)))
        del self.samples[:-self.max_samples]
        self.seen += 1
        if self.seen % self.refit_every or len(self.samples) < 2:
            return None
        return PrefillModel.fit(self.samples)


@dataclass(frozen=True)
class Bandwidths:
    """Bytes per second per source, plus a fixed per-request setup latency per kind.

    ``host``: the node's shared-memory slab to the worker (shm + host-to-device copy);
    ``disk``: the node's slot files; ``remote``: between nodes (nixl, or objstore as fallback).
    A remote block on a remote disk goes at ``min(disk, remote)``. ``links``: per probed link
    (holder node -> reader node) its own bytes/s (:meth:`for_pull`); ``remote`` prices the
    links nobody probed.
    """

    host: float = 25e9
    disk: float = 5e9
    remote: float = 12.5e9
    local_latency_s: float = 0.0
    remote_latency_s: float = 0.001
    links: Links = Links()

    def __post_init__(self) -> None:
        for name in ("host", "disk", "remote"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Bandwidths.{name} must be positive bytes/s")

    @classmethod
    def from_measured(cls, measured: Mapping[str, float], base: Bandwidths | None = None) -> Bandwidths:
        """Override defaults with measured bytes/s keyed by transport or tier.

        Keys: ``shm`` or ``host``; ``disk``; ``nixl``, ``objstore`` or ``remote`` (the best
        remote transport wins). Unknown keys raise ValueError.
        """
        base = base or cls()
        known = {"shm", "host", "disk", "nixl", "objstore", "remote"}
        bad = set(measured) - known
        if bad:
            raise ValueError(f"unknown bandwidth keys {sorted(bad)}: use {sorted(known)}")
        host = measured.get("shm", measured.get("host", base.host))
        remote_vals = [measured[k] for k in ("nixl", "objstore", "remote") if k in measured]
        remote = max(remote_vals) if remote_vals else base.remote
        return cls(host, measured.get("disk", base.disk), remote, base.local_latency_s,
                   base.remote_latency_s, base.links)

    def for_pull(self, holders: Iterable[str], reader: str) -> Bandwidths:
        """These bandwidths for a reader on node ``reader`` pulling from ``holders``: ``remote``
        is the slowest probed link among them (unchanged where none was probed)."""
        bw = self.links.slowest(holders, reader) if self.links else None
        return self if bw is None or bw == self.remote else replace(self, remote=bw)

    def per_block_s(self, block_bytes: int) -> tuple[float, ...]:
        """Seconds to fetch one block from each :class:`Source`, in enum order."""
        return (
            0.0,
            block_bytes / self.host,
            block_bytes / self.disk,
            block_bytes / self.remote,
            block_bytes / self.remote,
            block_bytes / min(self.disk, self.remote),
        )


@quick_init
@dataclass(frozen=True)
class CutPlan:
    """A chosen cut point and its estimated cost."""

    cut: int
    cached_tokens: int
    fetch_s: float
    prefill_s: float
    sources: Mapping[Source, int] = field(default_factory=dict)

    @property
    def total_s(self) -> float:
        return self.fetch_s + self.prefill_s

    @functools.cached_property
    def remote_blocks(self) -> int:
        """Blocks the plan fetches from other nodes (:attr:`Source.remote` sources)."""
        return sum([v for s, v in self.sources.items() if s >= REMOTE_OFFSET])


Windows = tuple[tuple[int, int], ...]
"""Sliding-window KV-cache groups as ``(window blocks, bytes per token)`` each
(:meth:`kvshare.layout.KVLayout.fetch_terms`)."""


@dataclass(frozen=True)
class CostModel:
    """Prefill model + bandwidths + block geometry: plans one request on one worker.

    ``bytes_per_token`` is what every fetched block moves per token: the whole KV of an MHA or
    MLA layout (MLA's latent), a sliding-window layout's full-attention layers. Each of
    ``windows`` adds its bytes for the last ``min(k, window blocks)`` blocks of a cut at ``k``
    only (a hit needs no sliding-window KV behind the window), at those blocks' sources.
    :meth:`for_layout` takes both from a :class:`~kvshare.layout.KVLayout`.
    """

    prefill: PrefillModel
    bandwidths: Bandwidths
    block_tokens: int
    bytes_per_token: int
    windows: Windows = ()
    block_fetch_s: tuple[float, ...] = field(init=False, repr=False, compare=False)
    """Seconds per block from each :class:`Source` (index by the enum); derived."""
    window_fetch_s: tuple[tuple[int, tuple[float, ...]], ...] = field(
        init=False, repr=False, compare=False)
    """Per window: its blocks and seconds per block from each :class:`Source`; derived."""
    _pulls: dict[float, CostModel] = field(default_factory=dict, init=False, repr=False,
                                           compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.block_tokens <= 0 or self.bytes_per_token < 0 or (
                self.bytes_per_token == 0 and not self.windows):
            raise ValueError("CostModel needs positive block_tokens and bytes_per_token")
        if any(wb < 0 or bpt <= 0 for wb, bpt in self.windows):
            raise ValueError(f"CostModel windows are (blocks >= 0, bytes_per_token > 0), got "
                             f"{self.windows}")
        fetch = self.bandwidths.per_block_s(self.block_tokens * self.bytes_per_token)
        object.__setattr__(self, "block_fetch_s", fetch)
        object.__setattr__(self, "window_fetch_s", tuple(
            (wb, self.bandwidths.per_block_s(self.block_tokens * bpt))
            for wb, bpt in self.windows if wb))

    @classmethod
    def for_layout(cls, prefill: PrefillModel, bandwidths: Bandwidths,
                   layout: KVLayout) -> CostModel:
        """The model of ``layout``'s blocks: what a hit on them moves, per attention kind."""
        every, windows = layout.fetch_terms()
        return cls(prefill, bandwidths, layout.block_tokens, every, windows)

    @property
    def block_bytes(self) -> int:
        return self.block_tokens * self.bytes_per_token

    def for_pull(self, holders: Iterable[str], reader: str) -> CostModel:
        """This model for a reader on node ``reader`` pulling from ``holders``: remote blocks
        priced at the slowest probed link among them (:meth:`Bandwidths.for_pull`); ``self``
        where no link is known. Kept per figure, so a router asks for it per candidate."""
        bw = self.bandwidths.for_pull(holders, reader)
        if bw is self.bandwidths:
            return self
        got = self._pulls.get(bw.remote)
        if got is None:
            if len(self._pulls) >= 64:
                self._pulls.clear()
            got = self._pulls[bw.remote] = replace(self, bandwidths=bw)
        return got

    def cached_tokens(self, blocks: int, total_tokens: int) -> int:
        """Tokens covered by ``blocks`` cached blocks (the last token is always computed)."""
        return max(0, min(blocks * self.block_tokens, total_tokens - 1))

    def plan(self, total_tokens: int, sources: Sequence[int]) -> CutPlan:
        """Best cut point given the cheapest :class:`Source` of each leading block."""
        return self.plan_runs(total_tokens, source_runs(sources))

    def plan_runs(self, total_tokens: int, runs: Sequence[tuple[int, int]]) -> CutPlan:
        """:meth:`plan` of sources given as runs ``(source, count)`` in block order (the same
        plan, computed block by block with the same arithmetic; runs only hoist per-source
        work and make equal views cheap to compare)."""
        if total_tokens <= 0:
            raise ValueError(f"total_tokens must be positive, got {total_tokens}")
        bw = self.bandwidths
        scan_args = (self.block_fetch_s, self.prefill.a, self.prefill.b, self.block_tokens,
                     total_tokens, bw.remote_latency_s, bw.local_latency_s, runs)
        if self.window_fetch_s:
            best_k, best_total, best_fetch = _scan_windows(self.window_fetch_s, *scan_args)
        else:
            best_k, best_total, best_fetch = _scan(*scan_args)
        counts: dict[Source, int] = {}
        left = best_k
        for src, ln in runs:
            if left <= 0:
                break
            take = ln if ln < left else left
            if take > 0:
                key = _SOURCES[src]
                counts[key] = counts.get(key, 0) + take
                left -= take
        cached = self.cached_tokens(best_k, total_tokens)
        return CutPlan(best_k, cached, best_fetch, best_total - best_fetch, counts)

    def recompute_s(self, total_tokens: int) -> float:
        """Prefill time with nothing cached."""
        return self.prefill.time(total_tokens, 0)


def _scan(fetch: Sequence[float], a: float, b: float, bt: int, p: int, lat_r: float,
          lat_l: float, runs: Sequence[tuple[int, int]]) -> tuple[int, float, float]:
    """The cut-point scan of :meth:`CostModel.plan_runs`: the best cut (blocks), its total and
    its fetch seconds."""
    last = p - 1
    best_k, best_total, best_fetch = 0, a * p + b * p * p / 2, 0.0
    cum = lat = 0.0
    any_r = any_l = False
    i = 0
    # Within a run (one fetch cost per block) the total over cuts at c = i * bt tokens is
    # cum + lat + a*(p - c) + b*(p*p - c*c)/2: linear (b = 0) or concave in i, so no cut
    # strictly inside the run's uncapped part beats both its ends, by more than rounding
    # whenever the slope or the curvature is well above it (_FLAT of the totals' scale);
    # then only the ends are computed (the cumulated fetch still adds up block by block,
    # so every total is the same float as computing all of them).
    flat = _FLAT * (best_total + lat_r + lat_l + max(fetch) * (p // bt + 1))
    curved = b * bt * bt > flat
    for src, ln in runs:
        f = fetch[src]
        if src >= 3:
            if not any_r:
                any_r, lat = True, lat + lat_r
        elif src and not any_l:
            any_l, lat = True, lat + lat_l
        first = i + 1
        end = first + ln - 1
        ends_only = curved or abs(f - a * bt) > flat
        for i in range(first, end + 1):  # hot loop: plain floats and ints only
            cum += f
            if ends_only and first < i < end and (i + 1) * bt <= last:
                continue  # inside the run, the next cut uncapped too: cannot win
            c = i * bt
            if c > last:
                c = last
            n = p - c
            total = cum + lat + a * n + b * n * (c + n / 2)
            if total <= best_total:
                best_k, best_total, best_fetch = i, total, cum + lat
            if c >= last:
                break
        else:
            continue
        break
    return best_k, best_total, best_fetch


def _scan_windows(windows: Sequence[tuple[int, Sequence[float]]], fetch: Sequence[float],
                  a: float, b: float, bt: int, p: int, lat_r: float, lat_l: float,
                  runs: Sequence[tuple[int, int]]) -> tuple[int, float, float]:
    """:func:`_scan` of a layout with sliding-window groups, block by block: a cut at ``k``
    fetches every block's ``fetch`` and, per window of ``w`` blocks, that window's seconds for
    blocks ``k - w .. k - 1`` only (a running sum over each window)."""
    last = p - 1
    best_k, best_total, best_fetch = 0, a * p + b * p * p / 2, 0.0
    srcs = [src for src, ln in runs for _ in range(ln)][: last // bt + 1]
    sums = [0.0] * len(windows)
    cum = lat = 0.0
    any_r = any_l = False
    for i, src in enumerate(srcs, 1):
        cum += fetch[src]
        for j, (w, wf) in enumerate(windows):
            sums[j] += wf[src] - (wf[srcs[i - 1 - w]] if i > w else 0.0)
        if src >= 3:
            if not any_r:
                any_r, lat = True, lat + lat_r
        elif src and not any_l:
            any_l, lat = True, lat + lat_l
        c = min(i * bt, last)
        n = p - c
        got = cum + sum(sums) + lat
        total = got + a * n + b * n * (c + n / 2)
        if total <= best_total:
            best_k, best_total, best_fetch = i, total, got
        if c >= last:
            break
    return best_k, best_total, best_fetch
