"""What each tier is worth: the prefill it saved against the time spent moving blocks.

:class:`ValueLedger` is a pool's account, per tier, of

- ``hits``: blocks served from the tier (each worth ``block_tokens`` prompt tokens that were
  not prefilled), and ``lookups``: the namespace's block uses, the same stream the sizing
  estimate reads (every block a reader pins or touches, every block a writer reserves: a
  block stored after a miss counts as a lookup that no tier served);
- ``bytes_in`` / ``write_s``: bytes written into the tier and the seconds the pool spent on it;
- ``bytes_out`` / ``read_s``: bytes read out of it and the seconds spent,

since the ledger started and over a sliding window (``window_s``, in ``buckets`` steps: the
window is the last ``buckets - 1`` whole steps plus the current one). Seconds are measured
where the pool copies bytes itself (a disk write or read, a move between tiers, a copy into or
out of the host slab, a remote reader's pull as the holder saw it, prepare to finish); bytes a
reader or writer copies itself through shared memory are counted, their seconds are the
reader's and not in the ledger.

:func:`assess` turns one tier's figures into a :class:`TierWorth`: the prefill seconds its
tokens saved at the engines' measured prefill speed, as the router's cost model prices a
token (:meth:`kvshare.cost.PrefillModel.from_tokens_per_s`), less the seconds spent writing
into and reading out of the tier. A tier whose net over the window is <= 0 while it had
traffic gets a verdict naming the reason and the fix (:func:`verdict`).

Not thread-safe: the owner (the pool, under its lock) serialises calls. Recording is one
clock read and a few float additions.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvshare.cost import PrefillModel

FIELDS = ("lookups", "hits", "bytes_in", "write_s", "bytes_out", "read_s")
"""What the ledger counts per tier, in this order."""
LOOKUPS, HITS, BYTES_IN, WRITE_S, BYTES_OUT, READ_S = range(len(FIELDS))

REMOTE = "remote"
"""The ledger's name for blocks a pool served to readers on other nodes (remote pulls): they
count there, not in the tier they were read from, and cost the pull's seconds."""


@dataclass(frozen=True)
class ValueConfig:
    """The ledger's sliding window: ``window_s`` seconds in ``buckets`` steps."""

    window_s: float = 300.0
    buckets: int = 30

    def __post_init__(self) -> None:
        if not (self.window_s > 0 and math.isfinite(self.window_s)) or self.buckets < 2:
            raise ValueError(f"the value window needs window_s > 0 and buckets >= 2, got "
                             f"window_s={self.window_s}, buckets={self.buckets}")


class ValueLedger:
    """Per-tier counters since start and over a sliding window (module docstring)."""

    def __init__(self, tiers: Sequence[str], config: ValueConfig = ValueConfig(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.tiers = tuple(tiers)
        self.config = config
        self._clock = clock
        self._width = config.window_s / config.buckets
        self._slot = {t: i * len(FIELDS) for i, t in enumerate(self.tiers)}
        n = len(self.tiers) * len(FIELDS)
        self._total = [0.0] * n
        self._ring = [[0.0] * n for _ in range(config.buckets)]
        self._started = clock()
        self._step = self._step_of(self._started)

    def _step_of(self, now: float) -> int:
        return int(now // self._width)

    def _bucket(self) -> list[float]:
        step = self._step_of(self._clock())
        if step != self._step:  # zero the buckets the clock moved past
            n = len(self._total)
            for s in range(max(self._step + 1, step - self.config.buckets + 1), step + 1):
                self._ring[s % self.config.buckets] = [0.0] * n
            self._step = step
        return self._ring[step % self.config.buckets]

    def add(self, tier: str, field: int, amount: float) -> None:
        """Count ``amount`` of ``field`` (:data:`FIELDS` index) for ``tier`` (a name, or a
        :class:`~kvshare.types.Tier`, which is its name)."""
        i = self._slot[tier] + field
        self._bucket()[i] += amount
        self._total[i] += amount

    def moved(self, tier: str, nbytes: int, seconds: float, *, into: bool) -> None:
        """Bytes written into (``into``) or read out of ``tier`` and the seconds it took."""
        bucket, total = self._bucket(), self._total
        i = self._slot[tier] + (BYTES_IN if into else BYTES_OUT)
        bucket[i] += nbytes
        bucket[i + 1] += seconds
        total[i] += nbytes
        total[i + 1] += seconds

    def figures(self) -> dict[str, object]:
        """``{"window_s": covered, "since_s": age, "tiers": {tier: {"window": {field: v},
        "total": {field: v}}}}``; ``window_s`` is the window's span so far (shorter than the
        configured window while the ledger is younger than it)."""
        self._bucket()
        now = self._clock()
        window = [sum(col) for col in zip(*self._ring, strict=True)]
        since = now - self._started
        span = min(since, (self.config.buckets - 1) * self._width + now % self._width)
        return {"window_s": round(span, 3), "since_s": round(since, 3), "tiers": {
            t: {"window": _named(window, j), "total": _named(self._total, j)}
            for t, j in self._slot.items()}}


def _named(values: Sequence[float], at: int) -> dict[str, float]:
    return {f: round(values[at + k], 6) for k, f in enumerate(FIELDS)}


@dataclass(frozen=True)
class TierWorth:
    """One tier's value over one span: ``saved_s`` (None: no measured prefill speed yet) and
    ``net_s`` = ``saved_s - write_s - read_s``; ``hit_share``: its hits over the namespace's
    lookups."""

    tier: str
    tokens: int
    hit_share: float
    saved_s: float | None
    write_s: float
    read_s: float
    bytes_in: int
    bytes_out: int

    @property
    def spent_s(self) -> float:
        return self.write_s + self.read_s

    @property
    def net_s(self) -> float | None:
        return None if self.saved_s is None else self.saved_s - self.spent_s

    @property
    def active(self) -> bool:
        """Whether the tier had traffic (hits or bytes moved) in the span."""
        return self.tokens > 0 or self.bytes_in > 0 or self.bytes_out > 0

    def as_dict(self) -> dict[str, object]:
        net = self.net_s
        return {"tokens": self.tokens, "hit_share": round(self.hit_share, 6),
                "saved_s": None if self.saved_s is None else round(self.saved_s, 6),
                "write_s": round(self.write_s, 6), "read_s": round(self.read_s, 6),
                "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
                "net_s": None if net is None else round(net, 6)}


def assess(tier: str, counts: Mapping[str, float], lookups: float, block_tokens: int,
           prefill_tokens_per_s: float) -> TierWorth:
    """``counts`` (one span of :meth:`ValueLedger.figures`) priced at ``prefill_tokens_per_s``
    (0: unknown, no ``saved_s``); ``lookups``: the namespace's lookups in the same span."""
    tokens = int(counts.get("hits", 0.0)) * block_tokens
    saved = (PrefillModel.from_tokens_per_s(prefill_tokens_per_s).time(tokens)
             if prefill_tokens_per_s > 0 else None)
    return TierWorth(tier, tokens, counts.get("hits", 0.0) / lookups if lookups else 0.0,
                     saved, counts.get("write_s", 0.0), counts.get("read_s", 0.0),
                     int(counts.get("bytes_in", 0.0)), int(counts.get("bytes_out", 0.0)))


FIXES = {
    "disk": "consider --disk-gb 0 or a larger host tier (--host-gb)",
    "host": "consider a smaller --host-gb: the engines' own caches serve this reuse",
    REMOTE: "pulls cost more than recomputing: check the link (kvshare status bandwidth) "
            "or lower the nixl/objstore figure with --bandwidth so the router recomputes",
}
"""What to change when a tier does not pay (``kvshare up`` options)."""
HOST_TOO_SMALL = ("consider a larger --host-gb: the reuse reaches back past it to the disk "
                  "tier (kvshare status --sizing shows the hit rate a larger one would have)")
"""The host tier's fix when the disk tier below it served what it did not."""


def verdict(w: TierWorth, below_served: bool = False) -> str:
    """``""`` when the tier pays (net > 0), had no traffic, or no prefill speed is known yet;
    else the reason and the fix, e.g. ``"disk: 0.4% of lookups hit, 0.2 s saved, 31 s spent
    writing: consider --disk-gb 0 or a larger host tier (--host-gb)"``. ``below_served``: a
    tier below this one served tokens in the same span (for the host tier: it is too small,
    not too large)."""
    net = w.net_s
    if net is None or net > 0 or not w.active or w.tier not in FIXES:
        return ""
    fix = HOST_TOO_SMALL if w.tier == "host" and below_served else FIXES[w.tier]
    assert w.saved_s is not None
    spent = []
    if w.write_s > 0 or w.bytes_in:
        spent.append(f"{_secs(w.write_s)} s spent writing")
    if w.read_s > 0 or w.bytes_out:
        spent.append(f"{_secs(w.read_s)} s spent reading")
    return (f"{w.tier}: {w.hit_share:.1%} of lookups hit, {_secs(w.saved_s)} s saved, "
            f"{', '.join(spent) or 'nothing spent'}: {fix}")


def _secs(s: float) -> str:
    return f"{s:.3g}"


SPANS = ("window", "total")
"""The two spans every figure is given over: the sliding window and since the pool started."""


def namespace_worth(value: Mapping[str, object], block_tokens: int,
                    prefill_tokens_per_s: float) -> dict[str, dict[str, TierWorth]]:
    """``{tier: {"window": TierWorth, "total": TierWorth}}`` for one namespace's ledger
    (:meth:`ValueLedger.figures`, the ``value`` of a pool's stats) priced at
    ``prefill_tokens_per_s`` (0: unknown)."""
    tiers = value.get("tiers")
    assert isinstance(tiers, Mapping)
    out: dict[str, dict[str, TierWorth]] = {t: {} for t in tiers}
    for span in SPANS:
        lookups = sum(float(t[span].get("lookups", 0.0)) for t in tiers.values())
        for tier, t in tiers.items():
            out[tier][span] = assess(tier, t[span], lookups, block_tokens, prefill_tokens_per_s)
    return out


def namespace_verdicts(worth: Mapping[str, Mapping[str, TierWorth]],
                       span: str = "window") -> dict[str, str]:
    """Each tier's :func:`verdict` over ``span`` of :func:`namespace_worth`'s answer, the host
    tier's told whether the disk tier below it served tokens then."""
    disk = worth.get("disk", {}).get(span)
    below = disk is not None and disk.tokens > 0
    return {tier: verdict(spans[span], below_served=below and tier == "host")
            for tier, spans in worth.items()}
