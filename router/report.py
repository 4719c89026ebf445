"""Simulation summaries: per-policy metrics, the text table, Parquet rows and the plot."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np


def summarize(rows: Mapping[str, Sequence[Any]], busy_s: Sequence[float]) -> dict[str, Any]:
    """Hit rates (overall, per tier, remote), TTFT stats, prefill time saved, imbalance."""
    tokens = float(sum(rows["input_tokens"])) or 1.0
    ttft = np.asarray(rows["ttft_s"], dtype=float)
    spent = float(sum(rows["fetch_s"]) + sum(rows["prefill_s"]))
    cold = float(sum(rows["recompute_s"])) or 1.0
    mean_busy = float(np.mean(busy_s)) if len(busy_s) else 0.0

    def pct(q: float) -> float:
        return float(np.percentile(ttft, q)) if ttft.size else 0.0

    return {
        "requests": len(ttft),
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


_COLS = (  # header, width, format, key
    ("hit", 7, ".3f", "hit_rate"), ("gpu", 7, ".3f", "hit_gpu"), ("host", 7, ".3f", "hit_host"),
    ("disk", 7, ".3f", "hit_disk"), ("remote", 8, ".3f", "hit_remote"),
    ("ttft_mean", 10, ".3f", "ttft_mean_s"), ("p50", 8, ".3f", "ttft_p50_s"),
    ("p90", 8, ".3f", "ttft_p90_s"), ("p99", 8, ".3f", "ttft_p99_s"),
    ("saved", 7, ".3f", "prefill_saved"), ("imbal", 7, ".2f", "imbalance"),
)


def format_table(reference_hit: float, results: Mapping[str, Mapping[str, Any]], sharing: str) -> str:
    """The text table ``kvshare sim`` prints (TTFT in seconds, hit rates as fractions)."""
    lines = [
        f"sharing={sharing}; hit = cached input tokens / input tokens (per tier and remote); "
        "TTFT in s; saved = prefill time saved; imbal = max/mean busy time",
        f"{'policy':<16}" + "".join(f"{h:>{w}}" for h, w, _, _ in _COLS),
        f"{'global_lru':<16}{reference_hit:>7.3f}   (one LRU of the whole cluster's capacity, "
        "arrival order: the upper bound)",
    ]
    for name, s in results.items():
        lines.append(f"{name:<16}" + "".join(f"{s[k]:>{w}{f}}" for _, w, f, k in _COLS))
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
        cols = {"policy": [name] * n, **{k: list(v) for k, v in rows.items()}}
        tables.append(pa.table(cols))
    pq.write_table(pa.concat_tables(tables), str(path))


def plot(
    path: str | Path,
    capacity_curve: Mapping[str, Sequence[tuple[float, float]]],
    results: Mapping[str, Mapping[str, Any]],
    title: str,
) -> None:
    """Left: hit rate vs per-node cache capacity (tokens); right: TTFT mean/p99 per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, pts in capacity_curve.items():
        xs, ys = zip(*pts, strict=True) if pts else ((), ())
        ax1.plot([x / 1e6 for x in xs], ys, marker="o", label=name,
                 linestyle="--" if name == "global_lru" else "-")
    ax1.set_xlabel("cache capacity per node (M tokens)")
    ax1.set_ylabel("hit rate (cached / input tokens)")
    ax1.set_ylim(0, 1)
    ax1.legend(fontsize=8)
    ax1.grid(alpha=0.3)
    names = list(results)
    x = np.arange(len(names))
    ax2.bar(x - 0.2, [results[n]["ttft_mean_s"] for n in names], 0.4, label="mean")
    ax2.bar(x + 0.2, [results[n]["ttft_p99_s"] for n in names], 0.4, label="p99")
    ax2.set_xticks(x, names, rotation=20, fontsize=8)
    ax2.set_ylabel("TTFT (s)")
    ax2.set_yscale("log")
    ax2.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(str(path), dpi=110)
    plt.close(fig)
