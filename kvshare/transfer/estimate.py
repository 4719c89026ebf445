"""Robust bandwidth estimates from timed batches: probes and the transfers that really ran.

A batch of ``n`` bytes takes about ``latency + n / bandwidth`` (a control round trip, then the
copy). One batch size alone cannot separate the two, so small probe batches understate the
bandwidth the cost model needs for a real prefix (8 MiB at 20 GB/s is 0.4 ms of copy behind a
~1 ms control call). :func:`fit` takes timed batches of at least two sizes and returns the
Theil-Sen line (median of the pairwise slopes: one slow batch on a busy host moves it little);
with a single size it falls back to the median rate. :class:`BandwidthEstimator` keeps a
bounded window of samples per ``(transport, peer)`` and refines as transfers complete.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

WINDOW = 64
"""Samples kept per (transport, peer): old timings age out as the machine's load changes."""
MIN_BYTES = 1 << 20
"""Batches smaller than this are latency, not bandwidth: not used for the rate."""


@dataclass(frozen=True)
class Estimate:
    """Bytes/s of the copy itself, the fixed seconds per batch, and how many batches it rests on."""

    bytes_per_s: float
    latency_s: float
    samples: int


NO_ESTIMATE = Estimate(0.0, 0.0, 0)


def fit(samples: Sequence[tuple[int, float]]) -> Estimate:
    """Fit ``seconds = latency + bytes / bytes_per_s`` to ``(bytes, seconds)`` samples.

    Theil-Sen over pairs of different sizes; the slope must be positive, else (or with one
    size) the median of ``bytes / seconds`` with zero latency. Samples with no bytes or no time
    are ignored.
    """
    pts = [(b, s) for b, s in samples if b > 0 and s > 0]
    if not pts:
        return NO_ESTIMATE
    slopes = [(s2 - s1) / (b2 - b1) for i, (b1, s1) in enumerate(pts) for b2, s2 in pts[i + 1:]
              if b2 != b1]
    if slopes:
        per_byte = statistics.median(slopes)
        if per_byte > 0:
            latency = statistics.median(s - b * per_byte for b, s in pts)
            return Estimate(1.0 / per_byte, max(latency, 0.0), len(pts))
    return Estimate(statistics.median(b / s for b, s in pts), 0.0, len(pts))


class BandwidthEstimator:
    """Windows of timed batches per ``(transport, peer)``; thread-safe.

    ``observe`` a finished batch (successful blocks' bytes and its wall time); ``estimate`` a
    transport to one peer, or over all peers (``peer=None``: the fit of every window pooled).
    """

    def __init__(self, window: int = WINDOW) -> None:
        if window < 2:
            raise ValueError(f"an estimator window needs >= 2 samples, got {window}")
        self.window = window
        self._samples: dict[tuple[str, str], deque[tuple[int, float]]] = {}
        self._lock = threading.Lock()

    def observe(self, transport: str, peer: str, nbytes: int, seconds: float) -> None:
        if nbytes < MIN_BYTES or seconds <= 0:
            return
        with self._lock:
            q = self._samples.get((transport, peer))
            if q is None:
                q = self._samples[(transport, peer)] = deque(maxlen=self.window)
            q.append((nbytes, seconds))

    def observe_all(self, transport: str, peer: str, samples: Iterable[tuple[int, float]]) -> None:
        for nbytes, seconds in samples:
            self.observe(transport, peer, nbytes, seconds)

    def estimate(self, transport: str, peer: str | None = None) -> Estimate:
        with self._lock:
            if peer is not None:
                pts = list(self._samples.get((transport, peer), ()))
            else:
                pts = [p for (t, _), q in self._samples.items() if t == transport for p in q]
        return fit(pts[-4 * self.window:])

    def transports(self) -> dict[str, float]:
        """Bytes/s per transport over all peers (only transports with samples)."""
        with self._lock:
            names = {t for t, _ in self._samples}
        return {n: self.estimate(n).bytes_per_s for n in sorted(names)}

    def peers(self, transport: str) -> dict[str, float]:
        """Bytes/s of ``transport`` per peer."""
        with self._lock:
            peers = [p for t, p in self._samples if t == transport]
        return {p: self.estimate(transport, p).bytes_per_s for p in peers}
