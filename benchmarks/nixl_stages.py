"""Where a kvshare NIXL READ's time goes, against raw NIXL on the same kind of memory.

The set-up of ``benchmarks/transfer.py`` (a pool actor on fake node A holding 256 MiB in
16 MiB blocks in its tmpfs slab, a reader actor on node B) and, interleaved in the same run,
``benchmarks/raw_nixl.py`` (two plain processes). Per leg the median of 5 timed batches after
a warm-up, each split into the stages ``NixlTransport`` marks (``control``: the pin call's
round trip; ``prepare``: peer lookup, registration check, descriptors; ``post``: creating and
posting the transfers (UCX cma copies inside the post); ``move``: polling until done;
``release``: the handles; ``finish``: the release call with the pool's checksum verdict).
Legs: ``nixl`` (the default: the pool checks while the READ runs), ``nixl_unverified``
(``verify=False``: what the checksum costs), ``nixl_end_to_end`` (the reader checks the
blocks once they landed) and ``bare_in_actor`` (the reader actor's own agent reading the pinned slots with
one initialize_xfer/transfer/poll, nothing else: what the actor process costs against two
plain processes). Last line: one JSON object.

    .venv/bin/python benchmarks/nixl_stages.py
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ray

from benchmarks.raw_nixl import RawNixl
from benchmarks.transfer import LAYOUTS, REPEATS, TOTAL, PoolHost, Reader, hashes
from kvshare.actors.local_cluster import local_cluster

MiB = 2**20
BLOCK = 16 * MiB


class StageReader(Reader):
    """:class:`benchmarks.transfer.Reader` that also reports per-stage medians."""

    def __init__(self, node: str, pool: Any, agent: str) -> None:
        super().__init__(node, pool, agent)
        from kvshare.transfer.reader.nixl import NixlTransport

        self.transports["nixl_unverified"] = NixlTransport(agent + "-nv", verify=False)
        self.transports["nixl_unverified"].register(self.dest)

    def stages(self, name: str) -> dict[str, float]:
        """Median GB/s and per-stage milliseconds of ``REPEATS`` reads (after one warm-up)."""
        tr = self.transports[name]
        ctl = self.control(self.pool, f"bench{BLOCK // MiB}m")
        hs = hashes(BLOCK)
        dest = list(self.dest.reshape(len(hs), BLOCK))
        rows: list[dict[str, float]] = []
        for _ in range(REPEATS + 1):
            t0 = time.perf_counter()
            t = tr.submit_read(ctl, hs, dest, deadline_s=60.0)
            res = tr.wait(t)
            total = time.perf_counter() - t0
            if not res.ok:
                raise RuntimeError(f"{name} read failed: {res.reasons()}")
            row = {k: v * 1e3 for k, v in t.state["stages"].items()}
            row["total"] = total * 1e3
            rows.append(row)
        out = {k: round(statistics.median(r.get(k, 0.0) for r in rows[1:]), 2) for k in rows[-1]}
        out["GBps"] = round(TOTAL / (out["total"] / 1e3) / 1e9, 3)
        return out

    def bare(self) -> dict[str, float]:
        """The reader's agent READs the pinned slots directly: one initialize_xfer + transfer +
        poll per batch, as raw NIXL does (pins taken once, ended after)."""
        from kvshare.transfer.base import call
        from kvshare.transfer.nixl_agent import xfer_descs

        tr = self.transports["nixl"]
        ctl = self.control(self.pool, f"bench{BLOCK // MiB}m")
        hs = hashes(BLOCK)
        holder = f"bare-{time.monotonic_ns()}"  # a finished holder can pin nothing again
        prep = call(ctl.prepare_read(hs, holder, 120.0, False), 30.0)
        remote, info = tr._peer(ctl, prep.nixl_agent, 30.0)
        base = int(self.dest.ctypes.data)
        local = tr.agent.get_xfer_descs(xfer_descs([base + i * BLOCK for i in range(len(hs))], BLOCK), "DRAM")
        far = tr.agent.get_xfer_descs(
            xfer_descs([info.base_addr + b.slot * BLOCK for b in prep.blocks], BLOCK), "DRAM")
        times = []
        try:
            for _ in range(REPEATS + 1):
                t0 = time.perf_counter()
                handle = tr.agent.initialize_xfer("READ", local, far, remote)
                state = tr.agent.transfer(handle)
                while state == "PROC":
                    state = tr.agent.check_xfer_state(handle)
                times.append(time.perf_counter() - t0)
                tr.agent.release_xfer_handle(handle)
                assert state == "DONE", state
        finally:
            call(ctl.finish(holder, []), 10.0)
        ms = statistics.median(times[1:]) * 1e3
        return {"total": round(ms, 2), "GBps": round(TOTAL / (ms / 1e3) / 1e9, 3)}


def main() -> None:
    host_cls = ray.remote(num_cpus=0, max_concurrency=4)(PoolHost)
    reader_cls = ray.remote(num_cpus=0)(StageReader)
    legs = ("nixl", "nixl_unverified", "nixl_end_to_end")
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in ("raw", "bare_in_actor", *legs)}
    with local_cluster(2, head_cpus=0, head_store_mib=200, node_store_mib=400,
                       resources=[{"bench_a": 10}, {"bench_b": 10}], temp_prefix="kvs-stages-"):
        assert BLOCK in LAYOUTS
        host = host_cls.options(resources={"bench_a": 1}).remote("bench-a")
        b = reader_cls.options(resources={"bench_b": 1}).remote("bench-b", host, "stages/b/reader")
        ray.get([host.ready.remote(), b.memcpy.remote()])
        raw_nixl = RawNixl(TOTAL, BLOCK, REPEATS)
        try:
            for _ in range(3):
                runs["raw"].append({"GBps": round(raw_nixl.read_gbps(), 3)})
                runs["bare_in_actor"].append(ray.get(b.bare.remote()))
                for name in legs:
                    runs[name].append(ray.get(b.stages.remote(name)))
                print("round:", {k: v[-1] for k, v in runs.items()}, flush=True)
        finally:
            raw_nixl.close()
        ray.get(host.shutdown.remote())
    best = {k: max(v, key=lambda r: r["GBps"]) for k, v in runs.items()}
    raw = best["raw"]["GBps"]
    best["raw"]["total"] = round(TOTAL / raw / 1e6, 2)
    for k, v in best.items():
        print(f"{k:16s} {v['GBps']:6.2f} GB/s ({v['GBps'] / raw:.2f}x raw)  "
              + "  ".join(f"{s}={ms}" for s, ms in v.items() if s != "GBps"), flush=True)
    result: dict[str, Any] = {"raw_nixl_GBps": raw}
    for k, v in best.items():
        if k != "raw":
            result[f"{k}_vs_raw"] = round(v["GBps"] / raw, 3)
    result["stages_ms"] = {k: v for k, v in best.items()}
    result["runs_GBps"] = {k: [r["GBps"] for r in v] for k, v in runs.items()}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
