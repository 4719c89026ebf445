"""What the tier value ledger costs the pool's hot path, against the same pool without it.

Two pools per round, alternated: the same :class:`~kvshare.pool.tiered.TieredBlockPool`, one
with its :class:`~kvshare.pool.value.ValueLedger` as node pools run it, one whose ledger
records nothing (the baseline, same run). Each round drives ``--requests`` requests of
``--chain`` blocks through it as a worker does: ``prefix_len``, ``pin`` + ``unpin`` of the
prefix it holds, ``reserve`` + ``commit`` of the rest; every ``--reuse``-th request repeats an
earlier one (hits), the rest are new (stores, evictions). ``--bytes`` gives the pool a host
slab and a disk tier (copies and moves are timed by the ledger); by default it keeps books
only (the pool's bookkeeping alone, where the ledger's share is largest). Medians over
``--rounds``; the last line is one JSON object with ``us_per_block`` both ways and the ratio.

    python benchmarks/pool_value.py [--bytes] [--rounds 5]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's kvshare first
from kvshare.layout import KVLayout  # noqa: E402
from kvshare.pool.tiered import TieredBlockPool  # noqa: E402
from kvshare.pool.types import PoolConfig, Reserved, TierSpec  # noqa: E402
from kvshare.pool.value import ValueLedger  # noqa: E402
from kvshare.tiers.base import TierStore  # noqa: E402
from kvshare.tiers.disk import DiskStore  # noqa: E402
from kvshare.tiers.host import HostSlab  # noqa: E402
from kvshare.types import BlockHash, Tier  # noqa: E402

LAYOUT = KVLayout(2, 2, 16, "fp16", 16)  # 4 KiB blocks


class SilentLedger(ValueLedger):
    """The baseline: a ledger that records nothing."""

    def add(self, tier: str, field: int, amount: float) -> None:
        return None

    def moved(self, tier: str, nbytes: int, seconds: float, *, into: bool) -> None:
        return None


def make_pool(host_blocks: int, disk_blocks: int, with_bytes: bool, directory: str,
              silent: bool) -> TieredBlockPool:
    bb = LAYOUT.bytes_per_block
    tiers = (TierSpec(Tier.HOST, host_blocks * bb), TierSpec(Tier.DISK, disk_blocks * bb))
    stores: dict[Tier, TierStore] | None = None
    if with_bytes:
        stores = {Tier.HOST: HostSlab(bb, host_blocks),
                  Tier.DISK: DiskStore(directory, bb, disk_blocks, LAYOUT.fingerprint())}
    pool = TieredBlockPool(PoolConfig("bench", LAYOUT, tiers, sizing_blocks=16384), stores)
    if silent:
        pool.value = SilentLedger(pool.value.tiers)
        pool.books.value = None
    return pool


def h(i: int) -> BlockHash:
    return BlockHash(hashlib.sha256(i.to_bytes(8, "little")).digest())


def drive(pool: TieredBlockPool, requests: int, chain: int, reuse: int, with_bytes: bool) -> float:
    """Seconds of CPU (this process) per block for the workload in the module docstring."""
    import numpy as np

    payload = np.zeros(LAYOUT.bytes_per_block, dtype=np.uint8)
    blocks = 0
    t0 = time.process_time()
    for r in range(requests):
        base = (r // 2 if r % reuse == 0 else r) * chain
        hs = [h(base + i) for i in range(chain)]
        held = pool.prefix_len(hs)
        leases = pool.pin(hs[:held], "w") if held else []
        pool.unpin([x.lease_id for x in leases if x is not None])
        res = pool.reserve(hs[held:], "w")
        ids = []
        for x in res:
            if isinstance(x, Reserved):
                if with_bytes:
                    pool.write(x.lease_id, payload)
                ids.append(x.lease_id)
        pool.commit(ids, None if with_bytes else [0] * len(ids))
        blocks += chain
    return (time.process_time() - t0) / blocks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--chain", type=int, default=64)
    ap.add_argument("--reuse", type=int, default=3, help="every Nth request repeats one")
    ap.add_argument("--bytes", action="store_true", help="host slab + disk files, not books only")
    args = ap.parse_args(argv)
    host, disk = 4096, 8192
    got: dict[str, list[float]] = {"with": [], "without": []}
    with tempfile.TemporaryDirectory(prefix="kvs-value-bench-") as tmp:
        for r in range(args.rounds):
            for name in (("with", "without") if r % 2 == 0 else ("without", "with")):
                pool = make_pool(host, disk, args.bytes, os.path.join(tmp, f"{name}{r}"),
                                 silent=name == "without")
                got[name].append(drive(pool, args.requests, args.chain, args.reuse, args.bytes))
                pool.close()
    med = {k: statistics.median(v) * 1e6 for k, v in got.items()}
    out: dict[str, Any] = {
        "bytes": args.bytes, "rounds": args.rounds, "blocks_per_round": args.requests * args.chain,
        "us_per_block": round(med["with"], 3), "baseline_us_per_block": round(med["without"], 3),
        "ratio": round(med["with"] / med["without"], 4),
        "added_us_per_block": round(med["with"] - med["without"], 3),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    print(f"pool with the value ledger {out['us_per_block']} us a block, without "
          f"{out['baseline_us_per_block']} us (same run, medians of {args.rounds})")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
