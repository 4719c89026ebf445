"""Replicas of a trace, so a comparison of routing policies can tell a difference from chance.

A replay is chaotic: one decision that goes the other way (a near-tie between two idle
workers, a queue estimate a millisecond apart) changes which worker holds a prefix later, and
every decision after it. On the dynamo trace at 32 workers, arrival times moved by less than
half a millisecond move ``cost``'s mean TTFT by +-0.2% (sd of 8 replicas) and on 6 workers the
p99 by +-5%: more than many of the gaps a single replay reports between two policies.

:func:`jittered` makes replica ``seed`` of a trace: every arrival moved by a uniform offset in
``[-within_s, +within_s]`` (clipped at 0), requests re-sorted by arrival (ties in the trace's
order). Replica 0 is the trace as it is. Half a millisecond is the default a caller should use
for Mooncake-format traces: their timestamps are whole milliseconds, so every replica is a trace
the same recording could have produced. :func:`paired_gap` compares two policies over the same
replicas (the mean difference and its standard error), so a gap is called a loss only when it
stands out of the replay's own noise: :func:`beats` applies the paired t-test at 95%
(two-sided), the standard test for two treatments measured on the same units.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from kvshare.router.sim.trace import Trace, TraceRequest


def jittered(requests: Trace | Sequence[TraceRequest], seed: int, within_s: float
             ) -> Trace | list[TraceRequest]:
    """Replica ``seed`` of ``requests`` (module docstring): the same requests, each arrival
    moved by at most ``within_s`` seconds, in arrival order. ``seed`` 0 or ``within_s`` 0:
    ``requests`` itself (a :class:`Trace` stays one; a sequence comes back as a list).
    ValueError for a negative seed or offset."""
    if seed < 0 or not within_s >= 0 or math.isinf(within_s):
        raise ValueError(f"jittered needs seed >= 0 and a finite within_s >= 0 "
                         f"(got seed={seed}, within_s={within_s})")
    if seed == 0 or within_s == 0:
        return requests if isinstance(requests, Trace) else list(requests)
    rng = np.random.default_rng(seed)
    n = len(requests)
    if isinstance(requests, Trace):
        t = np.maximum(0.0, requests.arrival_s + rng.uniform(-within_s, within_s, n))
        order = np.argsort(t, kind="stable")
        return dataclasses.replace(
            requests, rows=requests.rows[order], arrival_s=t[order],
            input_tokens=requests.input_tokens[order], output_tokens=requests.output_tokens[order],
            starts=requests.starts[order], ends=requests.ends[order], users=requests.users[order])
    shift = rng.uniform(-within_s, within_s, n)
    moved = [dataclasses.replace(r, arrival_s=max(0.0, r.arrival_s + float(d)))
             for r, d in zip(requests, shift, strict=True)]
    return sorted(moved, key=lambda r: r.arrival_s)  # (stable: ties keep the trace's order)


def replay_figures(requests: Trace | Sequence[TraceRequest], seed: int, within_s: float,
                   config: Any, names: Sequence[str], sharing: str = "global",
                   progress: Callable[[int], None] | None = None,
                   policy_options: Mapping[str, dict[str, Any]] | None = None,
                   ) -> dict[str, tuple[float, float]]:
    """Replica ``seed`` of ``requests`` (:func:`jittered`) replayed by every policy in ``names``
    on ``config`` (a :class:`~kvshare.router.sim.cluster_model.ClusterConfig`; :func:`kvshare.router.sim.replay.simulate`, no
    reference run; ``policy_options``: per policy name, its options): per policy, its
    ``(mean, p99)`` TTFT in seconds."""
    from kvshare.router.sim.replay import simulate
    from kvshare.router.sim.report import summarize

    r = simulate(jittered(requests, seed, within_s), config, names, sharing, progress,
                 reference=False, **dict(policy_options or {}))
    out = {}
    for n in names:
        s = summarize(r.rows[n], r.busy[n], len(r.unfit[n]))
        out[n] = (s["ttft_mean_s"], s["ttft_p99_s"])
    return out


_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
        9: 2.262, 10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042, 60: 2.000}
"""Student's t, 97.5th percentile, by degrees of freedom (from the standard table)."""


def t95(df: int) -> float:
    """The two-sided 95% critical value of Student's t with ``df`` >= 1 degrees of freedom
    (between tabulated ones, the next lower df's: the larger value, so never too lenient;
    past 60, 1.96)."""
    if df < 1:
        raise ValueError(f"t95 needs df >= 1 (got {df})")
    if df > 60:
        return 1.960
    return _T95[max(k for k in _T95 if k <= df)]


def beats(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether ``b`` is lower than ``a`` beyond the replay's noise: the mean of ``a[k] -
    b[k]`` over the same replicas exceeds ``t95(n - 1)`` standard errors (a paired t-test at
    95%, two-sided). Never with one replica."""
    return gap_beyond_noise(a, b) is not None


def gap_beyond_noise(a: Sequence[float], b: Sequence[float]) -> tuple[float, float] | None:
    """:func:`paired_gap` of ``a`` over ``b`` where ``b`` :func:`beats` ``a``, else None."""
    gap, se = paired_gap(a, b)
    return (gap, se) if len(a) > 1 and gap > t95(len(a) - 1) * se else None


def paired_gap(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """Over the same replicas: the mean of ``a[k] - b[k]`` and its standard error (``nan``
    with one replica: a single replay cannot tell its noise). ValueError if the lengths differ
    or there are none."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired_gap needs two equal, non-empty lists (got {len(a)} and {len(b)})")
    d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    se = float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else math.nan
    return float(d.mean()), se


def replica_table(figures: dict[str, list[tuple[float, float]]], jitter_ms: float) -> str:
    """A markdown table of each policy's mean and p99 TTFT over the replicas (average and
    standard deviation), and how far each is behind the best on that metric: ``noise`` where
    the best does not beat it beyond the replay's noise (:func:`beats`), else the gap alone.
    ``figures``: per policy, ``(mean, p99)`` per replica, replica 0 first."""
    k = len(next(iter(figures.values())))
    lines = [f"replicas: {k} (replica 0: the trace as it is; 1-{k - 1}: each arrival moved "
             f"within +-{jitter_ms:g} ms)", "",
             "| policy | mean TTFT s (sd) | vs best | p99 TTFT s (sd) | vs best |",
             "|---|---|---|---|---|"]
    cols: dict[str, list[str]] = {n: [] for n in figures}
    for m in (0, 1):
        series = {n: [f[m] for f in figs] for n, figs in figures.items()}
        avg = {n: float(np.mean(v)) for n, v in series.items()}
        best = min(avg, key=avg.__getitem__)
        for n, v in series.items():
            sd = float(np.std(v, ddof=1)) if len(v) > 1 else 0.0
            cols[n].append(f"{avg[n]:.3f} ({sd:.3f})")
            if n == best:
                cols[n].append("best")
            else:
                gap = 100 * (avg[n] / avg[best] - 1) if avg[best] else 0.0
                cols[n].append(f"+{gap:.1f}%" + ("" if beats(v, series[best]) else ", noise"))
    lines += [f"| {n} | " + " | ".join(c) + " |" for n, c in cols.items()]
    return "\n".join(lines)
