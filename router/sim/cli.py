"""What ``kvshare sim`` does with its arguments: load, reference, replay, report, plot.

Every phase has its own progress bar on stderr (loading ticks by bytes, the reference and
each replay by request, the plot by replay), so a long run never sits on a frozen bar.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

PLOT_FRACTIONS = (1 / 30, 1 / 10, 1 / 3, 1.0, 2.0)  # per-node capacities of the plot's curve


def run_sim(args: argparse.Namespace) -> int:
    from kvshare.router.core.registry import POLICIES
    from kvshare.router.sim.cluster_model import ClusterConfig
    from kvshare.router.sim.replay import simulate
    from kvshare.router.sim.report import format_table, json_summary, summarize, write_parquet
    from kvshare.router.sim.trace_read import read_trace

    cpu: dict[str, float] = {}
    t0 = time.process_time()
    quiet: bool | None = True if args.no_progress else (False if args.progress else None)
    paths = [Path(p) for p in args.trace]
    size = sum(p.stat().st_size for p in paths if p.is_file())
    with _bar(quiet, size or None, "load", "B") as tick:
        trace = read_trace(
            paths, args.limit, fmt=None if args.format == "auto" else args.format,
            block_tokens=args.block_tokens, progress=tick, users=args.users,
            warm_prefix_pct=args.warm_prefix_pct, max_delay_s=args.max_delay,
            time_scale=args.time_scale,
        )
    cpu["load"] = time.process_time() - t0
    for w in trace.warnings:
        print(f"warning: {w}", file=sys.stderr)
    cfg = ClusterConfig(
        workers=args.workers, host_tokens=args.host_tokens, disk_tokens=args.disk_tokens,
        block_tokens=trace.block_tokens, model=args.model, net_bw=args.net_gbps * 1e9 / 8,
        gpu_bytes=args.gpu_gb * 1e9, gpu_cache_tokens=args.gpu_cache_tokens,
    )
    _fit_notes(trace, cfg)
    names = list(POLICIES) if args.policy == "all" else [args.policy]
    with _bar(quiet, len(trace), "reference global_lru", "req") as tick:
        from kvshare.router.sim.replay import global_lru

        t0 = time.process_time()
        reference = global_lru(trace, cfg, progress=tick)
        cpu["reference"] = time.process_time() - t0
    rows: dict[str, Any] = {}
    results: dict[str, dict[str, Any]] = {}
    for n in names:
        with _bar(quiet, len(trace), f"replay {n}", "req") as tick:
            t0 = time.process_time()
            r = simulate(trace, cfg, [n], args.sharing, tick, reference=False)
            cpu[f"replay {n}"] = time.process_time() - t0
        rows[n] = r.rows[n]
        results[n] = summarize(r.rows[n], r.busy[n], len(r.unfit[n]))
    print(format_table(reference, results, args.sharing))
    replicas = _replicas(args, trace, cfg, names, results, quiet)
    if args.parquet:
        write_parquet(args.parquet, rows)
    if args.plot:
        _plot(args, trace, cfg, names, results, quiet)
    if args.json:
        print(json.dumps(json_summary(reference, results) | {"cpu_s": cpu}
                         | ({"replicas": replicas} if replicas else {})))
    return 0


def _replicas(args: argparse.Namespace, trace: Any, cfg: Any, names: list[str],
              results: dict[str, dict[str, Any]], quiet: bool | None) -> dict[str, Any] | None:
    """With ``--replicas`` > 1, replay every policy on replicas 1..N-1 of the trace
    (:mod:`kvshare.router.sim.replicas`), print the replica table and return its figures (None with one)."""
    if args.replicas < 2:
        return None
    from kvshare.router.sim.replicas import replay_figures, replica_table

    figures = {n: [(results[n]["ttft_mean_s"], results[n]["ttft_p99_s"])] for n in names}
    for k in range(1, args.replicas):
        with _bar(quiet, len(trace) * len(names), f"replica {k}", "req") as tick:
            got = replay_figures(trace, k, args.jitter_ms / 1000, cfg, names, args.sharing, tick)
        for n in names:
            figures[n].append(got[n])
    print()
    print(replica_table(figures, args.jitter_ms))
    return {"count": args.replicas, "jitter_ms": args.jitter_ms,
            "ttft_mean_s": {n: [f[0] for f in figs] for n, figs in figures.items()},
            "ttft_p99_s": {n: [f[1] for f in figs] for n, figs in figures.items()}}


def _fit_notes(trace: Any, cfg: Any) -> None:
    """Say which prompts the modelled worker cannot take, rather than pretend it can."""
    longest = int(trace.input_tokens.max())
    unfit = int((trace.input_tokens > cfg.kv_capacity_tokens).sum())
    if unfit:
        print(
            f"note: {unfit} of {len(trace)} prompts (longest {longest:,} tokens) exceed the "
            f"{cfg.kv_capacity_tokens:,} tokens of KV a worker's GPUs hold next to {cfg.model}'s "
            "weights: they are not replayed (table column 'unfit'); more --gpu-gb or a smaller "
            "--model fits more",
            file=sys.stderr,
        )
        if unfit == len(trace):
            raise ValueError("no prompt of the trace fits a worker: raise --gpu-gb or pick a smaller --model")
    ctx = cfg.max_context_tokens
    over = int((trace.input_tokens > ctx).sum()) if ctx else 0
    if over:
        print(
            f"note: {over} of {len(trace)} prompts (longest {longest:,} tokens) exceed "
            f"{cfg.model}'s {ctx:,}-token context (max_position_embeddings); they are replayed "
            "with its KV shape and speed as if it accepted them (pick a --model with a longer "
            "context to model one that does)",
            file=sys.stderr,
        )


def _plot(
    args: argparse.Namespace, trace: Any, cfg: Any, names: list[str],
    results: dict[str, dict[str, Any]], quiet: bool | None,
) -> None:
    from kvshare.router.sim.replay import global_lru, simulate
    from kvshare.router.sim.report import plot, summarize

    caps = [max(cfg.block_tokens, int(cfg.host_tokens * f)) for f in PLOT_FRACTIONS]
    curve: dict[str, list[tuple[float, float]]] = {"global_lru": []}
    with _bar(quiet, len(trace) * len(caps) * (1 + len(names)), "plot", "req") as tick:
        for c in caps:
            curve["global_lru"].append((c, global_lru(trace, replace(cfg, host_tokens=c), progress=tick)))
        for n in names:
            pts = []
            for c in caps:
                r = simulate(trace, replace(cfg, host_tokens=c), [n], args.sharing, tick,
                             reference=False)
                pts.append((float(c), summarize(r.rows[n], [1.0])["hit_rate"]))
            curve[n] = pts
    title = f"{trace.name}, {cfg.workers} workers, sharing={args.sharing}"
    plot(args.plot, curve, results, title)


@contextmanager
def _bar(quiet: bool | None, total: int | None, desc: str, unit: str) -> Iterator[Callable[[int], Any]]:
    try:
        from tqdm import tqdm
    except ImportError:  # the progress extra is not installed: run without a bar
        yield lambda _n: None
        return
    bar = tqdm(total=total, unit=unit, unit_scale=unit == "B", disable=quiet,
               file=sys.stderr, desc=desc, mininterval=0.5)
    try:
        yield bar.update
        if bar.total is not None and bar.n < bar.total:
            bar.update(bar.total - bar.n)  # the phase is done (e.g. --limit skipped the rest)
    finally:
        bar.close()
