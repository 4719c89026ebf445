"""Transfer benchmark: node B pulls 256 MiB from node A's pool in 2 MiB and 16 MiB blocks.

Two fake nodes (``ray.cluster_utils.Cluster``): a pool actor on node A serves two namespaces
(2 MiB and 16 MiB blocks, 256 MiB each, random bytes); a reader actor on node B pulls every
block through ``nixl`` (default UCX transports: cma here, the stand-in for RDMA),
``nixl_push`` (the pool WRITEs into the reader's registered memory) and ``objstore``; a
reader on node A pulls through ``shm`` (shared memory is same-node only). The NIXL case runs again with a second pool/reader pair started with ``UCX_TLS=tcp,self`` (what
hosts without RDMA get). Each figure is the median of 5 timed batches (3 for objstore) after one warm-up, with
checksums verified as in production. Baseline: plain numpy copy of the same 256 MiB in the
reader. ``nixl`` is the default ``NixlTransport``: the holding pool checks the pinned slots
against their checksums while one READ runs; ``nixl_end_to_end`` has the reader check every
block once it landed instead (after the read).
Second baseline, raw NIXL (``benchmarks/raw_nixl.py``): two plain processes, one READ
of the same 256 MiB in 16 MiB blocks from a tmpfs mapping like the pool's slab, nothing of
kvshare around it, no checksum (``nixl_vs_raw_same_memory`` = kvshare's default nixl / raw,
each the best of 3 interleaved medians, in the same run). Then the pools' own
probes (the ``transfer_measure`` the watcher runs: node A probes itself for shm, node B probes
node A for nixl and objstore) and ``probe_vs_measured``: the lowest published/measured ratio
over shm, nixl and objstore. Last line: one JSON object (16 MiB-block figures and ratios).

    .venv/bin/python benchmarks/transfer.py

``--hosts`` (root only) runs the two-host leg instead (``benchmarks/transfer_hosts.py``): NIXL
over UCX TCP against a plain TCP socket stream between two emulated hosts, same run
(``nixl_tcp_vs_socket``), and the pools' probe on the unshaped and a tbf-shaped link.

    sudo .venv/bin/python benchmarks/transfer.py --hosts [--rounds 5] [--ucx K=V,K=V]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ray

from benchmarks.raw_nixl import RawNixl
from kvshare.actors.local_cluster import local_cluster
from kvshare.layout import KVLayout
from kvshare.tiers.host import shm_huge_pages
from kvshare.transfer.holder.local import make_local_pool
from kvshare.transfer.node_api import TransferEndpoints, TransferService
from kvshare.transfer.probe import PROBE_NAMESPACE
from kvshare.types import BlockHash

MiB = 2**20
TOTAL = 256 * MiB
# 2 * layers * kv_heads * head_dim * 2 bytes (fp16) = 32 KiB per token
LAYOUTS = {2 * MiB: KVLayout(8, 8, 128, "fp16", 64), 16 * MiB: KVLayout(8, 8, 128, "fp16", 512)}
REPEATS = 5


def hashes(block_bytes: int) -> list[BlockHash]:
    n = TOTAL // block_bytes
    return [BlockHash(block_bytes.to_bytes(8, "little") + i.to_bytes(24, "little")) for i in range(n)]


class PoolHost(TransferEndpoints):
    """Node A: one pool per block size, filled with random bytes, served like a NodePool."""

    def __init__(self, node: str) -> None:
        self.transfer = TransferService(node, nixl=True)
        noise = np.frombuffer(np.random.default_rng(1).bytes(TOTAL), dtype=np.uint8)
        for bb, layout in LAYOUTS.items():
            pool = make_local_pool(f"bench{bb // MiB}m", node, layout, TOTAL // bb)
            for i, h in enumerate(hashes(bb)):
                assert pool.put(h, noise[i * bb : (i + 1) * bb])
            self.transfer.add_pool(pool)

    def ready(self) -> bool:
        return True

    def slab_huge_page_bytes(self) -> int:
        """Bytes of the pools' slabs backed by 2 MiB pages in this process."""
        total = 0
        for bb in LAYOUTS:
            slab = self.transfer.source(f"bench{bb // MiB}m").slab
            total += slab.huge_page_bytes() if slab is not None else 0
        return total

    def shutdown(self) -> None:
        pools = [self.transfer.source(f"bench{bb // MiB}m").pool for bb in LAYOUTS]
        self.transfer.close()
        for p in pools:
            p.close()  # unmaps and unlinks the /dev/shm slab


class ProbeHost(TransferEndpoints):
    """Node B's pool side for the probe only: it measures node A as the watcher asks pools to."""

    def __init__(self, node: str) -> None:
        self.transfer = TransferService(node, nixl=True)

    def shutdown(self) -> None:
        self.transfer.close()


class Reader:
    """Pulls every block of a namespace into pre-touched memory and times it."""

    def __init__(self, node: str, pool: Any, agent: str) -> None:
        from kvshare.transfer.reader.control import ActorControl
        from kvshare.transfer.reader.objstore import ObjStoreTransport
        from kvshare.transfer.reader.shm import ShmTransport

        self.node = node
        self.pool = pool
        from kvshare.transfer.reader.nixl import aligned_empty

        self.dest = aligned_empty(TOTAL)  # 2 MiB-aligned: see aligned_empty
        self.dest.fill(1)  # pre-touched
        self.src = np.ones(TOTAL, dtype=np.uint8)
        self.transports: dict[str, Any] = {"shm": ShmTransport(node), "objstore": ObjStoreTransport()}
        try:
            from kvshare.transfer.reader.nixl import NixlTransport

            self.transports["nixl"] = NixlTransport(agent)
            self.transports["nixl"].register(self.dest)
            self.transports["nixl_end_to_end"] = NixlTransport(agent + "-e2e", end_to_end=True)
            self.transports["nixl_end_to_end"].register(self.dest)
            from kvshare.transfer.reader.nixl_push import NixlPushTransport

            self.transports["nixl_push"] = NixlPushTransport(agent + "-push")
            self.transports["nixl_push"].register(self.dest)
        except Exception as exc:
            print(f"nixl unavailable on {node}: {exc}", flush=True)
        self.control = ActorControl
        self.stages_ms: dict[tuple[str, int], dict[str, float]] = {}

    def memcpy(self) -> float:
        times = []
        for _ in range(REPEATS + 1):
            t = time.perf_counter()
            np.copyto(self.dest, self.src)
            times.append(time.perf_counter() - t)
        return TOTAL / statistics.median(times[1:]) / 1e9

    def pull(self, name: str, block_bytes: int) -> float:
        tr = self.transports[name]
        ctl = self.control(self.pool, f"bench{block_bytes // MiB}m")
        hs = hashes(block_bytes)
        dest = list(self.dest.reshape(len(hs), block_bytes))
        times = []
        stages: list[dict[str, float]] = []
        for _ in range((REPEATS if name != "objstore" else 3) + 1):  # objstore is slow: 3 runs
            t = time.perf_counter()
            transfer = tr.submit_read(ctl, hs, dest, deadline_s=60.0)
            res = tr.wait(transfer)
            times.append(time.perf_counter() - t)
            if not res.ok:
                raise RuntimeError(f"{name} read failed: {res.reasons()}")
            stages.append(transfer.state.get("stages", {}))
        self.stages_ms[(name, block_bytes)] = {
            k: round(statistics.median(s.get(k, 0.0) for s in stages[1:]) * 1e3, 2)
            for k in stages[-1]}
        return TOTAL / statistics.median(times[1:]) / 1e9

    def stages(self, name: str, block_bytes: int) -> dict[str, float]:
        """Median milliseconds per stage of the last :meth:`pull` (NIXL legs: see
        ``benchmarks/nixl_stages.py`` for what each stage holds)."""
        return self.stages_ms.get((name, block_bytes), {})


def main() -> None:
    host_cls = ray.remote(num_cpus=0, max_concurrency=4)(PoolHost)  # threaded, as NodePoolActor
    reader_cls = ray.remote(num_cpus=0)(Reader)
    out: dict[str, dict[int, float]] = {}
    with local_cluster(2, head_cpus=0, head_store_mib=200, node_store_mib=700,
                       resources=[{"bench_a": 10}, {"bench_b": 10}], temp_prefix="kvs-bench-"):
        host = host_cls.options(resources={"bench_a": 1}).remote("bench-a")
        b = reader_cls.options(resources={"bench_b": 1}).remote("bench-b", host, "bench/b/reader")
        a = reader_cls.options(resources={"bench_a": 1}).remote("bench-a", host, "bench/a/reader")
        ray.get([host.ready.remote(), a.memcpy.remote()])  # pools filled, readers started
        memcpy = ray.get(b.memcpy.remote())
        print(f"memcpy (node B, 256 MiB): {memcpy:.2f} GB/s", flush=True)
        for bb in LAYOUTS:
            for name, reader in (("shm", a), ("nixl", b), ("nixl_end_to_end", b), ("nixl_push", b),
                                 ("objstore", b)):
                gbps = ray.get(reader.pull.remote(name, bb))
                out.setdefault(name, {})[bb] = gbps
                print(f"{name:15s} {bb // MiB:2d} MiB blocks: {gbps:6.2f} GB/s "
                      f"({gbps / memcpy:.2f}x memcpy)", flush=True)
        published = ray.get(host.transfer_measure.remote(PROBE_NAMESPACE, {"bench-a": host}))
        prober = ray.remote(num_cpus=0)(ProbeHost).options(resources={"bench_b": 1}).remote("bench-b")
        published.update({k: v for k, v in ray.get(prober.transfer_measure.remote(
            PROBE_NAMESPACE, {"bench-a": host})).items() if k != "shm"})
        ray.get(prober.shutdown.remote())
        print("published by the pools' probes (GB/s): "
              + ", ".join(f"{k}={v:.2f}" for k, v in sorted(published.items())), flush=True)
        raw_nixl = RawNixl(TOTAL, 16 * MiB, REPEATS)
        try:  # interleaved with kvshare's nixl on the same bytes, best of 3 each (noisy host)
            runs: dict[str, list[float]] = {"raw": [], "nixl": [], "nixl_end_to_end": []}
            stage_runs: list[tuple[float, dict[str, float]]] = []
            for _ in range(3):
                runs["raw"].append(raw_nixl.read_gbps())
                for name in ("nixl", "nixl_end_to_end"):
                    runs[name].append(ray.get(b.pull.remote(name, 16 * MiB)))
                stage_runs.append((runs["nixl"][-1], ray.get(b.stages.remote("nixl", 16 * MiB))))
        finally:
            raw_nixl.close()
        raw = max(runs["raw"])
        for name in ("nixl", "nixl_end_to_end"):
            out[name][16 * MiB] = max(runs[name])
        print(f"raw NIXL READ, two plain processes, tmpfs source, 16 MiB blocks: {raw:6.2f} GB/s "
              f"(kvshare nixl, interleaved with it: {out['nixl'][16 * MiB]:6.2f} GB/s; checked by "
              f"the reader instead: {out['nixl_end_to_end'][16 * MiB]:6.2f} GB/s; runs "
              + ", ".join(f"{k} {[round(x, 2) for x in v]}" for k, v in runs.items()) + ")",
              flush=True)
        nixl_stages = max(stage_runs)[1]  # of the fastest run, the one reported
        print(f"kvshare nixl READ stages (ms, median of that run): {nixl_stages}; raw: "
              f"{TOTAL / raw / 1e6:.2f} ms", flush=True)
        huge = ray.get(host.slab_huge_page_bytes.remote())
        again = ray.get(b.memcpy.remote())
        print(f"memcpy again: {again:.2f} GB/s (baseline = the faster of the two)", flush=True)
        memcpy = max(memcpy, again)
        ray.get(host.shutdown.remote())
        for actor in (host, a, b):
            ray.kill(actor)
        env = {"env_vars": {"UCX_TLS": "tcp,self", "NIXL_LOG_LEVEL": "WARN"}}
        host = host_cls.options(resources={"bench_a": 1}, runtime_env=env).remote("bench-a-tcp")
        b = reader_cls.options(resources={"bench_b": 1}, runtime_env=env).remote(
            "bench-b-tcp", host, "bench/b/reader-tcp")
        for bb in LAYOUTS:
            gbps = ray.get(b.pull.remote("nixl", bb))
            out.setdefault("nixl_tcp", {})[bb] = gbps
            print(f"nixl_tcp  {bb // MiB:2d} MiB blocks: {gbps:6.2f} GB/s "
                  f"({gbps / memcpy:.2f}x memcpy)", flush=True)
        ray.get(host.shutdown.remote())
        raw_nixl = RawNixl(TOTAL, 16 * MiB, 3, {"UCX_TLS": "tcp,self"})
        try:
            raw_tcp = raw_nixl.read_gbps()
        finally:
            raw_nixl.close()
        print(f"raw NIXL READ over tcp: {raw_tcp:6.2f} GB/s", flush=True)
    big = 16 * MiB
    result = {
        "memcpy_GBps": round(memcpy, 3),
        "shm_GBps": round(out["shm"][big], 3),
        "nixl_GBps": round(out["nixl"][big], 3),
        "nixl_tcp_GBps": round(out["nixl_tcp"][big], 3),
        "objstore_GBps": round(out["objstore"][big], 3),
        "nixl_vs_memcpy": round(out["nixl"][big] / memcpy, 3),
        "nixl_vs_objstore": round(out["nixl"][big] / out["objstore"][big], 3),
        "nixl_end_to_end_GBps": round(out["nixl_end_to_end"][big], 3),
        "nixl_push_GBps": round(out["nixl_push"][big], 3),
        "nixl_push_vs_memcpy": round(out["nixl_push"][big] / memcpy, 3),
        "raw_nixl_GBps": round(raw, 3),
        "raw_nixl_tcp_GBps": round(raw_tcp, 3),
        "nixl_vs_raw_same_memory": round(out["nixl"][big] / raw, 3),
        "nixl_tcp_vs_raw_tcp": round(out["nixl_tcp"][big] / raw_tcp, 3),
        "published_GBps": {k: round(v, 3) for k, v in sorted(published.items())},
        "probe_vs_measured": round(min(published.get(k, 0.0) / out[k][big]
                                       for k in ("shm", "nixl", "objstore")), 3),
        "probe_vs_measured_each": {k: round(published.get(k, 0.0) / out[k][big], 3)
                                   for k in ("shm", "nixl", "objstore")},
        "nixl_end_to_end_vs_raw": round(out["nixl_end_to_end"][big] / raw, 3),
        "nixl_stages_ms": nixl_stages,
        "raw_nixl_ms": round(TOTAL / raw / 1e6, 2),
        "shm_huge_pages": shm_huge_pages(),
        "slab_huge_page_MiB": huge // MiB,
    }
    print(f"targets: shm >= 0.8x memcpy: {result['shm_GBps'] / memcpy:.2f}x; "
          f"nixl >= 0.4x memcpy: {result['nixl_vs_memcpy']:.2f}x; "
          f"nixl >= 4x objstore: {result['nixl_vs_objstore']:.2f}x; "
          f"nixl_push (pool WRITEs into the reader): {result['nixl_push_vs_memcpy']:.2f}x memcpy",
          flush=True)
    print(f"note: NIXL here reads over UCX cma (process_vm_readv), which pins the source pages "
          f"on every transfer; the pool slab lives in /dev/shm (tmpfs), whose huge pages are "
          f"'{shm_huge_pages()}' here ({huge // MiB} MiB of the slabs on 2 MiB pages), so it pins "
          "4 KiB pages unless /dev/shm is mounted with huge=within_size or huge=advise (RDMA "
          "NICs register the slab once instead). nixl_push makes the pool the initiator: cma then pins the reader's "
          "(anonymous, huge-page) buffer and copies the slab by plain copy. The reader's buffer "
          "is 2 MiB-aligned (aligned_empty): an unaligned one halves both.", flush=True)
    print(f"targets: nixl >= 0.8x raw NIXL on the same memory: "
          f"{result['nixl_vs_raw_same_memory']:.2f}x; probe_vs_measured >= 0.5: "
          f"{result['probe_vs_measured']:.2f} ({result['probe_vs_measured_each']})", flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    if "--hosts" in sys.argv[1:]:
        from benchmarks.transfer_hosts import cli

        cli(sys.argv[1:])
    else:
        main()
