"""The two-host leg of ``benchmarks/transfer.py`` (``--hosts``; root only): NIXL over UCX TCP
against a plain TCP socket stream between the same two emulated hosts, in the same run.

Two emulated hosts (:class:`kvshare.testing.hosts.EmulatedHosts`: own network namespace on a
private bridge, own ``/dev/shm`` and hostname, so UCX sees two machines and speaks TCP), a Ray
node on each. Host A runs a pool (256 MiB in 16 MiB blocks, random bytes) served as a node pool
serves it, and a socket server that streams the same 256 MiB to whoever connects. Host B runs a
reader that, round after round, pulls every block through kvshare's ``NixlTransport`` (the
default: the pool checksums the pinned slots during the READ) and the same bytes through one
TCP connection (``recv_into`` a pre-touched buffer), interleaved so that both see the same
load. Figures are medians over ``--rounds`` rounds after one warm-up each; the link is the
unshaped veth pair. ``--ucx K=V,...`` adds a variant: a fresh pool/reader pair whose processes
start with those variables (``KVSHARE_NIXL_BUSY_POLL=0`` included), measured against its own
socket baseline.

Then the probe that node pools run (``transfer_measure``: host B probes host A) on the unshaped
link and with host A's link shaped by tbf (``--shape``, default 1gbit), each beside a socket
stream on the same link: ``probe_vs_socket`` says whether the cost model sees the link per peer.
Last line: one JSON object (``nixl_tcp_vs_socket``: target >= 0.7).

    sudo .venv/bin/python benchmarks/transfer.py --hosts
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import threading
import time
from typing import Any

import numpy as np

from kvshare.transfer.node_api import TransferEndpoints

MiB = 2**20
TOTAL = 256 * MiB
BLOCK = 16 * MiB
NAMESPACE = "hosts16m"


def _hashes() -> list[Any]:
    from kvshare.types import BlockHash

    return [BlockHash(b"hosts-leg" + i.to_bytes(23, "little")) for i in range(TOTAL // BLOCK)]


def _set_env(env: dict[str, str]) -> None:
    """Before this process's first NIXL agent: UCX reads its variables when it starts."""
    os.environ.update(env)


class HostA(TransferEndpoints):
    """Host A: the pool (served like a node pool) and a socket server of the same bytes."""

    def __init__(self, node: str, env: dict[str, str]) -> None:
        _set_env(env)
        import ray

        from kvshare.layout import KVLayout
        from kvshare.transfer.holder.local import make_local_pool
        from kvshare.transfer.node_api import TransferService

        self.transfer = TransferService(node, nixl=True)
        self.noise = np.frombuffer(np.random.default_rng(1).bytes(TOTAL), dtype=np.uint8)
        self.pool = make_local_pool(NAMESPACE, node, KVLayout(8, 8, 128, "fp16", 512), TOTAL // BLOCK)
        for i, h in enumerate(_hashes()):
            assert self.pool.put(h, self.noise[i * BLOCK : (i + 1) * BLOCK])
        self.transfer.add_pool(self.pool)
        self.ip = ray.util.get_node_ip_address()
        self._srv = socket.socket()
        self._srv.bind((self.ip, 0))
        self._srv.listen(4)
        self._srv.settimeout(0.5)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        served = 0
        while not self._stop.is_set() and served < 1000:  # bounded
            try:
                conn, _ = self._srv.accept()
            except OSError:
                continue
            served += 1
            with conn:
                conn.settimeout(60)
                try:
                    conn.sendall(memoryview(self.noise))
                except OSError:
                    pass

    def address(self) -> tuple[str, int]:
        return self.ip, int(self._srv.getsockname()[1])

    def nixl_error(self) -> str:
        return self.transfer.source(NAMESPACE).nixl_error

    def shutdown(self) -> None:
        self._stop.set()
        self._srv.close()
        self._thread.join(timeout=5)
        self.transfer.close()
        self.pool.close()


class HostB:
    """Host B: pulls host A's blocks over NIXL and its stream over a socket; probes host A."""

    def __init__(self, node: str, env: dict[str, str], pool: Any, agent: str) -> None:
        _set_env(env)
        from kvshare.transfer.node_api import TransferService
        from kvshare.transfer.reader.control import ActorControl
        from kvshare.transfer.reader.nixl import NixlTransport, aligned_empty

        self.pool = pool
        self.control = ActorControl(pool, NAMESPACE)
        self.dest = aligned_empty(TOTAL)
        self.dest.fill(1)  # pre-touched
        self.nixl = NixlTransport(agent)
        self.nixl.register(self.dest)
        self.unverified = NixlTransport(agent + "-nv", verify=False)
        self.unverified.register(self.dest)
        self.transfer = TransferService(node, nixl=True)  # the prober, as node B's pool

    def pull_nixl(self, verify: bool = True) -> float:
        tr = self.nixl if verify else self.unverified
        hs = _hashes()
        t = time.perf_counter()
        res = tr.read(self.control, hs, list(self.dest.reshape(len(hs), BLOCK)), deadline_s=120.0)
        took = time.perf_counter() - t
        if not res.ok:
            raise RuntimeError(f"nixl read failed: {res.reasons()}")
        return TOTAL / took / 1e9

    def pull_socket(self, address: tuple[str, int]) -> float:
        view = memoryview(self.dest)
        t = time.perf_counter()
        with socket.create_connection(address, timeout=10) as s:
            s.settimeout(60)
            got = 0
            while got < TOTAL:
                n = s.recv_into(view[got:])
                if n == 0:
                    raise RuntimeError(f"socket stream ended after {got} bytes")
                got += n
        return TOTAL / (time.perf_counter() - t) / 1e9

    def probe(self, peer: str) -> float:
        """What node B's pool publishes for nixl to ``peer`` (GB/s), as the watcher has it run."""
        from kvshare.transfer.probe import PROBE_NAMESPACE
        from kvshare.transfer.reader.control import ActorControl

        self.transfer.measure(PROBE_NAMESPACE, {peer: ActorControl(self.pool, PROBE_NAMESPACE)})
        return self.transfer.per_node[peer].get("nixl", 0.0) / 1e9

    def shutdown(self) -> None:
        self.nixl.close()
        self.unverified.close()
        self.transfer.close()


def _pair(hs: Any, env: dict[str, str], tag: str) -> tuple[Any, Any]:
    import ray

    a, b = hs[0], hs[1]
    pool = ray.remote(num_cpus=0, max_concurrency=4)(HostA).options(
        resources={a.name: 0.01}).remote(a.name, env)
    reader = ray.remote(num_cpus=0)(HostB).options(resources={b.name: 0.01}).remote(
        b.name, env, pool, f"hosts/{b.name}/reader-{tag}")
    err = ray.get(pool.nixl_error.remote(), timeout=180)
    if err:
        raise RuntimeError(f"NIXL did not start on {a.name}: {err}")
    return pool, reader


def _rounds(pool: Any, reader: Any, rounds: int) -> dict[str, list[float]]:
    import ray

    address = ray.get(pool.address.remote())
    ray.get([reader.pull_nixl.remote(), reader.pull_socket.remote(address)], timeout=300)  # warm-up
    runs: dict[str, list[float]] = {"nixl": [], "nixl_unverified": [], "socket": []}
    for _ in range(rounds):
        runs["nixl"].append(ray.get(reader.pull_nixl.remote(), timeout=300))
        runs["socket"].append(ray.get(reader.pull_socket.remote(address), timeout=300))
        runs["nixl_unverified"].append(ray.get(reader.pull_nixl.remote(False), timeout=300))
    return runs


def _close(*actors: Any) -> None:
    import ray

    for actor in actors:
        try:
            ray.get(actor.shutdown.remote(), timeout=30)
        except Exception as exc:
            print(f"shutdown: {exc}", flush=True)
        ray.kill(actor)


def _median(xs: list[float]) -> float:
    return round(statistics.median(xs), 3)


def main(rounds: int = 5, variants: list[str] | None = None, shape: str = "1gbit") -> dict[str, Any]:
    import ray

    from kvshare.testing.hosts import EmulatedHosts
    from kvshare.transfer.nixl_agent import UCX_DEFAULTS

    envs: dict[str, dict[str, str]] = {"default": {}}
    for v in variants or []:
        envs[v] = dict(kv.split("=", 1) for kv in v.split(",") if kv)
    out: dict[str, Any] = {"ucx_defaults": dict(UCX_DEFAULTS), "rounds": rounds, "legs": {}}
    t0 = time.monotonic()
    with EmulatedHosts(2, ray=True, shm_mb=1024, object_store_mb=200) as hs:
        print(f"2 emulated hosts with Ray up in {time.monotonic() - t0:.1f} s "
              f"({hs[0].ip} -> {hs[1].ip}, unshaped veth)", flush=True)
        hs.connect_ray("kvs-bench-hosts")
        try:
            for i, (label, env) in enumerate(envs.items()):
                pool, reader = _pair(hs, env, str(i))
                try:
                    runs = _rounds(pool, reader, rounds)
                    if label == "default":
                        out["probe_GBps"] = {"unshaped": round(ray.get(
                            reader.probe.remote(hs[0].name), timeout=300), 3)}
                        hs.shape(hs[0], shape)
                        try:
                            address = ray.get(pool.address.remote())
                            out["probe_GBps"][shape] = round(ray.get(
                                reader.probe.remote(hs[0].name), timeout=300), 3)
                            out[f"socket_{shape}_GBps"] = round(ray.get(
                                reader.pull_socket.remote(address), timeout=300), 3)
                        finally:
                            hs.shape(hs[0], None)
                finally:
                    _close(reader, pool)
                leg = {k: _median(v) for k, v in runs.items()}
                leg["nixl_tcp_vs_socket"] = round(leg["nixl"] / leg["socket"], 3)
                leg["runs"] = {k: [round(x, 3) for x in v] for k, v in runs.items()}
                out["legs"][label] = leg
                print(f"[{label}] nixl (pool verifies) {leg['nixl']:.3f} GB/s, unverified "
                      f"{leg['nixl_unverified']:.3f} GB/s, socket stream {leg['socket']:.3f} GB/s"
                      f" -> nixl_tcp_vs_socket {leg['nixl_tcp_vs_socket']:.2f} "
                      f"(runs {leg['runs']})", flush=True)
        finally:
            ray.shutdown()
    d = out["legs"]["default"]
    out.update(nixl_tcp_GBps=d["nixl"], socket_GBps=d["socket"],
               nixl_tcp_vs_socket=d["nixl_tcp_vs_socket"])
    sock_shaped = out[f"socket_{shape}_GBps"]
    out["probe_vs_socket"] = {"unshaped": round(out["probe_GBps"]["unshaped"] / d["socket"], 3),
                              shape: round(out["probe_GBps"][shape] / sock_shaped, 3)}
    print(f"pool probe (host B -> host A, nixl): unshaped {out['probe_GBps']['unshaped']:.3f} "
          f"GB/s; link shaped to {shape}: {out['probe_GBps'][shape]:.3f} GB/s against a socket "
          f"stream of {sock_shaped:.3f} GB/s on it", flush=True)
    print(f"target: nixl_tcp_vs_socket >= 0.7: {out['nixl_tcp_vs_socket']:.2f}", flush=True)
    return out


def cli(argv: list[str]) -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hosts", action="store_true")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--ucx", action="append", default=[],
                   help="a variant: K=V,K=V set in both hosts' processes (repeatable)")
    p.add_argument("--shape", default="1gbit", help="tbf rate for the probe's shaped leg")
    args = p.parse_args(argv)
    if not 1 <= args.rounds <= 20:
        raise SystemExit("--rounds takes 1..20")
    print(json.dumps(main(args.rounds, args.ucx, args.shape)))
