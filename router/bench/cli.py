"""``kvshare bench``: replay a trace or a chat log against an OpenAI-compatible endpoint (and
with ``--compare`` a second one, the same workload, one after the other), then print a table,
optionally one JSON object and a PNG. Progress goes to stderr."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the command's modules load when it runs, not when ``kvshare`` starts
    from kvshare.router.bench.workload import Workload
    from kvshare.router.sim.trace import Trace

SETTLE_S = 0.5  # before the last scrape: vLLM's counters follow its last outputs


def add_bench(subparsers: Any, positive_int: Any, agentic_options: Any) -> None:
    b = subparsers.add_parser(
        "bench", help="replay a workload against a live endpoint: TTFT, throughput, hit rate per tier",
        description="Replay a trace (Mooncake JSONL; kv-cache-tester JSON files or a folder, "
        "sub-agents as concurrent users) or a JSONL log of chat requests ({messages, timestamp} "
        "a line) against an OpenAI-compatible URL (a kvshare gateway or a vLLM server), at the "
        "trace's times scaled by --speed, streaming. Reports TTFT p50/p90/p99, inter-token "
        "latency, requests/s and output tokens/s completed, and the hit rate per tier from "
        "vLLM's /metrics (the gateway's workers for a gateway URL).")
    b.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    b.add_argument("--trace", required=True, nargs="+", type=Path,
                   help="trace file, agentic folder/files, or chat log JSONL")
    b.add_argument("--format", default="auto", choices=["auto", "mooncake", "agentic", "chat"],
                   help="workload format (default: detected)")
    b.add_argument("--compare", default=None, metavar="URL2",
                   help="replay the same workload against URL2 after URL and print the ratios")
    b.add_argument("--speed", type=_positive_float, default=1.0,
                   help="scale the trace's arrival rate (2 = twice as fast; default 1)")
    b.add_argument("--max-concurrency", type=positive_int, default=None,
                   help="requests in flight at most (default: unbounded, open loop)")
    b.add_argument("--duration", type=_positive_float, default=None, metavar="S",
                   help="send nothing that is due after S seconds (in-flight requests finish)")
    b.add_argument("--max-requests", type=positive_int, default=None, help="first N requests only")
    b.add_argument("--max-tokens", type=positive_int, default=256,
                   help="cap on each request's output tokens (default 256; the trace's if lower)")
    b.add_argument("--block-tokens", type=positive_int, default=None,
                   help="tokens per trace hash id (default: the trace's: 512 for Mooncake)")
    b.add_argument("--vocab", type=positive_int, default=32000,
                   help="the model's vocabulary size: token ids are drawn in [100, vocab) "
                   "(default 32000)")
    b.add_argument("--model", default=None, help="model name to send (default: the URL's first "
                   "in /v1/models)")
    b.add_argument("--workers", default="", help="comma-separated vLLM URLs to read tier "
                   "counters from (default: the URL, or the workers a gateway's /health lists)")
    b.add_argument("--metrics-interval", type=_positive_float, default=1.0, metavar="S",
                   help="seconds between /metrics scrapes for the hit rate over time (default 1)")
    b.add_argument("--timeout", type=_positive_float, default=300.0, help="per request, s")
    agentic_options(b, "agentic traces (kv-cache-tester's replay knobs, as in kvshare sim)")
    b.add_argument("--json", action="store_true", help="print one JSON object after the table")
    b.add_argument("--plot", default=None, metavar="PNG", help="write TTFT CDF and hit rate over time")
    b.add_argument("--progress", action="store_true",
                   help="progress on stderr even when it is not a terminal")
    b.set_defaults(func=run_bench)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def run_bench(args: argparse.Namespace) -> int:
    from kvshare.router.bench.report import document, plot, table
    from kvshare.router.bench.workload import read_source

    try:
        source = read_source(args.trace, args.format, block_tokens=args.block_tokens,
                             max_tokens=args.max_tokens, limit=args.max_requests,
                             users=args.users, warm_prefix_pct=args.warm_prefix_pct,
                             max_delay_s=args.max_delay)
    except (ValueError, FileNotFoundError) as e:
        print(f"kvshare bench: {e} (nothing sent)", file=sys.stderr)
        return 2
    import httpx

    try:
        runs = asyncio.run(_runs(args, source))
    except (httpx.HTTPError, ValueError) as e:
        print(f"kvshare bench: {e}", file=sys.stderr)
        return 2
    print(table(runs))
    if args.plot:
        plot(runs, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.json:
        print(json.dumps(document(runs)))
    return 0 if all(r["requests"]["failed"] == 0 for r in runs) else 1


async def _runs(args: argparse.Namespace, source: Trace | Workload) -> list[dict[str, Any]]:
    urls = [args.url.rstrip("/")] + ([args.compare.rstrip("/")] if args.compare else [])
    workers = [w.strip().rstrip("/") for w in args.workers.split(",") if w.strip()]
    out = []
    for url in urls:
        out.append(await _one(args, url, source, workers if url == urls[0] else []))
    return out


async def _one(args: argparse.Namespace, url: str, source: Trace | Workload,
               workers: list[str]) -> dict[str, Any]:
    import httpx

    from kvshare.router.bench.client import Limits, replay, served_model
    from kvshare.router.bench.report import summarize
    from kvshare.router.bench.tiers import TierSampler, discover
    from kvshare.router.bench.workload import Workload, from_trace

    async with httpx.AsyncClient(timeout=30.0) as http:
        target = await discover(http, url, workers)
        try:
            model, max_len = await served_model(http, url)
        except httpx.HTTPError as e:
            raise ValueError(f"{url}/v1/models: {e} (is --url an OpenAI-compatible server?)") from e
        model = args.model or model
        workload = source if isinstance(source, Workload) else from_trace(
            source, args.vocab, args.max_tokens, max_len, args.max_requests)
        if workload.truncated:
            print(f"{url}: {workload.truncated} prompts cut to the model's {max_len} tokens",
                  file=sys.stderr)
        sampler = TierSampler(target.metrics_urls, args.metrics_interval)
        stop = asyncio.Event()
        t0 = time.perf_counter()
        if target.metrics_urls:  # the baseline, before any request of the run is admitted
            await sampler.scrape(http, t0)
        scraping = asyncio.create_task(sampler.run(http, t0, stop))
        show = args.progress or sys.stderr.isatty()
        n = len(workload.requests)

        def progress(sent: int, done: int, failed: int, elapsed: float) -> None:
            if show:
                tty = sys.stderr.isatty()
                line = f"{url}: sent {sent}/{n}, done {done}, failed {failed}, {elapsed:.0f} s"
                print("\r" + line if tty else line, end="" if tty else "\n", file=sys.stderr,
                      flush=True)

        print(f"{url} ({target.kind}, model {model}): {n} requests from {workload.name}",
              file=sys.stderr)
        limits = Limits(args.speed, args.max_concurrency, args.duration, args.timeout)
        run = await replay(url, model, workload, limits, progress)
        if show and sys.stderr.isatty():
            print(file=sys.stderr)
        await asyncio.sleep(SETTLE_S)
        stop.set()
        await scraping
        summary = summarize(run, target, sampler if target.metrics_urls else None)
        if summary["hit_rate_from"] != ["usage"]:  # else the answers said where hits came from
            for problem in sampler.errors[:3]:
                print(f"{url}: tier counters: {problem}", file=sys.stderr)
        return summary
