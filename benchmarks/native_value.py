"""What each C module lifts: the user-visible figure it serves, with and without it, one run.

Each native module has a Python twin that runs where it is not built; here a module is taken
away by blocking its import (``sys.modules["kvshare._native._x"] = None``: the import fails, the same
fallback as an install without a compiler) in a child process, or by the switch its caller
has, and the figure is measured both ways, alternated ``--rounds`` times (medians):

- ``_chain``: hashing tokens/s of 8,192-token prompts (lists of ints, 256-token blocks, as
  the gateway hashes them), sha256 (the default) and the opt-in xxh3-128;
- ``_statemap``: the index's events/s (Arrow batches of BlockStored) and match/s
  (``benchmarks/index.py``'s workload);
- ``_copy``: the host tier's store and load GB/s (``benchmarks/pool_bandwidth.py``'s pool
  steps, ``HostSlab.stream_copies`` on and off on the same slab);
- for context, gateway requests/s (:mod:`benchmarks.gateway_load`'s concurrent leg) with
  everything built and with ``_chain`` or ``_statemap`` blocked.

Verdict per module: kept where a figure it serves lifts >= 1.3x. The table is printed; the
last line is one JSON object. The modules this removed (``_pending``, ``_ready``,
``_select``, ``_plan``: gateway requests/s 0.86-0.95x; ``_hashq``: NIXL reads checked by
the reader 1.02x) were measured by this script at commit 57497ad, which still has them
(``docs/native_modules.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import gateway_load  # noqa: E402

KEEP_AT = 1.3
TOKENS = 8192
BLOCK = 256


def _block(mods: str) -> None:
    for name in filter(None, mods.split(",")):
        sys.modules[f"kvshare._native.{name}"] = None  # type: ignore[assignment]


# ---------------------------------------------------------------- child measurements


def hashing_figures() -> dict[str, float]:
    """Tokens/s of block_hashes on new 8,192-token prompts (lists of ints), best of 5."""
    import random

    from kvshare.hashing import HashFn, block_hashes, namespace_root

    rng = random.Random(0)
    prompts = [[rng.randrange(128_000) for _ in range(TOKENS)] for _ in range(100)]
    out = {}
    for fn in (HashFn.SHA256, HashFn.XXH3_128):
        root = namespace_root("bench", "layout", fn=fn)
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            for p in prompts:
                block_hashes(root, p, BLOCK, fn=fn)
            best = min(best, time.perf_counter() - t)
        out[f"{fn.value}_tokens_per_s"] = len(prompts) * TOKENS / best
    return out


def index_figures() -> dict[str, float]:
    """benchmarks/index.py's apply and match figures (CPU time; apply once, match best of 3)."""
    import gc

    import numpy as np

    from benchmarks.index import (
        BLOCK_TOKENS,
        DOCS,
        NODES,
        PROMPTS,
        VOCAB,
        event_batches,
        make_prompts,
    )
    from kvshare.hashing import block_hashes, namespace_root
    from kvshare.types import Location

    rng = np.random.default_rng(0)
    root = namespace_root("bench-model", "bench-layout")
    docs = [rng.integers(0, VOCAB, int(rng.integers(128, 449)) * BLOCK_TOKENS)
            for _ in range(DOCS)]
    stored = make_prompts(rng, docs, PROMPTS)
    fresh = make_prompts(rng, docs, PROMPTS)
    hashes = [block_hashes(root, p, BLOCK_TOKENS) for p in stored + fresh]
    nodes = [Location(f"node:n{i:02d}") for i in range(NODES)]
    placement = [rng.choice(NODES, int(rng.integers(1, 4)), replace=False).tolist()
                 for _ in stored]
    apply_s = match_s = float("inf")
    n_events = 0
    for _ in range(3):
        index, batches = event_batches(hashes, placement, nodes)
        n_events = sum(b.num_rows for b in batches)
        t = time.process_time()
        for b in batches:
            index.apply_arrow(b)
        apply_s = min(apply_s, time.process_time() - t)
        gc.collect()
        t = time.process_time()
        for q in hashes:
            index.match("bench", q)
        match_s = min(match_s, time.process_time() - t)
    return {"events_per_s": n_events / apply_s, "match_per_s": len(hashes) / match_s}


CHILDREN: dict[str, Callable[[], dict[str, float]]] = {
    "hashing": hashing_figures, "index": index_figures}


def child(kind: str, blocked: str) -> dict[str, float]:
    """Run ``kind``'s figures in a fresh process with ``blocked`` modules taken away."""
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", kind, "--block", blocked],
        check=True, capture_output=True, text=True, cwd=ROOT)
    got: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return got


# ---------------------------------------------------------------- in this process


def pool_figures(rounds: int, mib: int) -> dict[str, dict[str, float]]:
    """Host tier store/load GB/s with streaming copies (``kvshare._native._copy``) and numpy's copy,
    interleaved on the same pool; best of each round's pass, median over rounds."""
    import numpy as np

    from benchmarks.pool_bandwidth import BLOCK as POOL_BLOCK
    from benchmarks.pool_bandwidth import LAYOUT, interleaved, pool_steps
    from kvshare.hashing import block_hashes, namespace_root
    from kvshare.pool.tiered import TieredBlockPool
    from kvshare.pool.types import PoolConfig, TierSpec
    from kvshare.tiers.base import STREAMING_COPY
    from kvshare.tiers.host import HostSlab, segment_name
    from kvshare.types import Tier

    if not STREAMING_COPY:
        raise RuntimeError("kvshare._native._copy is not built (setup.py build_ext --inplace)")
    n = max(1, mib * 2**20 // POOL_BLOCK)
    nbytes = n * POOL_BLOCK
    root = namespace_root("bench", LAYOUT.fingerprint())
    hashes = block_hashes(root, np.arange(n * LAYOUT.block_tokens) % 50000, LAYOUT.block_tokens)
    src = np.random.default_rng(0).integers(0, 256, (n, POOL_BLOCK), dtype=np.uint8)
    dst = np.ones((n, POOL_BLOCK), dtype=np.uint8)
    cfg = PoolConfig("bench", LAYOUT, (TierSpec(Tier.HOST, nbytes),))
    slab = HostSlab(POOL_BLOCK, n, segment_name("bench", f"nv{os.getpid()}", 0))
    pool = TieredBlockPool(cfg, {Tier.HOST: slab})
    runs: dict[str, list[float]] = {}
    try:
        steps = {**pool_steps(pool, hashes, src, dst, "with", stream=True),
                 **pool_steps(pool, hashes, src, dst, "without", stream=False)}
        for _ in range(rounds):
            for k, v in interleaved(nbytes, 2, steps).items():
                runs.setdefault(k, []).append(v)
        assert np.array_equal(src, dst), "the host tier returned other bytes"
    finally:
        pool.close()
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {side: {"store_GBps": med[f"{side}_store"], "load_GBps": med[f"{side}_load"]}
            for side in ("with", "without")}


def gateway_figures(rounds: int, seconds: float, concurrency: int,
                    variants: dict[str, tuple[str, ...]]) -> dict[str, float]:
    """Gateway requests/s per variant (C modules blocked in that gateway), alternated."""
    body_list = gateway_load.bodies(2000, seed=2)
    up = gateway_load.upstream(4)
    gws = {name: gateway_load.gateway(up.urls, blocked) for name, blocked in variants.items()}
    runs: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for gw in gws.values():
            gateway_load.run_leg(gw.urls, body_list, 4, count=200)  # warm-up
        for r in range(rounds):
            names = list(gws) if r % 2 == 0 else list(reversed(gws))
            for name in names:
                leg = gateway_load.run_leg(gws[name].urls, body_list, concurrency, seconds=seconds)
                runs[name].append(leg.requests_per_s)
    finally:
        for gw in gws.values():
            gw.stop()
        up.stop()
    print("gateway requests/s per round: " + "; ".join(
        f"{k} {[round(x) for x in v]}" for k, v in runs.items()), flush=True)
    return {name: statistics.median(v) for name, v in runs.items()}


# ---------------------------------------------------------------- the table


def row(module: str, figure: str, with_: float, without: float, unit: str,
        primary: bool = True) -> dict[str, Any]:
    """One figure with and without ``module``; ``primary``: the figure the module serves
    (its verdict reads those), else shown for context."""
    return {"module": module, "figure": figure, "with": with_, "without": without,
            "unit": unit, "ratio": with_ / without, "primary": primary}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    ap.add_argument("--block", default="", help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=3, help="alternations per figure (default 3)")
    ap.add_argument("--seconds", type=float, default=3.0, help="per gateway leg (default 3)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--mib", type=int, default=256, help="host tier pass size (default 256)")
    args = ap.parse_args()
    if args.child:
        _block(args.block)
        print(json.dumps(CHILDREN[args.child]()))
        return

    rows: list[dict[str, Any]] = []
    variants: dict[str, tuple[str, ...]] = {"all built": ()}
    variants.update({f"no {m}": (m,) for m in ("_chain", "_statemap")})
    gw = gateway_figures(args.rounds, args.seconds, args.concurrency, variants)
    for m in ("_chain", "_statemap"):
        rows.append(row(m, "gateway requests/s", gw["all built"], gw[f"no {m}"], "req/s",
                        primary=False))

    hashing: dict[str, list[dict[str, float]]] = {"with": [], "without": []}
    index: dict[str, list[dict[str, float]]] = {"with": [], "without": []}
    for _ in range(args.rounds):
        hashing["with"].append(child("hashing", ""))
        hashing["without"].append(child("hashing", "_chain"))
        index["with"].append(child("index", ""))
        index["without"].append(child("index", "_statemap"))

    def med(runs: list[dict[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    for key, label in (("sha256_tokens_per_s", "hashing tokens/s, sha256"),
                       ("xxh3_128_tokens_per_s", "hashing tokens/s, xxh3-128")):
        rows.append(row("_chain", label, med(hashing["with"], key), med(hashing["without"], key),
                        "tokens/s"))
    for key, label in (("events_per_s", "index events/s"), ("match_per_s", "index match/s")):
        rows.append(row("_statemap", label, med(index["with"], key), med(index["without"], key),
                        "/s"))

    pool = pool_figures(args.rounds, args.mib)
    for key, label in (("store_GBps", "host tier store GB/s"), ("load_GBps", "host tier load GB/s")):
        rows.append(row("_copy", label, pool["with"][key], pool["without"][key], "GB/s"))

    verdict: dict[str, str] = {}
    for r in rows:  # kept where it lifts any figure it serves by KEEP_AT
        if r["primary"]:
            kept = verdict.get(r["module"]) == "kept" or r["ratio"] >= KEEP_AT
            verdict[r["module"]] = "kept" if kept else "removed"
    print(f"\n{'module':10s} {'figure':28s} {'with':>12s} {'without':>12s} {'ratio':>6s}")
    for r in rows:
        mark = "" if r["primary"] else "  (context)"
        print(f"{r['module']:10s} {r['figure']:28s} {r['with']:12,.2f} {r['without']:12,.2f} "
              f"{r['ratio']:6.2f}{mark}")
    print(f"keep at >= {KEEP_AT}x: " + ", ".join(f"{m} {v}" for m, v in verdict.items()))
    print(json.dumps({"rows": [{k: (round(v, 3) if isinstance(v, float) else v)
                                for k, v in r.items()} for r in rows],
                      "verdict": verdict, "keep_at": KEEP_AT, "rounds": args.rounds,
                      "cpu_count": os.cpu_count()}))


if __name__ == "__main__":
    main()
