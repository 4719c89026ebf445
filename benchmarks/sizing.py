"""The online sizing estimate against the simulator's exact LRU replay, on whole traces.

For each trace (a Mooncake JSONL file or a folder of kv-cache-tester agentic files), feeds
:class:`kvshare.pool.sizing.HitRateCurve` the lookups ``global_lru`` replays
(:func:`kvshare.router.sim.sizing.estimate`) twice: once exact (every block tracked: the
stack model's own error against the pool) and once with the default, bounded sampling (what a
pool runs). Then replays ``global_lru`` at ``--fractions`` of the trace's working set (its
distinct blocks) and prints, per capacity, the replay's hit rate (the baseline, same run),
both estimates and their errors. Ends with one JSON line: ``max_abs_error`` (the sampled
estimate, over every trace and capacity), ``per_trace``, the estimator's memory and its CPU
microseconds per block looked up.

    python benchmarks/sizing.py ../shared/traces/*.jsonl ../shared/traces/agentic
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's kvshare first
from kvshare.pool.sizing import SizingConfig  # noqa: E402
from kvshare.router.sim.cluster_model import ClusterConfig  # noqa: E402
from kvshare.router.sim.replay import global_lru  # noqa: E402
from kvshare.router.sim.sizing import estimate  # noqa: E402
from kvshare.router.sim.trace_read import read_trace  # noqa: E402

FRACTIONS = (0.25, 0.5, 1.0)


def one_trace(path: Path, fractions: tuple[float, ...], limit: int | None,
              max_tracked: int, block_tokens: int | None = None) -> dict[str, Any]:
    trace = read_trace(path, limit, block_tokens=block_tokens)
    cfg = ClusterConfig(block_tokens=trace.block_tokens)
    bt = cfg.block_tokens
    bpt = cfg.layout.bytes_per_token
    blocks = int(len(np.unique(trace.ids)))
    caps = [max(bt, int(f * blocks) * bt) for f in fractions]  # tokens, whole blocks

    t0 = time.process_time()
    exact = estimate(trace, cfg, SizingConfig(cfg.layout.bytes_per_block, max_tracked=10**9))
    exact_s = time.process_time() - t0
    t0 = time.process_time()
    sampled = estimate(trace, cfg, SizingConfig(cfg.layout.bytes_per_block, max_tracked=max_tracked))
    sampled_s = time.process_time() - t0
    rows = []
    for f, c in zip(fractions, caps, strict=True):
        ref = global_lru(trace, cfg, c)
        e, s = exact.hit_rate(c * bpt), sampled.hit_rate(c * bpt)
        rows.append({"fraction": f, "capacity_tokens": c, "replay": round(ref, 4),
                     "exact_estimate": round(e, 4), "estimate": round(s, 4),
                     "exact_error": round(e - ref, 4), "error": round(s - ref, 4)})
    return {
        "trace": path.name, "requests": len(trace), "working_set_blocks": blocks,
        "block_tokens": bt, "blocks_looked_up": sampled.blocks, "rate": sampled.rate,
        "tracked": sampled.tracked, "memory_bytes": sampled.memory_bytes(),
        "exact_memory_bytes": exact.memory_bytes(), "exact_tracked": exact.tracked,
        "us_per_access": 1e6 * sampled_s / max(1, sampled.blocks),
        "exact_us_per_access": 1e6 * exact_s / max(1, exact.blocks), "capacities": rows,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", nargs="+", help="Mooncake JSONL files and/or agentic folders")
    ap.add_argument("--fractions", default=",".join(map(str, FRACTIONS)),
                    help="capacities as fractions of each trace's working set (default %(default)s)")
    ap.add_argument("--limit", type=int, default=None, help="the first N requests of each trace")
    ap.add_argument("--block-tokens", type=int, default=None,
                    help="tokens a block (default: the format's; a multiple of an agentic "
                    "trace's 64 coarsens its ids, as kvshare sim --block-tokens does)")
    ap.add_argument("--max-tracked", type=int, default=SizingConfig(1).max_tracked,
                    help="the sampled estimator's bound (default: the pool's, %(default)s)")
    args = ap.parse_args(argv)
    fractions = tuple(float(x) for x in args.fractions.split(","))
    results = []
    for p in args.trace:
        r = one_trace(Path(p), fractions, args.limit, args.max_tracked, args.block_tokens)
        results.append(r)
        print(f"{r['trace']}: {r['requests']} requests, {r['working_set_blocks']:,} blocks of "
              f"{r['block_tokens']} tokens, rate {r['rate']:.3f} ({r['tracked']:,} tracked, "
              f"{r['memory_bytes'] / 1e6:.1f} MB), {r['us_per_access']:.2f} us/block", file=sys.stderr)
        print(f"{'capacity':>14} {'replay':>7} {'exact est':>9} {'err':>7} {'sampled':>8} {'err':>7}")
        for row in r["capacities"]:
            print(f"{row['fraction']:>5.0%} {row['capacity_tokens']:>8,} {row['replay']:>7.4f} "
                  f"{row['exact_estimate']:>9.4f} {row['exact_error']:>+7.4f} {row['estimate']:>8.4f} "
                  f"{row['error']:>+7.4f}")
    errs = [abs(row["error"]) for r in results for row in r["capacities"]]
    exact_errs = [abs(row["exact_error"]) for r in results for row in r["capacities"]]
    blocks = sum(r["blocks_looked_up"] for r in results)
    summary = {
        "max_abs_error": max(errs),
        "max_abs_error_exact": max(exact_errs),
        "per_trace": {r["trace"]: {"max_abs_error": max(abs(x["error"]) for x in r["capacities"]),
                                   "capacities": r["capacities"], "rate": round(r["rate"], 4)}
                      for r in results},
        "max_tracked": args.max_tracked, "block_tokens": args.block_tokens,
        "memory_bytes": max(r["memory_bytes"] for r in results),
        "bytes_per_tracked_block": round(max(r["memory_bytes"] / max(1, r["tracked"]) for r in results)),
        "us_per_access": round(sum(r["us_per_access"] * r["blocks_looked_up"] for r in results) / blocks, 3),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

