"""Simulation summaries: per-policy metrics, the text table, Parquet rows and the plot."""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np


def summarize(
    rows: Mapping[str, Sequence[Any]], busy_s: Sequence[float], unfit: int = 0
) -> dict[str, Any]:
    """Hit rates (overall, per tier, remote), TTFT stats, prefill time saved, imbalance, and
    ``unfit``: requests not replayed because they do not fit a worker."""
    tokens = float(sum(rows["input_tokens"])) or 1.0
    ttft = np.asarray(rows["ttft_s"], dtype=float)
    spent = float(sum(rows["fetch_s"]) + sum(rows["prefill_s"]))
    cold = float(sum(rows["recompute_s"])) or 1.0
    mean_busy = float(np.mean(busy_s)) if len(busy_s) else 0.0

    def pct(q: float) -> float:
        return float(np.percentile(ttft, q)) if ttft.size else 0.0

    return {
        "requests": len(ttft),
        "unfit": unfit,
        "hit_rate": sum(rows["cached_tokens"]) / tokens,
        "hit_gpu": sum(rows["gpu_tokens"]) / tokens,
        "hit_host": sum(rows["host_tokens"]) / tokens,
        "hit_disk": sum(rows["disk_tokens"]) / tokens,
        "hit_remote": sum(rows["remote_tokens"]) / tokens,
        "ttft_mean_s": float(ttft.mean()) if ttft.size else 0.0,
        "ttft_p50_s": pct(50),
        "ttft_p90_s": pct(90),
        "ttft_p99_s": pct(99),
        "prefill_saved": 1.0 - spent / cold,
        "imbalance": max(busy_s) / mean_busy if mean_busy > 0 else 1.0,
        "reasons": dict(Counter(rows["reason"])),
    }


_COLS = (  # header, format, key
    ("hit", ".3f", "hit_rate"), ("gpu", ".3f", "hit_gpu"), ("host", ".3f", "hit_host"),
    ("disk", ".3f", "hit_disk"), ("remote", ".3f", "hit_remote"),
    ("ttft_mean", ".3f", "ttft_mean_s"), ("p50", ".3f", "ttft_p50_s"),
    ("p90", ".3f", "ttft_p90_s"), ("p99", ".3f", "ttft_p99_s"),
    ("saved", ".3f", "prefill_saved"), ("imbal", ".2f", "imbalance"), ("unfit", "d", "unfit"),
)


def format_table(reference_hit: float, results: Mapping[str, Mapping[str, Any]], sharing: str) -> str:
    """The text table ``kvshare sim`` prints (TTFT in seconds, hit rates as fractions).

    Each column is as wide as its widest value plus two spaces, so large TTFTs never run
    into the next column."""
    cells = {name: [format(s[k], f) for _, f, k in _COLS] for name, s in results.items()}
    widths = [
        2 + max([len(h), 5, *(len(c[i]) for c in cells.values())]) for i, (h, _, _) in enumerate(_COLS)
    ]
    first = max([16, *(len(n) + 2 for n in results)])
    lines = [
        f"sharing={sharing}; hit = cached input tokens / input tokens (per tier and remote); "
        "TTFT in s; saved = prefill time saved; imbal = max/mean busy time; unfit = prompts "
        "that do not fit a worker (not replayed)",
        f"{'policy':<{first}}" + "".join(f"{h:>{w}}" for (h, _, _), w in zip(_COLS, widths, strict=True)),
        f"{'global_lru':<{first}}{reference_hit:>{widths[0]}.3f}   (one LRU of the whole "
        "cluster's capacity, arrival order: the upper bound)",
    ]
    for name, row in cells.items():
        lines.append(f"{name:<{first}}" + "".join(f"{c:>{w}}" for c, w in zip(row, widths, strict=True)))
    return "\n".join(lines)


def json_summary(reference_hit: float, results: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The ``--json`` object (exact shape from the issue, plus extra per-policy keys)."""
    return {
        "reference": {"global_lru_hit_rate": reference_hit},
        "policies": {
            name: {k: v for k, v in s.items() if k != "reasons"} | {"reasons": s["reasons"]}
            for name, s in results.items()
        },
    }


def write_parquet(path: str | Path, per_policy: Mapping[str, Mapping[str, Sequence[Any]]]) -> None:
    """Per-request results of every policy in one Parquet file (column ``policy``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tables = []
    for name, rows in per_policy.items():
        n = len(rows["request"])
        cols = {"policy": [name] * n, **{
            k: np.asarray(v) if isinstance(v, array) else list(v) for k, v in rows.items()}}
        tables.append(pa.table(cols))
    pq.write_table(pa.concat_tables(tables), str(path))


def plot(
    path: str | Path,
    capacity_curve: Mapping[str, Sequence[tuple[float, float]]],
    results: Mapping[str, Mapping[str, Any]],
    title: str,
) -> None:
    """Left: each policy's hit rate minus the ``global_lru`` upper bound, in percentage
    points, against per-node capacity (log axis), so differences of 1-3% stay visible; right:
    TTFT mean and p99 per policy (log axis), each bar labelled with its value."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'kvshare[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    ref = dict(capacity_curve.get("global_lru", ()))
    for name, pts in capacity_curve.items():
        if name == "global_lru" or not pts:
            continue
        ax1.plot([c / 1e6 for c, _ in pts], [100 * (y - ref.get(c, 0.0)) for c, y in pts],
                 marker="o", label=name)
    ax1.axhline(0.0, color="k", linestyle="--", linewidth=1, label="global_lru (upper bound)")
    if ref:
        for cap, y in sorted(ref.items()):
            ax1.annotate(f"{y:.3f}", (cap / 1e6, 0.0), textcoords="offset points", xytext=(0, 5),
                         ha="center", fontsize=7)
    ax1.set_xscale("log")
    ax1.set_xlabel("cache capacity per node (M tokens, log)")
    ax1.set_ylabel("hit rate - global_lru hit rate (points)")
    ax1.legend(fontsize=8)
    ax1.grid(alpha=0.3, which="both")
    names = list(results)
    x = np.arange(len(names))
    for offset, key, label in ((-0.2, "ttft_mean_s", "mean"), (0.2, "ttft_p99_s", "p99")):
        bars = ax2.bar(x + offset, [results[n][key] for n in names], 0.4, label=label)
        ax2.bar_label(bars, fmt="%.3g", fontsize=7, rotation=90, padding=2)
    ax2.set_xticks(x, names, rotation=20, fontsize=8)
    ax2.set_ylabel("TTFT (s, log)")
    ax2.set_yscale("log")
    ax2.margins(y=0.25)
    ax2.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(str(path), dpi=110)
    plt.close(fig)
