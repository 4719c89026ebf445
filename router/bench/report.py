"""A run's summary: percentiles, the table, the JSON object and the PNG.

One JSON object: ``{"runs": [run, ...], "ratios": {...} | null}``; a run has ``requests``
(sent, completed, failed, skipped), ``ttft_s``, ``itl_s`` and ``tpot_s`` (p50/p90/p99/mean, seconds),
``requests_per_s`` and ``output_tokens_per_s`` (completed, over the run's wall time),
``hit_rate`` (tier -> share of prompt tokens, :mod:`.tiers`; from vLLM's counters, or else from
the kvshare workers' usage objects, ``hit_rate_from`` says which; null when neither was read)
and ``hit_rate_over_time``. ``ratios``: the second run's value over the first's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvshare.router.bench.client import RunResult
from kvshare.router.bench.tiers import (
    COMPUTED,
    TIERS,
    Target,
    TierSampler,
    hit_rates,
    usage_counters,
    usage_series,
)

PCTS = (50, 90, 99)
USAGE_INTERVAL_S = 1.0
"""The chart's window when the hit rates come from the answers' usage objects."""
RATIO_KEYS = ("ttft_p50", "ttft_p90", "ttft_p99", "itl_p50", "tpot_p50", "requests_per_s",
              "output_tokens_per_s", "hit_rate")


def percentiles(xs: Sequence[float]) -> dict[str, float] | None:
    """p50/p90/p99 and mean of ``xs`` (linear interpolation), None when empty."""
    if not xs:
        return None
    a = np.asarray(xs, float)
    out = {f"p{p}": round(float(np.percentile(a, p)), 6) for p in PCTS}
    out["mean"] = round(float(a.mean()), 6)
    return out


def summarize(run: RunResult, target: Target, tiers: TierSampler | None) -> dict[str, Any]:
    ok = [r for r in run.results if r.error is None]
    errors = sorted({r.error for r in run.results if r.error is not None})
    rates = tiers.total() if tiers is not None else None
    series = tiers.series() if tiers is not None else []
    source = list(target.metrics_urls)
    answers = [r for r in ok if r.sources is not None]
    if rates is None and answers:  # no vLLM counters: the kvshare workers' own usage objects
        rates = hit_rates(usage_counters([]),
                          usage_counters([(r.prompt_tokens, r.sources or {}) for r in answers]))
        series = usage_series([(r.done_s or r.sent_s, r.prompt_tokens, r.sources or {})
                               for r in answers], USAGE_INTERVAL_S)
        source = ["usage"]
    if rates is not None:
        rates = {t: round(v, 4) for t, v in rates.items()}
    hit = None if rates is None else round(sum(v for t, v in rates.items() if t != COMPUTED), 4)
    return {
        "url": run.url, "kind": target.kind, "model": run.model,
        "requests": {"sent": len(run.results), "completed": len(ok),
                     "failed": len(run.results) - len(ok), "skipped": run.skipped},
        "wall_s": round(run.wall_s, 3),
        "ttft_s": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_s": percentiles([x for r in ok for x in r.itl_s]),
        "tpot_s": percentiles([r.decode_s / (r.completion_tokens - 1) for r in ok
                               if r.completion_tokens > 1]),
        "requests_per_s": round(len(ok) / run.wall_s, 4) if run.wall_s > 0 else 0.0,
        "output_tokens_per_s": round(sum(r.completion_tokens for r in ok) / run.wall_s, 3)
        if run.wall_s > 0 else 0.0,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "output_tokens": sum(r.completion_tokens for r in ok),
        "hit_rate": hit,
        "hit_rate_by_tier": rates,
        "hit_rate_from": source,
        "hit_rate_over_time": [{"t_s": round(t, 3), **{k: round(v, 4) for k, v in r.items()}}
                               for t, r in series],
        "workers": sorted({r.worker for r in ok if r.worker}),  # the gateway's x-kvshare-worker
        "usage_extension": any(r.gateway for r in ok),  # the gateway's kvshare usage object
        "errors": errors[:5],
        "ttfts_s": sorted(r.ttft_s for r in ok if r.ttft_s is not None),
    }


def ratios(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float | None]:
    """``b``'s value over ``a``'s for :data:`RATIO_KEYS` (None where either is missing or 0)."""
    out: dict[str, float | None] = {}
    for k in RATIO_KEYS:
        x, y = _value(a, k), _value(b, k)
        out[k] = round(y / x, 4) if x and y is not None else None
    return out


def _value(run: dict[str, Any], key: str) -> float | None:
    if key.startswith(("ttft_", "itl_", "tpot_")):
        kind, p = key.split("_")
        d = run[f"{kind}_s"]
        return None if d is None else float(d[p])
    v = run[key]
    return None if v is None else float(v)


def document(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The one JSON object (the per-request TTFTs left out)."""
    return {"runs": [{k: v for k, v in r.items() if k != "ttfts_s"} for r in runs],
            "ratios": ratios(runs[0], runs[1]) if len(runs) > 1 else None}


def table(runs: Sequence[dict[str, Any]]) -> str:
    """The runs side by side (and the ratio column with two)."""

    def ms(d: dict[str, float] | None, p: str) -> str:
        return "-" if d is None else f"{d[p] * 1000:.1f}"

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.1%}"

    rows: list[tuple[str, ...]] = [("", *(r["url"] for r in runs))]
    rows.append(("kind", *(r["kind"] for r in runs)))
    rows.append(("requests sent/completed/failed",
                 *(f"{r['requests']['sent']}/{r['requests']['completed']}/{r['requests']['failed']}"
                   for r in runs)))
    for p in PCTS:
        rows.append((f"TTFT p{p} (ms)", *(ms(r["ttft_s"], f"p{p}") for r in runs)))
    rows.append(("ITL p50 (ms)", *(ms(r["itl_s"], "p50") for r in runs)))
    rows.append(("TPOT p50 (ms)", *(ms(r["tpot_s"], "p50") for r in runs)))
    rows.append(("requests/s", *(f"{r['requests_per_s']:.2f}" for r in runs)))
    rows.append(("output tokens/s", *(f"{r['output_tokens_per_s']:.1f}" for r in runs)))
    rows.append(("hit rate", *(pct(r["hit_rate"]) for r in runs)))
    for t in (*TIERS.values(), COMPUTED):
        if any(r["hit_rate_by_tier"] and r["hit_rate_by_tier"][t] for r in runs) or t == COMPUTED:
            rows.append((f"  {t}", *(pct(r["hit_rate_by_tier"][t] if r["hit_rate_by_tier"] else None)
                                     for r in runs)))
    if len(runs) == 2:
        rat = ratios(runs[0], runs[1])
        keys = {"TTFT p50 (ms)": "ttft_p50", "TTFT p90 (ms)": "ttft_p90", "TTFT p99 (ms)": "ttft_p99",
                "ITL p50 (ms)": "itl_p50", "TPOT p50 (ms)": "tpot_p50", "requests/s": "requests_per_s",
                "output tokens/s": "output_tokens_per_s", "hit rate": "hit_rate"}
        rows = [(*row, "second / first" if i == 0 else
                 (f"{rat[keys[row[0]]]:.2f}x" if row[0] in keys and rat[keys[row[0]]] is not None
                  else "")) for i, row in enumerate(rows)]
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) if c == 0 else cell.rjust(w)
                               for c, (cell, w) in enumerate(zip(row, widths, strict=True))).rstrip()
                     for row in rows)


def plot(runs: Sequence[dict[str, Any]], path: str) -> None:
    """TTFT CDF per run (left) and hit rate per tier over time (right) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cdf, over) = plt.subplots(1, 2, figsize=(11, 4))
    styles = ("-", "--")
    colors = dict(zip(TIERS.values(), ("tab:blue", "tab:green", "tab:orange", "tab:purple",
                                       "tab:gray"), strict=True))
    for k, run in enumerate(runs):
        xs = np.asarray(run["ttfts_s"]) * 1000
        if xs.size:
            cdf.plot(np.sort(xs), np.arange(1, xs.size + 1) / xs.size, styles[k % 2], color="black",
                     label=run["url"])
        series = run["hit_rate_over_time"]
        for t in TIERS.values():
            ys = [p[t] for p in series]
            if any(ys):
                over.plot([p["t_s"] for p in series], ys, styles[k % 2], marker=".", color=colors[t],
                          label=f"{t} ({run['url']})" if len(runs) > 1 else t)
    cdf.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="TTFT CDF")
    over.set(xlabel="time (s)", ylabel="share of prompt tokens", title="hit rate per tier",
             ylim=(0, 1.05))
    for ax in (cdf, over):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
