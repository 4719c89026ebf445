"""Every routing policy on every trace, 4/10/32 workers x 3M/10M tokens of host cache each.

Traces: the two public Mooncake traces and the agentic set in ../shared/traces (agentic
replayed at 512-token blocks, every 64-token id group of 8 coarsened to one, so a sweep stays
within a shared machine's CPU), plus two generated multi-turn conversation traces
(:mod:`router.trace_conversations`: ``conv`` 600 conversations, seed 0; ``conv_heavy`` 2400
conversations, seed 1, which overloads small clusters), written under /tmp and removed.

Prints one markdown table per trace (mean / p99 TTFT in s per policy and cell; ``*`` marks
the cell's best of each) and ends with ONE JSON line: per cell whether ``cost`` has the lowest
mean and the lowest p99 (the baseline is every other policy, measured in the same run); for
each cell it does not win both, ``gap_pct``: how much higher its mean and p99 are than the best
other policy's, in percent (negative where it wins).

    python benchmarks/sim_sweep.py [--traces synthetic,dynamo,agentic,conv,conv_heavy]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's router, not ./router.py

from router.cluster import ClusterConfig  # noqa: E402
from router.policy import POLICIES  # noqa: E402
from router.report import summarize  # noqa: E402
from router.sim import simulate  # noqa: E402
from router.trace import Trace, read_trace  # noqa: E402
from router.trace_conversations import ConversationShape, conversation_rows, write_jsonl  # noqa: E402

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
WORKERS = (4, 10, 32)
HOST_TOKENS = (3_000_000, 10_000_000)


def load(name: str, tmp: Path, limit: int | None) -> Trace:
    if name == "synthetic":
        return read_trace(TRACES / "synthetic_trace.jsonl", limit)
    if name == "dynamo":
        return read_trace(TRACES / "dynamo_mooncake_trace_1000.jsonl", limit)
    if name == "agentic":
        return read_trace(TRACES / "agentic", limit, block_tokens=512)
    shape, seed = {"conv": (ConversationShape(), 0),
                   "conv_heavy": (ConversationShape(conversations=2400), 1)}[name]
    path = tmp / f"{name}.jsonl"
    write_jsonl(path, conversation_rows(shape, seed))
    try:
        return read_trace(path, limit)
    finally:
        path.unlink()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", default="synthetic,dynamo,agentic,conv,conv_heavy")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--limit", type=int, default=None, help="first N requests of each trace")
    ap.add_argument("--workers", default=",".join(map(str, WORKERS)))
    args = ap.parse_args()
    names = args.policies.split(",")
    workers = [int(w) for w in args.workers.split(",")]
    cells: dict[str, Any] = {}
    t0 = time.process_time()
    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        for tname in args.traces.split(","):
            trace = load(tname, Path(d), args.limit)
            print(f"\n### {tname} ({len(trace)} requests, {trace.block_tokens}-token blocks)\n")
            print("| policy | " + " | ".join(f"{w}w {h // 1_000_000}M mean / p99" for w in workers
                                           for h in HOST_TOKENS) + " |")
            print("|---" * (1 + len(workers) * len(HOST_TOKENS)) + "|")
            table: dict[str, list[str]] = {n: [] for n in names}
            for w in workers:
                for h in HOST_TOKENS:
                    cfg = ClusterConfig(workers=w, host_tokens=h, block_tokens=trace.block_tokens)
                    r = simulate(trace, cfg, names, "global", reference=False)
                    s = {n: summarize(r.rows[n], r.busy[n]) for n in names}
                    mean = {n: s[n]["ttft_mean_s"] for n in names}
                    p99 = {n: s[n]["ttft_p99_s"] for n in names}
                    best_m, best_p = min(mean.values()), min(p99.values())
                    for n in names:
                        table[n].append(f"{mean[n]:.3f}{'*' if mean[n] == best_m else ''} / "
                                        f"{p99[n]:.3f}{'*' if p99[n] == best_p else ''}")
                    others = [n for n in names if n != "cost"]
                    om, op = min(mean[n] for n in others), min(p99[n] for n in others)
                    cells[f"{tname}/{w}w/{h // 1_000_000}M"] = {
                        "cost_best_mean": mean["cost"] <= om, "cost_best_p99": p99["cost"] <= op,
                        "gap_pct": [round(100 * (mean["cost"] / om - 1), 3),
                                    round(100 * (p99["cost"] / op - 1), 3)],
                    }
            for n in names:
                print(f"| {n} | " + " | ".join(table[n]) + " |")
            sys.stdout.flush()
    both = sum(c["cost_best_mean"] and c["cost_best_p99"] for c in cells.values())
    print(json.dumps({"benchmark": "sim_sweep", "cells": len(cells), "cost_best_both": both,
                      "cost_best_mean": sum(c["cost_best_mean"] for c in cells.values()),
                      "cost_best_p99": sum(c["cost_best_p99"] for c in cells.values()),
                      "cpu_s": round(time.process_time() - t0, 1),
                      "lost": [k for k, c in cells.items()
                               if not (c["cost_best_mean"] and c["cost_best_p99"])],
                      "gap_pct": {k: c["gap_pct"] for k, c in cells.items()
                                  if not (c["cost_best_mean"] and c["cost_best_p99"])}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
