"""Every routing policy on every trace, 4/10/32 workers x 3M/10M tokens of host cache each.

Traces: the two public Mooncake traces and the agentic set in ../shared/traces (agentic
replayed at 512-token blocks, every 64-token id group of 8 coarsened to one, so a sweep stays
within a shared machine's CPU), plus two generated multi-turn conversation traces
(:mod:`kvshare.router.sim.trace_conversations`: ``conv`` 600 conversations, seed 0; ``conv_heavy`` 2400
conversations, seed 1, which overloads small clusters), written under /tmp and removed.

Prints one markdown table per trace (mean / p99 TTFT in s per policy and cell; ``*`` marks
the cell's best of each) and ends with ONE JSON line: per cell whether ``cost`` has the lowest
mean and the lowest p99 (the baseline is every other policy, measured in the same run); for
each cell it does not win both, ``gap_pct``: how much higher its mean and p99 are than the best
other policy's, in percent (negative where it wins).

    python benchmarks/sim_sweep.py [--traces synthetic,dynamo,agentic,conv,conv_heavy]
    python benchmarks/sim_sweep.py --heldout
    python benchmarks/sim_sweep.py --fresh --cells 'synthetic/3w/*,fresh_b/3w/*'

``--dump FILE`` writes every cell's mean / p99 per policy as JSON; ``--peers-from FILE`` takes
the figures of the policies not in ``--policies`` from such a file (a run of the same cells
in the same session, e.g. before a change to ``cost``: the peers' rules do not change with
it), so ``--policies cost --peers-from before.json`` replays only ``cost``.

``--replicas K`` replays every cell K times (replica 0 the trace as it is, replica k its
arrivals moved within +-``--jitter-ms``, 0.5 ms by default: :mod:`kvshare.router.sim.replicas`) and
reports each policy's figures averaged over the replicas. A single replay is chaotic: arrivals
moved by less than the traces' millisecond resolution move a cell's mean TTFT by up to ~10%
(p99 more), more than many gaps a single replay shows between two policies. So with K >= 2 the
JSON line also names ``lost_beyond_noise``: the cells where some peer beats ``cost`` on mean or
p99 beyond that noise: a paired t-test at 95% over the same replicas
(:func:`kvshare.router.sim.replicas.beats`; ``beyond_noise`` gives each such gap and its standard error in
percent).

``--cells`` keeps only the cells whose name (``trace/Ww/HM``, as the JSON line names them)
matches one of its comma-separated shell patterns, so one lost cell can be rerun alone.

``--heldout`` runs the cells no policy change is measured on first (the honest test): the
synthetic trace from its request 1000, 2000 and 3000 on (``synthetic@K``: to the trace's end,
2,993 / 1,993 / 993 requests; with ``--limit N``, N requests from K), and three generated
conversation traces of other shapes and seeds (``conv_many``: 3000 conversations, seed 5,
overloading small clusters; ``conv_long``: 12 turns of 1500-token user messages, 10 s think
time, seed 7; ``conv_wide``: 32 system prompts of 2-12k tokens, seed 9), at 4/10/32 workers
and 3M tokens of host cache.

``--fresh`` runs a second held-out set, fixed in stop 23 before the policy change of that stop
was run on it and not tuned on since: synthetic, dynamo and three more conversation shapes
(``fresh_a``: 1,500 conversations, 20 s think time, seed 21; ``fresh_b``: 4,000 conversations
on 4 system prompts, seed 23; ``fresh_c``: 800 conversations of 10 turns, 800-token user
messages, a 600 s start window, seed 25) at 3/6/16 workers, sizes the sweep never uses, and
3M tokens of host cache.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's router, not ./router.py

from kvshare.router.cli import jitter_ms, positive_int  # noqa: E402
from kvshare.router.core.registry import POLICIES  # noqa: E402
from kvshare.router.sim.cluster_model import ClusterConfig  # noqa: E402
from kvshare.router.sim.replicas import gap_beyond_noise, replay_figures  # noqa: E402
from kvshare.router.sim.trace import Trace, TraceRequest  # noqa: E402
from kvshare.router.sim.trace_conversations import ConversationShape, conversation_rows, write_jsonl  # noqa: E402
from kvshare.router.sim.trace_read import read_trace  # noqa: E402

TRACES = Path(os.environ.get("KVSHARE_TRACES",
                           Path(__file__).resolve().parents[2] / "shared" / "traces"))
"""The shared traces: ../shared/traces beside the checkout, or ``$KVSHARE_TRACES``."""
WORKERS = (4, 10, 32)
HOST_TOKENS = (3_000_000, 10_000_000)


FRESH = ("synthetic", "dynamo", "fresh_a", "fresh_b", "fresh_c")
FRESH_WORKERS = (3, 6, 16)
HELDOUT = ("synthetic@1000", "synthetic@2000", "synthetic@3000", "conv_many", "conv_long",
           "conv_wide")
SHAPES = {
    "conv": (ConversationShape(), 0),
    "conv_heavy": (ConversationShape(conversations=2400), 1),
    "conv_many": (ConversationShape(conversations=3000), 5),
    "conv_long": (ConversationShape(conversations=300, mean_turns=12.0, user_tokens=1500.0,
                                    think_s=10.0), 7),
    "fresh_a": (ConversationShape(conversations=1500, think_s=20.0), 21),
    "fresh_b": (ConversationShape(conversations=4000, system_prompts=4), 23),
    "fresh_c": (ConversationShape(conversations=800, mean_turns=10.0, user_tokens=800.0,
                                  start_window_s=600.0), 25),
    "conv_wide": (ConversationShape(system_prompts=32, system_tokens=(2000, 12000)), 9),
}


def load(name: str, tmp: Path, limit: int | None) -> Sequence[TraceRequest] | Trace:
    """A trace by name; ``synthetic@K``: the synthetic trace's requests K to K + limit."""
    if "@" in name:
        base, _, start = name.partition("@")
        whole = load(base, tmp, None)
        k = int(start)
        return whole[k:k + limit] if limit is not None else whole[k:]
    if name == "synthetic":
        return read_trace(TRACES / "synthetic_trace.jsonl", limit)
    if name == "dynamo":
        return read_trace(TRACES / "dynamo_mooncake_trace_1000.jsonl", limit)
    if name == "agentic":
        return read_trace(TRACES / "agentic", limit, block_tokens=512)
    shape, seed = SHAPES[name]
    path = tmp / f"{name}.jsonl"
    write_jsonl(path, conversation_rows(shape, seed))
    try:
        return read_trace(path, limit)
    finally:
        path.unlink()


def beyond_noise(cell: dict[str, list[Any]]) -> dict[str, dict[str, float]]:
    """The peers that beat ``cost`` beyond the replay's noise over the same replicas (a paired
    t-test at 95%: :func:`kvshare.router.sim.replicas.beats`), per metric (``mean``, ``p99``): their gap
    and its standard error in percent of the peer's figure. Empty where no peer does, or with
    fewer than two replicas on both sides."""
    out: dict[str, dict[str, float]] = {}
    mine = cell["cost"][2] if len(cell.get("cost", ())) > 2 else []
    for name, fig in cell.items():
        theirs = fig[2] if len(fig) > 2 else []
        if name == "cost" or len(theirs) != len(mine) or len(mine) < 2:
            continue
        for m, metric in enumerate(("mean", "p99")):
            a, b = [f[m] for f in mine], [f[m] for f in theirs]
            got = gap_beyond_noise(a, b)
            if got is not None:
                gap, se = got
                base = fig[m] or 1.0
                out[f"{name} {metric}"] = {"gap_pct": round(100 * gap / base, 3),
                                           "se_pct": round(100 * se / base, 3)}
    return out


def cell_name(trace: str, workers: int, host_tokens: int) -> str:
    """A cell's name in the JSON line and for ``--cells``: ``trace/Ww/HM``."""
    return f"{trace}/{workers}w/{host_tokens // 1_000_000}M"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", default="synthetic,dynamo,agentic,conv,conv_heavy")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--limit", type=int, default=None, help="first N requests of each trace")
    ap.add_argument("--workers", default=",".join(map(str, WORKERS)))
    ap.add_argument("--heldout", action="store_true",
                    help="the held-out cells instead (module docstring); 3M host tokens only")
    ap.add_argument("--fresh", action="store_true",
                    help="the second held-out set (module docstring); 3M host tokens only")
    ap.add_argument("--cells", default="*",
                    help="comma-separated shell patterns over cell names (trace/Ww/HM), e.g. "
                         "'dynamo/32w/*'; the other cells are not run")
    ap.add_argument("--no-recency", action="store_true",
                    help="cost without its recency rule (the shadow LRU per tier: "
                         "CostPolicy(recency=False); router/recency.py)")
    ap.add_argument("--replicas", type=positive_int, default=1,
                    help="replays per cell, arrivals jittered (module docstring); figures are "
                         "their averages")
    ap.add_argument("--jitter-ms", type=jitter_ms, default=0.5,
                    help="how far a replica may move each arrival, in ms (default 0.5: half "
                         "the Mooncake traces' timestamp resolution)")
    ap.add_argument("--dump", default=None, help="write every cell's mean/p99 per policy (JSON)")
    ap.add_argument("--peers-from", default=None,
                    help="a --dump file: the figures of the policies not in --policies")
    args = ap.parse_args()
    if args.heldout and args.fresh:
        ap.error("--heldout and --fresh are two different cell sets: choose one")
    names = args.policies.split(",")
    peers: dict[str, dict[str, list[Any]]] = {}
    if args.peers_from:
        with open(args.peers_from, encoding="utf-8") as f:
            peers = json.load(f)
    figures: dict[str, dict[str, list[Any]]] = {}
    traces = HELDOUT if args.heldout else FRESH if args.fresh else args.traces.split(",")
    hosts = HOST_TOKENS[:1] if args.heldout or args.fresh else HOST_TOKENS
    workers = list(FRESH_WORKERS) if args.fresh else [int(w) for w in args.workers.split(",")]
    patterns = args.cells.split(",")
    cells: dict[str, Any] = {}
    t0 = time.process_time()
    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        for tname in traces:
            picked = [(w, h) for w in workers for h in hosts
                      if any(fnmatch.fnmatchcase(cell_name(tname, w, h), p) for p in patterns)]
            if not picked:
                continue
            trace = load(tname, Path(d), args.limit)
            block_tokens = trace.block_tokens if isinstance(trace, Trace) else 512
            print(f"\n### {tname} ({len(trace)} requests, {block_tokens}-token blocks)\n")
            print("| policy | " + " | ".join(f"{w}w {h // 1_000_000}M mean / p99"
                                           for w, h in picked) + " |")
            print("|---" * (1 + len(picked)) + "|")
            table: dict[str, list[str]] = {}
            for w, h in picked:
                cfg = ClusterConfig(workers=w, host_tokens=h, block_tokens=block_tokens)
                opts: dict[str, Any] = {}
                if args.no_recency:
                    opts["recency"] = False
                per: dict[str, list[list[float]]] = {n: [] for n in names}  # per replica
                for k in range(args.replicas):
                    got = replay_figures(trace, k, args.jitter_ms / 1000, cfg, names,
                                         policy_options={"cost": opts} if opts else None)
                    for n in names:
                        per[n].append(list(got[n]))
                cell = figures[cell_name(tname, w, h)] = {
                    n: [float(np.mean([f[0] for f in per[n]])),
                        float(np.mean([f[1] for f in per[n]])), per[n]] for n in names}
                for n, fig in peers.get(cell_name(tname, w, h), {}).items():
                    cell.setdefault(n, fig)
                mean = {n: fig[0] for n, fig in cell.items()}
                p99 = {n: fig[1] for n, fig in cell.items()}
                best_m, best_p = min(mean.values()), min(p99.values())
                for n in mean:
                    table.setdefault(n, []).append(f"{mean[n]:.3f}{'*' if mean[n] == best_m else ''} / "
                                    f"{p99[n]:.3f}{'*' if p99[n] == best_p else ''}")
                others = [n for n in mean if n != "cost"]
                if not others or "cost" not in mean:
                    continue  # nothing to compare (a --dump of one policy)
                om, op = min(mean[n] for n in others), min(p99[n] for n in others)
                cells[cell_name(tname, w, h)] = {
                    "cost_best_mean": mean["cost"] <= om, "cost_best_p99": p99["cost"] <= op,
                    "gap_pct": [round(100 * (mean["cost"] / om - 1), 3),
                                round(100 * (p99["cost"] / op - 1), 3)],
                    "beyond_noise": beyond_noise(cell),
                }
            for n, row in table.items():
                print(f"| {n} | " + " | ".join(row) + " |")
            sys.stdout.flush()
    if args.dump:
        with open(args.dump, "w", encoding="utf-8") as f:
            json.dump(figures, f)
    both = sum(c["cost_best_mean"] and c["cost_best_p99"] for c in cells.values())
    lost = [k for k, c in cells.items() if not (c["cost_best_mean"] and c["cost_best_p99"])]
    print(json.dumps({"benchmark": "sim_sweep", "cells": len(cells), "cost_best_both": both,
                      "replicas": args.replicas, "jitter_ms": args.jitter_ms,
                      "cost_best_mean": sum(c["cost_best_mean"] for c in cells.values()),
                      "cost_best_p99": sum(c["cost_best_p99"] for c in cells.values()),
                      "cpu_s": round(time.process_time() - t0, 1),
                      "lost": lost,
                      "lost_beyond_noise": [k for k, c in cells.items() if c["beyond_noise"]]
                      if args.replicas > 1 else None,
                      "gap_pct": {k: cells[k]["gap_pct"] for k in lost},
                      "beyond_noise": {k: c["beyond_noise"] for k, c in cells.items()
                                       if c["beyond_noise"]}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
